"""Muon under ZeRO on gloo ranks: equal to one process, each matrix orthogonalised once a step."""

import muon_workers as mw
import pytest
from helpers import run_ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_muon_under_a_flops_plan_equals_one_process(world_size):
    """Every rank orthogonalises exactly the matrices the plan gives it: across the group each
    matrix once a step, never once per rank."""
    steps = 20
    results = run_ranks(mw.muon_whole, world_size, steps)
    for r in results:
        assert r["calls"] == steps * r["owned_matrices"]
    assert sum(results[0]["all_calls"]) == steps * results[0]["matrices"] == steps * 4
