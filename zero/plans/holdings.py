"""What one rank holds under a plan: the tensors its local optimizer steps, and what each holds.

Under a whole-param plan a rank's local optimizer steps the params the rank owns, whole; under a
flat plan one 1-D shard per flat buffer, each holding pieces of several params; under a hybrid
plan both, in each param group its whole params first, then its shards. A head buffer's shard
(``split_heads``) is stepped as one tensor per param it holds heads of: a view of those rows. `holdings` says this
from the plan alone: the local optimizer's tensors in its order (`LocalTensor`), and where each
piece of each param sits in them (`zero.plans.chunks.Held`). It is the seam between a plan and
its executors: the sharded rules' pieces, torch's consolidated state dict and DCP's per-FQN
checkpoints are all read from it, never from an executor's own bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from zero.plans.checks import check_int
from zero.plans.chunks import Held, param_chunks
from zero.plans.partition import check_rank

if TYPE_CHECKING:
    from zero.plans.plan_fields import PlanFields as Plan  # the fields are all this module reads

__all__ = ["LocalTensor", "Holdings", "holdings"]


@dataclass(frozen=True)
class LocalTensor:
    """One tensor of a rank's local optimizer, in param group ``group``, of ``numel`` elements:
    param ``param`` whole, or (``param`` None) this rank's shard of flat buffer ``buffer``, or of a
    head buffer (`zero.plans.layout.FlatBuffer.head`) the whole heads of param ``piece`` in that
    shard: a view of elements ``offset:offset + numel`` of the shard, in ``shape`` (the param's,
    with only the rows of those heads)."""

    group: int
    numel: int
    param: int | None = None
    buffer: int | None = None
    piece: int | None = None
    offset: int = 0
    shape: tuple[int, ...] = ()

    @property
    def whole(self) -> bool:
        return self.param is not None


@dataclass(frozen=True)
class Holdings:
    """What rank ``rank`` holds under ``plan`` (made by `holdings`).

    ``tensors[j]`` is the local optimizer's ``j``-th tensor (across its ``n_groups`` groups, in
    order); ``held`` lists, in that order, every piece of a param those tensors hold.
    """

    plan: Plan
    rank: int
    n_groups: int
    tensors: tuple[LocalTensor, ...]
    held: tuple[Held, ...]

    def group_sizes(self) -> list[int]:
        """How many tensors the local optimizer has in each param group."""
        sizes = [0] * self.n_groups
        for t in self.tensors:
            sizes[t.group] += 1
        return sizes

    @cached_property
    def _by_local(self) -> dict[int, tuple[Held, ...]]:
        out: dict[int, list[Held]] = {}
        for h in self.held:
            out.setdefault(h.local, []).append(h)
        return {j: tuple(hs) for j, hs in out.items()}

    @cached_property
    def spans(self) -> tuple[tuple[int, int, int, bool], ...]:
        """``(param, start, end, whole)`` of each of ``held``: whether the piece is all of its param
        (read every step: a whole param's gradient is checked as it is, with no view made)."""
        numels = [m.numel for m in self.plan.metas]
        return tuple((h.param, h.start, h.end, h.start == 0 and h.end == numels[h.param]) for h in self.held)

    def pieces(self, local: int) -> tuple[Held, ...]:
        """The pieces of params local tensor ``local`` holds, in its element order."""
        return self._by_local.get(local, ())

    def chunks(self, index: int) -> tuple[tuple[int, int, int], ...]:
        """Every rank's ``(rank, start, end)`` range of param ``index``'s elements under the plan."""
        return param_chunks(index, self.plan.metas[index].numel, self.plan.partition, self.plan.flat)


def holdings(plan: Plan, rank: int, n_groups: int | None = None) -> Holdings:
    """What ``rank``'s local optimizer holds under ``plan``: per param group (``n_groups`` of them,
    trailing empty groups included; default: those the params name), the params the rank owns
    whole, in the partition's order, then its shards of the group's flat buffers, in layout order."""
    check_rank(rank, plan.world_size)
    n_groups = _n_groups(plan.metas, n_groups)
    whole = _whole_by_group(plan, rank, n_groups)
    tensors: list[LocalTensor] = []
    held: list[Held] = []
    for k in range(n_groups):
        for i in whole[k]:
            held.append(Held(i, len(tensors), 0, 0, plan.metas[i].numel))
            tensors.append(LocalTensor(k, plan.metas[i].numel, param=i))
        for bi, buf in enumerate(plan.flat.buffers if plan.flat is not None else ()):
            if buf.group != k:
                continue
            pieces = [p for p in buf.pieces(rank) if p.end > p.start]
            if not buf.head:
                held += [Held(p.param, len(tensors), p.offset, p.start, p.end) for p in pieces]
                tensors.append(LocalTensor(k, buf.shard_numel, buffer=bi))
                continue
            for p in pieces:  # a head buffer: each param's whole heads a tensor of its own rows
                shape = plan.metas[p.param].shape
                held.append(Held(p.param, len(tensors), 0, p.start, p.end))
                tensors.append(LocalTensor(k, p.end - p.start, buffer=bi, piece=p.param, offset=p.offset,
                                           shape=((p.end - p.start) * shape[0] // plan.metas[p.param].numel,
                                                  *shape[1:])))
    return Holdings(plan, rank, n_groups, tuple(tensors), tuple(held))


def _n_groups(metas: Sequence, n_groups: int | None) -> int:
    named = 1 + max((m.group for m in metas), default=-1)
    if n_groups is None:
        return named
    check_int("n_groups", n_groups, named)
    return n_groups


def _whole_by_group(plan: Plan, rank: int, n_groups: int) -> list[list[int]]:
    """The params ``rank`` owns whole, per param group, in the order the partition gives them."""
    out: list[list[int]] = [[] for _ in range(n_groups)]
    if plan.partition is not None:
        for i in plan.partition.params_of(rank):
            out[plan.metas[i].group].append(i)
    return out
