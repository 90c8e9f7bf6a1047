"""Starting ranks on one machine: the demo, the notebooks, the benchmarks and the tests use it.

``run(fn, world_size, *args)`` returns ``fn(rank, world_size, *args)`` of every rank, in rank
order (tensors included: results travel by value, pickled, since a rank's shared memory is gone
once it exits), or raises with the failing rank's traceback. Each rank is a new process, forked
from a server that imported torch and zero once (`rank_context`), with a gloo process group on
127.0.0.1 (``backend="rpc"``: RPC workers ``worker0``... instead); ``fn`` must be importable
(defined at module level, not in a notebook cell). A rank that hangs is killed when ``timeout``
runs out.

`zero.tools.pool.Pool` keeps ranks and their process group alive between runs (the test suite's).
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

from zero.backends.fresh import adopt_environ, rank_context

__all__ = ["free_port", "run", "exit_now", "init_group", "collect", "rank_context", "adopt_environ"]

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


def init_group(backend: str, rank: int, world_size: int, port: int, pg_timeout: float, *,
               hosted: bool = False) -> None:
    """This rank's default process group, its store on ``port``: rank 0's, or (``hosted``) one
    the launcher holds, which outlives every rank (`run`)."""
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=pg_timeout)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout) if hosted else None
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _worker(fn, rank, world_size, port, results, args, pg_timeout, backend, threads, environ):
    import torch
    import torch.distributed as dist

    adopt_environ(environ)
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    try:
        if backend == "rpc":
            out = _rpc_worker(fn, rank, world_size, port, args, pg_timeout)
        else:
            init_group(backend, rank, world_size, port, pg_timeout, hosted=True)
            # Every rank's connections are made before any can finish: a rank that returned at once
            # and exited closed its end while a slower one still paired with it (gloo's
            # connectFullMesh, "Connection closed by peer", seen on CI), and that rank's error hid
            # what the run did
            dist.barrier()
            out = fn(rank, world_size, *args)
        # By value: torch's queue would pass a tensor as a handle to this process's shared
        # memory, unreadable once it exits (ConnectionResetError in the parent)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
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


def collect(results, procs: list, fn, wanted: set[int], timeout: float, unpack, where: str) -> dict:
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
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    store = _host_store(port, pg_timeout) if backend != "rpc" else None  # noqa: F841 (held until the ranks end)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, port, results, args, pg_timeout, backend, threads,
                               dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        out = collect(results, procs, fn, set(range(world_size)) - set(allow_exit), timeout,
                       lambda item: item, f"{world_size} ranks")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out.get(r) for r in range(world_size)]


def _host_store(port: int, pg_timeout: float) -> Any:
    """The ranks' store, held here: it outlives every rank, so that a rank that reaches it later
    than another ended (a rank slow to start on a loaded machine, a rank whose first check-in
    opens a connection of its own after the others raised and left) finds it, where one hosted
    by rank 0 would be gone with its process, and the late rank would retry it a minute a try
    until the run timed out. A rank that ends still closes its collectives' connections with its
    process, so a rank left waiting in a collective fails at once."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=pg_timeout),
                         wait_for_workers=False)
