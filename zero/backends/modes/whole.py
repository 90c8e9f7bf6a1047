"""Whole-param plans (torch's way): this rank steps the params it owns, whole, with their own
gradients (left there by DDP); `ParamSync` then moves every updated param to every replica."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.backends.local_optimizer import LocalStep, local_groups
from zero.backends.modes.base import Begin, Mode
from zero.backends.state_dict import to_global, to_local
from zero.backends.sync import ParamSync
from zero.functional import sharding
from zero.plans.chunks import Held, held_by, param_chunks
from zero.plans.layout import bucket_views
from zero.plans.meta import ParamMeta
from zero.plans.plan import Plan
from zero.plans.shards import local_indices, local_order

__all__ = ["WholeParams"]

logger = logging.getLogger(__name__)


class WholeParams(Mode):
    """Executes ``plan.partition``: owned params stepped whole, synced by ``parameters_as_bucket_view``'s
    rows (see `zero.backends.sync`)."""

    def __init__(self, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], plan: Plan, rank: int,
                 group: Any, n_groups: int, bucket_view: bool | None, chunk_bytes: int):
        super().__init__(params, plan, rank, group)
        self.bucket_view, self.chunk_bytes, self.n_groups = bucket_view, chunk_bytes, n_groups
        self.sync: ParamSync | None = None
        self._build(metas)

    def _build(self, metas: Sequence[ParamMeta]) -> None:
        """(Re)build the index maps, the sync and the rules for the current trainable params."""
        if self.sync is not None:
            self.sync.release()
        self.indices = local_indices(metas, self.plan.partition, self.n_groups)
        layout = bucket_views(metas, self.plan.partition)
        self.sync = ParamSync(self.params, layout, self.rank, self.group, self.bucket_view, self.chunk_bytes)
        self.storage = self.sync.watch
        self.trainable = [m.requires_grad for m in metas]
        self.rules = self._rules()

    def _rules(self) -> sharding.Sharding:
        """Each owned param is the whole of itself; rules over the whole model sum over the ranks."""
        device = self.params[0].device
        pieces = {id(p): sharding.Pieces((i,), (p.numel(),), (0,))
                  for i, p in enumerate(self.params) if self.plan.partition.owner[i] == self.rank}
        return sharding.Sharding(pieces, tuple(p.dtype for p in self.params), comm.summed(self.group, device),
                                 numels=tuple(p.numel() for p in self.params),
                                 shapes=tuple(tuple(p.shape) for p in self.params), whole_params=True)

    def local_groups(self, param_groups: list[dict]) -> list[dict]:
        return local_groups(param_groups, self.indices[self.rank], self.params)

    def step(self, local: LocalStep, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        verify = begin()
        loss = local.run(self.rules, closure, **kwargs)
        verify()  # before any param moves: ranks that diverged get a ValueError, not mismatched collectives
        local.stepped()
        self.sync.sync()
        return loss

    def retrain(self, metas: Sequence[ParamMeta]) -> None:
        logger.info("trainable params changed; rebuilding the sync buckets")
        self._build(metas)

    def extend(self, plan: Plan, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], n_groups: int) -> None:
        self.plan, self.params, self.n_groups = plan, list(params), n_groups
        self._build(metas)

    def holdings(self) -> tuple[Held, ...]:
        return held_by(self.rank, local_order(self.indices[self.rank]), None, None, [p.numel() for p in self.params])

    def chunks(self, index: int) -> tuple[tuple[int, int, int], ...]:
        return param_chunks(index, self.params[index].numel(), self.plan.partition, None)

    def to_global(self, shards: Sequence[dict], param_groups: list[dict], per_element: set[str] | None) -> dict:
        return to_global(shards, self.indices, param_groups, self.plan.partition.owner)

    def to_local(self, saved: dict, per_element: set[str] | None) -> dict:
        return to_local(saved, self.indices[self.rank], self.rank, self.plan.partition.owner)
