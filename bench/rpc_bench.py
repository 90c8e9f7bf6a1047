"""RPC DistributedOptimizer: zero's against torch's (TorchScript local optimizers), in the same run.

Three TensorPipe workers on 127.0.0.1: a trainer and two parameter owners, each owning
``--layers`` x Linear(``--width``, ``--width``). Only ``step(context_id)`` is timed (forward and
backward run before the clock starts). With ``--threads`` trainers stepping at once, the figure
is the wall time of all their iterations divided by the number of steps taken (an iteration
whose backward raised because another trainer's step changed a param it needed takes none;
the table counts them). Ours and torch's take turns
round by round so drift hits both alike.

    python bench/rpc_bench.py [--layers 16] [--width 256] [--steps 20] [--rounds 3] [--optim adam]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

from zero.backends import DistributedOptimizer
from zero.tools.launch import free_port

IMPLS = {"zero": DistributedOptimizer, "torch": TorchDistributedOptimizer}
FAILED: dict[tuple[str, int], list[int]] = {}  # iterations whose backward raised, per (impl, trainers), per round
OPTIMS = {"adam": (torch.optim.Adam, {"lr": 1e-3}), "sgd": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9})}


def make_stage(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def run_stage(rref, x):
    return rref.local_value()(x)


def stage_param_rrefs(rref):
    return [rpc.RRef(p) for p in rref.local_value().parameters()]


def _trainer_steps(stages, opt, width: int, steps: int, times: list[float], failed: list[str]) -> None:
    """``steps`` iterations; one whose backward fails is counted in ``failed`` and not timed.

    With several trainers, one trainer's step can change a param in place while another's
    backward still needs its old value; torch's autograd then raises (the version check). Such
    an iteration did no step, so the wall time is divided by the steps that did happen.
    """
    for _ in range(steps):
        with dist_autograd.context() as cid:
            x = torch.randn(8, width)
            for s in stages:
                x = rpc.rpc_sync(s.owner(), run_stage, args=(s, x))
            try:
                dist_autograd.backward(cid, [x.square().mean()])
            except RuntimeError as e:
                failed.append(str(e).splitlines()[0][:120])
                continue
            t = time.perf_counter()
            opt.step(cid)
            times.append(time.perf_counter() - t)


def measure(name: str, args, threads: int) -> float:
    """Seconds per step: the median step (one trainer) or the wall time per step (several)."""
    stages = [rpc.remote(f"worker{i}", make_stage, args=(args.layers, args.width)) for i in (1, 2)]
    rrefs = [r for s in stages for r in rpc.rpc_sync(s.owner(), stage_param_rrefs, args=(s,))]
    cls, kwargs = OPTIMS[args.optim]
    opt = IMPLS[name](cls, rrefs, **kwargs)
    _trainer_steps(stages, opt, args.width, 2, [], [])  # warm-up: state creation, TorchScript compile
    times: list[float] = []
    failed: list[str] = []
    pool = [threading.Thread(target=_trainer_steps, args=(stages, opt, args.width, args.steps, times, failed))
            for _ in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    wall = time.perf_counter() - start
    FAILED.setdefault((name, threads), []).append(len(failed))
    return statistics.median(times) if threads == 1 else wall / max(1, len(times))


def worker(rank: int, port: int, args, out) -> None:
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16,
                                              rpc_timeout=300)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 0:
        results: dict = {}
        for _ in range(args.rounds):
            for threads in (1, args.threads):
                for name in IMPLS:
                    results.setdefault((name, threads), []).append(measure(name, args, threads))
        out.put(({k: statistics.median(v) for k, v in results.items()}, FAILED))
    rpc.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--optim", choices=sorted(OPTIMS), default="adam")
    parser.add_argument("--plot", help="also draw the step times to this PNG")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, args, out)) for r in range(3)]
    for p in procs:
        p.start()
    res, failed = out.get(timeout=1800)
    for p in procs:
        p.join()
    n = 2 * args.layers * args.width * (args.width + 1)
    print(f"{args.optim}, 2 owners x {args.layers} x Linear({args.width},{args.width}) = {n / 1e6:.2f}M params, "
          f"{2 * 2 * args.layers} tensors; median of {args.rounds} rounds", file=sys.stderr)
    print("| trainers | torch ms/step | zero ms/step | ratio | iterations failed (torch / zero, per round) |\n"
          "|---:|---:|---:|---:|---|")
    for threads in (1, args.threads):
        t, z = res[("torch", threads)], res[("zero", threads)]
        print(f"| {threads} | {1e3 * t:.2f} | {1e3 * z:.2f} | {z / t:.2f}x | {failed[('torch', threads)]} / "
              f"{failed[('zero', threads)]} of {threads * args.steps} |")
    if args.plot:
        from figure import grouped_bars

        grouped_bars(args.plot, f"RPC DistributedOptimizer.step ({args.optim}): zero vs torch",
                     {f"{threads} trainer(s)": {impl: 1e3 * res[(impl, threads)] for impl in ("torch", "zero")}
                      for threads in (1, args.threads)}, "median ms per step")


if __name__ == "__main__":
    main()
