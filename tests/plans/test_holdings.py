"""`zero.holdings`: what each rank's local optimizer holds under a plan, from metadata alone."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import metas as metas_lists

import zero
from zero.plans.chunks import Held
from zero.plans.holdings import LocalTensor


def metas():
    """Two groups, uneven sizes, a frozen bias, a matrix a hybrid keeps whole."""
    return [zero.ParamMeta("a.weight", (6, 5), group=0), zero.ParamMeta("a.bias", (6,), group=0, requires_grad=False),
            zero.ParamMeta("b.weight", (4, 6), group=1), zero.ParamMeta("b.bias", (4,), group=1),
            zero.ParamMeta("c.weight", (3,), group=1)]


def test_a_whole_param_plan_gives_each_rank_its_owned_params_whole_by_group():
    plan = zero.make_plan(metas(), 2, "sorted_greedy")
    for rank in range(2):
        held = zero.holdings(plan, rank)
        owned = plan.partition.params_of(rank)
        assert [t.param for t in held.tensors] == sorted(owned, key=lambda i: plan.metas[i].group)
        assert all(t.whole and t.buffer is None and t.numel == plan.metas[t.param].numel for t in held.tensors)
        assert held.held == tuple(Held(t.param, j, 0, 0, t.numel) for j, t in enumerate(held.tensors))
        assert sum(held.group_sizes()) == len(owned)


def test_a_flat_plan_gives_each_rank_one_shard_per_buffer_holding_pieces():
    plan = zero.make_plan(metas(), 3, "flat")
    held = zero.holdings(plan, 1)
    order = [bi for k in (0, 1) for bi, b in enumerate(plan.flat.buffers) if b.group == k]
    assert held.tensors == tuple(LocalTensor(plan.flat.buffers[bi].group, plan.flat.buffers[bi].shard_numel,
                                             buffer=bi) for bi in order)
    # group 1 packs b.weight (24), b.bias (4), c.weight (3): 31 elements padded to 33, 11 a rank
    shard = held.tensors.index(next(t for t in held.tensors if t.group == 1))
    assert [(h.param, h.offset, h.start, h.end) for h in held.pieces(shard)] == [(2, 0, 11, 22)]


def test_a_hybrid_plan_puts_each_groups_whole_params_before_its_shards():
    plan = zero.make_plan(metas(), 2, "flat", whole=["b.weight"])
    owner = plan.partition.owner[2]
    held = zero.holdings(plan, owner)
    group1 = [t for t in held.tensors if t.group == 1]
    assert group1[0] == LocalTensor(1, 24, param=2) and all(not t.whole for t in group1[1:])
    other = zero.holdings(plan, 1 - owner)
    assert all(not t.whole for t in other.tensors)


def test_trailing_empty_groups_are_kept_and_too_few_groups_are_refused():
    plan = zero.make_plan(metas(), 2)
    assert zero.holdings(plan, 0, n_groups=4).group_sizes()[2:] == [0, 0]
    with pytest.raises(ValueError, match="n_groups must be >= 2"):
        zero.holdings(plan, 0, n_groups=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        zero.holdings(plan, 2)


@given(metas_lists(), st.integers(1, 9), st.sampled_from(["sorted_greedy", "contiguous", "flat", "hybrid"]))
def test_every_trainable_element_is_held_exactly_once_where_the_plan_says(ms, world_size, strategy):
    if strategy == "hybrid":
        plan = zero.make_plan(ms, world_size, "flat", whole=lambda m: len(m.shape) == 2)
    else:
        plan = zero.make_plan(ms, world_size, strategy)
    seen = {i: [] for i, m in enumerate(ms)}
    for rank in range(world_size):
        held = zero.holdings(plan, rank)
        used = {j: [] for j in range(len(held.tensors))}
        for h in held.held:
            seen[h.param].append((rank, h.start, h.end))
            used[h.local].append((h.offset, h.offset + h.end - h.start))
            assert 0 <= h.offset and h.offset + h.end - h.start <= held.tensors[h.local].numel
        for spans in used.values():  # pieces of one local tensor do not overlap
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        groups = [t.group for t in held.tensors]
        assert groups == sorted(groups)
    for i, m in enumerate(ms):
        chunks = sorted(c for c in zero.holdings(plan, 0).chunks(i))
        if plan.flat is None or (plan.partition is not None and plan.partition.owner[i] >= 0):
            assert sorted(seen[i]) == sorted((r, s, e) for r, s, e in chunks) or not m.numel
        else:
            assert sorted(seen[i]) == chunks
            assert sum(e - s for _, s, e in chunks) == (m.numel if m.requires_grad else 0)
