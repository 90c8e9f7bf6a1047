"""zero beside DeepSpeed and fairscale, on the same model, data and gloo ranks, in one run.

Each system trains a stack of ``--layers`` x ``Linear(--width, --width)`` with Adam (fp32, lr 1e-3)
on ``--ranks`` gloo ranks (one thread each), every rank its own batches, for ``--steps`` steps:

- ``ddp``: DDP + ``torch.optim.Adam`` (the reference every other row is a ratio to);
- ``torch_zero``: DDP + torch's ``ZeroRedundancyOptimizer``;
- ``zero_1``: DDP + `zero.ZeroRedundancyOptimizer` (flat plan); ``zero_2``: the same with
  ``reduce_scatter_grads=True`` (no DDP);
- ``fairscale_oss``: DDP + fairscale's ``OSS``; ``fairscale_sddp``: ``OSS`` + ``ShardedDataParallel``;
- ``deepspeed_1`` / ``deepspeed_2``: ``deepspeed.initialize`` with ZeRO stage 1 / 2 (CPU
  accelerator, gloo), its ``backward`` and ``step``.

Per system: the largest relative difference of its params from DDP's after the steps, the median
iteration (forward, backward, step) as a ratio to DDP's, the optimizer state each rank holds (its
tensors, and a ZeRO's fp32 partition), the resident memory a rank gained over the steps (its
peak), and the bytes each rank sent per iteration, read off the loopback interface's counters
(``/proc/net/dev``: every byte gloo moved, whatever API moved it), divided by the ranks.

DeepSpeed and fairscale are not zero's dependencies: run this in a venv of their own
(``bench/peers-venv.sh`` makes one beside the project's, with the same CPU torch).

    bench/peers-venv.sh && /tmp/peers-venv/bin/python bench/peers_bench.py --ranks 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from checkpoint_bench import PeakRSS  # noqa: E402

from zero.tools.launch import run  # noqa: E402

SYSTEMS = ("ddp", "torch_zero", "zero_1", "zero_2", "fairscale_oss", "fairscale_sddp", "deepspeed_1", "deepspeed_2")
LR = 1e-3


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def _batch(rank: int, step: int, width: int) -> torch.Tensor:
    return torch.randn(32, width, generator=torch.Generator().manual_seed(1000 * step + rank))


def _loopback_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":")[1].split()[8])  # transmitted bytes
    return 0


def build(system: str, layers: int, width: int):
    """``(model, forward, backward, step, zero_grad, state_bytes)`` of one system."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(layers, width)
    if system.startswith("deepspeed"):
        return _deepspeed(model, int(system[-1]))
    if system == "fairscale_sddp":
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim.oss import OSS

        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=LR)
        net = ShardedDataParallel(model, opt)
        return model, net, lambda loss: loss.backward(), opt.step, opt.zero_grad, lambda: _torch_state(opt.optim)
    if system == "zero_2":
        import zero

        opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, strategy="flat",
                                           reduce_scatter_grads=True, lr=LR)
        return model, model, lambda loss: loss.backward(), opt.step, opt.zero_grad, lambda: _torch_state(opt.optim)
    net = DDP(model)
    if system == "ddp":
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        return model, net, lambda loss: loss.backward(), opt.step, opt.zero_grad, lambda: _torch_state(opt)
    if system == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
    elif system == "zero_1":
        import zero

        opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, strategy="flat", lr=LR)
    else:
        from fairscale.optim.oss import OSS

        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=LR)
    inner = getattr(opt, "optim", opt)
    return model, net, lambda loss: loss.backward(), opt.step, opt.zero_grad, lambda: _torch_state(inner)


def _deepspeed(model: nn.Module, stage: int):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR),
                                             config=config)

    def state() -> int:
        inner = getattr(opt, "optimizer", opt)
        flat = sum(t.nbytes for t in getattr(opt, "single_partition_of_fp32_groups", []))
        return _torch_state(inner) + flat

    return model, engine, engine.backward, engine.step, engine.zero_grad, state


def _torch_state(opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.nbytes
    return total


def train(system: str, rank: int, world_size: int, layers: int, width: int, steps: int) -> dict:
    model, net, backward, step, zero_grad, state = build(system, layers, width)
    times, sent = [], 0
    with PeakRSS() as rss:
        for k in range(steps):
            dist.barrier()
            before, t = _loopback_bytes(), time.perf_counter()
            zero_grad()
            loss = net(_batch(rank, k, width)).square().mean()
            backward(loss)
            step()
            dist.barrier()
            times.append(time.perf_counter() - t)
            if k >= 2:  # after warm-up (DDP's bucket rebuild, lazy state)
                sent += _loopback_bytes() - before
    return {"params": [p.detach().clone() for p in model.parameters()], "time": statistics.median(times[2:]),
            "state": state(), "peak": rss.above, "sent": sent / (steps - 2) / world_size}


def worker(rank: int, world_size: int, systems: list[str], layers: int, width: int, steps: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed asks its launcher's variables even with a process group already made
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    out = {}
    for system in systems:
        with warnings.catch_warnings(), contextlib.redirect_stdout(open(os.devnull, "w")):
            warnings.simplefilter("ignore")
            try:
                out[system] = train(system, rank, world_size, layers, width, steps)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
                out[system] = {"error": f"{type(e).__name__}: {e}"[:300]}
    ref = out["ddp"]["params"]
    for r in out.values():
        if "params" in r:
            r["rel"] = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(r.pop("params"), ref))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--systems", nargs="*", default=list(SYSTEMS))
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = run(worker, args.ranks, ["ddp", *[s for s in args.systems if s != "ddp"]], args.layers, args.width,
               args.steps, timeout=3000, pg_timeout=600)
    _print(rows, args)
    return 0


def _print(rows: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    n = args.layers * (args.width * args.width + args.width) / 1e6
    table = Table(title=f"Adam, {args.layers} x Linear({args.width},{args.width}) ({n:.1f}M fp32 params), "
                        f"{args.ranks} gloo ranks, {args.steps} steps; MB per rank")
    for col in ("system", "params vs DDP (rel)", "iteration x DDP", "state", "peak", "sent / iteration"):
        table.add_column(col, justify="left" if col == "system" else "right")
    ddp = max(r["ddp"]["time"] for r in rows)
    for system in rows[0]:
        got = [r[system] for r in rows]
        if "error" in got[0]:
            table.add_row(system, got[0]["error"], "", "", "", "")
            continue
        table.add_row(system, f"{max(g['rel'] for g in got):.1e}", f"{max(g['time'] for g in got) / ddp:.2f}x",
                      f"{max(g['state'] for g in got) / 1e6:.1f}", f"{max(g['peak'] for g in got) / 1e6:.0f}",
                      f"{max(g['sent'] for g in got) / 1e6:.1f}")
    Console(width=130).print(table)


if __name__ == "__main__":
    sys.exit(main())
