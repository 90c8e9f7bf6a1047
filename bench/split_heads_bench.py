"""Per-head Muon under ZeRO's flat plans (#67 item 5): q, k, v whole on owners (the hybrid plan)
against cut at head edges (``split_heads=True``: every rank steps an equal share of their heads
where they lie in its shards), in one run: each rank's step time, Newton-Schulz work, state and
bytes sent; and the plans' balance of Newton-Schulz work on LLaMA-7B at 64 ranks and LLaMA-70B at
1,024 (``make_plan(..., "step_flops", "muon(heads=...)")``).

    .venv/bin/python bench/split_heads_bench.py [--scale 8] [--blocks 2] [--steps 12] [--ranks 2 3 4]

The model: ``--blocks`` blocks of LLaMA-7B's shapes divided by ``--scale`` (q, k, v, o of d x d,
q, k, v with 32 heads; the MLP's d x 2.69d; two norms), float32, gradients set by hand;
`zero.ZeroRedundancyOptimizer(..., strategy="flat")` with zero's per-head Muon, at ``--ranks``
gloo ranks, the two plans taking turns step by step; medians of ``--steps`` steps after two.
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

import zero  # noqa: E402
from zero.functional.contrib import MuonDimensionNumbers as Dims  # noqa: E402
from zero.plans.presets import preset  # noqa: E402
from zero.tools.launch import run  # noqa: E402

QKV = ("q_proj.weight", "k_proj.weight", "v_proj.weight")


def _model(scale: int, blocks: int):
    from torch import nn

    d, ff = 4096 // scale, 11008 // scale
    shapes = {"q_proj": (d, d), "k_proj": (d, d), "v_proj": (d, d), "o_proj": (d, d), "gate_proj": (d, ff),
              "up_proj": (d, ff), "down_proj": (ff, d)}
    layers = nn.ModuleDict()
    for b in range(blocks):
        layer = nn.ModuleDict({n: nn.Linear(*s, bias=False) for n, s in shapes.items()})
        layer["norm"] = nn.LayerNorm(d)
        layers[str(b)] = layer
    return layers


def _rule():
    import zero.functional as F

    def dims(tree):
        if not isinstance(tree, dict):
            return [None] * len(tree)
        return {n: Dims(1, 0, heads=32 if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) else 1)
                if n.endswith("_proj.weight") else None for n in tree}
    return F.contrib.muon(0.02, muon_weight_dimension_numbers=dims)


def _zero(rank: int, world_size: int, scale: int, blocks: int, steps: int) -> dict:
    import torch.distributed as dist

    from zero.backends import comm
    from zero.functional.contrib import newton_schulz

    torch.manual_seed(0)
    runs = {}
    for split in (False, True):
        model = _model(scale, blocks)
        runs[split] = (model, zero.ZeroRedundancyOptimizer(list(model.named_parameters()), _rule(),
                                                           strategy="flat", split_heads=split))
    times, sent, work = {s: [] for s in runs}, {}, {}
    real = newton_schulz.newton_schulz
    for k in range(steps + 2):
        for split, (model, opt) in runs.items():
            gen = torch.Generator().manual_seed(k)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            count = {"matrices": 0, "elements": 0}

            def counted(x, *args, count=count, **kwargs):
                count["matrices"] += x.shape[0]
                count["elements"] += x.numel()
                return real(x, *args, **kwargs)
            newton_schulz.newton_schulz = counted
            dist.barrier()
            with comm.recording() as made:
                start = time.perf_counter()
                opt.step()
                times[split].append(time.perf_counter() - start)
            newton_schulz.newton_schulz = real
            sent[split] = sum(c.bytes for c in made if c.dtype != "int64")
            work[split] = count
    return {split: {"step_ms": 1e3 * statistics.median(times[split][2:]), "sent": sent[split],
                    "state": opt.rank_state.optim.state_nbytes(), **work[split],
                    "whole": len(opt.plan.whole)} for split, (_, opt) in runs.items()}


def plan_balance() -> list[tuple]:
    """(preset, world size, split, busiest / mean, busiest / best possible) of Newton-Schulz work."""
    out = []
    for name, world in (("llama-7b", 64), ("llama-70b", 1024)):
        metas = preset(name)
        heads = {m.name: 64 if name == "llama-70b" and m.name.endswith("q_proj.weight") else
                 (8 if name == "llama-70b" else 32) for m in metas if m.name.endswith(QKV)}
        for split in (False, True):
            plan = zero.make_plan(metas, world, "flat", "step_flops", f"muon(heads={heads!r})", split_heads=split)
            out.append((name, world, split, plan.max_over_mean, plan.max_over_bound))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    args = parser.parse_args()
    print(f"torch {torch.__version__}; {args.blocks} LLaMA-7B blocks / {args.scale}, per-head Muon (32 heads)")
    for world in args.ranks:
        ranks = run(_zero, world, args.scale, args.blocks, args.steps, timeout=900)
        print(f"\n{world} ranks")
        for split in (False, True):
            rows = [r[split] for r in ranks]
            kind = "heads cut (split)" if split else "q,k,v on owners"
            print(f"{kind:>18}: step {[round(r['step_ms'], 1) for r in rows]} ms, Newton-Schulz matrices "
                  f"{[r['matrices'] for r in rows]} (elements {[r['elements'] for r in rows]}), state "
                  f"{[r['state'] for r in rows]} B, sent {[r['sent'] for r in rows]} B, whole {rows[0]['whole']}")
    print("\nplans, Newton-Schulz work (step_flops): busiest / mean, busiest / best possible")
    for name, world, split, over_mean, over_bound in plan_balance():
        print(f"{name:>10} at {world:5d} ranks, {'split' if split else 'whole':>5}: {over_mean:.4f}, {over_bound:.4f}")


if __name__ == "__main__":
    main()
