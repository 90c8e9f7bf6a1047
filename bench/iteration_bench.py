"""A whole training iteration (forward + backward + Adam step), five ways, in the same run.

- ``ddp+adam``: DDP + ``torch.optim.Adam`` (every rank steps everything);
- ``ddp+torch_zero``: DDP + torch's ``ZeroRedundancyOptimizer``;
- ``ddp+zero``: DDP + zero's, whole-param plan (torch's ownership), stepping after backward;
- ``ddp+zero_overlap`` / ``ddp+zero_overlap_il``: DDP + zero's with ``overlap_with_ddp=True``,
  stepping inside DDP's comm hook (`hook_with_zero_step` / its interleaved form);
- ``zero_flat_rs``: no DDP; zero's flat plan with ``reduce_scatter_grads=True``;
- ``fsdp2``: ``fully_shard(reshard_after_forward=False)`` per layer and on the root (ZeRO-2).

``--world-size`` gloo ranks (2) on 127.0.0.1, one thread each, each rank on its own batch. Iteration time is the
median of ``--iters`` timed iterations per system, the systems taking turns iteration by
iteration so that drift hits all alike. Bytes moved are counted in a separate pass, over one
iteration, from every collective a system issues: ``torch.distributed``'s functions are wrapped,
and DDP's all-reduces go through them by a comm hook that calls DDP's default one. An all-reduce
of N bytes counts 2N (a reduce-scatter then an all-gather), a reduce-scatter its input, an
all-gather its output, a broadcast its tensor; reported in units of the model's bytes. The
peak memory of an iteration (after one that made the optimizer state) is torch's ``MemTracker``'s,
in another pass: params, gradients, buckets, optimizer state and temporaries, activations too.

    python bench/iteration_bench.py [--world-size 2] [--layers 24] [--width 512] [--bucket-mb 2] [--iters 20]
                                    [--systems ...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

import zero
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import comm, hook_with_zero_step, hook_with_zero_step_interleaved
from zero.tools.launch import run

SYSTEMS = ("ddp+adam", "ddp+torch_zero", "ddp+zero", "ddp+zero_overlap", "ddp+zero_overlap_il", "zero_flat_rs",
           "fsdp2")
REFERENCES = ("ddp+adam", "ddp+zero", "ddp+torch_zero")  # what every row is divided by
OVERLAP_HOOKS = {"ddp+zero_overlap": hook_with_zero_step, "ddp+zero_overlap_il": hook_with_zero_step_interleaved}


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def build(system: str, layers: int, width: int, bucket_mb: float, count_hook=None):
    """(model to call, optimizer) for one system."""
    model = _model(layers, width)
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    if system == "zero_flat_rs":
        numel = int(bucket_mb * 2**20) // 4
        plan = zero.make_plan(zero.param_metas(model), dist.get_world_size(), "flat", bucket_numel=numel)
        return model, Zero(model.parameters(), torch.optim.Adam, plan=plan, reduce_scatter_grads=True, lr=1e-4)
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    if system in OVERLAP_HOOKS:
        opt = Zero(model.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-4)
        ddp.register_comm_hook(None, OVERLAP_HOOKS[system](count_hook or allreduce_hook, ddp, opt))
        return ddp, opt
    if count_hook is not None:
        ddp.register_comm_hook(None, count_hook)
    if system == "ddp+adam":
        return ddp, torch.optim.Adam(model.parameters(), lr=1e-4)
    cls = TorchZero if system == "ddp+torch_zero" else Zero
    return ddp, cls(model.parameters(), torch.optim.Adam, lr=1e-4)


def iteration(model, opt, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


class Volume:
    """Bytes put through collectives while active (see the module docstring for the convention)."""

    # name: (bytes counted per byte of the tensor, its position, its keyword names)
    WRAPPED = {"all_reduce": (2, 0, ("tensor",)), "broadcast": (1, 0, ("tensor",)),
               "all_gather_single": (1, 0, ("output_tensor", "output")),
               "all_gather_into_tensor": (1, 0, ("output_tensor", "output")),
               "reduce_scatter_single": (1, 1, ("input", "input_tensor")),
               "reduce_scatter_tensor": (1, 1, ("input", "input_tensor"))}

    def __init__(self):
        self.bytes = 0
        self._saved = {}

    @staticmethod
    def hook(state, bucket):
        """DDP's own all-reduce, but issued from Python, where ``dist.all_reduce`` is counted."""
        return allreduce_hook(None, bucket)

    def __enter__(self):
        for name, how in self.WRAPPED.items():
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._counting(self._saved[name], *how))
        self._saved["comm"] = comm._ALL_GATHER, comm._REDUCE_SCATTER
        comm._ALL_GATHER, comm._REDUCE_SCATTER = dist.all_gather_single, dist.reduce_scatter_single
        return self

    def _counting(self, fn, factor: int, position: int, keywords: tuple[str, ...]):
        def counted(*args, **kwargs):
            named = [kwargs[k] for k in keywords if k in kwargs]
            tensor = named[0] if named else args[position]
            self.bytes += factor * tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        comm._ALL_GATHER, comm._REDUCE_SCATTER = self._saved.pop("comm")
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def worker(rank: int, world_size: int, layers: int, width: int, bucket_mb: float, iters: int,
           systems: tuple[str, ...] = SYSTEMS) -> dict:
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(rank))
    model_bytes = sum(p.numel() * p.element_size() for p in _model(layers, width).parameters())
    moved = {}
    for system in systems:  # counting pass, on systems of their own (a counting hook stays registered)
        volume = Volume()
        model, opt = build(system, layers, width, bucket_mb, volume.hook)
        iteration(model, opt, x)  # DDP rebuilds its buckets after the first iteration: count the second
        with volume:
            iteration(model, opt, x)
        moved[system] = volume.bytes / model_bytes
    peak = {system: _peak_bytes(*build(system, layers, width, bucket_mb), x) for system in systems}
    built = {system: build(system, layers, width, bucket_mb) for system in systems}
    for model, opt in built.values():
        for _ in range(3):
            iteration(model, opt, x)
    times = {system: [] for system in systems}
    for _ in range(iters):
        for system, (model, opt) in built.items():
            dist.barrier()
            t = time.perf_counter()
            iteration(model, opt, x)
            times[system].append(time.perf_counter() - t)
    state = {system: _state_bytes(opt) for system, (_, opt) in built.items()}
    return {"ms": {s: 1e3 * statistics.median(t) for s, t in times.items()}, "moved": moved, "state": state,
            "peak": peak, "model_bytes": model_bytes}


def _peak_bytes(model, opt, x: torch.Tensor) -> int:
    """The peak bytes of an iteration after the first (the optimizer state exists), by MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker

    iteration(model, opt, x)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        iteration(model, opt, x)
    return int(sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values()))


def _state_bytes(opt) -> int:
    inner = getattr(opt, "optim", opt)
    total = 0
    for st in inner.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v = v.to_local() if hasattr(v, "to_local") else v
                total += v.numel() * v.element_size()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--bucket-mb", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--plot", help="also draw the iteration times to this PNG")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS,
                    help="time only these (ddp+adam, ddp+zero and ddp+torch_zero always run: the ratios' references)")
    args = ap.parse_args()
    args.systems = tuple(s for s in SYSTEMS if s in {*args.systems, *REFERENCES})
    results = run(worker, args.world_size, args.layers, args.width, args.bucket_mb, args.iters, args.systems,
                  timeout=1800)
    _print(results, args)
    if args.plot:
        from figure import grouped_bars

        grouped_bars(args.plot, f"Iteration on {args.world_size} gloo ranks, "
                                f"{args.layers} x Linear({args.width},{args.width})",
                     {f"rank {r}": res["ms"] for r, res in enumerate(results)}, "median ms per iteration")
    return 0


def _print(results: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"forward + backward + Adam step, {args.layers} x Linear({args.width},{args.width}), "
                        f"{args.world_size} gloo ranks, 1 thread each, {args.bucket_mb} MB buckets "
                        f"(rank 0; median of {args.iters})")
    table.add_column("system", no_wrap=True)
    for col in ("ms / iteration", "vs ddp+adam", "vs ddp+zero", "vs ddp+torch_zero", "moved (x model)",
                "Adam state rank 0 (MB)", "peak rank 0 (MB)"):
        table.add_column(col, justify="right")
    r = results[0]
    for s in args.systems:
        table.add_row(s, f"{r['ms'][s]:.1f}", f"{r['ms'][s] / r['ms']['ddp+adam']:.2f}x",
                      f"{r['ms'][s] / r['ms']['ddp+zero']:.2f}x",
                      f"{r['ms'][s] / r['ms']['ddp+torch_zero']:.2f}x", f"{r['moved'][s]:.3f}",
                      f"{r['state'][s] / 1e6:.2f}", f"{r['peak'][s] / 1e6:.1f}")
    Console().print(table)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
