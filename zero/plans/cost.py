"""What a placement costs each rank: bytes held (params, grads, master copies, optimizer state,
padding) and bytes moved by the parameter sync, as one `RankCost` per rank.

ZeRO-1's accounting: every rank holds the full params and grads and only its shard of the master
copies and state; ``grad_shard_bytes`` is what it would hold of the gradients if they were
reduce-scattered (ZeRO-2), and `stage_bytes` gives the ZeRO paper's four rows from one plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero.plans.accounting import master_itemsize, state_bytes, state_itemsize, sync_bytes
from zero.plans.layout import FlatLayout
from zero.plans.meta import itemsize
from zero.plans.partition import Partition

__all__ = ["RankCost", "partition_costs", "flat_costs", "stage_bytes", "STAGES"]


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
    master_bytes: int = 0  # master copies (e.g. fp32) of the 16-bit params this rank steps
    grad_shard_bytes: int = 0  # gradients of what this rank steps: all it holds when they are reduce-scattered

    @property
    def total_bytes(self) -> int:
        """Held with the gradients replicated (DDP + ZeRO-1)."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.state_bytes + self.padding_bytes

    @property
    def total_bytes_grads_sharded(self) -> int:
        """Held with the gradients reduce-scattered (``reduce_scatter_grads=True``, ZeRO-2)."""
        return self.total_bytes - self.grad_bytes + self.grad_shard_bytes


def _replica_bytes(metas) -> tuple[int, int]:
    return sum(m.nbytes for m in metas), sum(m.nbytes for m in metas if m.requires_grad)


def partition_costs(metas, part: Partition, spec, master_dtype: str | None = None) -> tuple[RankCost, ...]:
    param_bytes, grad_bytes = _replica_bytes(metas)
    keys = sorted({(m.device, m.dtype) for m in metas if m.requires_grad})
    key_of = {k: j for j, k in enumerate(keys)}
    w = part.world_size
    per_key = [[0] * w for _ in keys]  # trainable bytes each rank owns, per (device, dtype)
    numel, nbytes, masters, state = [0] * w, [0] * w, [0] * w, [0] * w
    for m, r in zip(metas, part.owner):
        if m.requires_grad:
            per_key[key_of[m.device, m.dtype]][r] += m.nbytes
            numel[r] += m.numel
            nbytes[r] += m.nbytes
            masters[r] += m.numel * master_itemsize(m.dtype, master_dtype)
            state[r] += state_bytes(m, spec, master_dtype)
    bcast, gather = _sync(per_key, w)
    return tuple(RankCost(r, len(part.params_of(r)), numel[r], part.loads[r], param_bytes, grad_bytes,
                          state[r], 0, bcast[r], gather[r], masters[r], nbytes[r]) for r in range(w))


def flat_costs(metas, flat: FlatLayout, spec, master_dtype: str | None = None) -> tuple[RankCost, ...]:
    param_bytes, grad_bytes = _replica_bytes(metas)
    w = flat.world_size
    per_key = [[b.shard_numel * itemsize(b.dtype)] * w for b in flat.buffers]
    bcast, gather = _sync(per_key, w)
    held = [_held(b, w) for b in flat.buffers]
    pieces = [sum(p[r] for p, _ in held) for r in range(w)]
    numel = [sum(n[r] for _, n in held) for r in range(w)]
    state, masters = [0] * w, [0] * w
    for b, (_, n) in zip(flat.buffers, held):
        size, wide = state_itemsize(b.dtype, master_dtype), master_itemsize(b.dtype, master_dtype)
        # State tensors (and master copies) are shaped like the padded shard, one set per buffer on every rank;
        # a head buffer's like each param's heads a rank holds (no padding): the matrix rule's state.
        counts = n if b.head else [b.shard_numel] * w
        one = {c: spec.shard_state_bytes(c, size, b.block or b.head) if c or not b.head else 0 for c in set(counts)}
        state = [s + one[c] for s, c in zip(state, counts)]
        masters = [m + c * wide for m, c in zip(masters, counts)]
    grad_shard = sum(b.shard_numel * itemsize(b.dtype) for b in flat.buffers)
    padding = sum(b.padding * itemsize(b.dtype) for b in flat.buffers)
    return tuple(RankCost(r, pieces[r], numel[r], flat.shard_numel, param_bytes, grad_bytes, state[r],
                          padding, bcast[r], gather[r], masters[r], grad_shard) for r in range(w))


def _held(buf, world_size: int) -> tuple[list[int], list[int]]:
    """Per rank, the pieces of params it holds in ``buf`` and their elements (its shard less padding)."""
    pieces, elements = [0] * world_size, [0] * world_size
    for segs in buf.segments:
        for s in segs:
            pieces[s.rank] += 1
            elements[s.rank] += s.end - s.start
    return pieces, elements


# The ZeRO paper's rows (its Figure 1): what the busiest rank holds as more is sharded.
STAGES = ("replicated (DDP)", "optimizer state sharded (ZeRO-1)", "gradients sharded too (ZeRO-2)",
          "parameters sharded too (ZeRO-3, FSDP)")


def stage_bytes(ranks: tuple[RankCost, ...]) -> dict[str, int]:
    """Bytes the busiest rank holds at each of `STAGES`, from one plan's ranks: nothing sharded
    (every rank holds all the masters and state), this plan (ZeRO-1), its gradients
    reduce-scattered (ZeRO-2), and its params sharded like its gradients (what FSDP holds between
    layers)."""
    shared = sum(r.master_bytes + r.state_bytes for r in ranks)
    first = ranks[0]
    return {STAGES[0]: first.param_bytes + first.grad_bytes + shared,
            STAGES[1]: max(r.total_bytes for r in ranks),
            STAGES[2]: max(r.total_bytes_grads_sharded for r in ranks),
            STAGES[3]: max(r.total_bytes_grads_sharded - r.param_bytes + r.grad_shard_bytes for r in ranks)}


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
