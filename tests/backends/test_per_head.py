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
