"""make_plan accounting, the readable table, and errors at the boundary."""

import json
import re

import pytest

from zero import ParamMeta, assign_ddp_buckets, ddp_buckets, flat_layout, make_plan, param_metas, partition
from zero.plans.mesh_padding import mesh_state_bytes
from zero.plans.plan import Plan
from zero.plans.presets import preset

METAS = [ParamMeta("a", (100,)), ParamMeta("b", (60,)), ParamMeta("c", (50,)),
         ParamMeta("frozen", (1000,), requires_grad=False), ParamMeta("h", (30,), "bfloat16")]


def test_accounting_for_a_small_model():
    plan = make_plan(METAS, 2, "sorted_greedy", "state_bytes", "adam")
    # state_bytes weighs a=804, b=484, c=404, h=124 (bf16), frozen=0; sorted greedy gives
    # a->0, b->1, c->1 (484 < 804), h->0 (804 < 888), frozen->1 (888 < 928).
    assert plan.partition.owner == (0, 1, 1, 1, 0)
    r0, r1 = plan.ranks
    assert (r0.state_bytes, r1.state_bytes) == (804 + 124, 484 + 404)
    assert r0.param_bytes == r1.param_bytes == 4 * 1210 + 2 * 30
    assert r0.grad_bytes == 4 * 210 + 60
    # broadcast, as nccl-tests count: each of the 2 ranks' shards (460 B and 440 B) is one
    # broadcast, which every rank counts whole.
    assert r0.broadcast_bytes == r1.broadcast_bytes == (900, 900)
    # all_gather per (device, dtype), (W - 1) / W of the buffer: fp32 blocks of max(400, 440),
    # bf16 blocks of max(60, 0).
    assert r0.all_gather_bytes == r1.all_gather_bytes == (440 + 60, 440 + 60)
    assert plan.max_over_bound == 928 / max(804, 1816 / 2) and plan.max_over_mean == 928 / (1816 / 2)


def test_torch_weighting_counts_frozen_params():
    plan = make_plan(METAS, 2)
    assert plan.partition.owner[3] == 0 and plan.partition.loads[0] >= 1000


def test_flat_layout_figures():
    ms = [ParamMeta("a", (5,)), ParamMeta("b", (6,))]
    layout = flat_layout(ms, 4, alignment=2)
    (buf,) = layout.buffers
    assert (buf.numel, buf.padded_numel, buf.shard_numel, buf.padding) == (11, 16, 4, 5)
    assert [(s.rank, s.start, s.end) for s in layout.segments(1)] == [(1, 0, 3), (2, 3, 6)]
    plan = make_plan(ms, 4, "flat", alignment=2)
    assert [r.numel for r in plan.ranks] == [4, 4, 3, 0]
    assert all(r.state_bytes == 2 * 4 * 4 + 4 and r.padding_bytes == 20 for r in plan.ranks)


def test_presets_plan_and_render():
    for name, count in [("gpt2", 148), ("llama-7b", 291)]:
        ms = preset(name)
        assert len(ms) == count
        text = str(make_plan(ms, 8))
        assert "busiest rank / mean" in text and "best possible" in text and "rank" in text
    assert 120e6 < sum(m.numel for m in preset("gpt2")) < 130e6
    assert 6.5e9 < sum(m.numel for m in preset("llama-7b")) < 6.9e9


def test_large_world_table_elides_middle_ranks():
    text = str(make_plan(preset("gpt2"), 256))
    assert "..." in text and "255" in text


def test_a_bucketed_flat_plan_round_trips_through_json():
    plan = make_plan(METAS, 3, "flat", bucket_numel=8)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.flat.bucket_numel == 8 and len(again.flat.buffers) > 1
    assert again.fingerprint != make_plan(METAS, 3, "flat").fingerprint, "the cap is part of the plan"


def test_from_json_detects_tampering():
    text = make_plan(METAS, 3).to_json()
    data = json.loads(text)
    data["inputs"]["world_size"] = 4
    with pytest.raises(ValueError, match="fingerprint"):
        Plan.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="format"):
        Plan.from_json(json.dumps({**data, "format": 99}))


@pytest.mark.parametrize("call, words", [
    (lambda: partition([], 2), "empty"),
    (lambda: partition(["x"], 2), "metas[0] is a str"),
    (lambda: partition(METAS, 0), "world_size must be >= 1, got 0"),
    (lambda: partition(METAS, 2.5), "got 2.5"),
    (lambda: partition(METAS, 2, "random"), "unknown strategy 'random'"),
    (lambda: partition(METAS, 2, "flat"), "flat_layout"),
    (lambda: partition(METAS, 2, weight="flops"), "unknown weight 'flops'"),
    (lambda: partition(METAS, 2, weight=lambda m: -1), "must be >= 0, got -1"),
    (lambda: partition(METAS, 2, weight="state_bytes", optimizer="adamx"), "unknown optimizer 'adamx'"),
    (lambda: partition(METAS, 2).params_of(2), "rank must be in [0, 2), got 2"),
    (lambda: flat_layout(METAS, 2, alignment=0), "alignment"),
    (lambda: make_plan(METAS, 2, weight="bytes"), "'step_flops' or a function of a ParamMeta, got 'bytes'"),
    (lambda: make_plan(METAS, 2, weight=lambda m: -1.5), "weight("),
    (lambda: assign_ddp_buckets([[1], []], 2), "DDP bucket 1 is empty"),
    (lambda: assign_ddp_buckets([[1, -3]], 2), "bucket_numels[0][1] must be >= 0, got -3"),
    (lambda: ddp_buckets(METAS, bucket_cap_mb=0), "bucket_cap_mb"),
    (lambda: ddp_buckets(METAS, order=[0, 0]), "distinct"),
    (lambda: ParamMeta("x", (2,), group=-1), "group"),
])
def test_bad_inputs(call, words):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert words in str(info.value)


def test_balance_is_reported_against_the_mean_and_against_the_best_possible():
    metas = [ParamMeta("big", (10,)), ParamMeta("a", (5,)), ParamMeta("b", (5,))]
    plan = make_plan(metas, 4)
    assert plan.max_over_mean == 2.0, "the busiest rank holds the 10-element tensor, the mean is 5"
    assert plan.max_over_bound == 1.0, "and no whole-tensor plan can do better"
    data = json.loads(plan.to_json())
    assert (data["max_over_mean"], data["max_over_bound"]) == (2.0, 1.0)
    assert "busiest rank / mean 2.0000" in str(plan) and "best possible 1.0000" in str(plan)


def test_plots_draw_what_the_plan_says():
    import matplotlib

    matplotlib.use("Agg")
    from zero.plans.plot import plot_balance

    plan = make_plan(METAS, 2)
    ax = plan.plot()
    tops = [bar.get_y() + bar.get_height() for bar in ax.containers[-1]]
    assert tops == pytest.approx([r.total_bytes / 2**20 for r in plan.ranks])
    ax = plot_balance([make_plan(METAS, w, s) for w in (1, 2, 4) for s in ("sorted_greedy", "flat")])
    assert len(ax.get_lines()) == 2
    with pytest.raises(ValueError, match="against"):
        plot_balance([plan], against="median")


def test_default_rows_pack_every_param_unless_they_would_pad_too_much():
    from zero import bucket_views, sync_rows
    from zero.plans.layout import row_padding

    even = [ParamMeta("a", (1000,)), ParamMeta("b", (1000,)), ParamMeta("c", (10,)), ParamMeta("d", (10,))]
    layout = bucket_views(even, make_plan(even, 2).partition)
    assert row_padding(layout.at(("cpu", "float32"))) == 0
    (rows,) = sync_rows(layout, 500, None, pad_limit=1 / 16)
    assert rows.direct == () and rows.chunk == 1008 + 16, "even rows: one collective carries every param"
    uneven = even[:2] + [ParamMeta("big", (3000,))]
    layout = bucket_views(uneven, make_plan(uneven, 2).partition)
    assert row_padding(layout.at(("cpu", "float32"))) == 2 * 3008 - (3008 + 2 * 1008)  # params start 64 bytes apart
    (rows,) = sync_rows(layout, 500, None, pad_limit=1 / 16)
    assert sorted(i for _, i in rows.direct) == [0, 1, 2] and rows.chunk == 0, "padding 20%: large params go alone"
    (rows,) = sync_rows(layout, 500, None, pad_limit=0.25)
    assert rows.direct == () and rows.chunk == 3008


def test_contiguous_spreads_what_the_largest_tensor_leaves():
    """GPT-2's embedding fixes the busiest rank; the other 7 ranks share the rest evenly."""
    metas = preset("gpt2")
    part = partition(metas, 8, "contiguous")
    loads = sorted(part.loads)
    assert loads[-1] == max(m.numel for m in metas)  # the best cap any split can have
    rest = loads[:-1]
    assert min(rest) > 0.7 * sum(rest) / len(rest), loads


def test_the_zero_papers_figure_1_from_metadata():
    """7.5B params in 16 bits, Adam with fp32 masters (K = 12 bytes a param), 64 ranks: the paper's
    120 GB, 31.4 GB (optimizer state sharded), 16.6 GB (gradients too), 1.9 GB (params too)."""
    metas = [ParamMeta(f"layer{i}", (100_000_000,), "bfloat16") for i in range(75)]
    plan = make_plan(metas, 64, "flat", optimizer="adam", master_dtype="float32")
    stages = [round(n / 1e9, 1) for n in plan.stage_bytes().values()]
    assert stages == [120.0, 31.4, 16.6, 1.9]
    r = plan.ranks[0]
    n = 7.5e9 / 64
    assert (r.param_bytes, r.grad_bytes, r.master_bytes) == (15e9, 15e9, 4 * n)
    assert r.state_bytes == 8 * n + 4 and r.grad_shard_bytes == 2 * n  # fp32 moments, one fp32 step


def test_masters_count_only_for_params_narrower_than_the_master_dtype():
    metas = [ParamMeta("w", (64, 8), "bfloat16"), ParamMeta("b", (8,), "float32"),
             ParamMeta("frozen", (100,), "bfloat16", requires_grad=False)]
    plan = make_plan(metas, 1, optimizer="adam", master_dtype="torch.float32")
    r = plan.ranks[0]
    assert plan.master_dtype == "float32" and r.master_bytes == 4 * 512  # b is its own master; frozen has none
    assert r.state_bytes == 2 * 4 * (512 + 8) + 4 * 2
    assert make_plan(metas, 1, optimizer="adam").ranks[0].state_bytes == 2 * (2 * 512 + 4 * 8) + 4 * 2
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.fingerprint != make_plan(metas, 1, optimizer="adam").fingerprint
    assert json.loads(plan.to_json())["stage_bytes"]["replicated (DDP)"] == r.total_bytes


@pytest.mark.parametrize("master, words", [
    ("int8", "master_dtype must be a float dtype"),
    ("bfloat16", "master_dtype bfloat16 is less precise than param 'b''s float32"),
    ("float16", "master_dtype float16 is less precise than param 'w''s bfloat16"),
])
def test_a_master_dtype_that_cannot_hold_the_params_is_named(master, words):
    metas = [ParamMeta("w", (4,), "bfloat16"), ParamMeta("b", (4,), "float32")]
    with pytest.raises(ValueError, match=re.escape(words)):
        make_plan(metas, 2, master_dtype=master)


def test_state_bytes_weight_balances_masters_too():
    metas = [ParamMeta("big16", (1000,), "bfloat16"), ParamMeta("big32", (1000,), "float32"),
             ParamMeta("small16", (10,), "bfloat16")]
    plan = make_plan(metas, 2, weight="state_bytes", optimizer="sgd_momentum", master_dtype="float32")
    # bf16 params cost 4 (master) + 4 (momentum) bytes an element, fp32 ones 4: big16 alone on a rank
    assert plan.partition.owner[0] != plan.partition.owner[1] == plan.partition.owner[2]
    assert sorted(r.master_bytes + r.state_bytes for r in plan.ranks) == [4080, 8000]


def test_a_low_bit_plan_cuts_at_block_edges_and_counts_codes_and_scales():
    """A 6,144-element weight and a small bias on 3 ranks: an Adam plan cuts the weight anywhere
    (2,082 elements a shard), an 8-bit one at multiples of 256, the bias in a buffer of its own;
    each rank's state is one byte a code and four a 256-block for the weight, 8 a moment element
    for the bias, and the weight's blocks cost no padding."""
    metas = [ParamMeta("w", (48, 128)), ParamMeta("b", (100,))]
    adam = make_plan(metas, 3, "flat", optimizer="adam")
    assert any(s.end % 256 for buf in adam.flat.buffers for segs in buf.segments for s in segs)
    plan = make_plan(metas, 3, "flat", optimizer="adamw8bit")
    weight = next(b for b in plan.flat.buffers if b.params == (0,))
    assert weight.block == 256 and weight.shard_numel == 2048 and weight.padding == 0
    assert [(s.start, s.end) for s in weight.segments[0]] == [(0, 2048), (2048, 4096), (4096, 6144)]
    bias = next(b for b in plan.flat.buffers if b.params == (1,))
    assert bias.block == 0
    assert [r.state_bytes for r in plan.ranks] == [2 * (2048 + 8 * 4) + 2 * bias.shard_numel * 4] * 3
    assert make_plan(metas, 3, "flat", optimizer="adamw4bit").ranks[0].state_bytes == \
        2 * (1024 + 16 * 4) + 2 * bias.shard_numel * 4
    assert "1 params cut at blocks of 256" in str(plan)
    with pytest.raises(ValueError, match="unknown optimizer 'adamw8bit/3'"):
        make_plan(metas, 3, "flat", optimizer="adamw8bit/3")


def test_mesh_state_bytes_pads_each_dtype_row_to_its_busiest_rank():
    """A JAX mesh lays a whole-param plan's state in one row per dtype, each as long as that
    dtype's busiest rank's: here bf16's is rank 2's (d: 21 elements x 2 moments x 2 bytes = 84)
    and float32's rank 1's (c: 300 x 2 x 4 = 2400), so every device holds 2484 bytes, more than
    any rank's own (torch's per-param step left out: Optax keeps one count)."""
    metas = param_metas({"a": {"shape": [10], "dtype": "bfloat16"}, "b": (10,), "c": (300,),
                              "d": {"shape": [7, 3], "dtype": "bfloat16"}})
    plan = make_plan(metas, 3, "contiguous")
    assert plan.partition.owner == (0, 0, 1, 2)
    assert [r.state_bytes for r in plan.ranks] == [40 + 80 + 8, 2400 + 4, 84 + 4]
    assert mesh_state_bytes(plan) == (84 + 2400,) * 3
    flat = make_plan(metas, 3, "flat")  # a flat buffer's slice is its padded shard, per dtype
    assert mesh_state_bytes(flat) == (sum(b.padded_numel // 3 * 2 * (2 if b.dtype == "bfloat16" else 4)
                                           for b in flat.flat.buffers),) * 3


def test_collective_bytes_are_what_each_rank_sends_as_nccl_tests_count_them():
    from zero.plans.accounting import bus_bytes

    assert bus_bytes("all_gather_rows", 400, 4) == bus_bytes("reduce_scatter_sum", 400, 4) == 300
    assert bus_bytes("all_reduce_sum", 400, 4) == 600
    assert bus_bytes("broadcast_from", 400, 4) == bus_bytes("reduce_sum_to", 400, 4) == 400
    assert bus_bytes("all_reduce", 400, 1) == bus_bytes("broadcast", 400, 1) == 0
    with pytest.raises(ValueError, match=r"unknown collective 'alltoall'"):
        bus_bytes("alltoall", 1, 2)
