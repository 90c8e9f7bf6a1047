"""A plan's fields (`PlanFields`): the data `zero.plans.plan.Plan` is, and what the modules that
execute a plan (`footprint`, `holdings`, `mesh_padding`) read."""

from __future__ import annotations

from dataclasses import dataclass

from zero.plans.cost import RankCost
from zero.plans.layout import FlatLayout
from zero.plans.meta import ParamMeta
from zero.plans.partition import Partition

__all__ = ["PlanFields"]


@dataclass(frozen=True)
class PlanFields:
    """What a plan is, as data: its inputs, placement and costs (`zero.plans.plan.Plan` adds its
    JSON, table and plot). The modules that say what executing a plan takes read these fields
    only, so they depend on the plan's data, never on how it prints."""

    metas: tuple[ParamMeta, ...]
    world_size: int
    strategy: str
    weight: str
    optimizer: str
    alignment: int
    bucket_numel: int | None  # flat buffers' cap (None: one per group, device and dtype)
    partition: Partition | None  # None for "flat" (but a hybrid's: its whole params, owner -1 for the rest)
    flat: FlatLayout | None  # only for "flat"
    ranks: tuple[RankCost, ...]
    max_over_mean: float  # the busiest rank's load / the mean load
    max_over_bound: float  # the busiest rank's load / the best any plan could do (see make_plan)
    fingerprint: str
    master_dtype: str | None = None  # the optimizer steps copies of 16-bit params in this dtype
    whole: tuple[int, ...] = ()  # a hybrid plan's params kept whole (by `partition`); the rest are in `flat`

    @property
    def hybrid(self) -> bool:
        """A flat plan that keeps some params whole (`zero.plans.hybrid`)."""
        return bool(self.whole)

    @property
    def cut_at_heads(self) -> tuple[int, ...]:
        """The params in head buffers (``make_plan(..., split_heads=True)``), cut at head edges,
        each rank stepping whole heads of them; in buffer order."""
        return tuple(i for b in self.flat.buffers if b.head for i in b.params) if self.flat is not None else ()

    @property
    def split_heads(self) -> bool:
        """A flat plan with head buffers: some params cut at head edges (`cut_at_heads`)."""
        return bool(self.cut_at_heads)
