"""The ZeRO tutorial, runnable anywhere: DDP on N ranks, once with ZeRO and once with plain Adam.

``python -m zero demo`` spawns 2 gloo ranks on CPU (NCCL, one GPU per rank, when there are
enough GPUs) and trains the tutorial's stack of ``Linear`` layers a few steps with each
optimizer, then compares per-rank optimizer state, peak memory, and the final parameter sums
(equal: sharding changes where state lives, not the maths). ``--full`` is the tutorial's size
(20 x Linear(2000, 2000)). Under ``torchrun`` it uses the launcher's ranks::

    torchrun --nproc_per_node=2 -m zero.tools.demo
"""

from __future__ import annotations

import os
import resource
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zero.backends.local_optimizer import state_nbytes
from zero.tools import launch
from zero.tools.arguments import demo_parser

__all__ = ["main", "run_rank", "train_and_save", "load_and_train", "plain_training"]


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def run_rank(rank: int, world_size: int, use_zero: bool, layers: int, width: int, steps: int) -> dict[str, Any]:
    """One rank of one run; returns what it measured (the process group must exist)."""
    from zero.backends import ZeroRedundancyOptimizer

    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    model = _tutorial_model(layers, width).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if use_zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    gen = torch.Generator(device=device).manual_seed(rank)
    # A NaN or inf gradient would make every param NaN (torch's semantics, kept): the scaler
    # checks the (all-reduced, so equal on every rank) gradients and skips such a step everywhere.
    scaler = torch.amp.GradScaler(device.type)
    peaks, skipped = [], 0
    for _ in range(steps):
        x = torch.randn(20, width, generator=gen, device=device)
        labels = torch.randn(20, width, generator=gen, device=device)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(ddp(x), labels)).backward()
        peaks.append(_peak_bytes(device))
        scale = scaler.get_scale()
        scaler.step(opt)  # the first step allocates the optimizer state: the tutorial's measurement
        scaler.update()
        skipped += scaler.get_scale() < scale  # the scale backs off exactly when a step was skipped
        peaks.append(_peak_bytes(device))
    before, after = peaks[0], peaks[1]
    local = opt.optim if use_zero else opt
    state = state_nbytes(local)
    return {"rank": rank, "zero": use_zero, "state_bytes": state, "peak_before_step": before, "skipped": skipped,
            "peak_after_step": after, "param_sum": float(sum(p.detach().sum() for p in model.parameters())),
            "device": str(device)}


def _tutorial_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, width: int) -> None:
    """Steps on data that depends on the step only: every rank (and world size) sees the same."""
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        opt.zero_grad()
        x, y = torch.randn(20, width, generator=gen), torch.randn(20, width, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def train_and_save(rank: int, world_size: int, path: str, steps: int, layers: int = 4, width: int = 64) -> float:
    """One rank: ZeRO(Adam) for ``steps`` steps, then model + consolidated optimizer state saved
    by rank 0 to ``path``; returns the params' sum."""
    from zero.backends import ZeroRedundancyOptimizer

    model = _tutorial_model(layers, width)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    _train(model, opt, range(steps), width)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return float(sum(p.detach().sum() for p in model.parameters()))


def load_and_train(rank: int, world_size: int, path: str, start: int, steps: int, layers: int = 4,
                   width: int = 64) -> float:
    """One rank: resume `train_and_save`'s checkpoint at this world size, train ``steps`` more."""
    from zero.backends import ZeroRedundancyOptimizer

    model = _tutorial_model(layers, width)
    saved = torch.load(path)
    model.load_state_dict(saved["model"])
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    opt.load_state_dict(saved["optimizer"])
    _train(model, opt, range(start, start + steps), width)
    return float(sum(p.detach().sum() for p in model.parameters()))


def plain_training(steps: int, layers: int = 4, width: int = 64) -> float:
    """The single-process reference: plain Adam on the same data; returns the params' sum."""
    model = _tutorial_model(layers, width)
    _train(model, torch.optim.Adam(model.parameters(), lr=0.01), range(steps), width)
    return float(sum(p.detach().sum() for p in model.parameters()))


def _run_spawned(args, use_zero: bool) -> list[dict]:
    """One run, each rank in a process of its own (NCCL with a GPU per rank, else gloo)."""
    backend = "nccl" if torch.cuda.device_count() >= args.world_size else "gloo"
    return launch.run(run_rank, args.world_size, use_zero, args.layers, args.width, args.steps, backend=backend,
                      timeout=3600, pg_timeout=300, threads=max(1, (os.cpu_count() or 2) // args.world_size))


def _report(runs: dict[bool, list[dict]], args) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.layers} x Linear({args.width}, {args.width}), Adam, {args.world_size} ranks, "
                        f"{args.steps} steps, {runs[True][0]['device']}")
    for col in ("optimizer", "rank", "optimizer state", "peak before 1st step", "peak after",
                "skipped", "param sum"):
        table.add_column(col, justify="right")
    peak = "max allocated" if runs[True][0]["device"].startswith("cuda") else "peak RSS"
    for use_zero in (True, False):
        for r in runs[use_zero]:
            table.add_row("ZeRO(Adam)" if use_zero else "Adam", str(r["rank"]),
                          f"{r['state_bytes'] / 1e6:.1f} MB", _mb(r["peak_before_step"]), _mb(r["peak_after_step"]),
                          str(r["skipped"]), f"{r['param_sum']:.6f}")
    console = Console()
    console.print(table)
    z, a = runs[True], runs[False]
    same = len({r["param_sum"] for r in z + a}) == 1
    ratio = max(r["state_bytes"] for r in z) / max(r["state_bytes"] for r in a)
    if z[0]["peak_after_step"] is None:
        growth = ("peak memory not shown: under torchrun on CPU both runs share each rank's process, so its "
                  "peak RSS would mix them (`python -m zero demo` runs each in processes of its own).")
    else:
        growth = (f"the first step() grows the {peak} by {_growth(z) / 1e6:.0f} MB with ZeRO vs "
                  f"{_growth(a) / 1e6:.0f} MB without.")
    console.print(f"Optimizer state per rank: {ratio:.2f}x of plain Adam's; {growth}")
    console.print("parameter sums: " + ("identical across ranks and optimizers" if same else "DIFFER"))


def _growth(rows: list[dict]) -> int:
    return max(r["peak_after_step"] - r["peak_before_step"] for r in rows)


def _mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.0f} MB"


def main(argv: list[str] | None = None) -> int:
    args = demo_parser().parse_args(argv)
    if args.full:
        args.layers, args.width = 20, 2000
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: ranks exist already
        return _main_torchrun(args)
    runs = _with_progress(args)
    _report(runs, args)
    return 0 if len({r["param_sum"] for rs in runs.values() for r in rs}) == 1 else 1


def _with_progress(args) -> dict[bool, list[dict]]:
    """Both runs, each in processes of its own, with a spinner and the time each takes."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    runs = {}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True) as bar:
        for use_zero in (True, False):
            task = bar.add_task(f"{'ZeRO(Adam)' if use_zero else 'Adam'}: {args.layers} x Linear({args.width}, "
                                f"{args.width}) on {args.world_size} ranks, {args.steps} steps", total=None)
            runs[use_zero] = _run_spawned(args, use_zero)
            bar.remove_task(task)
    return runs


def _main_torchrun(args) -> int:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = dist.get_rank(), dist.get_world_size()
    args.world_size = world
    runs = {}
    for use_zero in (True, False):
        if backend == "nccl":
            torch.cuda.reset_peak_memory_stats()
        mine = run_rank(rank, world, use_zero, args.layers, args.width, args.steps)
        if backend != "nccl":  # one process runs both: its peak RSS would hold the first run's too
            mine["peak_before_step"] = mine["peak_after_step"] = None
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        runs[use_zero] = gathered
    if rank == 0:
        _report(runs, args)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # under torchrun: a rank's process ends without finalization (see exit_now)
    launch.exit_now(main())
