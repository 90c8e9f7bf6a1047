"""``Pool(world_size)``: ranks kept alive, with their process group, between runs, as torch's
``MultiProcContinuousTest`` does: ``pool.run(fn, *args)`` costs no process start and no group
set-up (the test suite runs its multi-rank tests this way). Each run starts from the same
process state (seeds, default dtype, environment, threads); a run that fails or times out ends
the pool's processes, and the next run starts new ones. One-off runs: `zero.tools.launch.run`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any

from zero.tools.launch import adopt_environ, collect, exit_now, free_port, init_group, rank_context

__all__ = ["Pool"]


SETTLE_S = 30.0  # how long a pool waits, after a run, for every rank to pass the barrier that ends it
BARRIER_S = 10.0  # that barrier's own timeout, by default
_SETTLED, _BROKEN = "settled", "broken"


class Pool:
    """``world_size`` ranks kept alive, with their process group, for many runs of ``fn``.

    ``pool.run(fn, *args)`` returns what `run` would, without starting processes or a group: on
    a 2-core machine that start costs seconds a run. Every run begins from the state a fresh
    rank has (torch's seeds, default dtype and grad mode, ``os.environ``, the working directory,
    warning filters, ``threads``), and ends with a barrier, so the next run starts only once
    every rank has finished this one. A run that fails on any rank or times out ends the
    processes (a rank may be left inside a collective the failed one never joins); the next run
    starts new ones. Use it as a context manager, or call `close`. ``barrier_timeout``: how long
    that barrier waits for a rank before the pool counts the group broken (a run that leaves it
    unusable costs this long).
    """

    def __init__(self, world_size: int, *, pg_timeout: float = 60, start_timeout: float = 120,
                 barrier_timeout: float = BARRIER_S):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not barrier_timeout > 0:
            raise ValueError(f"barrier_timeout must be a positive number of seconds, got {barrier_timeout!r}")
        self.world_size, self.pg_timeout, self.start_timeout = world_size, pg_timeout, start_timeout
        self.barrier_timeout = barrier_timeout
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._runs = 0
        self.unsettled: str | None = None  # why the last run that ended the pool's processes did

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def runs(self) -> int:
        """Runs given to this pool so far."""
        return self._runs

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        ctx = rank_context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [ctx.Process(target=_pool_worker, daemon=True, name=f"zero-pool-rank{r}",
                                   args=(r, self.world_size, port, self._tasks[r], self._results, self.pg_timeout,
                                         self.barrier_timeout, dict(os.environ)))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 240, threads: int = 1) -> list:
        """``fn(rank, world_size, *args)`` on every rank, in rank order (see `run`)."""
        if not self.alive:
            self.close()
            self._start()
        self._runs += 1
        task = self._runs
        try:
            for q in self._tasks:
                q.put((task, fn, args, threads))
            out = self._collect(fn, task, timeout)
        except BaseException:  # a failure, a timeout, or the test's own timeout: ranks may be mid-collective
            self.close()
            raise
        if not self._settled(task):
            self.close()  # fn ended on every rank but left the group unusable: the next run starts anew
        return out

    def _collect(self, fn, task: int, timeout: float) -> list:
        # a fast rank's end of the run may come before a slow one's result: kept for `_settled`
        self._ends: dict[int, tuple[str, Any]] = {}

        def unpack(item):  # an answer to a run given up on is dropped (the pool restarted after it)
            got, rank, status, value = item
            if got == task and status in (_SETTLED, _BROKEN):
                self._ends[rank] = (status, value)
            return item[1:] if got == task and status in (True, False) else None

        out = collect(self._results, self._procs, fn, set(range(self.world_size)), timeout, unpack,
                       f"{self.world_size} pooled ranks")
        return [out[r] for r in range(self.world_size)]

    def _settled(self, task: int, timeout: float = SETTLE_S) -> bool:
        """Whether every rank passed the barrier after run ``task`` (its group is fit for the next)."""
        ends, deadline = self._ends, time.monotonic() + timeout
        while len(ends) < self.world_size and not any(status == _BROKEN for status, _ in ends.values()):
            try:
                got, rank, status, why = self._results.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                self.unsettled = f"ranks {sorted(set(range(self.world_size)) - set(ends))} did not pass it in " \
                                 f"{timeout} s"
                return False
            if got == task and status in (_SETTLED, _BROKEN):
                ends[rank] = (status, why)
        broken = {r: why for r, (status, why) in ends.items() if status == _BROKEN}
        if broken:
            self.unsettled = "; ".join(f"rank {r}: {why}" for r, why in sorted(broken.items()))
        return not broken

    def close(self) -> None:
        """End the ranks' processes (killed: the pool's group dies with them)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for q in [*self._tasks, *([self._results] if self._results is not None else [])]:
            q.cancel_join_thread()
            q.close()
        self._procs, self._tasks, self._results = [], [], None


def _pool_worker(rank, world_size, port, tasks, results, pg_timeout, barrier_timeout, environ):
    import torch
    import torch.distributed as dist

    adopt_environ(environ)  # before the fresh state is taken: each run starts from it
    init_group("gloo", rank, world_size, port, pg_timeout)
    store, fresh = dist.distributed_c10d._get_default_store(), _FreshState(torch)
    while True:
        task, fn, args, threads = tasks.get()
        fresh.restore(threads)
        try:
            payload, ok = pickle.dumps(fn(rank, world_size, *args)), True
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            payload, ok = traceback.format_exc(), False
        results.put((task, rank, ok, payload))
        try:
            if not ok:
                raise RuntimeError("the run failed")
            _ended(store, task, world_size, barrier_timeout)
        except BaseException:  # noqa: BLE001 - the parent starts the pool again
            results.put((task, rank, _BROKEN, traceback.format_exc()))
            results.close()
            results.join_thread()
            exit_now(1)
        results.put((task, rank, _SETTLED, None))


def _ended(store, task: int, world_size: int, barrier_timeout: float) -> None:
    """The end of a pooled run on this rank: once every rank has left ``fn`` (counted through the
    store, apart from the group's collectives, so that no rank still in ``fn`` meets a collective
    of the pool's), each drops zero's bookkeeping of the run, then a barrier on the group checks
    that it still pairs collectives (a run whose ranks diverged on purpose leaves it unusable:
    the barrier then fails or times out, and the process ends)."""
    import torch.distributed as dist

    key = f"zero_pool/ended/{task}"
    store.add(key, 1)
    while store.add(key, 0) < world_size:
        time.sleep(0.002)
    _forget_run()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=barrier_timeout))


class _FreshState:
    """What a fresh rank starts from, put back before each pooled run."""

    def __init__(self, torch):
        import warnings

        self.torch, self.warnings = torch, warnings
        self.seed = torch.initial_seed()
        self.dtype = torch.get_default_dtype()
        self.environ, self.cwd = dict(os.environ), os.getcwd()
        self.filters = list(warnings.filters)

    def restore(self, threads: int) -> None:
        torch = self.torch
        torch.manual_seed(self.seed)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        self.warnings.filters[:] = self.filters
        # a new filters version voids the modules' once-only registries, as in a fresh process
        getattr(self.warnings, "_filters_mutated", lambda: None)()


def _forget_run() -> None:
    """zero's per-group bookkeeping of the finished run (where each rank was) is dropped, so the
    next run's checks never read it; only if zero's backend was used."""
    consistency = sys.modules.get("zero.backends.consistency")
    if consistency is not None:
        consistency.forget_places()
