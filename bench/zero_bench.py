"""zero.ZeroRedundancyOptimizer vs torch's, in the same run: step time, consolidation, state bytes.

Two gloo ranks on 127.0.0.1, one thread each. Step time is the median of ``--steps`` timed Adam
steps (grads fixed, a barrier before each); the four optimizers take turns step by step so drift
hits all alike. Consolidation (``consolidate_state_dict`` + ``state_dict``) runs in fresh
processes, one per implementation, so its peak-RSS growth is its own.

    python bench/zero_bench.py [--steps 30] [--rounds 3] [--foreach] [--json out.json] [--check-in | --local-step]
    python bench/zero_bench.py --ranks 3 --optimizer AdamW --model "400 x Linear(64,64)" --no-consolidate
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends.local_optimizer import state_nbytes
from zero.tools.launch import free_port

MODELS = {"200 x Linear(64,64)": (200, 64), "8 x Linear(1024,1024)": (8, 1024), "400 x Linear(64,64)": (400, 64)}
DEFAULT_MODELS = ("200 x Linear(64,64)", "8 x Linear(1024,1024)")
# the rule every optimizer steps with (``--optimizer``): torch's class and its settings
RULES = {"Adam": (torch.optim.Adam, {"lr": 1e-3}), "AdamW": (torch.optim.AdamW, {"lr": 1e-3}),
         "SGD": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9})}
IMPLS = {"zero": Zero, "torch": TorchZero}
# (impl, parameters_as_bucket_view): "default" passes none (torch: False; zero: None, row views for
# small params and direct broadcasts for large ones), "own" passes False, "bucket" passes True.
MODES = [("torch", "default"), ("torch", "bucket"), ("zero", "default"), ("zero", "own"), ("zero", "bucket")]


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def _init(rank: int, port: int, world_size: int = 2) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=5))


def _time_steps(opt, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return times


def _interleaved(opts: dict, steps: int, rounds: int) -> dict:
    """Each optimizer's step times, after 3 warm-up steps (state allocation, first touch), the
    optimizers taking turns step by step so that drift and noise hit all alike; the turn order
    rotates every step, so that none always follows the same one (whose memory traffic leaves the
    caches in its own state: two identical optimizers measured 6% apart in a fixed order)."""
    for opt in opts.values():
        _time_steps(opt, 3)
    times = {key: [] for key in opts}
    keys = list(opts)
    for i in range(rounds * steps):
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            times[key] += _time_steps(opts[key], 1)
    return times


def step_worker(rank, port, world_size, name, steps, rounds, foreach, rule, out):
    _init(rank, port, world_size)
    cls, settings = RULES[rule]
    opts = {}
    extra = {"foreach": True} if foreach else {}  # torch's foreach step given to every optimizer alike
    for impl, bv in MODES:
        opts[impl, bv] = IMPLS[impl](_model(*MODELS[name]).parameters(), cls,
                                     **({} if bv == "default" else {"parameters_as_bucket_view": bv == "bucket"}),
                                     lr=1e-3, **extra)
    times = _interleaved(opts, steps, rounds)
    local_state = {impl: state_nbytes(opts[impl, "default"].optim) for impl in IMPLS}
    if rank == 0:
        out.put({"model": name, "step_ms": {f"{i}/{bv}": 1e3 * statistics.median(t) for (i, bv), t in times.items()},
                 "state_bytes_rank0": local_state})
    dist.destroy_process_group()


def check_in_worker(rank, port, name, steps, rounds, out):
    """What the per-step check-in costs: our default step as is, with its check-in waited for at
    once, and with none (a test double; never do this in training), against torch's bucket view."""
    _init(rank, port)
    opts = {label: Zero(_model(*MODELS[name]).parameters(), torch.optim.Adam, lr=1e-3)
            for label in ("zero (check-in overlapped)", "zero (check-in waited at once)", "zero (no check-in)")}
    overlapped = opts["zero (check-in waited at once)"]._check_in

    def at_once(*a, **k):
        overlapped(*a, **k)()
        return lambda: None

    opts["zero (check-in waited at once)"]._check_in = at_once
    opts["zero (no check-in)"]._check_in = lambda *a, **k: (lambda: None)
    opts["torch bucket view"] = TorchZero(_model(*MODELS[name]).parameters(), torch.optim.Adam,
                                          parameters_as_bucket_view=True, lr=1e-3)
    times = _interleaved(opts, steps, rounds)
    if rank == 0:
        out.put({"model": name, "step_ms": {k: 1e3 * statistics.median(t) for k, t in times.items()}})
    dist.destroy_process_group()


# The local step's rule, given four ways to zero's default mode: torch's class as torch's ZeRO builds
# it (torch's default on CPU: the for-loop step), the class with torch's fused kernel, Optax's
# `adam` and `from_torch(Adam)` from zero.functional.
LOCAL_RULES = {
    "torch.optim.Adam": lambda: (torch.optim.Adam, {"lr": 1e-3}),
    "torch.optim.Adam(fused=True)": lambda: (torch.optim.Adam, {"lr": 1e-3, "fused": True}),
    "zero.functional.adam": lambda: (_functional().adam, {"learning_rate": 1e-3}),
    "from_torch(Adam)": lambda: (_functional().from_torch(torch.optim.Adam, lr=1e-3), {}),
}


def _functional():
    import zero.functional as F

    return F


def local_step_worker(rank, port, name, steps, rounds, out):
    """zero's step with the same rule given as a torch class or a zero.functional rule."""
    _init(rank, port)
    opts = {}
    for label, make in LOCAL_RULES.items():
        rule, options = make()
        opts[label] = Zero(_model(*MODELS[name]).parameters(), rule, **options)
    times = _interleaved(opts, steps, rounds)
    if rank == 0:
        out.put({"model": name, "step_ms": {k: 1e3 * statistics.median(t) for k, t in times.items()}})
    dist.destroy_process_group()


def consolidate_worker(rank, port, impl, out):
    _init(rank, port)
    opt = IMPLS[impl](_model(*MODELS["8 x Linear(1024,1024)"]).parameters(), torch.optim.Adam, lr=1e-3)
    opt.step()
    dist.barrier()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    opt.consolidate_state_dict(to=0)
    sd = opt.state_dict() if rank == 0 else None
    dist.barrier()
    seconds = time.perf_counter() - t
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    state = state_nbytes(opt.optim)
    out.put({"impl": impl, "rank": rank, "seconds": seconds, "peak_growth": grew, "local_state": state,
             "entries": len(sd["state"]) if sd else None})
    dist.destroy_process_group()


def _spawn(fn, *args, ranks: int = 2) -> list:
    port = free_port()
    q = mp.get_context("spawn").Queue()
    args = (ranks, *args) if fn is step_worker else args
    ctx = mp.start_processes(fn, args=(port, *args, q), nprocs=ranks, start_method="spawn", join=False)
    results = []
    while not ctx.join(timeout=0.5):
        pass
    while not q.empty():
        results.append(q.get())
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=str)
    ap.add_argument("--plot", help="also draw the step times to this PNG")
    ap.add_argument("--check-in", action="store_true", help="only measure what the per-step check-in costs")
    ap.add_argument("--foreach", action="store_true",
                    help="pass foreach=True to every optimizer (torch's CPU default, foreach=None, is the for-loop)")
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks of the step table")
    ap.add_argument("--optimizer", choices=sorted(RULES), default="Adam",
                    help="the rule of the step table (SGD: with momentum 0.9)")
    ap.add_argument("--model", action="append", choices=sorted(MODELS),
                    help=f"a model of the step table (repeat it; default: {', '.join(DEFAULT_MODELS)})")
    ap.add_argument("--no-consolidate", action="store_true", help="leave out the consolidation table")
    ap.add_argument("--local-step", action="store_true",
                    help="only compare the local rule given as a torch class or a zero.functional rule")
    args = ap.parse_args()
    if args.check_in or args.local_step:
        from rich.console import Console

        for name in args.model or DEFAULT_MODELS:
            for r in _spawn(local_step_worker if args.local_step else check_in_worker, name, args.steps, args.rounds):
                Console().print(r["model"], {k: round(v, 2) for k, v in r["step_ms"].items()})
        return 0
    report = {"torch": torch.__version__, "foreach": args.foreach, "ranks": args.ranks, "optimizer": args.optimizer,
              "steps": [], "consolidate": []}
    for name in args.model or DEFAULT_MODELS:
        report["steps"] += _spawn(step_worker, name, args.steps, args.rounds, args.foreach, args.optimizer,
                                  ranks=args.ranks)
    for impl in () if args.no_consolidate else IMPLS:
        report["consolidate"] += _spawn(consolidate_worker, impl)
    _print(report)
    if args.plot:
        from figure import grouped_bars

        grouped_bars(args.plot, "Adam step on 2 gloo ranks: zero vs torch's ZeroRedundancyOptimizer",
                     {r["model"]: r["step_ms"] for r in report["steps"]}, "median ms per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    given = ", foreach=True given to all" if report.get("foreach") else ""
    table = Table(title=f"{report.get('optimizer', 'Adam')} step, {report.get('ranks', 2)} gloo ranks, "
                        f"1 thread each (median ms){given}")
    for col in ("model", "torch default", "torch bucket view", "zero default", "x torch's fastest",
                "zero own storage (False)", "zero bucket view", "x torch bucket view"):
        table.add_column(col, justify="right")
    for r in report["steps"]:
        ms = r["step_ms"]
        fastest = min(ms["torch/default"], ms["torch/bucket"])
        table.add_row(r["model"], f"{ms['torch/default']:.2f}", f"{ms['torch/bucket']:.2f}",
                      f"{ms['zero/default']:.2f}", f"{ms['zero/default'] / fastest:.2f}x", f"{ms['zero/own']:.2f}",
                      f"{ms['zero/bucket']:.2f}",
                      f"{ms['zero/bucket'] / ms['torch/bucket']:.2f}x")
    console.print(table)
    if not report["consolidate"]:
        return
    cons = Table(title="consolidate_state_dict(to=0) + state_dict(), 8 x Linear(1024,1024), Adam")
    for col in ("impl", "rank", "seconds", "peak RSS growth", "local state"):
        cons.add_column(col, justify="right")
    for r in sorted(report["consolidate"], key=lambda r: (r["impl"], r["rank"])):
        cons.add_row(r["impl"], str(r["rank"]), f"{r['seconds']:.3f}", f"{r['peak_growth'] / 1e6:.0f} MB",
                     f"{r['local_state'] / 1e6:.1f} MB")
    console.print(cons)
    secs = {r["impl"]: r["seconds"] for r in report["consolidate"] if r["rank"] == 0}
    console.print(f"consolidation time ratio zero/torch: {secs['zero'] / secs['torch']:.3f}x")


if __name__ == "__main__":
    sys.exit(main())
