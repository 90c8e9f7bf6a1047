"""RPC DistributedOptimizer on 3 TensorPipe workers (127.0.0.1): ours against torch's."""

import pytest
import rpc_workers as w
from helpers import run_ranks


def rpc_run(fn, *args, world_size=3):
    return run_ranks(fn, world_size, *args, backend="rpc", pg_timeout=60, timeout=180)[0]


def test_the_docs_example_leaves_params_without_gradients_alone():
    out = rpc_run(w.seed_example, world_size=2)
    assert out["ours"] == out["torch"] == ([4.0, 4.0], [2.0, 2.0])


@pytest.mark.parametrize("config", sorted(w.CONFIGS))
def test_a_model_split_over_two_workers_matches(config):
    """torch classes against torch's DistributedOptimizer; a factory against a local functional run."""
    assert rpc_run(w.split_model, config) == {"owners": ["worker1", "worker2"]}


def test_concurrent_steps_on_one_worker_are_serialised():
    out = rpc_run(w.concurrent_steps, world_size=2)
    assert out["log"] == ["enter", "exit", "enter", "exit"], "two contexts were applied at the same time"
    # Both updates land: gradients of 2 from the start (1 - 0.2 - 0.2), or the second after the first step.
    assert out["value"] in ([pytest.approx(0.6)] * 3, [pytest.approx(0.64)] * 3)


def test_a_worker_that_does_not_answer_fails_the_step_within_the_timeout():
    out = rpc_run(w.unresponsive)
    assert out["error"] is not None and "worker1 did not answer within the RPC timeout of 1.5 s" in out["error"]
    assert out["seconds"] < 5, "the step gave up at the timeout instead of waiting for the slow worker"
    assert out["fast"] == [1 - 0.1 * 2] * 2, "the worker that answered stepped"
