"""The optimizer step inside DDP's comm hook (`overlap_with_ddp=True`), on gloo, from the first iteration."""

import overlap_workers as w
import pytest
import torch
from helpers import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import zero
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import hook_with_zero_step


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_iteration_equals_ddp_and_sgd_from_the_first(world_size):
    """{plain, interleaved hook} x {shard_buckets} x {static_graph} x {gradient_as_bucket_view}: after
    each of 6 iterations (DDP rebuilds its buckets after the first), params equal DDP +
    torch.optim.SGD(momentum, weight_decay) with two param groups, each rank on its own data:
    to the bit at 2 ranks; at 3 within float64 rounding (DDP's own reduction divides after the
    sum, the allreduce_hook before it)."""
    results = run_ranks(w.matrix, world_size, timeout=240)
    for rank, by_case in enumerate(results):
        assert len(by_case) == 16
        for case, r in by_case.items():
            assert max(r["worst"]) <= 1e-9 and (r["equal"] or world_size != 2), f"{case} rank {rank}: {r['worst']}"
    owners = {case: tuple(r["owners"]) for case, r in results[0].items()}
    assert len(set(owners.values())) >= 2 or world_size == 2, "shard_buckets changes the ownership"
    assert len(set(results[0][("plain", False, False, False)]["owners"])) == world_size, "every rank owns some"


def test_functional_rules_mixed_dtypes_and_unused_parameter_search():
    results = run_ranks(w.rules, 2, timeout=240)
    for rank, by_case in enumerate(results):
        for case, r in by_case.items():
            assert r["equal"] and max(r["worst"]) == 0.0, f"{case} rank {rank}: {r['worst']}"


def test_a_checkpoint_moves_from_overlapped_to_plain_zero():
    results = run_ranks(w.checkpoint_between_modes, 2, "unused", timeout=120)
    assert all(r["equal"] for r in results)
    assert results[0]["torch_format"] == ["momentum_buffer"], "the plain torch.optim format"


@pytest.mark.parametrize("hook", ["plain", "interleaved"])
def test_join_with_uneven_inputs(hook):
    results = run_ranks(w.join_uneven, 3, hook, timeout=120)
    assert all(r["equal"] for r in results), results


def test_the_hook_keeps_no_reference_to_ddp():
    assert all(r["ddp_freed"] for r in run_ranks(w.no_cycle, 2, timeout=90))


def test_a_rule_over_the_whole_model_is_refused_in_backward():
    """Every rank fails in its first backward: with our message, or (a rank whose peer stopped
    first) with gloo's lost connection; none hangs."""
    results = run_ranks(w.global_norm_rule, 2, pg_timeout=20, timeout=90)
    assert all(r["message"] for r in results), results
    assert any("overlap_with_ddp=True steps one DDP bucket at a time" in r["message"] for r in results), results


# -- errors at the boundary (one gloo rank, in process) ------------------------------------------

@pytest.mark.usefixtures("one_rank")
def test_overlap_errors():
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ddp = DDP(model)
    opt = Zero(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    with pytest.raises(RuntimeError, match="register zero.backends.hook_with_zero_step"):
        opt.step()
    with pytest.raises(ValueError, match="1 only in the model, 0 only in the optimizer"):
        hook_with_zero_step(allreduce_hook, ddp, Zero(list(model.parameters())[1:], torch.optim.SGD,
                                                      overlap_with_ddp=True, lr=0.1))
    with pytest.raises(ValueError, match="built with overlap_with_ddp=False"):
        hook_with_zero_step(allreduce_hook, ddp, Zero(model.parameters(), torch.optim.SGD, lr=0.1))
    with pytest.raises(TypeError, match="must be a DistributedDataParallel model"):
        hook_with_zero_step(allreduce_hook, model, opt)
    hook_with_zero_step(allreduce_hook, ddp, opt)
    with pytest.raises(ValueError, match="register hook_with_zero_step once"):
        hook_with_zero_step(allreduce_hook, ddp, opt)
    with pytest.raises(ValueError, match="whole-param plan"):
        Zero(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, strategy="flat", lr=0.1)


def test_ownership_follows_ddp_buckets_as_a_plan():
    """A pure function: DDP's predicted buckets, whole to ranks in turn or split over them."""
    from zero.plans.ddp_buckets import ddp_bucket_partition

    metas = [zero.ParamMeta(str(i), (n,)) for i, n in enumerate([300, 100, 200, 400, 50])]
    whole = ddp_bucket_partition(metas, 2, bucket_cap_mb=1200 / 2**20)  # 300 floats per bucket
    buckets = zero.ddp_buckets(metas, 1200 / 2**20)
    for b, idx in enumerate(buckets):
        assert {whole.owner[i] for i in idx} == {b % 2}
    split = ddp_bucket_partition(metas, 2, bucket_cap_mb=1, shard_buckets=True)  # one bucket, split
    assert set(split.owner) == {0, 1} and split.strategy == "ddp_buckets_sharded"


def test_torch_overlap_scenario_counted_from_the_first_iteration():
    """torch's own `test_ddp_zero_overlap` scenario, its 16 combinations, on CPU/gloo (which torch
    disables), without the 2-3 warm-up iterations torch's version needs before it updates."""
    for rank, by_case in enumerate(run_ranks(w.torch_scenario, 2, timeout=300)):
        assert len(by_case) == 16
        for case, (close, moved) in by_case.items():
            assert close and moved, f"{case} rank {rank}: equal to DDP + SGD {close}, params moved {moved}"
