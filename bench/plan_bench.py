"""Planning time and imbalance: zero's planner vs torch's ZeroRedundancyOptimizer constructor.

Torch's constructor is run with meta parameters and a faked world size (no process group), so it
does exactly its partition work. Usage: python bench/plan_bench.py [--presets ...] [--worlds ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.plans.torch_reference import torch_zero  # noqa: E402
from zero import make_plan, param_metas, partition  # noqa: E402
from zero.plans.plan import PLAN_STRATEGIES  # noqa: E402
from zero.plans.presets import preset  # noqa: E402


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def torch_constructor_seconds(metas, world_size: int) -> float:
    params = [torch.empty(m.shape, device="meta", requires_grad=True) for m in metas]
    seconds, opt = timed(lambda: torch_zero(params, world_size))
    if seconds < 1.0:  # cheap enough to take the best of three, as for ours
        seconds = min(seconds, timed(lambda: torch_zero(params, world_size), repeat=2)[0])
    # Check torch's partition is ours, so the two timings are of the same work.
    ours = partition(metas, world_size)
    index = {id(p): i for i, p in enumerate(params)}
    got = [[index[id(p)] for g in groups for p in g["params"]] for groups in opt._partition_parameters_cache]
    assert got == [list(ours.params_of(r)) for r in range(world_size)], "partitions differ"
    return seconds


def metas_sources(metas) -> dict[str, object]:
    """The same model three ways a user holds it: a shape mapping, a meta-device module, a JAX
    pytree of ShapeDtypeStructs (the last only when JAX is installed)."""
    shapes = {m.name: m.shape for m in metas}
    with torch.device("meta"):
        module = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(torch.empty(s))
                                         for n, s in shapes.items()})
    sources = {"shapes": shapes, "meta module": module}
    try:
        import jax
    except ImportError:
        return sources
    sources["jax pytree"] = {n: jax.ShapeDtypeStruct(s, jax.numpy.float32) for n, s in shapes.items()}
    return sources


def metas_table(name: str, worlds: list[int]) -> Table:
    """param_metas + make_plan from each source, against torch's constructor at each W."""
    metas = preset(name)
    sources = metas_sources(metas)
    table = Table(title=f"{name}: zero.param_metas(x) + make_plan vs torch's constructor ({len(metas):,} tensors)")
    for col in ["source", "metas s", "us/param"] + [f"W={w} ratio" for w in worlds]:
        table.add_column(col, justify="right")
    t_torch = {w: torch_constructor_seconds(metas, w) for w in worlds}
    t_plan = {w: timed(lambda w=w: make_plan(metas, w), repeat=3)[0] for w in worlds}
    table.add_row("torch ctor s", "", "", *[f"{t_torch[w]:.3f}" for w in worlds])
    table.add_row("make_plan s", "", "", *[f"{t_plan[w]:.3f}" for w in worlds])
    for label, source in sources.items():
        t_metas, got = timed(lambda s=source: param_metas(s), repeat=3)
        assert sorted(m.numel for m in got) == sorted(m.numel for m in metas), label  # dicts sort keys
        table.add_row(label, f"{t_metas:.3f}", f"{t_metas / len(metas) * 1e6:.2f}",
                      *[f"{(t_metas + t_plan[w]) / t_torch[w]:.3f}" for w in worlds])
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["gpt2", "llama-7b", "moe-100k"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 8, 64, 256, 1024])
    ap.add_argument("--metas", default="moe-100k",
                    help="the preset whose metadata is timed from shapes, a module and a pytree ('' to skip)")
    ap.add_argument("--plot", help="also draw the last preset's planning times against W to this PNG")
    args = ap.parse_args()
    torch_zero([torch.empty(3, device="meta", requires_grad=True)], 2)  # one-time warm-up
    table = Table(title="planning time (s) and busiest rank / best possible (imb); torch = its constructor")
    for col in ["model", "W", "torch ctor s", "sorted_greedy s", "ratio"] + \
               [f"{s} imb" for s in PLAN_STRATEGIES] + ["flat s", "make_plan s", "plan ratio"]:
        table.add_column(col, justify="right")
    curves: dict[str, dict[str, list[float]]] = {}
    for name in args.presets:
        metas = preset(name)
        for w in args.worlds:
            t_torch = torch_constructor_seconds(metas, w)
            t_ours, _ = timed(lambda m=metas, w=w: partition(m, w), repeat=3)
            t_plan, _ = timed(lambda m=metas, w=w: make_plan(m, w))
            t_flat, _ = timed(lambda m=metas, w=w: make_plan(m, w, "flat"))
            imb = [make_plan(metas, w, s).max_over_bound for s in PLAN_STRATEGIES]
            table.add_row(name, str(w), f"{t_torch:.4f}", f"{t_ours:.4f}", f"{t_ours / t_torch:.3f}",
                          *[f"{x:.4f}" for x in imb], f"{t_flat:.3f}", f"{t_plan:.3f}", f"{t_plan / t_torch:.3f}")
            Console().print(f"{name} W={w}: torch {t_torch:.3f}s, ours {t_ours:.4f}s", style="dim")
            curves.setdefault(name, {}).setdefault("torch ZeroRedundancyOptimizer()", []).append(t_torch)
            curves[name].setdefault("zero.partition", []).append(t_ours)
            curves[name].setdefault("zero.make_plan", []).append(t_plan)
    Console(width=200).print(table)
    if args.metas:
        Console(width=200).print(metas_table(args.metas, args.worlds))
    if args.plot:
        from figure import lines

        last = args.presets[-1]
        lines(args.plot, f"planning {last} ({len(preset(last)):,} tensors)", args.worlds, curves[last],
              "world size", "seconds (lower is better)")


if __name__ == "__main__":
    main()
