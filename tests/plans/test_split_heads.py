"""Flat plans that cut per-head matrices at head edges (``make_plan(..., "flat", split_heads=True)``,
#67 item 5): head buffers whose shards are whole heads, so every rank steps an equal share of the
heads where they lie and no rank owns a whole matrix of them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zero
from zero.plans.holdings import holdings
from zero.plans.presets import preset

QKV = ("q_proj.weight", "k_proj.weight", "v_proj.weight")


def _muon_by_heads(metas, heads: int) -> str:
    return f"muon(heads={ {m.name: heads for m in metas if m.name.endswith(QKV)}!r})"


def test_llama_7b_at_64_ranks_gives_every_rank_48_whole_heads_and_stays_within_the_bound():
    """Per-head Muon on LLaMA-7B's q, k, v (32 heads of 128 rows each) at 64 ranks: the 96
    matrices go to one head buffer of 3,072 heads, 48 on every rank with no padding; none is kept
    whole on an owner; the busiest rank's Newton-Schulz work within 1.05 of the best possible."""
    metas = preset("llama-7b")
    plan = zero.make_plan(metas, 64, "flat", "step_flops", _muon_by_heads(metas, 32), split_heads=True)
    (buf,) = [b for b in plan.flat.buffers if b.head]
    assert buf.head == 128 * 4096 and len(buf.params) == 96 and buf.padding == 0
    assert plan.cut_at_heads == buf.params and all(plan.metas[i].name.endswith(QKV) for i in buf.params)
    assert buf.shard_numel == 48 * buf.head
    assert not any(plan.metas[i].name.endswith(QKV) for i in plan.whole)
    assert plan.max_over_bound <= 1.05
    for rank in (0, 31, 63):
        mine = [t for t in holdings(plan, rank).tensors if t.piece is not None]
        assert sum(t.shape[0] for t in mine) == 48 * 128 and all(t.shape[0] % 128 == 0 for t in mine)
    assert zero.Plan.from_json(plan.to_json()).fingerprint == plan.fingerprint


@settings(max_examples=60, deadline=None)
@given(heads=st.lists(st.sampled_from([(2, 3), (4, 3), (3, 5), (1, 7)]), min_size=1, max_size=5).filter(
    lambda hs: any(h > 1 for h, _ in hs)),  # (none with heads: an error, tested below)
       world_size=st.integers(1, 6), vector=st.integers(1, 40))
def test_every_rank_holds_whole_heads_and_every_head_is_held_once(heads, world_size, vector):
    """Any mix of per-head matrices (heads x rows per head, 4 columns) beside a vector: each
    rank's pieces of them start and end at head edges, are views of whole rows in the param's
    shape, and together cover each param once (a matrix of one head is whole on an owner)."""
    shapes = {f"w{k}.weight": (h * d, 4) for k, (h, d) in enumerate(heads)}
    metas = zero.param_metas({**shapes, "b": (vector,)})
    cost = f"muon(heads={ {n: h for n, (h, _) in zip(shapes, heads)}!r})"
    plan = zero.make_plan(metas, world_size, "flat", optimizer=cost, split_heads=True)
    covered = {m.name: 0 for m in metas}
    for rank in range(world_size):
        for t in holdings(plan, rank).tensors:
            if t.piece is None:
                continue
            meta = plan.metas[t.piece]
            per = meta.numel // dict(zip(shapes, (h for h, _ in heads)))[meta.name]
            assert t.numel % per == 0 and t.offset % per == 0 and t.shape[1:] == meta.shape[1:]
            assert t.shape[0] * meta.shape[1] == t.numel
            covered[meta.name] += t.numel
    for n, (h, _) in zip(shapes, heads):  # one head: a plain matrix, whole on an owner
        assert covered[n] == (shapes[n][0] * shapes[n][1] if h > 1 else 0), covered
    assert sorted(plan.metas[i].name for i in plan.whole) == sorted(n for n, (h, _) in zip(shapes, heads) if h == 1)


def test_what_cannot_be_cut_at_head_edges_stays_as_it_was():
    """split_heads where nothing would be cut (8-bit Muon, whose codes' blocks lie in whole
    matrices; Muon without heads) is an error saying so; a plan without split_heads keeps its
    fingerprint; split_heads on a whole-param strategy is refused by name."""
    metas = zero.param_metas({"w.weight": (8, 4), "b": (3,)})
    for name in ("muon_8bit(heads={'w.weight': 2})", "muon"):
        with pytest.raises(ValueError, match=r"split_heads=True, but optimizer .* steps none of the params it keeps "
                                             r"whole head by head, so nothing would be cut"):
            zero.make_plan(metas, 2, "flat", optimizer=name, split_heads=True)
    plain = zero.make_plan(metas, 2, "flat", optimizer="muon(heads={'w.weight': 2})")
    cut = zero.make_plan(metas, 2, "flat", optimizer="muon(heads={'w.weight': 2})", split_heads=True)
    assert cut.split_heads and not cut.hybrid and plain.hybrid and cut.fingerprint != plain.fingerprint
    assert zero.Plan.from_json(cut.to_json()).fingerprint == cut.fingerprint
    with pytest.raises(ValueError, match="split_heads cuts a flat plan's per-head matrices .* strategy 'greedy'"):
        zero.make_plan(metas, 2, "greedy", optimizer="muon(heads={'w.weight': 2})", split_heads=True)
