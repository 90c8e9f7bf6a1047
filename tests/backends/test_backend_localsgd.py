"""Post-local SGD on 2 and 4 gloo ranks: ours against torch's PostLocalSGDOptimizer and averagers."""

import localsgd_workers as w
import pytest
from helpers import run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_torch_every_step_and_resumes_mid_run(world_size):
    """Periodic and hierarchical averagers x SGD(momentum) and Adam: see `localsgd_workers.parity`."""
    results = run_ranks(w.parity_matrix, world_size)
    pair = 2
    expected = {
        "periodic": {3: [world_size], 6: [world_size], 9: [world_size], 12: [world_size]},
        "hierarchical": {4: [pair], 6: [world_size], 8: [pair], 10: [pair], 12: [world_size]},
    }
    for (kind, local), r in results[0].items():
        averaged = {step: sizes for step, sizes in enumerate(r["sizes"]) if sizes}
        assert averaged == expected[kind], f"{kind}/{local}: one all-reduce per averaging step, in the right group"
        assert r["step"] == 14, f"{kind}/{local}: the averager counts steps, not param groups"


def test_zero_as_the_local_optimizer_shards_state_and_matches_torch():
    results = run_ranks(w.with_zero, 4)
    for rank, r in enumerate(results):
        assert r["state_bytes"] == r["plan_bytes"], f"rank {rank}: state is sharded within its pair as planned"
        assert r["same_everywhere"], "the last step averaged every replica"
    assert [r["sd_step"] for r in results] == [12, None, 12, None], "the consolidated state dict carries the step"


def test_pairs_with_ddp_post_local_sgd_hook():
    results = run_ranks(w.with_ddp_hook, 4)
    for r in results:
        assert (r["iter"], r["step"]) == (w.WARMUP, 10)
        assert r["same_in_pair"], "gradients are all-reduced within the pair after the warm-up"


def test_mixed_dtypes_average_once_per_dtype():
    for r in run_ranks(w.mixed_dtypes, 3):
        assert r == {"reduces": 3, "same": True}
