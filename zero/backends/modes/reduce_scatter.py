"""Gradients reduce-scattered into a flat plan's shards during backward, in place of DDP.

DDP + ZeRO-1 moves about 3x the model per iteration: DDP all-reduces every gradient (2x), then
the optimizer all-gathers the updated params (1x). But a rank steps only its shard, so it needs
only its shard of the averaged gradients: one reduce-scatter (1x), and the iteration moves 2x,
as plain DDP does.

Each trainable param's ``.grad`` is a view into a flat gradient buffer laid out as the plan's
param buffers, so backward accumulates straight into it. A post-accumulate-grad hook counts the
params of each buffer; when all have their gradient, the buffer's reduce-scatter starts
(asynchronously, while backward goes on), its output being the shard's gradient. Buffers start
in the plan's order on every rank, so every rank issues the same collectives in the same order;
`finish` (called by ``step()``) starts any left and waits.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from zero.backends import comm
from zero.backends.consistency import wait_for
from zero.backends.local_optimizer import is_functional
from zero.backends.modes.base import Begin
from zero.backends.modes.flat import FlatShards, Gradients
from zero.backends.rank_state import RankState
from zero.plans.layout import FlatLayout
from zero.plans.meta import ParamMeta

__all__ = ["GradShards", "ReducedGradients", "ReduceScatteredShards", "no_gradient"]


class GradShards:
    """Per flat buffer, a gradient buffer the params' grads view, reduce-scattered into ``outputs``."""

    def __init__(self, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], layout: FlatLayout,
                 outputs: Sequence[torch.Tensor], group: Any):
        self.params, self.metas, self.layout, self.outputs, self.group = list(params), metas, layout, outputs, group
        self.buffers = [torch.zeros(b.padded_numel, dtype=o.dtype, device=o.device)
                        for b, o in zip(layout.buffers, outputs)]
        self._views: dict[int, tuple[int, torch.Tensor]] = {}
        for bi, (buf, flat) in enumerate(zip(layout.buffers, self.buffers)):
            for i, off in zip(buf.params, buf.offsets):
                self._views[i] = (bi, flat[off:off + self.metas[i].numel].view(self.metas[i].shape))
        self._hooks = [self.params[i].register_post_accumulate_grad_hook(self._ready) for i in self._views]
        self._index = {id(self.params[i]): i for i in self._views}
        self._syncing = True
        self.end_iteration()
        self.zero_grads()

    def end_iteration(self) -> None:
        """Forget this iteration (after waiting for any reduction still running)."""
        for work in getattr(self, "_works", ()):
            if work is not None:  # a reduction started before an error: let it end before its buffer is reused
                with contextlib.suppress(RuntimeError):  # its failure, if any, was the error raised already
                    work.wait()
        self._seen = [set() for _ in self.layout.buffers]
        self._works: list[Any] = []

    def zero_grads(self) -> None:
        """Zero the gradient buffers in place, the params' grads viewing them again; an iteration
        that failed half way is dropped."""
        self.end_iteration()
        with torch.no_grad():
            for flat in self.buffers:
                flat.zero_()
        for i, (_, view) in self._views.items():
            self.params[i].grad = view if view.dtype == self.params[i].dtype else None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all micro-batches but the last)."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _ready(self, param: torch.Tensor) -> None:
        i = self._index[id(param)]
        bi, view = self._views[i]
        if view.dtype != param.dtype:  # reduce_dtype: accumulate in the buffer's dtype, free the param's
            with torch.no_grad():
                view.add_(param.grad)
            param.grad = None
        elif param.grad is not view:  # zero_grad(set_to_none=True) ran: backward made a fresh grad
            with torch.no_grad():
                view.copy_(param.grad)
            param.grad = view
        if not self._syncing:
            return
        if len(self._works) > bi:
            raise RuntimeError(f"param {self.metas[i].name} got a second gradient after its buffer was reduced: "
                               "call step() after each backward, or accumulate inside optimizer.no_sync()")
        self._seen[bi].add(i)
        while len(self._works) < len(self.buffers) and self._complete(len(self._works)):
            self._start(len(self._works))

    def _complete(self, bi: int) -> bool:
        return len(self._seen[bi]) == len(self.layout.buffers[bi].params)

    def _start(self, bi: int) -> None:
        self._works.append(comm.reduce_scatter_sum(self.outputs[bi], self.buffers[bi], self.group))

    def finish(self, world_size: int) -> None:
        """Start the reductions backward did not, wait for all, and average: ``outputs`` are then
        this rank's shards of the mean gradient."""
        self.start_rest()
        for bi in range(len(self.buffers)):
            self.wait(bi, world_size)
        self.end_iteration()

    def start_rest(self) -> None:
        """Start, in order, the reductions backward did not (every param must have its gradient)."""
        for bi in range(len(self._works), len(self.buffers)):
            missing = [i for i in self.layout.buffers[bi].params if i not in self._seen[bi]]
            if missing:
                self.end_iteration()
                raise no_gradient(self.metas[missing[0]].name)
            self._start(bi)

    def wait(self, bi: int, world_size: int) -> None:
        """Wait for buffer ``bi``'s reduction and average it (after `start_rest`)."""
        self._wait_once(bi)
        with torch.no_grad():
            self.outputs[bi].div_(world_size)

    def _wait_once(self, bi: int) -> None:
        # Gloo's reduce-scatter copies its result into the output on every wait(): a second wait
        # would undo the averaging (and a failed one would fail again).
        work, self._works[bi] = self._works[bi], None
        if work is not None:
            wait_for(work, self.group, "the gradients' reduce-scatter")

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class ReducedGradients(Gradients):
    """Gradients averaged here, in place of DDP: the shards' by `GradShards` (reduce-scattered
    during backward), and a hybrid plan's whole params' each summed into its owner at the step,
    one reduce per param in the plan's order (the same on every rank), and dropped elsewhere.

    Params start from rank 0's (as DDP's do). Until the first step, a DDP model around these
    params is a ``ValueError`` at its forward: it would all-reduce the gradients a second time.
    """

    scaler_sees_grads = False  # a rank holds only its shards' reduced gradients

    def __init__(self, mode: FlatShards, reduce_dtype: torch.dtype | None = None):
        params, metas, group, plan = mode.params, mode.metas, mode.group, mode.plan
        self.reduce_dtype, self.whole, self.world_size = reduce_dtype, plan.whole, plan.world_size
        if reduce_dtype is not None:  # the shards' gradients, and the buffers reduced into them, in it
            mode.widen_grads(reduce_dtype)
        with torch.no_grad():  # start from rank 0's params, as DDP does
            for flat in mode.flats:
                comm.broadcast_from(flat, 0, group)
            for p, m in zip(params, metas):
                if not m.requires_grad:
                    comm.broadcast_from(p.data, 0, group)
            for i in plan.whole:
                comm.broadcast_from(params[i].data, 0, group)
        self.shards = GradShards(params, metas, plan.flat, mode.grads, group)
        self.ddp_watch = register_module_forward_pre_hook(_refuse_ddp({id(p) for p in params}))
        weakref.finalize(self, self.ddp_watch.remove)  # an optimizer dropped before stepping leaves no hook

    def take(self, mode: FlatShards, master_dtype: torch.dtype | None) -> dict[int, torch.Tensor]:
        """The shards' reduce-scattered means (started during backward), then the whole params'."""
        self.ddp_watch.remove()
        self.shards.finish(self.world_size)
        wide = mode.use_reduced_grads(master_dtype)
        self._reduce_whole(mode, master_dtype, wide)
        return wide

    def _reduce_whole(self, mode: FlatShards, master_dtype: torch.dtype | None, wide: dict) -> None:
        for i in self.whole:
            p, owner = mode.params[i], mode.plan.partition.owner[i]
            if p.grad is None:
                raise no_gradient(mode.metas[i].name)
            grad = p.grad if self.reduce_dtype is None else p.grad.to(self.reduce_dtype)
            wait_for(comm.reduce_sum_to(grad, owner, mode.group), mode.group, "the whole params' reduce")
            if owner != mode.rank:
                p.grad = None  # ZeRO-2: only the owner keeps it
                continue
            grad.div_(self.world_size)
            if grad.dtype == p.dtype:
                p.grad = grad
            elif grad.dtype == master_dtype:  # straight to the master, as the shards' (use_reduced_grads)
                p.grad, wide[id(p)] = None, grad
            else:
                p.grad = grad.to(p.dtype)

    def zero_grad(self, default: Callable[[], None]) -> None:
        """The grads stay views of the flat gradient buffers, zeroed in place (a fresh grad would be
        copied into them by the next backward); a hybrid plan's whole params' as torch zeroes them."""
        if self.whole:
            default()
        self.shards.zero_grads()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate (as ``DDP.no_sync``); the first backward after it
        reduces the sum."""
        with self.shards.no_sync():
            yield

    def check_join(self) -> None:
        raise NotImplementedError("Join with reduce_scatter_grads=True: a joined rank would have to shadow "
                                  "the gradients' reduce-scatters too; use DDP + Join for uneven inputs")


class ReduceScatteredShards(FlatShards):
    """A flat plan with ``reduce_scatter_grads=True``: DDP's place is taken by `ReducedGradients`.

    With an element-wise ``torch.optim`` rule the step is pipelined buffer by buffer with the
    all-gathers.
    """

    def __init__(self, state: RankState, metas: list[ParamMeta], reduce_dtype: torch.dtype | None = None):
        super().__init__(state, metas, lambda mode: ReducedGradients(mode, reduce_dtype))

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
        shards, works, state = self.gradients.shards, [], self.state
        self.gradients.ddp_watch.remove()
        try:
            shards.start_rest()
            for k in range(len(self.shards)):
                shards.wait(k, self.layout.world_size)
                state.run(self.rules, grads=self.use_reduced_grads(state.masters.dtype, only=k))
                if k == 0:
                    verify()
                works += self.start_sync(k)
            state.stepped()
        finally:
            shards.end_iteration()
            self.clear_grads()
        for work in works:
            wait_for(work, self.group, "the params' all-gather")


def no_gradient(name: str) -> ValueError:
    return ValueError(f"param {name} got no gradient in this iteration: with reduce_scatter_grads=True every "
                      "trainable param needs one (as DDP without find_unused_parameters); freeze it before building "
                      "the optimizer")


def _refuse_ddp(ids: set[int]) -> Callable:
    """A global forward pre-hook: ``ValueError`` when a DDP model over any of these params runs."""
    def hook(module: nn.Module, args: Any) -> None:
        if isinstance(module, DistributedDataParallel) and any(id(p) in ids for p in module.module.parameters()):
            raise ValueError("reduce_scatter_grads=True averages the gradients itself, but these params are also in a "
                             "DistributedDataParallel model, which would all-reduce them again (the gradients would "
                             "cross the network twice): run the bare model (ddp.module), or keep DDP and drop "
                             "reduce_scatter_grads")

    return hook
