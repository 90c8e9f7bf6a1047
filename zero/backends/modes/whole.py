"""Whole-param plans (torch's way): this rank steps the params it owns, whole, with their own
gradients (left there by DDP); `ParamSync` then moves every updated param to every replica."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from zero.backends.modes.base import Begin, Mode, build_sharding
from zero.backends.rank_state import RankState
from zero.backends.sync import ParamSync
from zero.functional import sharding
from zero.plans.holdings import LocalTensor
from zero.plans.layout import bucket_views
from zero.plans.meta import ParamMeta

__all__ = ["WholeParams"]

logger = logging.getLogger(__name__)


class WholeParams(Mode):
    """Executes ``plan.partition``: owned params stepped whole, synced by ``parameters_as_bucket_view``'s
    rows (see `zero.backends.sync`)."""

    def __init__(self, state: RankState, metas: list[ParamMeta], bucket_view: bool | None, chunk_bytes: int):
        super().__init__(state)
        self.bucket_view, self.chunk_bytes = bucket_view, chunk_bytes
        self.sync: ParamSync | None = None
        self._build(metas)

    def _build(self, metas: list[ParamMeta]) -> None:
        """(Re)build the sync and the sharding for the plan and the current trainable params."""
        if self.sync is not None:
            self.sync.release()
        layout = bucket_views(metas, self.plan.partition)
        state = self.state
        self.sync = ParamSync(self.params, layout, state.rank, state.process_group, self.bucket_view,
                              self.chunk_bytes)
        self.storage = self.sync.watch
        self.trainable = [m.requires_grad for m in metas]
        self.sharding = self._made_sharding()

    def _made_sharding(self) -> sharding.Sharding:
        """Each owned param is the whole of itself; quantities over the whole model sum over the ranks."""
        return build_sharding(self.state, self.tensor)

    def tensor(self, t: LocalTensor):
        return self.params[t.param]

    def step(self, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        verify = begin()
        loss = self.state.run(self.sharding, closure, **kwargs)
        verify()  # before any param moves: ranks that diverged get a ValueError, not mismatched collectives
        self.state.stepped()
        self.sync.sync()
        return loss

    def sync_params(self) -> None:
        self.sync.sync()

    def retrain(self, metas: list[ParamMeta]) -> None:
        logger.info("trainable params changed; rebuilding the sync buckets")
        self._build(metas)

    def extend(self, metas: list[ParamMeta]) -> None:
        self._build(metas)
