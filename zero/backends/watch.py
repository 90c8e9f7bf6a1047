"""Waiting on zero's own collectives in bounded time, and naming the rank that holds them up.

A collective that one rank never joins (it skipped ``step()``, it was stopped, it died) leaves
the others waiting for the process group's timeout (gloo's default: 30 minutes), then failing
with gloo's words. zero watches the ranks beside its collectives, through the rendezvous store
(a channel apart from the collectives'):

- **Heartbeats.** A daemon thread per process bumps a counter in the store every
  ``HEARTBEAT_S``. A rank whose counter has not moved for ``STOPPED_S`` while others wait for it
  is named as stopped or dead (``RuntimeError``): a ``SIGSTOP``-ed or killed rank, within seconds.
- **Places.** Where a rank is (`Place`: in which call, after how many steps and backward
  passes), posted only when a wait does not end at once. A rank whose place shows that it
  skipped the call the others wait in is named with both counts (``ValueError``), on every rank.
- A backward pass that starts without a ``step()`` since the last one (gradient accumulation, or
  a skipped step) meets the other ranks' places before any gradient collective starts
  (`Watch.backward_started`), so the rank that skipped raises too, instead of pairing its
  gradients' all-reduce with the others' step.

A rank that is alive and consistent but slow is waited for, as a collective would. A wait that
ends at once (the check-in's all-gather ran behind the local step) costs one ``is_completed()``.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import DistStoreError

__all__ = ["Place", "Watch", "watch_of", "HEARTBEAT_S", "STOPPED_S"]

HEARTBEAT_S = 0.5  # how often each process bumps its heartbeat
STOPPED_S = 10.0  # a rank whose heartbeat has not moved for this long while others wait is named
_SPIN_S = 0.02  # a wait shorter than this posts nothing
_POLL_S = 0.02


@dataclass(frozen=True)
class Place:
    """Where a rank is: ``call`` ("step", "backward" ...) after ``steps`` steps and ``backwards``
    backward passes (the one starting included, for "backward")."""

    call: str
    steps: int
    backwards: int

    def reached(self, other: Place) -> bool:
        """Whether a rank at ``other`` has come at least as far as this place."""
        return (other.steps, other.backwards) >= (self.steps, self.backwards)

    def skipped_by(self, rank: int, other: Place, me: int) -> str | None:
        """The error when this place and a rank's ``other`` disagree on whether a step follows
        the last backward pass: one rank is in that step, the other starts the next backward."""
        if other.steps != self.steps:
            return None
        if self.call == "backward" and other.call != "backward" and other.backwards < self.backwards:
            (skipper, started), (stepping, at) = (me, self), (rank, other)
        elif other.call == "backward" and self.call != "backward" and other.backwards > self.backwards:
            (skipper, started), (stepping, at) = (rank, other), (me, self)
        else:
            return None
        return (f"rank {skipper} skipped step(): it has taken {started.steps} steps and started backward pass "
                f"{started.backwards}, while rank {stepping} is in {at.call} {at.steps + 1} after {at.backwards} "
                f"backward passes (this is rank {me}): every rank must call step() after the same backward passes")


class Watch:
    """The heartbeats and places of one process group's ranks (one per group and process)."""

    def __init__(self, group: Any, store: Any):
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.rank, self.size = dist.get_rank(group), len(self.ranks)
        self.store, self.prefix = store, f"zero/watch/{'-'.join(map(str, self.ranks))}"
        beat_store = store.clone() if hasattr(store, "clone") else store
        threading.Thread(target=self._beat, args=(beat_store,), daemon=True, name="zero-heartbeat").start()

    def _beat(self, store: Any) -> None:
        key = f"{self.prefix}/beat/{self.rank}"
        while True:  # until the store goes away with its process group
            time.sleep(HEARTBEAT_S)
            try:
                store.add(key, 1)
            except (RuntimeError, DistStoreError):  # the store went away: the group is being torn down
                return

    def post(self, place: Place) -> None:
        self.store.set(f"{self.prefix}/place/{self.rank}", pickle.dumps(place))

    def places(self) -> dict[int, Place]:
        keys = {r: f"{self.prefix}/place/{r}" for r in range(self.size) if r != self.rank}
        present = {r: k for r, k in keys.items() if self.store.check([k])}
        return {r: pickle.loads(self.store.get(k)) for r, k in present.items()}

    def beats(self) -> dict[int, int]:
        return {r: self.store.add(f"{self.prefix}/beat/{r}", 0) for r in range(self.size) if r != self.rank}

    def wait(self, done: Any, place: Place) -> None:
        """Until ``done()`` (a collective ended), or raise naming the rank that holds it up."""
        spin_until = time.monotonic() + _SPIN_S
        while not done():
            if time.monotonic() > spin_until:
                self.post(place)
                self._watch(done, place)
                return
            time.sleep(0.0005)

    def meet(self, place: Place) -> None:
        """A backward pass starting with no step since the last: wait until every rank has come
        as far (gradient accumulation), or raise when one is in the step this rank skipped."""
        self.post(place)
        self._watch(lambda: self._all_reached(place), place)

    def _all_reached(self, place: Place) -> bool:
        places = self.places()
        return len(places) == self.size - 1 and all(place.reached(p) for p in places.values())

    def _watch(self, done: Any, place: Place) -> None:
        beats, moved = self.beats(), {r: time.monotonic() for r in range(self.size)}
        while not done():
            for r, other in self.places().items():
                error = place.skipped_by(r, other, self.rank)
                if error:
                    raise ValueError(error)
            now, latest = time.monotonic(), self.beats()
            moved.update({r: now for r in latest if latest[r] != beats[r]})
            beats = latest
            stopped = [r for r in latest if now - moved[r] > STOPPED_S]
            if stopped:
                raise RuntimeError(f"rank {stopped[0]} has not answered for {STOPPED_S:.0f} s while rank {self.rank} "
                                   f"waits in {place.call}: it has stopped or died (its heartbeat stopped)")
            time.sleep(_POLL_S)

    def silent(self, wait_s: float = 3 * HEARTBEAT_S) -> list[int]:
        """The ranks whose heartbeat does not move within ``wait_s`` (after a collective failed)."""
        before = self.beats()
        time.sleep(wait_s)
        after = self.beats()
        return [r for r in before if after[r] == before[r]]


_WATCHES: dict[tuple, Watch | None] = {}


def watch_of(group: Any) -> Watch | None:
    """The group's `Watch` (started on first use), or None where no store can carry it."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    key = (tuple(dist.get_process_group_ranks(group)), id(store))  # a new init brings a new store
    if key not in _WATCHES:
        _WATCHES[key] = Watch(group, store) if len(key[0]) > 1 else None
    return _WATCHES[key]
