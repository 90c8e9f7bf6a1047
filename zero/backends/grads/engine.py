"""The bucket engine: per reduction unit of a plan, a bucket filled by its params' gradients,
started when complete, landed into the outputs the engine owns.

A flat buffer's bucket is reduced by the `zero.backends.comm.Reducer` (by default the plain
reduce-scatter and mean, `MeanReducer`) into this rank's shard of the mean (``outputs``,
accumulated across backward passes until `reset`); a hybrid plan's whole param is summed into
its owner, who keeps the mean (``kept``, by param). At most `IN_FLIGHT` reductions are in flight:
starting one more lands the oldest first, so a rank never holds more than that many buckets being
reduced (memory, not speed).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from zero.backends import comm
from zero.backends.consistency import wait_for
from zero.functional.adapters.nonfinite import l1_norm
from zero.plans.layout import IN_FLIGHT_BUCKETS, FlatLayout

__all__ = ["Unit", "BucketEngine", "IN_FLIGHT"]

IN_FLIGHT = IN_FLIGHT_BUCKETS


class Unit(NamedTuple):
    """One reduction unit: a flat buffer (``kind="flat"``, buffer ``index``) or a whole param
    (``kind="whole"``, param ``index``); its params with their offsets in the bucket, the bucket's
    dtype, elements (padded) and elements before the padding."""

    kind: str
    index: int
    members: tuple[tuple[int, int], ...]
    dtype: torch.dtype
    numel: int
    used: int


class BucketEngine:
    """Fill, start, land, drain: the buckets of ``units`` and the tensors their reductions land in."""

    def __init__(self, units: Sequence[Unit], layout: FlatLayout, device: torch.device, group: Any,
                 reducer: comm.Reducer, owner: Sequence[int] = (), rank: int = 0, check: bool = True,
                 names: Sequence[str] = ()):
        self.units, self.group, self.reducer, self.owner, self.rank = tuple(units), group, reducer, owner, rank
        self.names = names  # params' names, for errors
        self.world, self.check = layout.world_size, check
        shard_dtypes = {u.index: u.dtype for u in self.units if u.kind == "flat"}
        self.outputs = [torch.zeros(b.shard_numel, dtype=shard_dtypes.get(k, torch.float32), device=device)
                        for k, b in enumerate(layout.buffers)]  # this rank's shard of each buffer's mean
        self._buckets: dict[int, torch.Tensor] = {}  # unit -> its whole-size buffer, while it fills
        self._written: dict[int, set[int]] = {}  # flat unit -> the params whose gradient its bucket holds
        self._flight: collections.deque = collections.deque()
        self.reset()

    def reset(self) -> None:
        """Drop every bucket and reduction (an iteration that failed half way too), zero the shards."""
        self.drain(suppress=True)
        self._buckets, self._written = {}, {}
        self._fresh = [True] * len(self.outputs)  # the shard holds nothing yet: a reduction writes into it
        self.kept: dict[int, torch.Tensor] = {}  # whole param -> its mean gradient (its owner's), flat
        self.landed = False  # a reduction landed since the last reset or `end`
        self._norms: list[torch.Tensor] = []  # of each bucket of this rank's own gradients, since the step
        with torch.no_grad():
            for out in self.outputs:
                out.zero_()

    @torch.no_grad()
    def add(self, u: int, i: int, off: int, grad: torch.Tensor) -> None:
        """Add param ``i``'s gradient (flat) into unit ``u``'s bucket at ``off``. A whole param's
        bucket is its gradient (cast to the unit's dtype); a flat buffer's is made at its first
        gradient, uninitialised but for its padding, each param's region copied at its first
        gradient and added to after (``no_sync``)."""
        unit, bucket = self.units[u], self._buckets.get(u)
        if unit.kind == "whole":
            if bucket is None:
                self._buckets[u] = grad if grad.dtype == unit.dtype else grad.to(unit.dtype)
            else:
                bucket.add_(grad)
            return
        if bucket is None:
            bucket = self._buckets[u] = torch.empty(unit.numel, dtype=unit.dtype, device=grad.device)
            bucket[unit.used:].zero_()
            self._written[u] = set()
        region = bucket[off:off + grad.numel()]
        if i in self._written[u]:
            region.add_(grad)
        else:
            region.copy_(grad)
            self._written[u].add(i)

    @torch.no_grad()
    def zeros(self, u: int, i: int, off: int, numel: int, device: torch.device) -> None:
        """Param ``i`` of unit ``u`` counts as zeros this round (DDP's unused-parameter protocol)."""
        unit = self.units[u]
        if unit.kind == "whole":
            self._buckets[u] = torch.zeros(unit.numel, dtype=unit.dtype, device=device)
            return
        if u not in self._buckets:
            self._buckets[u] = torch.zeros(unit.numel, dtype=unit.dtype, device=self.outputs[unit.index].device)
            self._written[u] = set()
        self._buckets[u][off:off + numel].zero_()
        self._written[u].add(i)

    def start(self, u: int) -> None:
        """Start unit ``u``'s reduction (its bucket complete), landing the oldest beyond `IN_FLIGHT`."""
        bucket, unit = self._buckets.pop(u), self.units[u]
        if self.check:
            self._norms.append(l1_norm(bucket))  # NaN or inf where this rank's own gradients hold one
        if unit.kind == "whole":  # summed into the owner's bucket, in place
            self._flight.append((u, comm.reduce_sum_to(bucket, self.owner[unit.index], self.group), bucket, bucket))
        else:
            k = unit.index
            into = self.outputs[k] if self._fresh[k] else torch.empty_like(self.outputs[k])
            self._fresh[k] = False
            self._flight.append((u, self.reducer.start(into, bucket, self.group), bucket, into))
        while len(self._flight) > IN_FLIGHT:
            self.land()

    def land(self) -> None:
        """Wait for the oldest reduction in flight and add its mean into its shard (or its owner's
        kept gradient)."""
        u, pending, _, into = self._flight.popleft()
        unit = self.units[u]
        # Gloo's reduce-scatter copies its result into the output on wait(): wait exactly once.
        wait_for(pending, self.group, "the gradients' reduce-scatter" if unit.kind == "flat" else
                 f"the gradient's reduce to its owner (param {self.names[unit.index]})")
        if unit.kind == "flat":
            self.reducer.finish(pending, into, self.outputs[unit.index], self.world)
        elif self.owner[unit.index] == self.rank:
            kept = self.kept.get(unit.index)
            self.kept[unit.index] = into.div_(self.world) if kept is None else kept.add_(into, alpha=1 / self.world)
        self.landed = True

    def drain(self, suppress: bool = False) -> None:
        """Land every reduction in flight (``suppress``: wait for them, ignoring a failure: its
        error, if any, was raised already)."""
        while self._flight:
            if not suppress:
                self.land()
                continue
            _, pending, _, _ = self._flight.popleft()
            with contextlib.suppress(RuntimeError):
                pending.wait()

    def end(self) -> None:
        """An iteration ends (its step took the gradients, or an error): what is in flight is
        waited for and dropped, and no reduction counts as landed for the next."""
        self.drain(suppress=True)
        self.landed = False

    def wait(self, k: int) -> None:
        """Land flat buffer ``k``'s reductions (after every unit started): its shard is then the mean."""
        while any(self.units[u].kind == "flat" and self.units[u].index == k for u, *_ in self._flight):
            self.land()

    @property
    def in_flight(self) -> bool:
        """A reduction started and not landed."""
        return bool(self._flight)

    @property
    def busy(self) -> bool:
        """A reduction in flight or a bucket filling (``no_sync`` fills buckets without starting them)."""
        return bool(self._flight or self._buckets)

    def local_nonfinite(self) -> bool:
        """Whether this rank's own gradients, in the buckets started since the last call, held NaN or inf."""
        norms, self._norms = self._norms, []
        return bool(norms) and not bool(torch.isfinite(torch.stack([n.double().cpu() for n in norms]).sum()))

    def held_bytes(self) -> int:
        """Bytes of whole-size buckets held now (filling, or being reduced, with their scratch
        outputs): with the shards and ``kept``, all the gradient memory a rank holds."""
        buffers = [*self._buckets.values(), *(b for _, _, b, _ in self._flight)]
        scratch = [into for _, _, b, into in self._flight if into is not b and not any(into is o for o in self.outputs)]
        return sum(t.numel() * t.element_size() for t in buffers + scratch)
