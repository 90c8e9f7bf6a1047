"""The README's chain on the fast path: clip_by_global_norm + AdamW with a warmup-cosine schedule
and a weight-decay mask by param name, one step, every way of running it, in one run.

Rows: torch's ``clip_grad_norm_`` + fused AdamW with two param groups (decay, no decay) and a
LambdaLR (the reference); `zero.functional.Optimizer` given ``named_parameters()`` (the fused
path, as `explain` reports it); the same chain on its pure path (the links' updates and
``apply_updates``, fresh tensors); that pure update under ``torch.compile(fullgraph=True)``
(inductor; its first call, the compilation, is reported apart); jitted Optax (the pure path's
anchor: it too writes fresh params and state); and at 2 gloo ranks torch's
ZeroRedundancyOptimizer (fused AdamW, two groups, clip_grad_norm_ on the full grads) against
zero's (the sharded global norm, the fused kernel on the rank's share). Two shapes: 8.4M params
in 16 tensors, and 2,000 small tensors. Median of ``--repeat`` steps each.
Usage: python bench/chain_bench.py [--repeat 20] [--ranks 2] [--no-optax] [--no-zero] [--shapes ...]
[--compile ...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zero.functional as F  # noqa: E402

SHAPES = {"8.4M params, 16 tensors": (8, 1024), "2,000 small tensors": (1000, 32)}
PEAK, WARMUP, TOTAL, MAX_NORM, DECAY = 1e-3, 100, 10_000, 1.0, 0.1


def model_of(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def decays(tree):
    """No decay on biases: the mask researchers write most."""
    return {n: not n.endswith("bias") for n in tree}


def readme_chain() -> F.GradientTransformation:
    schedule = F.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, TOTAL)
    return F.chain(F.clip_by_global_norm(MAX_NORM), F.adamw(schedule, weight_decay=DECAY, mask=decays))


def lr_factor(step: int) -> float:
    """The warmup-cosine schedule as a factor of the peak (torch's LambdaLR)."""
    if step < WARMUP:
        return step / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(step - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)))


def with_grads(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 10  # a norm well above MAX_NORM: every step clips
    return model


def torch_step(model: nn.Module, zero_class=None):
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": DECAY},
              {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
    if zero_class is None:
        opt = torch.optim.AdamW(groups, lr=PEAK, fused=True)
    else:
        opt = zero_class(groups[0]["params"], torch.optim.AdamW, lr=PEAK, fused=True, weight_decay=DECAY)
        opt.add_param_group(groups[1])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    params = [p for _, p in named]

    def step():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()
        scheduler.step()

    return step


def zero_step(model: nn.Module, zero_class=None):
    opt = (F.Optimizer if zero_class is None else zero_class)(model.named_parameters(), readme_chain())
    return opt.step, opt


def pure_step(model: nn.Module, compiled: bool = False):
    """The chain's pure update and ``apply_updates``, eager or under
    ``torch.compile(fullgraph=True)`` (inductor): fresh params and state each step, as jitted
    Optax's below. (`zero.functional.Optimizer` steps the fused kernel whatever its ``inplace``:
    it rebuilds the alias to show its hyperparameters as group keys.)"""
    tx = readme_chain()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    held = {"params": params, "state": tx.init(params)}

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return F.apply_updates(params, updates), state

    if compiled:
        update = torch.compile(update, fullgraph=True)

    def step():
        held["params"], held["state"] = update(held["params"], held["state"], grads)

    return step


def optax_step(model: nn.Module):
    import jax
    import optax

    jax.config.update("jax_platforms", "cpu")
    params = {n: jax.numpy.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    grads = {n: jax.numpy.asarray(p.grad.numpy()) for n, p in model.named_parameters()}
    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, TOTAL)
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(schedule, weight_decay=DECAY, mask=decays))
    held = {"params": params, "state": tx.init(params)}

    @jax.jit
    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def step():
        held["params"], held["state"] = update(held["params"], held["state"], grads)
        jax.block_until_ready(held["params"])

    return step


def median_ms(step, repeat: int) -> float:
    step()
    step()  # warm-up: state allocation, compilation, first-touch page faults
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def one_process(shape: tuple[int, int], repeat: int, optax: bool, compiled: bool) -> dict:
    rows = {"torch clip_grad_norm_ + fused AdamW": median_ms(torch_step(with_grads(model_of(*shape))), repeat)}
    step, opt = zero_step(with_grads(model_of(*shape)))
    rows["zero Optimizer (fused)"] = median_ms(step, repeat)
    rows["zero pure update (eager)"] = median_ms(pure_step(with_grads(model_of(*shape))), repeat)
    compile_s = None
    if compiled:
        step, started = pure_step(with_grads(model_of(*shape)), compiled=True), time.perf_counter()
        step()  # the compilation
        compile_s = time.perf_counter() - started
        rows["zero pure update, torch.compile"] = median_ms(step, repeat)
    if optax:
        rows["jitted Optax"] = median_ms(optax_step(with_grads(model_of(*shape))), repeat)
    return {"rows": rows, "path": str(opt.path[0]), "compile_s": compile_s}


def zero_worker(rank: int, world_size: int, shape: tuple[int, int], repeat: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from zero.backends import ZeroRedundancyOptimizer as Zero

    theirs = median_ms(torch_step(with_grads(model_of(*shape)), zero_class=TorchZero), repeat)
    step, opt = zero_step(with_grads(model_of(*shape)), zero_class=Zero)
    return {"torch ZeRO + clip_grad_norm_ + fused AdamW": theirs, "zero ZeRO (fused)": median_ms(step, repeat),
            "path": str(opt.path[0])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--no-optax", action="store_true")
    parser.add_argument("--no-zero", action="store_true")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--compile", nargs="*", choices=sorted(SHAPES), default=[next(iter(SHAPES))],
                        help="shapes whose pure update is also timed under torch.compile (default: the "
                             "8.4M one; 2,000 small tensors took the compiler over 10 minutes here)")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from zero.tools.launch import run

    table = Table(title="The README chain (clip + AdamW + warmup-cosine + decay mask by name), ms per step")
    for column in ("shape", "system", "ms", "vs torch"):
        table.add_column(column, justify="left" if column in ("shape", "system") else "right")
    paths = {}
    for label in args.shapes:
        shape = SHAPES[label]
        found = one_process(shape, args.repeat, not args.no_optax, label in args.compile)
        rows, paths[label] = found["rows"], found["path"]
        if found["compile_s"] is not None:
            paths[f"{label}, torch.compile's first call"] = f"{found['compile_s']:.1f} s"
        ref = rows["torch clip_grad_norm_ + fused AdamW"]
        for system, ms in rows.items():
            table.add_row(label, system, f"{ms:.2f}", f"{ms / ref:.2f}x")
        if not args.no_zero:
            ranks = run(zero_worker, args.ranks, shape, args.repeat, timeout=900)
            theirs = max(r["torch ZeRO + clip_grad_norm_ + fused AdamW"] for r in ranks)
            ours = max(r["zero ZeRO (fused)"] for r in ranks)
            table.add_row(label, f"torch ZeRO, {args.ranks} ranks (slowest rank)", f"{theirs:.2f}", "1.00x")
            table.add_row(label, f"zero ZeRO, {args.ranks} ranks (slowest rank)", f"{ours:.2f}",
                          f"{ours / theirs:.2f}x")
            paths[f"{label}, ZeRO rank 0"] = ranks[0]["path"]
    console = Console(width=140)
    console.print(table)
    for label, path in paths.items():
        console.print(f"{label}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
