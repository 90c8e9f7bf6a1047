"""Gradients reduce-scattered into a flat plan's shards during backward, in place of DDP (ZeRO-2):
the mode's side. What reduces them is the `zero.backends.grads.GradientSource` (hooks, rounds,
buckets, the `zero.backends.comm.Reducer`); `ReducedGradients` hands what it settles to the
shards, and `ReduceScatteredShards` pipelines the step of an element-wise torch rule with the
sync, buffer by buffer.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from zero.backends import clipping, comm
from zero.backends.consistency import wait_for
from zero.backends.grads.source import GradientSource, after_settle, no_gradient
from zero.backends.local_optimizer import is_functional
from zero.backends.modes.base import Begin
from zero.backends.modes.flat import FlatShards, Gradients
from zero.backends.rank_state import RankState
from zero.plans.meta import ParamMeta

__all__ = ["ReducedGradients", "ReduceScatteredShards", "no_gradient", "after_settle"]


class ReducedGradients(Gradients):
    """Gradients averaged here, in place of DDP, by a `GradientSource` during backward: the shards'
    reduce-scattered, and a hybrid plan's whole params' each summed into its owner, who keeps it
    (the other ranks drop theirs).

    Params start from rank 0's (as DDP's do). Until the first step, a DDP model around these
    params is a ``ValueError`` at its forward: it would all-reduce the gradients a second time.
    """

    scaler_sees_grads = False  # a rank holds only its shards' reduced gradients

    def __init__(self, mode: FlatShards, reduce_dtype: torch.dtype | None = None, find_unused: bool = False,
                 reducer: comm.Reducer | None = None):
        params, metas, group, plan = mode.params, mode.metas, mode.group, mode.plan
        self.whole = plan.whole
        with torch.no_grad():  # start from rank 0's params, as DDP does
            for flat in mode.flats:
                comm.broadcast_from(flat, 0, group)
            for p, m in zip(params, metas):
                if not m.requires_grad:
                    comm.broadcast_from(p.data, 0, group)
            for i in plan.whole:
                comm.broadcast_from(params[i].data, 0, group)
        self.source = GradientSource(params, metas, plan.flat, group, whole=plan.whole,
                                     owner=plan.partition.owner if plan.whole else (), rank=mode.rank,
                                     reduce_dtype=reduce_dtype, find_unused=find_unused, reducer=reducer)
        clipping.register(mode, [p for p, m in zip(params, metas) if m.requires_grad])
        self.ddp_watch = register_module_forward_pre_hook(_refuse_ddp({id(p) for p in params}))
        weakref.finalize(self, self.ddp_watch.remove)  # an optimizer dropped before stepping leaves no hook

    @property
    def outputs(self) -> list[torch.Tensor]:
        """This rank's shard of each buffer's mean gradient, where the source lands it."""
        return self.source.outputs

    def start_pending(self) -> None:
        self.source.start_pending()

    def settled(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """Every reduction of the iteration waited for (`GradientSource.settle`): the shards'
        means and the owned whole params' (clipped in place, or taken by the step)."""
        self.ddp_watch.remove()
        self.source.settle()
        return self.source.outputs, self.source.kept

    def current(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        return self.settled() if not self.source.idle else (self.source.outputs, self.source.kept)

    def end(self) -> None:
        """After a step that took the shards' gradients itself (pipelined), or an error."""
        self.source.end_iteration()

    def zero_grad(self, default: Callable[[], None]) -> None:
        """The shards' gradients are zeroed in place and the kept ones dropped (the params hold
        none); a hybrid plan's whole params' as torch zeroes them."""
        if self.whole:
            default()
        self.source.zero_grads()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate the whole gradients (as ``DDP.no_sync``); the
        first backward after it reduces the sum: less traffic, the whole gradient in memory."""
        with self.source.no_sync():
            yield

    def check_join(self) -> None:
        raise NotImplementedError("Join with reduce_scatter_grads=True: a joined rank would have to shadow "
                                  "the gradients' reductions too; use DDP + Join for uneven inputs")

    checks_local = True  # each rank checks its own gradients as their buckets are reduced

    def local_nonfinite(self) -> bool:
        return self.source.engine.local_nonfinite()


class ReduceScatteredShards(FlatShards):
    """A flat plan with ``reduce_scatter_grads=True``: DDP's place is taken by `ReducedGradients`.

    With an element-wise ``torch.optim`` rule the step is pipelined buffer by buffer with the
    all-gathers.
    """

    def __init__(self, state: RankState, metas: list[ParamMeta], reduce_dtype: torch.dtype | None = None,
                 find_unused: bool = False, reducer: comm.Reducer | None = None):
        super().__init__(state, metas, gradients=lambda mode: ReducedGradients(mode, reduce_dtype, find_unused,
                                                                               reducer))

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
            wait_for(work, self.group, "the params' all-gather")


def _refuse_ddp(ids: set[int]) -> Callable:
    """A global forward pre-hook: ``ValueError`` when a DDP model over any of these params runs."""
    def hook(module: nn.Module, args: Any) -> None:
        if isinstance(module, DistributedDataParallel) and any(id(p) in ids for p in module.module.parameters()):
            raise ValueError("reduce_scatter_grads=True averages the gradients itself, but these params are also in a "
                             "DistributedDataParallel model, which would all-reduce them again (the gradients would "
                             "cross the network twice): run the bare model (ddp.module), or keep DDP and drop "
                             "reduce_scatter_grads")

    return hook
