"""Which of torch's step implementations a rank's local optimizer runs on a group: the for-loop
or foreach, decided from the group's tensors alone, so that the plan's footprint counts the
temporaries the executor then makes.

torch runs its for-loop step on the CPU when ``foreach`` is left ``None``. For many small tensors
its foreach step is much faster (one C++ loop over the tensors, not a Python one: 100 tensors of
64 x 64, Adam, one thread: 2.6 ms against 4.9), and it gives the for-loop's bits for Adam, AdamW
and SGD in float32 and float64 (tests/backends/test_local_foreach.py). But each of its passes
runs over every tensor of the group before the next pass starts, so it holds a temporary for
every tensor at once, and on large tensors it leaves the caches the for-loop keeps warm (16
tensors of 512 x 512: 23.9 ms against 17.8). zero takes it where it pays and costs little: a
group of float32 or float64 CPU tensors whose mean is at most `FOREACH_MEAN_BYTES` and whose
total, the size of its temporaries, at most `FOREACH_MAX_BYTES`. On CUDA torch takes its foreach step by
itself (its default there, whatever the sizes), and the footprint counts that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from zero.plans.accounting import master_itemsize
from zero.plans.meta import itemsize

if TYPE_CHECKING:
    from zero.plans.holdings import Holdings
    from zero.plans.plan_fields import PlanFields as Plan

__all__ = ["FOREACH_MAX_BYTES", "FOREACH_MEAN_BYTES", "FOREACH_DTYPES", "takes_foreach", "foreach_groups"]

FOREACH_MAX_BYTES = 16 * 2**20  # a foreach step's temporaries: a tensor the size of each the group holds
FOREACH_MEAN_BYTES = 64 * 2**10  # above it per-tensor Python is a small part of the for-loop's time
FOREACH_DTYPES = ("float32", "float64")  # bfloat16: foreach differs from the for-loop in the last bit


def takes_foreach(device: str, dtype: str, numels: Sequence[int]) -> bool:
    """Whether torch's foreach step runs for a local group of ``numels`` tensors, all of ``dtype``
    on ``device`` (the dtype the optimizer steps: the masters' where there are masters), for a
    class whose ``foreach`` the user left to torch: on CUDA by torch's own default; on the CPU
    where zero gives it (a class whose foreach step is its for-loop's bits, a group as above)."""
    if not numels:
        return False
    if str(device).startswith("cuda"):
        return True
    if not str(device).startswith("cpu") or dtype not in FOREACH_DTYPES:
        return False
    total = sum(numels) * itemsize(dtype)
    return total <= FOREACH_MAX_BYTES and total <= FOREACH_MEAN_BYTES * len(numels)


def foreach_groups(plan: Plan, held: Holdings) -> dict[int, tuple[str, int]]:
    """The local groups of a rank's holdings (``held``) that torch steps with its foreach step
    (`takes_foreach` of every tensor a group holds, frozen ones too), each with its device and the
    bytes of its trainable tensors (the step's temporaries): what the footprint counts and the
    executor gives (on the CPU)."""
    members: dict[int, list[tuple[str, str, int, bool]]] = {}
    for t in held.tensors:
        meta = plan.metas[t.param] if t.whole else None
        where = meta if meta is not None else plan.flat.buffers[t.buffer]
        trained = meta is None or meta.requires_grad  # (a frozen param gets no master)
        stepped = plan.master_dtype if trained and master_itemsize(where.dtype, plan.master_dtype) else where.dtype
        members.setdefault(t.group, []).append((where.device, stepped, t.numel, trained))
    out = {}
    for group, ts in members.items():
        kinds = {(device, dtype) for device, dtype, _, _ in ts}
        if len(kinds) == 1:
            device, dtype = kinds.pop()
            if takes_foreach(device, dtype, [n for _, _, n, _ in ts]):
                out[group] = (device, sum(n * itemsize(dtype) for _, _, n, trained in ts if trained))
    return out
