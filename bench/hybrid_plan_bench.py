"""What a hybrid plan holds per rank against a whole-param plan, for Muon with Moonlight's routing
(the embeddings and LM head on AdamW, every other matrix on Muon), from metadata alone.

Both plans balance the step's work (Newton-Schulz flops for Muon's matrices, elements for the
rest). The whole-param plan (``"balanced"``) puts each embedding whole on one rank, with AdamW's two
moments; the hybrid (``"flat", whole=<Muon's matrices>``) keeps Muon's matrices whole and splits
the AdamW params across every rank to the element. State bytes are counted per rank from each
plan's placement, Muon's matrices with one momentum and AdamW's params with two moments.
Usage: python bench/hybrid_plan_bench.py [--presets gpt2 llama-7b] [--worlds 8 16 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import zero  # noqa: E402
from zero.plans.costs import cost_of  # noqa: E402
from zero.plans.diff import placement  # noqa: E402

MUON = cost_of("muon")
ADAMW_NAMES = ("wte", "wpe", "embed", "lm_head")  # Moonlight's routing: these to AdamW


def is_muons(meta: zero.ParamMeta) -> bool:
    return len(meta.shape) == 2 and not any(n in meta.name for n in ADAMW_NAMES)


def step_flops(meta: zero.ParamMeta) -> int:
    return MUON.step_flops(meta) if is_muons(meta) else meta.numel


def state_per_rank(plan: zero.Plan) -> list[int]:
    """Bytes of optimizer state on each rank: one momentum per Muon element, two moments per AdamW one."""
    out = [0] * plan.world_size
    for i, m in enumerate(plan.metas):
        if m.requires_grad:
            slots = 1 if is_muons(m) else 2
            for rank, start, end in placement(plan, i):
                out[rank] += slots * (end - start) * m.nbytes // m.numel
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2", "llama-7b"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 64])
    args = parser.parse_args()
    table = Table(title="Muon (embeddings and LM head on AdamW): optimizer state per rank, MiB")
    for column in ("model", "ranks", "mean", "busiest, whole-param plan", "busiest, hybrid plan",
                   "whole / hybrid", "flops busiest / mean (both)"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name in args.presets:
        metas = zero.preset(name)
        for world in args.worlds:
            whole = zero.make_plan(metas, world, "balanced", step_flops, "muon")
            hybrid = zero.make_plan(metas, world, "flat", step_flops, "muon", whole=is_muons)
            a, b = state_per_rank(whole), state_per_rank(hybrid)
            table.add_row(name, str(world), f"{statistics.mean(a) / 2**20:,.1f}", f"{max(a) / 2**20:,.1f}",
                          f"{max(b) / 2**20:,.1f}", f"{max(a) / max(b):.2f}x",
                          f"{whole.max_over_mean:.3f} / {hybrid.max_over_mean:.3f}")
    Console(width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
