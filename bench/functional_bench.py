"""Adam step speed: zero.functional vs torch.optim, side by side in one run.

20M float32 elements in 200 tensors (uneven sizes). Reports ns/element, the implied memory
traffic (Adam reads p, g, m, v and writes p, m, v: 28 bytes/element) against a measured copy
bandwidth, and each path's time relative to torch's fused Adam.
Usage: python bench/functional_bench.py [--elements 20e6] [--tensors 200] [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import zero.functional as F  # noqa: E402

ADAM_BYTES = 28


def make_params(elements: int, tensors: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(tensors, generator=gen) + 0.5
    sizes = (weights / weights.sum() * elements).long().clamp(min=1)
    return [torch.randn(int(n), generator=gen) for n in sizes]


def timeit(fn, repeat: int) -> float:
    fn()  # warm-up: state allocation, first-touch page faults
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_step(params, grads, **kw):
    ps = [p.clone().requires_grad_() for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    opt = torch.optim.Adam(ps, lr=1e-3, **kw)
    return opt.step


def ours_step(params, grads, tx):
    ps = [p.clone().requires_grad_() for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    return F.Optimizer(ps, tx).step


def pure_step(params, grads):
    tx = F.adam(1e-3)
    box = {"params": [p.clone() for p in params]}
    box["state"] = tx.init(box["params"])

    def step():
        updates, box["state"] = tx.update(grads, box["state"], box["params"])
        box["params"] = F.apply_updates(box["params"], updates)

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=float, default=20e6)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--plot", help="also draw the ms/step of each path to this PNG")
    args = ap.parse_args()
    n = int(args.elements)
    params = make_params(n, args.tensors)
    grads = [torch.randn_like(p) for p in params]
    n = sum(p.numel() for p in params)
    src, dst = torch.randn(n), torch.empty(n)
    copy_s = timeit(lambda: dst.copy_(src), args.repeat)
    copy_gbs = 8 * n / copy_s / 1e9  # a copy reads and writes 4 bytes per element
    paths = {
        "torch Adam(fused=True)": torch_step(params, grads, fused=True),
        "torch Adam(foreach=True)": torch_step(params, grads, foreach=True),
        "zero Optimizer(adam)": ours_step(params, grads, F.adam(1e-3)),
        "zero Optimizer(from_torch(Adam))": ours_step(params, grads, F.from_torch("Adam", lr=1e-3)),
        "zero pure update + apply_updates": pure_step(params, grads),
    }
    results = {name: timeit(fn, args.repeat) for name, fn in paths.items()}
    base = results["torch Adam(fused=True)"]
    foreach = results["torch Adam(foreach=True)"]
    table = Table(title=f"Adam step on {n / 1e6:.1f}M float32 elements in {len(params)} tensors, "
                        f"{torch.get_num_threads()} threads; copy bandwidth {copy_gbs:.1f} GB/s")
    for col in ("path", "ms/step", "ns/element", "GB/s (28 B/elem)", "x fused", "x foreach"):
        table.add_column(col, justify="right")
    for name, s in results.items():
        table.add_row(name, f"{s * 1e3:.1f}", f"{s / n * 1e9:.3f}", f"{ADAM_BYTES * n / s / 1e9:.1f}",
                      f"{s / base:.2f}", f"{s / foreach:.2f}")
    Console(width=160).print(table)
    if args.plot:
        from figure import grouped_bars

        grouped_bars(args.plot, f"Adam step, {n / 1e6:.0f}M float32 elements in {len(params)} tensors (CPU)",
                     {"ms/step": {name: s * 1e3 for name, s in results.items()}}, "ms per step (lower is better)")


if __name__ == "__main__":
    main()
