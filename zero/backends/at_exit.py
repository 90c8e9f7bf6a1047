"""A gloo default group ended before Python finalizes, at a clean exit.

A script that ends without ``torch.distributed.destroy_process_group()`` leaves gloo's worker
threads alive while the interpreter finalizes. A worker that drops the last reference to a
finished collective's tensors then needs the interpreter that is being torn down, and the
process aborts (``terminate called without an active exception``, SIGABRT) after a run that went
well: torch's own, reproduced without zero (pytorch/pytorch#190489; ``python
bench/exit_check.py --kind plain``). torch asks every script to destroy its groups; zero does it
for the scripts that do not, where that is safe:

- only at a clean exit: after an uncaught exception collectives may still be in flight, and
  destroying the group would wait for them (up to the group's timeout) instead of exiting;
- only for gloo (the abort is gloo's; NCCL's teardown has rules of its own);
- registered when zero first uses a real group (`zero.backends.consistency.watch_of`), so it
  runs before the ``atexit`` handlers registered earlier: a handler of the script's own that
  still needs the group must be registered after zero's first step, or destroy the group itself.
"""

from __future__ import annotations

import atexit
import sys

import torch.distributed as dist

__all__ = ["end_group_at_exit"]

_registered = False


def end_group_at_exit() -> None:
    """Destroy the default group at interpreter exit if the script left a gloo one up (once)."""
    global _registered
    if not _registered:
        atexit.register(_end_default_group)
        _registered = True


def _end_default_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    if hasattr(sys, "last_value") or hasattr(sys, "last_exc"):  # an uncaught exception ended the script
        return
    if dist.get_backend() != "gloo":
        return
    dist.destroy_process_group()
