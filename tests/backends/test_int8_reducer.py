"""The reducer seam, proven by a second reducer: `zero.backends.Int8Reducer` (ZeRO++'s qgZ wire
format) under ZeRO-2, against the plan's bytes, the plain `MeanReducer` and its error bound."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks
from torch import nn

import zero
from zero.backends import Int8Reducer, MeanReducer, comm
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.plans.accounting import bus_bytes
from zero.plans.footprint import footprint


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 301), nn.Tanh(), nn.Linear(301, 7))


def _optimizer(model: nn.Module, world_size: int, reducer: comm.Reducer | None, **kwargs):
    plan = zero.make_plan(zero.param_metas(model), world_size, "flat", bucket_numel=40_000)
    return Zero(model.parameters(), torch.optim.SGD, plan=plan, reduce_scatter_grads=True, reducer=reducer,
                lr=0.05, **kwargs), plan


def _codes_loss(model: nn.Module, weights: list[torch.Tensor]) -> torch.Tensor:
    """A loss whose gradient is ``weights`` (one tensor per param): gradients chosen exactly."""
    return sum((p * c).sum() for p, c in zip(model.parameters(), weights))


def bytes_against_the_plan(rank: int, world_size: int) -> dict:
    model = _model()
    opt, plan = _optimizer(model, world_size, Int8Reducer())
    for step in range(2):
        with comm.recording() as made:
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    predicted = footprint(plan, rank, reduce_scatter_grads=True, reducer=Int8Reducer()).collectives
    plain = footprint(plan, rank, reduce_scatter_grads=True).collectives
    wire = sum(bus_bytes(k, b, world_size) for k, b in predicted if k == "all_to_all")
    fp32 = sum(bus_bytes(k, b, world_size) for k, b in plain if k == "reduce_scatter_sum")
    return {"made": sorted((c.kind, c.bytes) for c in made if c.kind != "all_gather_into"),
            "predicted": sorted(map(tuple, predicted)), "ratio": wire / fp32}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_bytes_on_the_wire_are_the_plans_and_under_0_30_of_fp32s(world_size):
    for rank, r in enumerate(run_ranks(bytes_against_the_plan, world_size, timeout=180)):
        assert [tuple(c) for c in r["made"]] == [tuple(c) for c in r["predicted"]], rank
        assert any(k == "all_to_all" for k, _ in r["made"]) and not any(k.startswith("reduce_scatter")
                                                                        for k, _ in r["made"])
        assert 0.25 < r["ratio"] <= 0.30, r["ratio"]


def exact_codes(rank: int, world_size: int) -> dict:
    """Gradients in {-127, 0, 127} (every block's scale 1 or 0: codes exact), three steps of
    AdamW, beside the same run with the plain reducer."""
    runs = {}
    for name, reducer in (("int8", Int8Reducer(block=64)), ("mean", MeanReducer())):
        model = _model()
        plan = zero.make_plan(zero.param_metas(model), world_size, "flat", bucket_numel=40_000)
        opt = Zero(model.parameters(), torch.optim.AdamW, plan=plan, reduce_scatter_grads=True, reducer=reducer,
                   lr=1e-2)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            weights = [127.0 * torch.randint(-1, 2, p.shape, generator=g).float() for p in model.parameters()]
            _codes_loss(model, weights).backward()
            opt.step()
            opt.zero_grad()
        runs[name] = [p.detach().clone() for p in model.parameters()]
    return {"equal": all(torch.equal(a, b) for a, b in zip(runs["int8"], runs["mean"]))}


def test_exact_codes_give_the_mean_reducers_numbers_bit_for_bit():
    assert all(r["equal"] for r in run_ranks(exact_codes, 3, timeout=180))


def error_bound(rank: int, world_size: int) -> dict:
    """One reduction of random gradients by each reducer: the int8 mean within half a code step a
    rank of the exact one, ``max |g| / 254`` (every rank's scale at most the largest magnitude / 127)."""
    grads = {}
    for name, reducer in (("int8", Int8Reducer()), ("mean", MeanReducer())):
        model = _model()
        opt, _ = _optimizer(model, world_size, reducer)
        g = torch.Generator().manual_seed(7 + rank)
        weights = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        _codes_loss(model, weights).backward()
        grads[name] = [grad.clone() for _, grad in opt.mode.held_grads()]
        largest = torch.tensor(max(float(w.abs().max()) for w in weights))
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    error = max(float((a - b).abs().max()) for a, b in zip(grads["int8"], grads["mean"]))
    return {"error": error, "bound": float(largest) / 254}


def test_the_int8_mean_is_within_half_a_code_step_of_the_exact_one():
    for r in run_ranks(error_bound, 3, timeout=180):
        assert 0 < r["error"] <= r["bound"] * (1 + 1e-5), r


def test_a_reducer_is_refused_where_zero_does_not_reduce_and_a_bad_one_by_name():
    with pytest.raises(ValueError, match=r"block=0"):
        Int8Reducer(block=0)
    without, not_a_reducer = run_ranks(_refused, 2)[0]
    assert without.startswith("ValueError: reducer=Int8Reducer(block=256) reduces the gradients' buckets"), without
    assert not_a_reducer.startswith("TypeError: reducer must be a zero.backends.comm.Reducer"), not_a_reducer
    assert not_a_reducer.endswith("got str")


def _refused(rank: int, world_size: int) -> list[str]:
    said = []
    for options in ({"reducer": Int8Reducer()}, {"reduce_scatter_grads": True, "reducer": "int8"}):
        try:
            Zero(_model().parameters(), torch.optim.SGD, strategy="flat", lr=0.1, **options)
        except (TypeError, ValueError) as e:
            said.append(f"{type(e).__name__}: {e}")
    return said
