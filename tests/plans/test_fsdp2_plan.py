"""The plan of zero's rules over FSDP2's layout (`zero.plans.fsdp2`), from metadata alone."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zero
from zero.plans.fsdp2 import chunk_rows, make_fsdp2_plan
from zero.plans.presets import preset


@given(st.integers(0, 300), st.integers(1, 12))
def test_rows_are_torch_chunks_rows(size, world_size):
    """FSDP2 cuts dim 0 with torch.chunk, padding the missing ranks with empty pieces."""
    chunks = torch.arange(size).chunk(world_size) if size else ()
    want = [(int(c[0]), len(c)) for c in chunks] + [(size, 0)] * (world_size - len(chunks))
    assert [length for _, length in chunk_rows(size, world_size)] == [n for _, n in want]
    assert [start for start, n in chunk_rows(size, world_size) if n] == [s for s, n in want if n]


def metas():
    return zero.param_metas({"a.weight": (37, 7), "a.bias": (37,), "b.weight": (64, 96), "c.weight": (5, 37)})


def test_muons_matrices_are_owned_once_and_balanced_by_newton_schulz_work():
    plan = make_fsdp2_plan(metas(), 3, "muon")
    assert [plan.owner[i] >= 0 for i in range(4)] == [True, False, True, True]
    assert sorted(len(plan.owned(r)) for r in range(3)) == [1, 1, 1]
    assert plan.fingerprint == make_fsdp2_plan(metas(), 3, "muon").fingerprint


@pytest.mark.parametrize("world_size, cut", [(2, False), (3, True), (4, False)])
def test_low_bit_blocks_cut_between_ranks_go_to_an_owner(world_size, cut):
    """64 x 96 = 6,144 elements in blocks of 256: rows of 96 start at a block edge on every rank
    at 2 and 4 ranks (32 and 16 rows), not at 3 (22 rows: 2,112 elements)."""
    plan = make_fsdp2_plan(metas(), world_size, "adamw8bit")
    assert (plan.owner[2] >= 0) == cut
    assert plan.blocks[2] == (0 if cut else 256)


def test_state_and_exchange_bytes_add_up():
    plan = make_fsdp2_plan(metas(), 3, "muon")
    m = metas()
    # whole state on the owners (Muon: one momentum), pieces of the bias's AdamW state elsewhere
    spec = zero.plans.costs.cost_of("muon")
    total = sum(plan.state_bytes(r) for r in range(3))
    assert total == sum(spec.state_bytes(x, 4) for i, x in enumerate(m) if plan.owner[i] >= 0) + \
        sum(spec.shard_state_bytes(plan.local_numel(1, r), 4) for r in range(3))
    sent = [plan.exchange_bytes(r)["float32"] for r in range(3)]
    # every piece that is not the owner's travels twice (param and gradient) to it, once back
    away = sum(plan.local_numel(i, r) * 4 for i in plan.whole for r in range(3) if r != plan.owner[i])
    assert sum(s[0] for s in sent) == 2 * away and sum(s[1] for s in sent) == away


def test_a_plan_at_scale_keeps_every_element_once():
    plan = make_fsdp2_plan(preset("llama-7b"), 1024, "muon")
    for i, m in enumerate(plan.metas[:40]):
        assert sum(plan.local_numel(i, r) for r in range(1024)) == m.numel
    assert max(len(plan.owned(r)) for r in range(1024)) <= math.ceil(len(plan.whole) / 1024) + 1


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"'a.bias' of shape \(37,\) cannot be sharded on dim 1"):
        make_fsdp2_plan(metas(), 2, dims={"a.bias": 1})
    with pytest.raises(ValueError, match=r"whole names params that are not in the plan: \['nope'\]"):
        make_fsdp2_plan(metas(), 2, whole=["nope"])
    with pytest.raises(TypeError, match="list of param names"):
        make_fsdp2_plan(metas(), 2, whole="a.weight")
