"""Per-head Muon (and Gram, 8-bit Muon) over FSDP2, HSDP and ZeRO against one process: rows that
fall on head edges are stepped where they lie with no exchange; over FSDP2 rows that do not are
stepped by whole heads, only the cut heads' rows moving (over HSDP they go to an owner whole);
each head is orthogonalised once in the mesh, and the bytes moved are the plan's."""

import heads_workers as w
import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.timeout(600)

# at 2 and 4 ranks FSDP2's rows of 0.weight (4 heads of 6 rows) and 4.weight (12 heads of 2) are
# whole heads; 2.weight's (3 heads of 6 rows: 9/9, 5/5/5/3) never are; 6.weight has no heads
IN_PLACE = ["0.weight", "4.weight"]
HEADS = 4 + 3 + 12 + 1  # matrices orthogonalised in a step: every head once, and the plain matrix


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_steps_whole_heads_where_they_lie(world_size):
    """Equal to one process bit for bit; the head-aligned weights are stepped in pieces with no
    exchange, the weight whose rows cut heads by whole heads (an owner holds the plain matrix
    only) and the bytes exchanged are the plan's; across the ranks each head is orthogonalised once."""
    out = run_ranks(w.against_one_process, world_size)
    for r, o in enumerate(out):
        assert o["worst"] == 0.0, (r, o["worst"])
        assert o["whole"] == ["6.weight"] and o["by_heads"] == ["2.weight"], o
        assert o["sent"] == o["planned"], (r, o)
    assert sum(o["runs"]["matrices"] for o in out) == HEADS


def test_dimension_numbers_as_a_dict_by_name():
    """A dict of dimension numbers by param name labels each rank's own params by name (an owner's
    whole matrices, the pieces of heads), as a function of the params does."""
    for o in run_ranks(w.against_one_process, 2, 1, {"dims_as_dict": True}):
        assert o["worst"] == 0.0 and o["whole"] == ["6.weight"] and o["by_heads"] == ["2.weight"]


def test_hsdp_steps_each_head_once_in_the_mesh():
    """HSDP 2 x 2 under ZeroRedundancyOptimizer: the aligned heads are cut between the replicas
    too (each rank steps whole heads of its shard's rows), so the mesh orthogonalises each head
    once; bit for bit one process; bytes within and across replicas are the plan's."""
    out = run_ranks(w.against_one_process, 4, 2)
    for r, o in enumerate(out):
        assert o["worst"] == 0.0, (r, o["worst"])
        assert o["whole"] == ["2.weight", "6.weight"]
        assert o["sent"] == o["planned"], (r, o)
    assert sum(o["runs"]["matrices"] for o in out) == HEADS


@pytest.mark.parametrize("kwargs", [{"ns_method": "gram", "ns_coeffs": "polar_express"}, {"mu_dtype": "int8"}],
                         ids=["gram", "8bit"])
def test_gram_and_8bit_muon_over_fsdp2_hsdp_and_zero(kwargs):
    """Gram per-head Muon and 8-bit per-head Muon (its codes' blocks lie in whole matrices, which
    an owner steps) equal one process bit for bit at 2 and 3 ranks over FSDP2, on HSDP 2 x 2,
    and under ZeRO's default whole-param plan and its flat (hybrid) plan on plain params."""
    for world_size in (2, 3):
        for o in run_ranks(w.against_one_process, world_size, 1, kwargs):
            assert o["worst"] == 0.0, (world_size, o["worst"])
            assert o["sent"] == o["planned"]
        for strategy in (None, "flat"):
            assert max(run_ranks(w.zero_on_plain_params, world_size, kwargs, strategy)) == 0.0, strategy
    hsdp = run_ranks(w.against_one_process, 4, 2, kwargs)
    assert max(o["worst"] for o in hsdp) == 0.0
    if kwargs.get("mu_dtype") == "int8":  # every matrix whole on an owner: the codes' blocks are the matrix's
        assert all(o["whole"] == ["0.weight", "2.weight", "4.weight", "6.weight"] for o in hsdp)


def test_a_flat_plan_cutting_headed_matrices_is_refused_by_name():
    """A flat shard holding pieces of a headed matrix is refused on every rank, naming the param,
    rather than stepping them with the shards' AdamW."""
    said = run_ranks(w.flat_plan_refusal, 2)
    assert all("weight" in s and "Muon weight" in s for s in said), said


def test_heads_stepped_where_they_lie_or_by_whole_heads_resume_at_other_mesh_sizes(tmp_path):
    """Saved through torch's get_state_dict and DCP at 2 ranks (2.weight stepped by whole heads,
    its state the rows of each rank's heads), resumed at 4 (other runs of heads, one rank with
    none) and at 3 (every weight's rows whole heads, stepped in place); saved at 4, resumed at 2:
    each equal to one process bit for bit."""
    one = run_ranks(w.one_process, 1)[0]
    for saved_at, resumed_at in ((2, 4), (2, 3), (4, 2)):
        path = str(tmp_path / f"at{saved_at}")
        if resumed_at != 3:
            run_ranks(w.save_then_resume, saved_at, path, True)
        got = run_ranks(w.save_then_resume, resumed_at, path, False)[0]
        for j, (a, b) in enumerate(zip(got, one)):
            assert torch.equal(a, b), f"saved at {saved_at}, resumed at {resumed_at}: param {j} differs"


def test_fp32_masters_of_heads_stepped_by_whole_heads():
    """bf16 params, fp32 masters under ZeroRedundancyOptimizer over FSDP2 at 2 ranks (2.weight's
    masters are the rows of each rank's heads): the bf16 params equal one process's fp32 params
    rounded, and the ranks' masters hold every element once."""
    out = run_ranks(w.masters_against_one_process, 2)
    assert all(worst == 0.0 for worst, _, _ in out), out
    assert sum(held for _, held, _ in out) == out[0][2], out


@pytest.mark.parametrize("world_size, one_buffer", [(2, False), (3, True)])
def test_a_flat_plan_cutting_heads_at_head_edges_steps_them_where_they_lie(world_size, one_buffer):
    """``ZeroRedundancyOptimizer(..., strategy="flat", split_heads=True)`` (its buffers capped:
    one head buffer a weight) and a plan given that puts the three per-head matrices (heads of 72
    elements in three shapes) in one head buffer: shards of whole heads, each rank stepping its
    heads where they lie, the plain matrix whole on an owner; bit for bit one process, each head
    orthogonalised once, the state the plan's."""
    out = run_ranks(w.zero_split_heads, world_size, None, None, one_buffer)
    for o in out:
        assert o["worst"] == 0.0, o
        assert o["whole"] == ["6.weight"] and o["cut"] == ["0.weight", "2.weight", "4.weight"], o
        # the heads' momenta (one slot, no padding), not AdamW's two slots of a padded shard; aside: the
        # rule's three Newton-Schulz coefficients (24 bytes) beside the plan's 4-byte count per state set
        assert abs(o["state"] - o["planned_state"]) < 32, o
    assert sum(o["runs"]["matrices"] for o in out) == 4 + 4 + 3 + 1  # each head once in the mesh, the plain matrix
    assert all(rows % 3 == 0 for rows in (o["held"]["2.weight"][0] for o in out if "2.weight" in o["held"]))


def test_heads_cut_at_head_edges_under_zero2_and_with_fp32_masters():
    """The same plan with gradients reduce-scattered (ZeRO-2, by backward) and clipped by torch's
    ``clip_grad_norm_`` (over the heads' rows of the shards) equal to one process to 1e-12; bf16
    params with fp32 masters of each rank's heads equal one process's fp32 params rounded."""
    for o in run_ranks(w.zero_split_heads, 2, None, {"reduce_scatter_grads": True}, True):
        assert o["worst"] < 1e-12, o  # the clip's norm summed over the ranks' shards: another order
        assert o["head_buffers"] == 1, o
    assert max(run_ranks(w.split_heads_masters, 2)) == 0.0


def test_heads_cut_step_as_owners_do_under_zero2_with_fp32_masters_and_reductions():
    """bf16 params trained by backward under ZeRO-2 with fp32 masters and fp32 reductions (the
    wider gradients go straight to each rank's heads' masters): the plan that cuts heads and the
    one that keeps them whole on owners give the same bits."""
    options = {"reduce_scatter_grads": True, "reduce_dtype": torch.float32}
    assert max(run_ranks(w.split_against_owners, 2, options)) == 0.0


def test_heads_cut_by_a_flat_plan_resume_from_dcp_and_torchs_dict_at_other_world_sizes(tmp_path):
    """Saved under a ``split_heads`` plan at 2 ranks (zero's DCP checkpoint, torch's consolidated
    dict, and torch's ``get_state_dict`` saved by DCP as torchtitan's checkpointer does), resumed
    at 3 and 2; saved at 3, resumed at 2, and under the plan that keeps the heads whole on owners;
    saved under that plan, resumed cut: each bit for bit one process."""
    one = run_ranks(w.one_process, 1, 6, w.SPLIT_LAYERS)[0]
    # (saved at, cut there, resumed at, cut there): the heads' state moves between cut and whole too
    for saved_at, cut, resumed_at, cut_after in ((2, True, 3, True), (2, True, 2, True), (3, True, 2, True),
                                                 (3, True, 2, False), (2, False, 3, True)):
        path = str(tmp_path / f"at{saved_at}{cut}")
        if (saved_at, resumed_at) != (2, 2):
            run_ranks(w.split_heads_resume, saved_at, path, True, cut)
        got = run_ranks(w.split_heads_resume, resumed_at, path, False, cut_after)[0]
        for how in ("dcp", "torch", "torch_dcp"):
            for j, (a, b) in enumerate(zip(got[how], one)):
                assert torch.equal(a, b), f"{how}: saved at {saved_at} (cut {cut}), resumed at {resumed_at} " \
                                          f"(cut {cut_after}): param {j} differs"


def test_split_heads_is_an_option_of_strategy_flat_only(one_rank):
    """``split_heads`` without ``strategy="flat"``, beside a plan given, or not a bool: errors
    naming it; over FSDP2's params (which step heads where they lie already) it is not taken."""
    from zero.backends import ZeroRedundancyOptimizer as Zero

    model = w.make_model()
    with pytest.raises(ValueError, match=r"split_heads=True cuts the per-head matrices of strategy='flat' at head "
                                         r"edges; strategy=None keeps every"):
        Zero(model.parameters(), w.rule(), split_heads=True)
    plan = Zero(model.parameters(), w.rule(), strategy="flat").plan
    with pytest.raises(ValueError, match=r"a plan given decides its own: make it with zero.make_plan\(\.\.\., "
                                         r"split_heads=True\)"):
        Zero(model.parameters(), w.rule(), plan=plan, split_heads=True)
    with pytest.raises(TypeError, match=r"split_heads must be True or False, got 'yes'"):
        Zero(model.parameters(), w.rule(), strategy="flat", split_heads="yes")
    one = Zero(list(model.named_parameters()), w.rule(), strategy="flat", split_heads=True).plan
    assert one.split_heads and [one.metas[i].name for i in one.whole] == ["6.weight"]
    import zero.functional as F  # the factory with its keywords asks the same rule for its heads

    by_factory = Zero(list(model.named_parameters()), F.contrib.muon, strategy="flat", split_heads=True,
                      learning_rate=0.02, muon_weight_dimension_numbers=w.dims, adam_learning_rate=0.01).plan
    assert by_factory.fingerprint == one.fingerprint and len(one.cut_at_heads) == 3
    from torch.distributed.fsdp import fully_shard

    sharded = fully_shard(w.make_model())
    with pytest.raises(ValueError, match=r"over FSDP2's DTensor params: split_heads=True is not taken"):
        Zero(list(sharded.named_parameters()), w.rule(), split_heads=True)
