"""The plan of zero's rules over FSDP2's layout (`zero.plans.fsdp2`), from metadata alone."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zero
from zero.plans.fsdp2 import HEADS, chunk_rows, make_fsdp2_plan
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


HEADED = "muon(heads={'q.weight': 3})"  # 18 rows of 3 heads of 6, 4 columns


def headed_metas():
    return zero.param_metas({"q.weight": (18, 4), "q.bias": (18,)})


def test_heads_cut_by_fsdp2s_rows_move_only_their_rows():
    """At 2 ranks (rows 9/9) rank 0 steps heads 0-1 (rows 0-12), rank 1 head 2: rows 9-11 (3 rows
    of 4) travel to rank 0 with their gradient and back. At 4 (rows 5/5/5/3) heads start on
    ranks 0, 1, 2 (rows 0, 6, 12): rank 3 steps none and sends its 3 rows; at 3 (6 each) the rows
    are whole heads, stepped in place; over HSDP's replicas, or named whole, an owner steps it."""
    plan = make_fsdp2_plan(headed_metas(), 2, HEADED)
    assert plan.owner == (HEADS, -1) and plan.blocks[0] == 24 and plan.by_heads == (0,) and plan.whole == ()
    assert [plan.head_run(0, r) for r in range(2)] == [(0, 48), (48, 24)]
    assert plan.head_moves(0) == ((1, 0, 36, 12),)
    assert [plan.exchange_bytes(r)["float32"] for r in range(2)] == [(0, 48), (96, 0)]
    # each rank holds the momentum of the heads it steps (48 and 24 elements), not of its rows (36 each)
    assert plan.state_bytes(0) - plan.state_bytes(1) == (48 - 24) * 4
    plan = make_fsdp2_plan(headed_metas(), 4, HEADED)
    assert [plan.head_run(0, r) for r in range(4)] == [(0, 24), (24, 24), (48, 24), (72, 0)]
    assert plan.head_moves(0) == ((1, 0, 20, 4), (2, 1, 40, 8), (3, 2, 60, 12))
    assert sum(n for r in range(4) for n in (plan.head_run(0, r)[1],)) == 72  # each element stepped once
    assert make_fsdp2_plan(headed_metas(), 3, HEADED).owner == (-1, -1)
    assert make_fsdp2_plan(headed_metas(), 2, HEADED, replicas=2).owner[0] >= 0
    assert make_fsdp2_plan(headed_metas(), 2, HEADED, whole=["q.weight"]).owner[0] >= 0
    assert make_fsdp2_plan(headed_metas(), 2, "muon").owner[0] >= 0  # no heads: whole
    assert HEADS not in make_fsdp2_plan(headed_metas(), 2, "muon_8bit(heads={'q.weight': 3})").owner


@given(st.integers(1, 12), st.integers(1, 9), st.integers(1, 3), st.integers(2, 16), st.integers(0, 7))
def test_heads_runs_step_every_element_once_and_the_moves_are_what_rows_and_runs_share(heads, d, cols, world, lead):
    """Whatever the heads, ranks and the param's place (``lead`` params before it: its anchor row):
    the heads' runs cover the param once, in rank order, each whole heads; what moves is exactly
    each rank's rows outside its own run, to the run holding them."""
    metas = zero.param_metas({**{f"b{k}": (3,) for k in range(lead)}, "q": (heads * d, cols)})
    plan = make_fsdp2_plan(metas, world, f"muon(heads={{'q': {heads}}})")
    if plan.owner[lead] != HEADS:
        return
    q = lead
    runs = [plan.head_run(q, r) for r in range(world)]
    assert [a for a, n in runs if n] == sorted(a for a, n in runs if n) and sum(n for _, n in runs) == heads * d * cols
    assert all(a % (d * cols) == 0 and n % (d * cols) == 0 for a, n in runs)
    brute = []
    for h in range(world):
        lo, hi = plan.start(q, h), plan.start(q, h) + plan.local_numel(q, h)
        for s, (a, n) in enumerate(runs):
            if s != h and max(lo, a) < min(hi, a + n):
                brute.append((h, s, max(lo, a), min(hi, a + n) - max(lo, a)))
    assert plan.head_moves(q) == tuple(brute)


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


@given(st.integers(1, 4), st.integers(1, 5), st.sampled_from(["adam", "adamw8bit"]))
def test_parts_over_the_replicas_cover_each_piece_once_at_block_edges(shards, replicas, optimizer):
    """Each element-wise param's piece on each shard is cut over the replicas in order: runs that
    tile it, each starting at a block edge (low-bit state keeps its blocks whole)."""
    plan = make_fsdp2_plan(metas(), shards, optimizer, replicas=replicas)
    for i in range(len(plan.metas)):
        for s in range(shards):
            runs = [plan.part(i, r * shards + s) for r in range(replicas)]
            if plan.owner[i] >= 0:
                owner_replica = plan.owner[i] // shards
                assert [n for _, n in runs] == [plan.local_numel(i, s) if r == owner_replica else 0
                                                for r in range(replicas)]
                continue
            at = 0
            for start, n in runs:
                assert start == at or n == 0
                assert start % (plan.blocks[i] or 1) == 0 or n == 0
                at += n
            assert at == plan.local_numel(i, s)
            # the slots each replica's part takes in the all-gather hold the piece in order
            assert all(n <= plan.slot(i, s) for _, n in runs) and replicas * plan.slot(i, s) >= at


def test_owners_span_the_mesh_and_each_rank_holds_its_part_of_the_state():
    plan = make_fsdp2_plan(metas(), 2, "muon", replicas=3)
    assert sorted(o for o in plan.owner if o >= 0) == sorted(set(o for o in plan.owner if o >= 0))
    assert max(plan.owner) < 6 and plan.ranks == 6
    one = make_fsdp2_plan(metas(), 1, "muon")  # every param on one rank
    spec = zero.plans.costs.cost_of("muon")
    # the slots: the same on every rank; the per-param scalars: once per part (or whole param) held
    per_rank_scalars = [sum(spec.scalar_bytes for i in range(4) if plan.owner[i] < 0 or plan.owner[i] == r)
                        for r in range(6)]
    assert sum(plan.state_bytes(r) - s for r, s in zip(range(6), per_rank_scalars)) == \
        one.state_bytes(0) - 4 * spec.scalar_bytes
    # a replica's exchange plan: its ranks' whole params, by shard rank
    for replica in range(3):
        inner = plan.within(replica)
        assert inner.replicas == 1 and all(
            o == (plan.owner[i] % 2 if plan.owner[i] >= 0 and plan.owner[i] // 2 == replica else -1)
            for i, o in enumerate(inner.owner))


def test_the_gathers_over_the_replicas_are_bucketed_and_counted():
    from zero.plans.fsdp2 import GATHER_BUCKET_BYTES

    plan = make_fsdp2_plan(preset("llama-7b"), 8, "adam", replicas=16)
    ts = [i for i, m in enumerate(plan.metas) if m.requires_grad]
    buckets = plan.gather_buckets(ts, 3)
    assert [t for b in buckets for t in b] == ts  # every param, in order
    for b in buckets:
        held = sum(plan.local_numel(t, 3) * 2 for t in b)
        assert held <= GATHER_BUCKET_BYTES or len(b) == 1
    want = sum(16 * plan.slot(t, 3) * 2 for b in buckets for t in b)
    assert plan.gather_bytes(3) == {"bfloat16": want}
    assert make_fsdp2_plan(preset("llama-7b"), 8, "adam").gather_bytes(3) == {}


@pytest.mark.parametrize("replicas", [0, -1, True, 1.5])
def test_replicas_must_be_a_positive_int(replicas):
    with pytest.raises(ValueError, match="replicas must be a positive int"):
        make_fsdp2_plan(metas(), 2, replicas=replicas)


def test_fsdp2s_footprint_from_metadata():
    """The parts of the prediction the simulation checks against FSDP2 (`tests/backends/test_fsdp2_simulate.py`):
    zero's state over the replicas is torch's over the shards divided among them; the traffic
    within a replica is two all-gathers and a reduce-scatter of the model; across, HSDP's all-reduce
    of the gradient shards (and zero's all-gathers)."""
    from zero.plans.accounting import bus_bytes
    from zero.plans.fsdp2_memory import fsdp2_footprint

    metas_ = preset("llama-7b")
    torch_, zero_ = (fsdp2_footprint(metas_, 64, 5, replicas=8, zero=z) for z in (False, True))
    assert abs(zero_.by_category["optimizer_state"] * 8 / torch_.by_category["optimizer_state"] - 1) < 1e-3
    assert torch_.peak_phase == zero_.peak_phase == "backward of layers.1"
    model = sum(m.numel * 2 for m in metas_)
    assert torch_.sent == {"within": 3 * bus_bytes("all_gather", model, 8),
                           "across": bus_bytes("all_reduce", model // 8, 8)}
    assert zero_.sent["within"] == torch_.sent["within"] and zero_.sent["across"] > torch_.sent["across"]
    assert fsdp2_footprint(metas_, 64, 5).sent["across"] == 0
    with pytest.raises(ValueError, match="3 replicas do not divide 64 ranks"):
        fsdp2_footprint(metas_, 64, 0, replicas=3)


def test_heads_of_every_layer_are_not_stepped_on_the_same_ranks():
    """LLaMA-70B at 1,024 ranks, per-head q, k, v (8 rows a rank cut every head): each head's
    anchor row moves from param to param, so the fullest rank's state stays within 5% of the plan
    with q, k, v whole on owners (the heads' first rows, the same ranks in every layer, held 2x)."""
    metas = preset("llama-70b")
    heads = {m.name: 64 if "q_proj" in m.name else 8 for m in metas if m.name.endswith(("q_proj.weight",
             "k_proj.weight", "v_proj.weight"))}
    by_heads = make_fsdp2_plan(metas, 1024, f"muon(heads={heads!r})")
    whole = make_fsdp2_plan(metas, 1024, f"muon(heads={heads!r})", blocks={})
    assert len(by_heads.by_heads) == 240 and not whole.by_heads
    fullest = [max(p.state_bytes(r) for r in range(1024)) for p in (by_heads, whole)]
    assert fullest[0] <= 1.05 * fullest[1], fullest
