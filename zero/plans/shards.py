"""What each rank's local optimizer sees of a partition, and how state indices map to it.

A sharded optimizer keeps torch's *global* indexing in its state dicts (param ``i`` is the
``i``-th param across ``param_groups``) while each rank's local optimizer numbers only the params
it owns, group by group. These are the index maps between the two, computed from a `Partition`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from zero.plans.meta import ParamMeta
from zero.plans.partition import Partition

__all__ = ["LocalIndices", "local_indices", "local_order", "group_ranges", "by_key"]

LocalIndices = tuple[tuple[int, ...], ...]  # per param group: global indices, in local order


def local_indices(metas: Sequence[ParamMeta], part: Partition, n_groups: int) -> tuple[LocalIndices, ...]:
    """For every rank, per param group, the global indices it owns in its local optimizer's order.

    Every rank gets all ``n_groups`` groups (possibly empty), so group ``k`` means the same on
    every rank.
    """
    out = []
    for rank in range(part.world_size):
        per_group: list[list[int]] = [[] for _ in range(n_groups)]
        for i in part.params_of(rank):
            per_group[metas[i].group].append(i)
        out.append(tuple(tuple(g) for g in per_group))
    return tuple(out)


def local_order(per_group: LocalIndices) -> tuple[int, ...]:
    """Global index of each local position: local param ``j`` is global param ``local_order[j]``."""
    return tuple(i for idx in per_group for i in idx)


def group_ranges(group_sizes: Sequence[int]) -> list[range]:
    """The consecutive indices of each group's params, numbered across groups (torch's state dicts)."""
    out, start = [], 0
    for n in group_sizes:
        out.append(range(start, start + n))
        start += n
    return out


def by_key(keys: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Positions grouped by key (e.g. (device, dtype): one flat buffer or kernel call each),
    keys in order of first appearance, positions in order."""
    out: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return out
