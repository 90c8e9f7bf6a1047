"""DDP gradient buckets: how DDP lays them out, and which rank updates which slice of each.

`ddp_buckets` reproduces DDP's bucketing rule so the overlap path can plan before the first
backward; `assign_ddp_buckets` maps buckets to ranks with torch's two `overlap_with_ddp`
algorithms.
"""

from __future__ import annotations

from collections.abc import Sequence

from zero.plans.checks import check_int
from zero.plans.meta import ParamMeta
from zero.plans.partition import Partition, check_metas, check_world_size

__all__ = ["assign_ddp_buckets", "ddp_buckets", "ddp_bucket_partition", "DEFAULT_BUCKET_CAP_MB",
           "FIRST_BUCKET_BYTES"]

DEFAULT_BUCKET_CAP_MB = 25
FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's small first bucket (its _DEFAULT_FIRST_BUCKET_BYTES)


def assign_ddp_buckets(bucket_numels: Sequence[Sequence[int]], world_size: int,
                       shard_buckets: bool = False) -> list[dict[int, tuple[int, int]]]:
    """Which slice of which DDP bucket each rank updates.

    Returns one dict per rank, ``{bucket_index: (offset, count)}``: the rank updates params
    ``offset:offset + count`` of that bucket. ``bucket_numels[i]`` lists the numel of each param
    of bucket ``i``, in bucket order.

    ``shard_buckets=False``: bucket ``i`` goes whole to rank ``i % world_size``.
    ``shard_buckets=True``: buckets in increasing size; each is cut into runs that stay under
    ``total / world_size`` elements, each run to the least-loaded rank not yet holding part of
    that bucket. Equal to torch's where torch succeeds; where torch would need more runs than
    ranks ("All indices are disallowed") the last allowed rank takes the rest of the bucket.
    """
    check_world_size(world_size)
    buckets = [list(b) for b in bucket_numels]
    for i, b in enumerate(buckets):
        if not b:
            raise ValueError(f"DDP bucket {i} is empty")
        for k, n in enumerate(b):
            check_int(f"bucket_numels[{i}][{k}]", n)
    out: list[dict[int, tuple[int, int]]] = [{} for _ in range(world_size)]
    if not shard_buckets:
        for i, b in enumerate(buckets):
            out[i % world_size][i] = (0, len(b))
        return out
    threshold = sum(map(sum, buckets)) / world_size
    loads = [0] * world_size
    for i in sorted(range(len(buckets)), key=lambda i: sum(buckets[i])):  # stable, as torch's
        for rank, offset, count, size in _runs(buckets[i], threshold, loads, world_size):
            out[rank][i] = (offset, count)
            loads[rank] += size
    return out


def _runs(numels: list[int], threshold: float, loads: list[int], world_size: int):
    """Cut one bucket into runs and give each to the least-loaded rank not used for it yet."""
    used: set[int] = set()
    start, size = 0, 0
    for j, n in enumerate(numels):
        # Cut before param j if the run would reach the threshold, unless only one unused rank
        # is left: it must take the rest (torch asserts here).
        if size + n >= threshold and j > start and len(used) < world_size - 1:
            rank = _least_loaded(loads, used)
            used.add(rank)
            yield rank, start, j - start, size
            start, size = j, 0
        size += n
    yield _least_loaded(loads, used), start, len(numels) - start, size


def _least_loaded(loads: list[int], used: set[int]) -> int:
    return min((r for r in range(len(loads)) if r not in used), key=loads.__getitem__)


def ddp_buckets(metas: Sequence[ParamMeta], bucket_cap_mb: float | None = None,
                order: Sequence[int] | None = None) -> list[list[int]]:
    """DDP's gradient buckets (param indices, in bucket order) for the trainable ``metas``.

    This is the layout DDP settles on after its first iteration: params in the order their
    gradients become ready (``order``; by default the reverse of registration order, as for a
    model used in definition order), grouped per (device, dtype), a bucket closing once it
    reaches its byte limit. With the default cap the first bucket of each key is capped at
    1 MiB (``FIRST_BUCKET_BYTES``) and the rest at 25 MiB; an explicit ``bucket_cap_mb`` caps all.
    """
    metas = check_metas(metas)
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    if order is None:
        order = [i for i in reversed(range(len(metas))) if metas[i].requires_grad]
    elif sorted(order) != sorted(set(order)) or not set(order) <= set(range(len(metas))):
        raise ValueError(f"order must list distinct param indices in 0..{len(metas) - 1}")
    cap = int((bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) * 1024 * 1024)
    limits = [FIRST_BUCKET_BYTES, cap] if bucket_cap_mb is None else [cap]
    return _bucket_by_size(metas, order, limits)


def _bucket_by_size(metas, order, limits) -> list[list[int]]:
    closed: list[tuple[int, list[int]]] = []  # (position of first param, indices)
    open_: dict[tuple[str, str], list] = {}  # key -> [first position, indices, bytes, limit index]
    for pos, i in enumerate(order):
        key = (metas[i].device, metas[i].dtype)
        acc = open_.setdefault(key, [pos, [], 0, 0])
        if not acc[1]:
            acc[0] = pos
        acc[1].append(i)
        acc[2] += metas[i].nbytes
        if acc[2] >= limits[acc[3]]:
            closed.append((acc[0], acc[1]))
            open_[key] = [pos + 1, [], 0, min(acc[3] + 1, len(limits) - 1)]
    # DDP appends the partial buckets last; order them by where they started so the result is
    # deterministic (torch's order for several keys is a hash-map order).
    closed += sorted((acc[0], acc[1]) for acc in open_.values() if acc[1])
    return [idx for _, idx in closed]



def ddp_bucket_partition(metas: Sequence[ParamMeta], world_size: int, bucket_cap_mb: float | None = None,
                         shard_buckets: bool = False) -> Partition:
    """Ownership of each param for stepping inside DDP's comm hook, from DDP's buckets.

    Each (predicted) bucket's params go to ranks as `assign_ddp_buckets` says: whole buckets
    round-robin, or with ``shard_buckets`` runs of each bucket balanced over the ranks. Ownership
    stays with the param when DDP rebuilds its buckets, so no state ever moves; frozen params go
    to rank 0 (they never step). The local order is registration order, group by group.
    """
    metas = check_metas(metas)
    buckets = ddp_buckets(metas, bucket_cap_mb)
    owner = [0] * len(metas)
    for rank, slices in enumerate(assign_ddp_buckets([[metas[i].numel for i in b] for b in buckets],
                                                     world_size, shard_buckets) if buckets else []):
        for b, (offset, count) in slices.items():
            for i in buckets[b][offset:offset + count]:
                owner[i] = rank
    order = tuple(tuple(i for i in range(len(metas)) if owner[i] == r) for r in range(world_size))
    loads = tuple(sum(metas[i].numel for i in idx) for idx in order)
    strategy = "ddp_buckets_sharded" if shard_buckets else "ddp_buckets"
    return Partition(world_size, strategy, "numel", tuple(owner), order, loads)
