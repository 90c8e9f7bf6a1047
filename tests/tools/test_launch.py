"""zero.tools.launch.run and zero.tools.pool.Pool: results come back from ranks that have exited,
tensors included; a pool keeps its ranks between runs."""

import os
import sys

import launch_workers as lw
import pytest
import torch
from launch_workers import heartbeat_stopped, many_tensors, tensors

from zero.tools.launch import free_port, rank_context, run
from zero.tools.pool import Pool


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


@pytest.mark.timeout(60)
def test_the_store_outlives_every_rank():
    """The launcher holds the ranks' store: hosted by rank 0, it left with rank 0's process, and a
    rank reaching it later retried it a minute a try (seen: a test whose ranks raise apart timed
    out at 150 s)."""
    assert run(lw.late_store_client, 2, timeout=30) == [0, 1]


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


@pytest.mark.timeout(120)
def test_a_pool_keeps_its_ranks_and_each_run_starts_from_a_fresh_ranks_state():
    """One process group for many runs; what a run leaves behind (default dtype, grad mode,
    environment, working directory, the default generator's state) is put back before the
    next, which sees what a fresh rank sees (compared with one; a process's seed is its own)."""
    fresh = run(lw.fresh_state, 2, timeout=90)
    with Pool(2) as pool:
        before = pool.run(lw.fresh_state)
        pool.run(lw.dirty)
        again = pool.run(lw.fresh_state, threads=1)
        assert [r["pid"] for r in again] == [r["pid"] for r in before], "the same processes"
        for got, first, want in zip(again, before, fresh):
            assert got["draw"] == first["draw"], "the default generator starts where it started"
            assert {k: v for k, v in got.items() if k not in ("pid", "draw")} == \
                {k: v for k, v in want.items() if k not in ("pid", "draw")}
        assert pool.run(tensors)[1]["total"].tolist() == [3.0, 3.0, 3.0]  # the group still pairs collectives
        assert pool.runs == 4 and pool.alive


@pytest.mark.timeout(120)
def test_runs_back_to_back_keep_the_pool():
    with Pool(2) as pool:
        for _ in range(8):
            assert len(pool.run(lw.uneven_results)[1]) == 200
            assert pool.alive, pool.unsettled


def test_a_fast_ranks_end_of_run_that_comes_before_a_slow_ranks_result_is_counted():
    """Each rank sends its result, then (past the barrier) its end of the run; across ranks they
    interleave: rank 1's end may come before rank 0's result. Seen under load: the pool dropped
    it, waited for it and started its processes again after every such run."""
    import pickle
    import queue

    from zero.tools import pool as pooling

    pool = Pool(2)
    pool._results = queue.Queue()
    for item in [(7, 1, True, pickle.dumps("one")), (7, 1, pooling._SETTLED, None), (7, 0, True, pickle.dumps("zero")),
                 (7, 0, pooling._SETTLED, None)]:
        pool._results.put(item)
    assert pool._collect(lw.tensors, 7, timeout=5) == ["zero", "one"]
    assert pool._settled(7, timeout=1), pool.unsettled


@pytest.mark.timeout(120)
def test_a_failed_run_names_the_rank_and_the_next_run_gets_new_processes():
    with Pool(3) as pool:
        pids = [r["pid"] for r in pool.run(lw.fresh_state)]
        with pytest.raises(AssertionError, match=r"rank 2 of 3 pooled ranks failed in fails_on:(.|\n)*rank 2 fails on"):
            pool.run(lw.fails_on, 2)
        assert not pool.alive
        again = pool.run(lw.fresh_state)
        assert not set(pids) & {r["pid"] for r in again}


@pytest.mark.timeout(120)
def test_a_rank_that_dies_fails_the_run_at_once_not_at_its_timeout():
    import time

    with Pool(2) as pool:
        start = time.monotonic()
        with pytest.raises(AssertionError, match=r"rank 1 of 2 pooled ranks died in crashes without a result "
                                                 r"\(exit code 3\)"):
            pool.run(lw.crashes, timeout=100)
        assert time.monotonic() - start < 30
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 of 2 ranks died in crashes without a result \(exit code 3\)"):
        run(lw.crashes, 2, timeout=100)
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_a_run_that_leaves_the_group_unusable_returns_and_the_pool_starts_again():
    with Pool(2, barrier_timeout=2.0) as pool:  # the broken group is found when its barrier times out
        assert pool.run(lw.diverges) == [0, 1]
        assert not pool.alive and pool.unsettled  # its barrier found the group broken
        assert pool.run(lw.fails_on, 5) == [0, 1]


@pytest.mark.parametrize("kwargs, words", [
    ({"world_size": 0}, "world_size must be a positive int, got 0"),
    ({"world_size": 2, "barrier_timeout": 0}, "barrier_timeout must be a positive")])
def test_a_pool_refuses_bad_sizes_and_timeouts_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Pool(**kwargs)


@pytest.mark.timeout(120)
def test_ranks_have_the_environment_of_the_moment_they_start(monkeypatch):
    """Ranks fork from a server that imported torch once (`rank_context`), started with the
    first run: a rank still gets its starter's environment as it is when the rank starts, as a
    spawned one would, in a one-off run and in a pool, and a variable removed since is gone."""
    name = "ZERO_TEST_LATE_VARIABLE"
    monkeypatch.setenv(name, "before")
    assert {r[0] for r in run(lw.environ_of, 2, name, timeout=90)} == {"before"}  # the server runs by now
    monkeypatch.setenv(name, "after")
    first = run(lw.environ_of, 2, name, timeout=90)
    assert [r[0] for r in first] == ["after", "after"]
    with Pool(2) as pool:
        assert [r[0] for r in pool.run(lw.environ_of, name)] == ["after", "after"]
    monkeypatch.delenv(name)
    assert [r[0] for r in run(lw.environ_of, 2, name, timeout=90)] == [None, None]
    assert len({r[1] for r in first}) == 2, "each rank a process of its own"
    if sys.platform == "linux":  # the fork server, not spawn, where the platform has one
        assert rank_context().get_start_method() == "forkserver"


def test_a_fresh_process_has_the_environment_of_its_call_and_raises_its_errors(monkeypatch):
    """`zero.backends.fresh.in_fresh_process` (the simulations' process, which reads
    ``ZERO_SIMULATE_CACHE``): forked from the same server, it gets its caller's environment as it is
    at the call, and an exception in it is raised in the caller."""
    from zero.backends.fresh import in_fresh_process

    name = "ZERO_TEST_LATE_VARIABLE"
    monkeypatch.setenv(name, "before")
    assert in_fresh_process(lw.environ_of, 0, 1, name)[0] == "before"  # the server runs by now
    monkeypatch.setenv(name, "after")
    value, pid = in_fresh_process(lw.environ_of, 0, 1, name)
    assert value == "after" and pid != os.getpid()
    with pytest.raises(ValueError, match="invalid literal"):
        in_fresh_process(int, "not a number")
