"""bf16 training with fp32 master weights, five ways, in the same run.

- ``ddp+masters``: DDP (bf16 all-reduce) + ``torch.optim.AdamW`` on fp32 masters kept by hand
  (every rank steps everything: the reference);
- ``ddp+zero``: DDP + zero's whole-param plan with ``master_dtype=float32``;
- ``zero_rs``: no DDP; zero's flat plan, ``reduce_scatter_grads=True``, masters, bf16 reduce;
- ``zero_rs_fp32``: the same, ``reduce_dtype=float32`` (gradients accumulated and reduced in fp32);
- ``fsdp2``: fp32 params under ``fully_shard(reshard_after_forward=False)`` per block and on the
  root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: its fp32 sharded params
  are the masters.

On CPU: 2 gloo ranks, one thread each. With ``--cuda``: one GPU, world size 1 on NCCL (time and
``torch.cuda.max_memory_allocated`` per system; multi-rank NCCL is not measured). Iteration time
is the median of ``--iters`` iterations, the systems taking turns. Bytes moved are counted as in
``iteration_bench.py`` (in units of the bf16 model's bytes). State is what the optimizer holds
per rank: masters + moments (FSDP2: its fp32 param shards + moments), next to the plan's figure.

    python bench/mixed_precision_bench.py [--layers 24] [--width 1024] [--iters 10] [--cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
from iteration_bench import Volume, _state_bytes
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.tools.launch import run

SYSTEMS = ("ddp+masters", "ddp+zero", "zero_rs", "zero_rs_fp32", "fsdp2")
BF16 = torch.bfloat16


def _model(layers: int, width: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]).to(device, dtype)


class HandMasters:
    """The reference: AdamW on fp32 copies, gradients cast up, copies rounded into the params."""

    def __init__(self, params):
        self.params = list(params)
        self.masters = [p.detach().float() for p in self.params]
        self.optim = torch.optim.AdamW(self.masters, lr=1e-4)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
        self.optim.step()
        torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def build(system: str, layers: int, width: int, device: torch.device, count_hook=None):
    """(model to call, optimizer) for one system."""
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = _model(layers, width, torch.float32, device)
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        for block in model:
            fully_shard(block, reshard_after_forward=False, mp_policy=policy)
        fully_shard(model, reshard_after_forward=False, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = _model(layers, width, BF16, device)
    if system.startswith("zero_rs"):
        reduce = torch.float32 if system == "zero_rs_fp32" else None
        return model, Zero(model.parameters(), torch.optim.AdamW, strategy="flat", reduce_scatter_grads=True,
                           master_dtype=torch.float32, reduce_dtype=reduce, lr=1e-4)
    ddp = DDP(model, bucket_cap_mb=25)
    if count_hook is not None:
        ddp.register_comm_hook(None, count_hook)
    if system == "ddp+masters":
        return ddp, HandMasters(model.parameters())
    return ddp, Zero(model.parameters(), torch.optim.AdamW, master_dtype=torch.float32, lr=1e-4)


def iteration(model, opt, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def held_bytes(opt) -> int:
    """Masters + optimizer state this rank holds (FSDP2: its sharded fp32 params + state)."""
    if isinstance(opt, HandMasters):
        return _state_bytes(opt.optim) + sum(m.nbytes for m in opt.masters)
    if isinstance(opt, Zero):
        return _state_bytes(opt) + opt.masters.nbytes()
    params = sum(p.to_local().nbytes for g in opt.param_groups for p in g["params"])
    return _state_bytes(opt) + params


def planned_bytes(opt) -> int | None:
    if not isinstance(opt, Zero):
        return None
    cost = opt.plan.ranks[opt.rank]
    return cost.state_bytes + cost.master_bytes


def worker(rank: int, world_size: int, layers: int, width: int, iters: int, cuda: bool) -> dict:
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(rank)).to(device, BF16)
    model_bytes = sum(p.nbytes for p in _model(layers, width, BF16, device).parameters())
    moved, peak = {}, {}
    for system in SYSTEMS:  # counting pass (and, on CUDA, each system's peak memory alone)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        volume = Volume()
        model, opt = build(system, layers, width, device, volume.hook)
        iteration(model, opt, x)
        with volume:
            iteration(model, opt, x)
        moved[system] = volume.bytes / model_bytes
        if cuda:
            peak[system] = torch.cuda.max_memory_allocated(device)
        del model, opt
    built = {system: build(system, layers, width, device) for system in SYSTEMS}
    for model, opt in built.values():
        for _ in range(2):
            iteration(model, opt, x)
    times = {system: [] for system in SYSTEMS}
    for _ in range(iters):
        for system, (model, opt) in built.items():
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            iteration(model, opt, x)
            if cuda:
                torch.cuda.synchronize()
            times[system].append(time.perf_counter() - t)
    return {"ms": {s: 1e3 * statistics.median(t) for s, t in times.items()}, "moved": moved, "peak": peak,
            "held": {s: held_bytes(o) for s, (_, o) in built.items()},
            "planned": {s: planned_bytes(o) for s, (_, o) in built.items()}, "model_bytes": model_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cuda", action="store_true", help="one GPU, world size 1 on NCCL")
    args = ap.parse_args()
    world, backend = (1, "nccl") if args.cuda else (2, "gloo")
    results = run(worker, world, args.layers, args.width, args.iters, args.cuda, backend=backend, timeout=3000)
    _print(results[0], args, world, backend)
    return 0


def _print(r: dict, args, world: int, backend: str) -> None:
    from rich.console import Console
    from rich.table import Table

    n = args.layers * (args.width * args.width + args.width) / 1e6
    table = Table(title=f"bf16 params + fp32 masters, AdamW, {args.layers} x Linear({args.width},{args.width}) "
                        f"({n:.1f}M params), {world} {backend} rank(s) (rank 0; median of {args.iters})")
    for col in ("system", "ms / iteration", "vs ddp+masters", "vs fsdp2", "moved (x bf16 model)",
                "masters+state rank 0 (MB)", "plan's (MB)", *(("peak CUDA (MB)",) if r["peak"] else ())):
        table.add_column(col, justify="left" if col == "system" else "right", no_wrap=col == "system")
    for s in SYSTEMS:
        planned = r["planned"][s]
        table.add_row(s, f"{r['ms'][s]:.1f}", f"{r['ms'][s] / r['ms']['ddp+masters']:.2f}x",
                      f"{r['ms'][s] / r['ms']['fsdp2']:.2f}x", f"{r['moved'][s]:.3f}", f"{r['held'][s] / 1e6:.2f}",
                      "-" if planned is None else f"{planned / 1e6:.2f}",
                      *((f"{r['peak'][s] / 1e6:.1f}",) if r["peak"] else ()))
    Console().print(table)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
