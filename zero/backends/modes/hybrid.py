"""Hybrid plans (`zero.plans.hybrid`): the params the plan keeps whole are stepped by their owner,
as under a whole-param plan, and the rest in flat shards, as under a flat plan.

One local optimizer steps both: per param group, this rank's whole params, then its shards of
that group's buffers (`zero.plans.holdings`; a rule routing by rank, as Muon does, sends the
matrices to Newton-Schulz and the 1-D shards to AdamW). After the step the whole params travel
by their owners' rows (`ParamSync`) and the shards by one all-gather per buffer.

With ``reduce_scatter_grads=True`` (`HybridReduceScattered`) the shards' gradients are
reduce-scattered during backward as under a flat plan, and each whole param's gradient is
summed into its owner by one reduce, also during backward, as soon as it is made; the other
ranks then drop it (`zero.backends.grads.GradientSource`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zero.backends.modes.flat import FlatShards, Gradients
from zero.backends.modes.reduce_scatter import ReducedGradients
from zero.backends.rank_state import RankState
from zero.backends.sync import ParamSync
from zero.plans.layout import bucket_views
from zero.plans.meta import ParamMeta

__all__ = ["HybridShards", "HybridReduceScattered"]


class HybridShards(FlatShards):
    """A hybrid plan, its gradients left on every rank by DDP: the whole params are stepped by
    their owners with their own gradients, the shards with copies of theirs."""

    def __init__(self, state: RankState, metas: list[ParamMeta], bucket_view: bool | None, chunk_bytes: int,
                 gradients: Callable[[FlatShards], Gradients] | None = None):
        # The whole params' rows: bucket views of the plan's partition, which holds the whole params only.
        self.rows = ParamSync(state.params, bucket_views(metas, state.plan.partition), state.rank,
                              state.process_group, bucket_view, chunk_bytes)
        super().__init__(state, metas, gradients)
        self.storage = self.storage.joined(self.rows.watch)

    @torch.no_grad()
    def sync(self) -> None:
        self.rows.sync()
        super().sync()


class HybridReduceScattered(HybridShards):
    """A hybrid plan with ``reduce_scatter_grads=True``: no DDP; the gradients are `ReducedGradients`."""

    def __init__(self, state: RankState, metas: list[ParamMeta], bucket_view: bool | None, chunk_bytes: int,
                 reduce_dtype: torch.dtype | None = None, find_unused: bool = False, reducer: Any = None):
        super().__init__(state, metas, bucket_view, chunk_bytes,
                         lambda mode: ReducedGradients(mode, reduce_dtype, find_unused, reducer))
