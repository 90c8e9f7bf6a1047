"""Starting ranks on one machine: the demo, the notebooks, the benchmarks and the tests use it.

``run(fn, world_size, *args)`` returns ``fn(rank, world_size, *args)`` of every rank, in rank
order (tensors included: results travel by value, pickled, since a rank's shared memory is gone
once it exits), or raises with the failing rank's traceback. Each rank is a fresh process with a gloo
process group on 127.0.0.1 (``backend="rpc"``: RPC workers ``worker0``... instead); ``fn`` must
be importable (defined at module level, not in a notebook cell). A rank that hangs is killed
when ``timeout`` runs out.

``Pool(world_size)`` keeps its ranks and their process group alive between runs, as torch's
``MultiProcContinuousTest`` does: ``pool.run(fn, *args)`` costs no process start and no group
set-up (the test suite runs its multi-rank tests this way). Each run starts from the same
process state (seeds, default dtype, environment, threads); a run that fails or times out ends
the pool's processes, and the next run starts new ones.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "run", "exit_now", "Pool"]


_GIVEN: set[int] = set()  # the ports free_port handed out in this process


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for ``MASTER_PORT``), and not one handed out
    before in this process: the system hands a freed port out again soon, and a rank of an
    earlier run still retrying its store must not reach the next run's."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError("free_port: the system kept handing out ports this process already used")


def _init_group(backend: str, rank: int, world_size: int, port: int, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout))
    dist.distributed_c10d._get_default_store().add(_JOINED, 1)


def _worker(fn, rank, world_size, port, results, args, pg_timeout, backend, threads):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    try:
        if backend == "rpc":
            out = _rpc_worker(fn, rank, world_size, port, args, pg_timeout)
        else:
            _init_group(backend, rank, world_size, port, pg_timeout)
            out = fn(rank, world_size, *args)
        # By value: torch's queue would pass a tensor as a handle to this process's shared
        # memory, unreadable once it exits (ConnectionResetError in the parent)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            if rank == 0:
                _wait_for_every_rank(world_size, pg_timeout)
            dist.destroy_process_group()
    results.close()
    results.join_thread()  # the result is in the pipe
    exit_now()


def exit_now(code: int = 0) -> None:
    """End this rank's process without Python's finalization, its output flushed.

    A gloo worker thread may still hold the last reference to a finished collective's work when
    the main thread returns; it then frees the work's tensors, which needs the GIL, while Python
    finalizes, and the thread is ended by an unwind that C++ forbids: ``terminate called without
    an active exception`` and SIGABRT after a run that went well (seen in about 1 run in 15 of a
    2-rank demo on a loaded 2-core machine, plain DDP scripts too: torch's, not zero's). With
    nothing left to do, skipping finalization avoids it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_JOINED = "zero_launch_joined"


def _wait_for_every_rank(world_size: int, timeout: float) -> None:
    """Rank 0 hosts the store: it stays until every rank has joined, so that a rank slow to start
    (a loaded machine) still finds the store when a run ends without collectives (an error raised
    before the first one): else it retries a store that is gone until the run times out."""
    import torch.distributed as dist

    store, deadline = dist.distributed_c10d._get_default_store(), time.monotonic() + timeout
    while store.add(_JOINED, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)


def _rpc_worker(fn, rank, world_size, port, args, rpc_timeout):
    """RPC worker ``worker{rank}`` (TensorPipe); shutdown waits for every worker's outstanding calls."""
    from torch.distributed import rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=rpc_timeout,
                                              num_worker_threads=8)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        return fn(rank, world_size, *args)
    finally:
        rpc.shutdown()


def _collect(results, procs: list, fn, wanted: set[int], timeout: float, unpack, where: str) -> dict:
    """The results of the ranks in ``wanted`` (others' too, if they come), by rank; the first
    failure is an ``AssertionError`` with the rank's traceback. A wanted rank whose process died
    without a result (a crash, an abort) fails the run at once rather than at ``timeout``."""
    out, deadline, dead_since = {}, time.monotonic() + timeout, None
    while not wanted <= out.keys():
        left = deadline - time.monotonic()
        if left <= 0:
            dead = [r for r, p in enumerate(procs) if not p.is_alive()]
            raise TimeoutError(f"{fn.__name__} on {where}: no result after {timeout}s (ranks done: {sorted(out)}; "
                               f"ranks whose process has ended: {dead})")
        try:
            item = unpack(results.get(timeout=min(1.0, max(0.05, left))))
        except queue.Empty:
            died = {r: p.exitcode for r, p in enumerate(procs)
                    if r in wanted and r not in out and p.exitcode not in (None, 0)}
            dead_since = (dead_since or time.monotonic()) if died else None
            if died and time.monotonic() - dead_since > 2:  # its last words, if any, had time to arrive
                r, code = min(died.items())
                raise AssertionError(f"rank {r} of {where} died in {fn.__name__} without a result "
                                     f"(exit code {code}{', a signal' if code < 0 else ''})") from None
            continue
        if item is None:
            continue
        rank, ok, value = item
        if not ok:
            raise AssertionError(f"rank {rank} of {where} failed in {fn.__name__}:\n{value}")
        out[rank] = pickle.loads(value)
    return out


def run(fn, world_size: int, *args, timeout: float = 240, pg_timeout: float = 60,
        allow_exit: tuple[int, ...] = (), backend: str = "gloo", threads: int = 1) -> list:
    """``fn(rank, world_size, *args)`` on every rank; ``allow_exit`` ranks may return no result.

    Each rank uses ``threads`` CPU threads (1 by default: ranks share the machine's cores).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, port, results, args, pg_timeout, backend, threads))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        out = _collect(results, procs, fn, set(range(world_size)) - set(allow_exit), timeout,
                       lambda item: item, f"{world_size} ranks")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out.get(r) for r in range(world_size)]


SETTLE_S = 30.0  # how long a pool waits, after a run, for every rank to pass the barrier that ends it
BARRIER_S = 10.0  # that barrier's own timeout
_SETTLED, _BROKEN = "settled", "broken"


class Pool:
    """``world_size`` ranks kept alive, with their process group, for many runs of ``fn``.

    ``pool.run(fn, *args)`` returns what `run` would, without starting processes or a group: on
    a 2-core machine that start costs seconds a run. Every run begins from the state a fresh
    rank has (torch's seeds, default dtype and grad mode, ``os.environ``, the working directory,
    warning filters, ``threads``), and ends with a barrier, so the next run starts only once
    every rank has finished this one. A run that fails on any rank or times out ends the
    processes (a rank may be left inside a collective the failed one never joins); the next run
    starts new ones. Use it as a context manager, or call `close`.
    """

    def __init__(self, world_size: int, *, pg_timeout: float = 60, start_timeout: float = 120):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size, self.pg_timeout, self.start_timeout = world_size, pg_timeout, start_timeout
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
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [ctx.Process(target=_pool_worker, daemon=True, name=f"zero-pool-rank{r}",
                                   args=(r, self.world_size, port, self._tasks[r], self._results, self.pg_timeout))
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

        out = _collect(self._results, self._procs, fn, set(range(self.world_size)), timeout, unpack,
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


def _pool_worker(rank, world_size, port, tasks, results, pg_timeout):
    import torch
    import torch.distributed as dist

    _init_group("gloo", rank, world_size, port, pg_timeout)
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
            _ended(store, task, world_size)
        except BaseException:  # noqa: BLE001 - the parent starts the pool again
            results.put((task, rank, _BROKEN, traceback.format_exc()))
            results.close()
            results.join_thread()
            exit_now(1)
        results.put((task, rank, _SETTLED, None))


def _ended(store, task: int, world_size: int) -> None:
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
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=BARRIER_S))


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
