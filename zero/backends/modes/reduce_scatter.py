"""A flat plan whose gradients are reduce-scattered during backward, in place of DDP (ZeRO-2),
with an element-wise torch rule: `ReduceScatteredShards` pipelines the step with the sync, buffer
by buffer. The gradients are `ReducedGradients` (`zero.backends.modes.gradients`), reduced by
a `zero.backends.grads.GradientSource`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zero.backends import comm
from zero.backends.consistency import wait_for
from zero.backends.grads.source import after_settle, no_gradient
from zero.backends.local_optimizer import is_functional
from zero.backends.modes.base import Begin
from zero.backends.modes.flat import FlatShards
from zero.backends.modes.gradients import ReducedGradients
from zero.backends.rank_state import RankState
from zero.plans.meta import ParamMeta

__all__ = ["ReducedGradients", "ReduceScatteredShards", "no_gradient", "after_settle"]


class ReduceScatteredShards(FlatShards):
    """A flat plan with ``reduce_scatter_grads=True``: DDP's place is taken by `ReducedGradients`.

    With an element-wise ``torch.optim`` rule the step is pipelined buffer by buffer with the
    all-gathers.
    """

    def __init__(self, state: RankState, metas: list[ParamMeta], reduce_dtype: torch.dtype | None = None,
                 find_unused: bool = False, reducer: comm.Reducer | None = None):
        super().__init__(state, metas, gradients=lambda flats, _: ReducedGradients(state, metas, flats, reduce_dtype,
                                                                                   find_unused, reducer))

    def step(self, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        state = self.state
        if is_functional(state.optim) or closure is not None or kwargs or state.scaling is not None:
            return super().step(closure, kwargs, begin)
        self._step_pipelined(begin())
        return None

    def _step_pipelined(self, verify: Callable[[], None]) -> None:
        """Reduce-scattered gradients with an element-wise torch rule: buffer by buffer, wait for
        its gradients, step its shard, start its all-gather, so each buffer's compute hides
        the next one's communication."""
        source, works, state = self.gradients.source, [], self.state
        self.gradients.ddp_watch.remove()
        try:
            source.start_rest()
            settings = state.settings()
            for k in range(len(self.shards)):
                source.engine.wait(k)
                if k:
                    state.rewind(settings)
                state.run(self.sharding, grads=self.use_reduced_grads(state.masters.dtype, source.outputs, only=k))
                if k == 0:
                    verify()
                works += self.start_sync(k)
            state.stepped()
        finally:
            self.gradients.end()
            self.clear_grads()
        for work in works:
            wait_for(work, self.state.process_group, "the params' all-gather")
