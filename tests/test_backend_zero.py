"""zero.ZeroRedundancyOptimizer on 2, 3 and 4 gloo ranks against torch's and a single process."""

import pytest

import zero_workers as w
from distributed import run_ranks


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_torch_zero_and_single_process(world_size):
    """Adam, AdamW, SGD(momentum, maximize) x bucket views off/on: see `zero_workers.torch_parity`."""
    results = run_ranks(w.torch_parity_matrix, world_size)
    for config in results[0]:
        for rank, by_config in enumerate(results):
            r = by_config[config]
            assert r["gathers"] == [1] * 24, f"{config}: one all-gather per step for one dtype"
            assert r["state_bytes"] == r["plan_state_bytes"], f"{config} rank {rank}: state bytes differ from the plan"
        total = sum(by_config[config]["state_bytes"] for by_config in results)
        assert max(by_config[config]["state_bytes"] for by_config in results) < total, "state is sharded"


@pytest.mark.parametrize("world_size", [2, 3])
def test_functional_local_optimizers(world_size):
    results = run_ranks(w.functional_parity, world_size)
    assert results[0]["factory_groups_lr"] == [1e-2, 5e-3]
    assert results[0]["chunked_gathers"] > 1
