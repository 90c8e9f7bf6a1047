"""Per-rank bodies of the Muon backend tests (run by `distributed.run_ranks` in fresh processes):
Muon under ZeRO against one process, and the count of Newton-Schulz runs on each rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zero
import zero.functional as zf
from tests.plan_workers import _worst
from tests.zero_workers import ddp_grads, make_model, same_on_every_rank, set_grads
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.functional.contrib import newton_schulz as ns_module


class CountingCalls:
    """Counts the calls of ``module.name`` inside the block (patched where its callers look it up)."""

    def __init__(self, module, name: str):
        self.calls, self._module, self._name = 0, module, name
        self._orig = getattr(module, name)

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)
        setattr(self._module, self._name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self._module, self._name, self._orig)


def CountingNewtonSchulz() -> CountingCalls:  # noqa: N802 (used as a class)
    """Counts Newton-Schulz runs (one per matrix orthogonalised), patched where `orthogonalize` calls it."""
    return CountingCalls(ns_module, "newton_schulz")


def side_by_side(ours_m, ours, ref_m, ref, rank: int, world_size: int, steps: int) -> tuple[int, float]:
    """Both optimizers on the same all-reduced gradients: the Newton-Schulz runs of ours on this
    rank, and the largest relative difference of their float64 params after any step."""
    calls, worst = 0, 0.0
    for step in range(steps):
        grads = ddp_grads(list(ours_m.parameters()), step, rank, world_size)
        set_grads(ours_m, grads)
        set_grads(ref_m, grads)
        with CountingNewtonSchulz() as count:
            ours.step()
        calls += count.calls
        ref.step()
        worst = max(worst, _worst(ours_m, ref_m))
    return calls, worst


def muon_whole(rank: int, world_size: int, steps: int = 20) -> dict:
    """``contrib.muon`` under a flops-balanced whole plan vs one process, float64, by name; each
    rank counts the matrices it orthogonalises."""
    tx = zf.contrib.muon(0.02, weight_decay=0.01, adam_weight_decay=0.01)
    ours_m, ref_m = make_model(dtypes=(torch.float64,)), make_model(dtypes=(torch.float64,))
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
