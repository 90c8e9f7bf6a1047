"""Every rank in the same call on the same optimizer, and every rank alive: checked, and named.

Ranks that diverge (one adds a param group while another steps, one skipped a step, one was
given another plan) would pair collectives of different sizes, which gloo answers by aborting
the process or hanging; a rank that stops leaves the others waiting for the process group's
timeout (gloo's default: 30 minutes). zero checks both beside its own collectives, and says which
rank and what differs:

- **Check-ins** (`check_in`, `OptimizerChecks`): before a step (``add_param_group``,
  ``consolidate_state_dict``) every rank all-gathers a few ints (the call, steps taken,
  checksums of the param groups, the plan, which params train); ranks that differ exchange
  the facts behind the checksum and get a ``ValueError`` naming the first difference.
- **Heartbeats** (`Watch`). Through the rendezvous store (a channel apart from the
  collectives'), a daemon thread per process bumps a counter every ``HEARTBEAT_S``. A rank whose
  counter has not moved for ``STOPPED_S`` while others wait for it is named as stopped or dead
  (``RuntimeError``): a ``SIGSTOP``-ed or killed rank, within seconds.
- **Places.** Where a rank is (`Place`: in which call, after how many steps and backward
  passes), posted only when a wait does not end at once. A rank whose place shows that it
  skipped the call the others wait in is named with both counts (``ValueError``), on every rank.
  A backward pass that starts without a ``step()`` since the last one (gradient accumulation, or
  a skipped step) meets the other ranks' places before any gradient collective starts, so the
  rank that skipped raises too, instead of pairing its gradients' all-reduce with the others' step.
- **Failed collectives** (`wait_for`): the error names the ranks whose heartbeat stopped.

A rank that is alive and consistent but slow is waited for, as a collective would. A wait that
ends at once (the check-in's all-gather ran behind the local step) costs one ``is_completed()``.
"""

from __future__ import annotations

import atexit
import pickle
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import DistStoreError

from zero.backends import at_exit, comm
from zero.plans.checks import checksum
from zero.plans.diff import plan_facts

__all__ = ["Place", "Watch", "watch_of", "HEARTBEAT_S", "STOPPED_S", "wait_for", "check_in", "OptimizerChecks",
           "settings", "stop_watches", "forget_places"]

HEARTBEAT_S = 0.5  # how often each process bumps its heartbeat
STOPPED_S = 10.0  # a rank whose heartbeat has not moved for this long while others wait is named
_SPIN_S = 0.02  # a wait shorter than this posts nothing
CARRIED = 1  # ints every check-in carries beside the agreed fields (see `check_in`)
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(beat_store,), daemon=True, name="zero-heartbeat")
        self._thread.start()

    def _beat(self, store: Any) -> None:
        key = f"{self.prefix}/beat/{self.rank}"
        while not self._stop.wait(HEARTBEAT_S):  # until stopped, or the store goes away with its group
            try:
                store.add(key, 1)
            except (RuntimeError, DistStoreError):  # the store went away: the group is being torn down
                return

    def stop(self) -> None:
        """Stop the heartbeat and wait for its thread (at most one store call)."""
        self._stop.set()
        self._thread.join(timeout=5 * HEARTBEAT_S)

    def post(self, place: Place) -> None:
        self.store.set(f"{self.prefix}/place/{self.rank}", pickle.dumps(place))

    def places(self) -> dict[int, Place]:
        keys = {r: f"{self.prefix}/place/{r}" for r in range(self.size) if r != self.rank}
        present = {r: k for r, k in keys.items() if self.store.check([k])}
        return {r: pickle.loads(self.store.get(k)) for r, k in present.items()}

    def beats(self) -> dict[int, int]:
        return {r: self.store.add(f"{self.prefix}/beat/{r}", 0) for r in range(self.size) if r != self.rank}

    def wait(self, work: Any, place: Place) -> None:
        """Until the collective ``work`` ended, or raise naming the rank that holds it up. The first
        `_SPIN_S` are waited on its future, woken the moment it ends (polled every 0.5 ms instead,
        its end was seen up to 0.8 ms late on a busy 2-core machine, where such a sleep took that)."""
        if work.is_completed() or _ended_within(work, _SPIN_S):
            return
        self.post(place)
        self._watch(work.is_completed, place)

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


def _ended_within(work: Any, seconds: float) -> bool:
    """Whether ``work`` ends (or fails) within ``seconds``."""
    ended = threading.Event()
    work.get_future().add_done_callback(lambda _: ended.set())
    return ended.wait(seconds)


_WATCHES: dict[tuple, Watch | None] = {}


@atexit.register
def stop_watches() -> None:
    """Stop every heartbeat thread before the interpreter exits. A daemon thread still inside a
    store call when Python finalizes is ended by unwinding C++ frames that must not unwind: the
    process aborts (``terminate called without an active exception``) after a run that went well."""
    for watch in list(_WATCHES.values()):
        if watch is not None:
            watch.stop()
    _WATCHES.clear()  # a group used after this starts a new heartbeat


def forget_places() -> None:
    """Delete the places this process posted (`Watch.post`), for a process that goes on to run
    another job on the same group (`zero.tools.pool.Pool`): a place left from the last one
    must not be read as where this rank is now."""
    for watch in _WATCHES.values():
        if watch is not None:
            watch.store.delete_key(f"{watch.prefix}/place/{watch.rank}")


def watch_of(group: Any) -> Watch | None:
    """The group's `Watch` (started on first use), or None where no store can carry it (or the
    group is fake: its ranks are simulated, with no heartbeats to read)."""
    if comm.is_fake(group):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    key = (tuple(dist.get_process_group_ranks(group)), id(store))  # a new init brings a new store
    if key not in _WATCHES:
        at_exit.end_group_at_exit()
        _WATCHES[key] = Watch(group, store) if len(key[0]) > 1 else None
    return _WATCHES[key]


Facts = Sequence[tuple[str, Any]]  # (label, value) pairs, e.g. ("param group 0's lr", 0.001)


def wait_for(work: Any, group: Any, what: str) -> None:
    """Wait on ``work``, one of zero's collectives; if it fails, say which rank stopped answering."""
    try:
        work.wait()
    except RuntimeError as e:
        raise _failed(e, group, what) from e


def _failed(error: RuntimeError, group: Any, what: str) -> RuntimeError:
    """A failed collective, with the ranks whose heartbeat stopped (`Watch`) named."""
    watch = watch_of(group)
    try:
        silent = watch.silent() if watch is not None else None
    except (RuntimeError, DistStoreError):
        silent = None
    who = (f"rank {', '.join(map(str, silent))} did not answer" if silent else
           "the rendezvous store is unreachable too (with env:// or tcp:// it lives on rank 0)" if silent is None
           else "every rank still answers")
    return RuntimeError(f"rank {comm.group_rank(group)} (of {comm.group_size(group)}) waited for {what} and the "
                        f"collective failed; {who}: it has stopped or left the process group ({error})")


def check_in(what: str, fields: Mapping[str, int], group: Any, device: torch.device,
             facts: Mapping[str, Callable[[], Facts]] | None = None, place: Place | None = None,
             carried: Sequence[int] = ()) -> Callable[[], list[list[int]]]:
    """Start checking that all ranks are in the same call ``what`` with equal ``fields``; returns ``verify``.

    ``fields`` names the ints every rank must agree on (steps taken, checksums of the params and
    of the param groups ...); every call passes the same number of them. ``verify()`` waits, then
    raises ``ValueError`` on every rank if some rank differs, naming that rank and what differs.
    A field that is a checksum has a ``facts`` function listing what it sums up as labelled values:
    only when the checksums differ do the ranks exchange those, and the error names the first
    label whose values differ and both values, never the checksum.
    The collective has the same size on every rank, so ranks that diverged (one adds a param
    group while another steps, or one skipped a step) meet here and get a clear error instead of
    pairing collectives of different sizes, which gloo answers by aborting the process or
    hanging. Started before a local step and verified after it, its latency hides behind the
    step's compute. A rank that never joins (it skipped the call, or stopped) is named in bounded
    time from ``place`` (where this rank is: `Place`), not after the group's timeout.

    ``carried``: ints each rank reports that need not agree (whether it found non-finite
    gradients), riding in the same collective; ``verify()`` returns every rank's, by rank. Every
    check-in carries `CARRIED` of them (zeros where a call has none), so that ranks in different
    calls still pair collectives of one size and get the error, not gloo's abort.
    """
    carried = [*carried, *[0] * (CARRIED - len(carried))]
    if len(carried) != CARRIED:
        raise ValueError(f"a check-in carries {CARRIED} values, got {len(carried)}")
    if comm.is_fake(group):  # a simulated rank: no other rank to agree with, no data to compare
        return lambda: [carried]
    rank, size = comm.group_rank(group), comm.group_size(group)
    watch = watch_of(group) if place is not None else None
    values = [_CALLS[what], *fields.values()]
    rows = torch.tensor([[*values, *carried]] * size, dtype=torch.int64, device=device)  # others' are overwritten
    work = comm.all_gather_into(rows.view(-1), rows[rank], group)

    def verify() -> list[list[int]]:
        if watch is not None:
            watch.wait(work, place)
        try:
            work.wait()
        except RuntimeError as e:
            raise _failed(e, group, f"the other ranks in {what}") from e
        got = rows.tolist()
        column = next((j for j in range(len(values)) if any(row[j] != got[0][j] for row in got)), None)
        if column is None:
            return [row[len(values):] for row in got]
        odd = next(r for r, row in enumerate(got) if row[column] != got[rank][column])
        if column == 0:
            names = {v: k for k, v in _CALLS.items()}
            raise ValueError(f"rank {rank} is in {what} but rank {odd} is in {names.get(got[odd][0], 'another call')}: "
                             f"every rank must make the same calls ({', '.join(_CALLS)}) in the same order")
        name = list(fields)[column - 1]
        describe = (facts or {}).get(name)
        if describe is None:
            detail = f"{got[rank][column]} here, {got[odd][column]} on rank {odd}"
        else:  # every rank found the same column: they all exchange that field's facts
            everyone = comm.all_gather_object(list(describe()), group)
            odd = next((r for r, theirs in enumerate(everyone) if theirs != everyone[rank]), odd)
            detail = _first_difference(everyone[rank], everyone[odd], odd)
        raise ValueError(f"rank {rank} and rank {odd} differ at {what}() in {name}: {detail}; every rank must "
                         "build the same optimizer and make the same calls")

    return verify


def _first_difference(mine: Facts, theirs: Facts, odd: int) -> str:
    """``param group 0's lr is 0.001 here and 0.002 on rank 1``: the first fact that differs."""
    for (label, a), (other, b) in zip(mine, theirs):
        if label != other:
            return f"{label} here where rank {odd} has {other}"
        if a != b:
            return f"{label} is {a!r} here and {b!r} on rank {odd}"
    if len(mine) != len(theirs):
        extra, where = (mine[len(theirs)][0], "here only") if len(mine) > len(theirs) else \
            (theirs[len(mine)][0], f"on rank {odd} only")
        return f"{extra} exists {where}"
    return "their details agree as exchanged"


_CALLS: dict[str, int] = {"step": 1, "add_param_group": 2, "consolidate_state_dict": 3}


def settings(group: dict) -> dict:
    """A param group's settings: everything but its params."""
    return {k: v for k, v in group.items() if k != "params"}


class OptimizerChecks:
    """The checks of one sharded optimizer: a check-in at each of its collective calls (`check_in`),
    and a count of backward passes through its params (`watch_backwards`), so that a rank that
    skipped ``step()`` is named before its gradients' collectives pair with the others' step.

    It reads ``subject``: the optimizer's `zero.backends.rank_state.RankState`, or anything with
    the same ``steps``, ``param_groups``, ``params``, ``plan`` (its ``fingerprint`` and ``metas``,
    described by ``plan_facts``), ``process_group`` and ``comm_device``; ``trainable()`` (which
    params the executor steps) and ``joined()`` (inside ``Join``).
    """

    def __init__(self, subject: Any, trainable: Callable[[], Sequence[bool]], joined: Callable[[], bool],
                 plan_facts: Callable[[Any], Facts] = plan_facts):
        self.state, self.trainable, self.joined = subject, trainable, joined
        self.plan_facts = plan_facts
        self.backwards = 0  # backward passes through the params: with the steps, where this rank is

    def check_in(self, what: str, argument: int = 0, argument_facts: Callable[[], Facts] | None = None,
                 carried: Sequence[int] = ()) -> Callable[[], list[list[int]]]:
        """Start the check that every rank is in call ``what`` on the same optimizer (`check_in`);
        returns ``verify`` (which returns every rank's ``carried``)."""
        state = self.state
        groups = [(len(g["params"]), settings(g)) for g in state.param_groups]
        fields = {"steps taken": state.steps,
                  "param groups (sizes and settings such as lr)": checksum(groups),
                  "plan (params, groups, placement)": int(state.plan.fingerprint[:15], 16),
                  "trainable params (requires_grad)": zlib.crc32(bytes(self.trainable())),  # bools: a byte each
                  "the call's argument (to=, or the new group)": argument}
        facts = {"param groups (sizes and settings such as lr)": lambda: group_facts(state.param_groups),
                 "plan (params, groups, placement)": lambda: self.plan_facts(state.plan),
                 "trainable params (requires_grad)": self._trainable_facts}
        if argument_facts is not None:
            facts["the call's argument (to=, or the new group)"] = argument_facts
        place = Place(what, state.steps, self.backwards)
        return check_in(what, fields, state.process_group, state.comm_device, facts, place, carried)

    def _trainable_facts(self) -> Facts:
        names = [m.name for m in self.state.plan.metas]
        return [(f"param {i} ({name})'s requires_grad", flag)
                for i, (name, flag) in enumerate(zip(names, self.trainable()))]

    def watch_backwards(self) -> None:
        """Count the backward passes through the trainable params; one that starts with no step
        since the last meets the other ranks first (`Watch.meet`): a rank that skipped step()
        raises there, by name, before its gradients' collectives pair with the others' step."""
        trainable = [p for p in self.state.params if p.requires_grad]
        group = self.state.process_group
        if comm.group_size(group) == 1 or comm.is_fake(group) or not trainable:
            return
        me = weakref.ref(self)

        def started(_grad: Any) -> None:
            checks = me()
            if checks is not None:
                checks._backward_started()

        handle = torch.autograd.graph.register_multi_grad_hook(trainable, started, mode="any")
        weakref.finalize(self, handle.remove)

    def _backward_started(self) -> None:
        done, self.backwards = self.backwards, self.backwards + 1
        steps = self.state.steps
        if done <= steps:  # a step followed the last backward pass: the common case, nothing to check
            return
        watch = watch_of(self.state.process_group)
        if watch is not None and not self.joined():  # accumulating, or a step was skipped
            watch.meet(Place("backward", steps, self.backwards))


def group_facts(param_groups: list[dict]) -> Facts:
    """The param groups as labelled values: their number, sizes and settings."""
    facts: list[tuple[str, Any]] = [("the number of param groups", len(param_groups))]
    for k, g in enumerate(param_groups):
        facts.append((f"param group {k}'s number of params", len(g["params"])))
        facts += [(f"param group {k}'s {key}", value) for key, value in sorted(settings(g).items())]
    return facts
