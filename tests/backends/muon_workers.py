"""Per-rank bodies of the Muon backend tests (run by `helpers.run_ranks` in fresh processes):
Muon under ZeRO against one process, and the count of Newton-Schulz runs on each rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import CountingCalls, ddp_grads, make_model, same_on_every_rank
from helpers import side_by_side as steps_side_by_side

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.functional.contrib import newton_schulz as ns_module


def CountingNewtonSchulz() -> CountingCalls:  # noqa: N802 (used as a class)
    """Counts Newton-Schulz runs (one per matrix orthogonalised), patched where `orthogonalize` calls it."""
    return CountingCalls(ns_module, "newton_schulz")


def side_by_side(ours_m, ours, ref_m, ref, rank: int, world_size: int, steps: int) -> tuple[int, float]:
    """Both optimizers on the same all-reduced gradients: the Newton-Schulz runs of ours on this
    rank, and the largest relative difference of their float64 params after any step."""
    calls = 0

    def step(opt):
        nonlocal calls
        with CountingNewtonSchulz() as count:
            opt.step()
        calls += count.calls if opt is ours else 0

    worst = steps_side_by_side([(ours_m, ours), (ref_m, ref)],
                               lambda k: ddp_grads(list(ours_m.parameters()), k, rank, world_size), range(steps),
                               step=step)
    return calls, worst


def muon_whole(rank: int, world_size: int, steps: int = 20) -> dict:
    """``contrib.muon`` under a flops-balanced whole plan vs one process, float64, by name; each
    rank counts the matrices it orthogonalises."""
    tx = zf.contrib.muon(0.02, weight_decay=0.01, adam_weight_decay=0.01)
    ours_m, ref_m = make_model("small", dtype=torch.float64), make_model("small", dtype=torch.float64)
    plan = zero.make_plan(zero.param_metas(ours_m), world_size, "balanced", "step_flops", "muon")
    ours = Zero(ours_m.named_parameters(), tx, plan=plan)
    ref = zf.Optimizer(ref_m.named_parameters(), tx)
    calls, worst = side_by_side(ours_m, ours, ref_m, ref, rank, world_size, steps)
    assert worst <= 1e-9, worst
    assert same_on_every_rank(ours_m)
    owned = [i for i in plan.partition.params_of(rank) if len(plan.metas[i].shape) == 2]
    counts = [None] * world_size
    dist.all_gather_object(counts, calls)
    return {"calls": calls, "owned_matrices": len(owned), "all_calls": counts,
            "matrices": sum(len(m.shape) == 2 for m in plan.metas)}
