"""The matrix frontier (#67): Newton-Schulz time, standard against Gram (and whole matrices
against per-head blocks), for LLaMA's 4096 x 4096 and 4096 x 11008 shapes scaled down to this CPU;
and per-head against whole-matrix Muon under FSDP2 at 2 and 3 ranks (step time, bytes exchanged
with owners, state per rank), in one run. At 2 ranks FSDP2's rows of q, k, v are whole heads
(stepped where they lie); at 3 they cut heads (each rank steps the heads that start in its rows).

    .venv/bin/python bench/matrix_frontier_bench.py [--scale 8] [--repeat 9] [--steps 12] [--ranks 2 3]

Kernel times are medians of ``--repeat`` alternating runs of `orthogonalize_via_newton_schulz`
(float32, five steps, Polar Express's coefficients, the Gram iteration's restart before its third
step), on this machine's CPU threads. The FSDP2 model: one block of LLaMA-7B's shapes divided by
``--scale`` (q, k, v, o of d x d with 32 heads, the MLP's d x 2.69d), float32, `zero.functional.
Optimizer` over ``fully_shard`` at ``--ranks`` gloo ranks; medians of ``--steps`` steps after two.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from zero.functional.contrib import MuonDimensionNumbers as Dims  # noqa: E402
from zero.functional.contrib import orthogonalize_via_newton_schulz  # noqa: E402
from zero.functional.contrib._muon import NS_COEFFS_PRESETS  # noqa: E402
from zero.tools.launch import run  # noqa: E402

PE = NS_COEFFS_PRESETS["polar_express"]


def kernel_times(scale: int, repeat: int) -> list[tuple]:
    """(shape, variant, median ms) for each shape and variant, alternating the variants."""
    d, ff = 4096 // scale, 11008 // scale
    cases = {(d, d): {"standard": {}, "per-head (32)": {"heads": 32}},
             (d, ff): {"standard": {}, "gram": {"ns_method": "gram"}},
             (ff, d): {"standard": {}, "gram": {"ns_method": "gram"}}}
    out = []
    for shape, variants in cases.items():
        x = torch.randn(*shape)
        times = {name: [] for name in variants}
        for _ in range(repeat + 1):
            for name, kw in variants.items():
                dims = Dims(1, 0, heads=kw.get("heads", 1))
                start = time.perf_counter()
                orthogonalize_via_newton_schulz(x, PE, 5, dimension_numbers=dims,
                                                **{k: v for k, v in kw.items() if k != "heads"})
                times[name].append(time.perf_counter() - start)
        out += [(shape, name, 1e3 * statistics.median(ts[1:])) for name, ts in times.items()]
    return out


def _fsdp2(rank: int, world_size: int, scale: int, per_head: bool, steps: int) -> dict:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import zero.functional as F
    from zero.backends import comm

    torch.manual_seed(0)
    d, ff = 4096 // scale, 11008 // scale
    names = ("q", "k", "v", "o", "gate", "up", "down")
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "gate": (d, ff), "up": (d, ff), "down": (ff, d)}
    model = nn.ModuleDict({n: nn.Linear(*shapes[n], bias=False) for n in names})
    for layer in model.values():
        fully_shard(layer)
    heads = 32 if per_head else 1
    dims = {f"{n}.weight": Dims(1, 0, heads=heads if n in ("q", "k", "v") else 1) for n in names}
    opt = F.Optimizer(list(model.named_parameters()), F.contrib.muon(0.02, muon_weight_dimension_numbers=dims))
    times = []
    for _ in range(steps + 2):
        for p in model.parameters():
            p.grad = torch.distributed.tensor.distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements)
        dist.barrier()
        with comm.recording() as made:
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    exchanged = sum(c.bus_bytes for c in made if c.kind == "exchange")
    plan = opt.executor.plan
    return {"step_ms": 1e3 * statistics.median(times[2:]), "exchanged": exchanged, "state": opt.state_nbytes(),
            "owned": len(plan.owned(rank)), "by_heads": len(plan.by_heads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; LLaMA-7B's shapes / {args.scale}")
    print(f"{'shape':>14} {'variant':>14} {'median ms':>10}")
    rows = kernel_times(args.scale, args.repeat)
    for shape, name, ms in rows:
        print(f"{str(shape):>14} {name:>14} {ms:10.2f}")
    base = {shape: ms for shape, name, ms in rows if name == "standard"}
    for shape, name, ms in rows:
        if name != "standard":
            print(f"{str(shape):>14} {name:>14} {base[shape] / ms:9.2f}x faster than standard")
    for world in args.ranks:
        print(f"\nMuon under FSDP2, {world} ranks (one LLaMA-7B block / scale)")
        for per_head in (False, True):
            ranks = run(_fsdp2, world, args.scale, per_head, args.steps, timeout=900)
            kind = "per-head q,k,v" if per_head else "whole matrices"
            print(f"{kind:>15}: step {[round(r['step_ms'], 1) for r in ranks]} ms, exchanged "
                  f"{[r['exchanged'] for r in ranks]} bytes, state {[r['state'] for r in ranks]} bytes, "
                  f"matrices owned {[r['owned'] for r in ranks]}, stepped by whole heads {ranks[0]['by_heads']}")


if __name__ == "__main__":
    main()
