"""Processes that have run nothing yet: the ranks the launcher starts (`zero.tools.launch`) and the
simulations that must measure as a fresh job does (`zero.backends.fsdp2_peer`).

Where the platform has one (Linux, macOS) they are forked from multiprocessing's fork server,
which imports torch and zero once (`PRELOAD`): a spawned process imports them afresh, 1-3 s of CPU
each, which on a 2-core machine is most of a short run. Elsewhere they are spawned. Either way
the function run must be importable (defined at a module's top level).
"""

from __future__ import annotations

import os
from typing import Any

import torch.multiprocessing as mp

__all__ = ["PRELOAD", "rank_context", "adopt_environ", "in_fresh_process"]

# What the server that processes are forked from imports once (see `rank_context`). One list for
# both users: the server is one a process, and whichever starts it first sets what it holds (the
# launcher's modules named as strings only: this layer imports nothing of zero.tools).
PRELOAD = ["torch", "torch.distributed", "zero.functional", "zero.backends", "zero.tools.launch", "zero.tools.pool"]


def rank_context() -> Any:
    """The multiprocessing context fresh processes start in: the fork server where the platform
    has one (its first use in a process starts the server), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first process this process starts)
    return ctx


def adopt_environ(environ: dict[str, str]) -> None:
    """A process's environment made the one its starter had when it started the process, as a
    spawned process's is (a forked one has the fork server's, from when that server started)."""
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)


def in_fresh_process(fn, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` in a process of its own that has run nothing before it, with this
    process's environment; its result comes back pickled, an exception it raises is raised here."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=rank_context()) as pool:
        return pool.submit(_with_environ, dict(os.environ), fn, args, kwargs).result()


def _with_environ(environ: dict[str, str], fn, args: tuple, kwargs: dict) -> Any:
    adopt_environ(environ)
    return fn(*args, **kwargs)
