"""What a placement costs each rank: bytes held (params, grads, optimizer state, padding) and
bytes moved by the parameter sync, as one `RankCost` per rank.

ZeRO-1's accounting: every rank holds the full params and grads and only its shard of the state.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero.plans.accounting import sync_bytes
from zero.plans.layout import FlatLayout
from zero.plans.meta import itemsize
from zero.plans.partition import Partition

__all__ = ["RankCost", "partition_costs", "flat_costs"]


@dataclass(frozen=True)
class RankCost:
    """What one rank holds and moves (ZeRO-1: full params and grads, a shard of the state)."""

    rank: int
    params: int  # parameters (or parameter pieces, for "flat") this rank updates
    numel: int  # trainable elements this rank updates
    load: int  # the balanced weight this rank owns (padded shard elements for "flat")
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    padding_bytes: int
    broadcast_bytes: tuple[int, int]  # (sent, received) per step, broadcast sync
    all_gather_bytes: tuple[int, int]  # (sent, received) per step, all-gather sync

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.state_bytes + self.padding_bytes


def _replica_bytes(metas) -> tuple[int, int]:
    return sum(m.nbytes for m in metas), sum(m.nbytes for m in metas if m.requires_grad)


def partition_costs(metas, part: Partition, spec) -> tuple[RankCost, ...]:
    param_bytes, grad_bytes = _replica_bytes(metas)
    keys = sorted({(m.device, m.dtype) for m in metas if m.requires_grad})
    key_of = {k: j for j, k in enumerate(keys)}
    w = part.world_size
    per_key = [[0] * w for _ in keys]  # trainable bytes each rank owns, per (device, dtype)
    numel, nbytes, count = [0] * w, [0] * w, [0] * w
    for m, r in zip(metas, part.owner):
        if m.requires_grad:
            per_key[key_of[m.device, m.dtype]][r] += m.nbytes
            numel[r] += m.numel
            nbytes[r] += m.nbytes
            count[r] += 1
    state = [spec.bytes_of(b, c) for b, c in zip(nbytes, count)]  # spec.bytes_for, summed per rank
    bcast, gather = _sync(per_key, w)
    return tuple(RankCost(r, len(part.params_of(r)), numel[r], part.loads[r], param_bytes, grad_bytes,
                          state[r], 0, bcast[r], gather[r]) for r in range(w))


def flat_costs(metas, flat: FlatLayout, spec) -> tuple[RankCost, ...]:
    param_bytes, grad_bytes = _replica_bytes(metas)
    w = flat.world_size
    per_key = [[b.shard_numel * itemsize(b.dtype)] * w for b in flat.buffers]
    bcast, gather = _sync(per_key, w)
    pieces, numel = [0] * w, [0] * w
    for b in flat.buffers:
        for segs in b.segments:
            for s in segs:
                pieces[s.rank] += 1
                numel[s.rank] += s.end - s.start
    # State tensors are shaped like the padded shard, one set per buffer, on every rank alike.
    state = sum(spec.slots * b.shard_numel * itemsize(b.dtype) + spec.scalar_bytes for b in flat.buffers)
    padding = sum(b.padding * itemsize(b.dtype) for b in flat.buffers)
    return tuple(RankCost(r, pieces[r], numel[r], flat.shard_numel, param_bytes, grad_bytes, state,
                          padding, bcast[r], gather[r]) for r in range(w))


def _sync(per_key: list[list[int]], world_size: int):
    """Sum (sent, received) over one collective per (device, dtype) key."""
    bcast = [(0, 0)] * world_size
    gather = [(0, 0)] * world_size
    for shard_bytes in per_key:
        bcast = [_add(a, b) for a, b in zip(bcast, sync_bytes(shard_bytes, "broadcast"))]
        gather = [_add(a, b) for a, b in zip(gather, sync_bytes(shard_bytes, "all_gather"))]
    return bcast, gather


def _add(a, b):
    return (a[0] + b[0], a[1] + b[1])
