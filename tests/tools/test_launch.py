"""zero.tools.launch.run: results come back from ranks that have exited, tensors included."""

import pytest
import torch
from launch_workers import heartbeat_stopped, many_tensors, tensors

from zero.tools.launch import free_port, run


@pytest.mark.timeout(120)
def test_a_rank_may_return_tensors():
    out = run(tensors, 2, timeout=90)
    assert [r["rank"] for r in out] == [0, 1]
    for rank, r in enumerate(out):
        torch.testing.assert_close(r["total"], torch.full((3,), 3.0))
        torch.testing.assert_close(r["pieces"][0], torch.arange(rank + 2))
        torch.testing.assert_close(r["pieces"][1], torch.eye(2) * rank)


@pytest.mark.timeout(120)
def test_many_tensors_from_ranks_that_exit_at_once():
    """Passed as handles to shared memory, most of these would be read after their rank exited
    (FileNotFoundError / ConnectionResetError in the parent)."""
    out = run(many_tensors, 2, timeout=90)
    for rank, r in enumerate(out):
        assert len(r) == 200 and all(float(t[0]) == rank + i for i, t in enumerate(r))


@pytest.mark.timeout(120)
def test_the_heartbeat_threads_stop_before_exit():
    """A daemon thread left inside a store call at interpreter exit can abort a clean run
    (``terminate called without an active exception``): zero stops its own at exit."""
    for r in run(heartbeat_stopped, 2, timeout=90):
        assert r["before"] and r["after"] == [], r


def test_free_port_never_hands_out_a_port_twice():
    """The system hands a just-freed port out again (2 repeats in 300 here): a rank of an earlier
    run still retrying its store could then join the next run's group."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
