"""Gradients reduce-scattered into a flat plan's shards during backward, in place of DDP (ZeRO-2).

DDP + ZeRO-1 moves about 3x the model per iteration: DDP all-reduces every gradient (2x), then
the optimizer all-gathers the updated params (1x). But a rank steps only its shard, so it needs
only its shard of the averaged gradients: one reduce-scatter (1x), and the iteration moves 2x,
as plain DDP does. And it needs to keep only that shard: ZeRO-2's memory.

Each flat buffer of the plan is a bucket. A post-accumulate-grad hook adds each param's gradient
into its bucket's whole-size buffer (allocated at its first gradient, in the reduce dtype) and
frees the param's own. When a bucket holds every param's gradient, its reduce-scatter starts
(asynchronously, while backward goes on) into this rank's shard, and when it ends the buffer is
dropped: besides the shards, a rank holds only the buckets being filled and at most
``IN_FLIGHT`` being reduced, never the whole gradient. Buckets start in the plan's order on every
rank, so every rank issues the same collectives in the same order.

Each backward pass reduces its gradients and the shards accumulate them, averaged, as DDP's
``.grad`` accumulates over micro-batches; inside `GradShards.no_sync` the buckets accumulate
instead and the first backward after it reduces their sum (one reduce-scatter per bucket for
all micro-batches, but the whole gradient in memory meanwhile).
"""

from __future__ import annotations

import collections
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
from zero.plans.layout import IN_FLIGHT_BUCKETS, FlatLayout
from zero.plans.meta import ParamMeta

__all__ = ["GradShards", "ReducedGradients", "ReduceScatteredShards", "no_gradient", "IN_FLIGHT"]

IN_FLIGHT = IN_FLIGHT_BUCKETS  # buckets being reduced at once; one more waits for the oldest (memory, not speed)


class GradShards:
    """Per flat buffer of ``layout`` (a bucket), its params' gradients, reduce-scattered into this
    rank's shard of their mean (``outputs``, accumulated) as soon as the bucket is complete."""

    def __init__(self, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], layout: FlatLayout,
                 outputs: Sequence[torch.Tensor], group: Any):
        self.params, self.metas, self.layout, self.outputs, self.group = list(params), metas, layout, outputs, group
        self._where = {id(self.params[i]): (i, bi, off) for bi, buf in enumerate(layout.buffers)
                       for i, off in zip(buf.params, buf.offsets)}
        self._hooks = [self.params[i].register_post_accumulate_grad_hook(self._ready)
                       for i, _, _ in self._where.values()]
        self._syncing = True
        self._flight: collections.deque = collections.deque()
        self.zero_grads()

    def zero_grads(self) -> None:
        """Zero the shards, drop every bucket (an iteration that failed half way too); the params
        keep no gradient."""
        self._drain(suppress=True)
        self._buckets: dict[int, torch.Tensor] = {}  # bucket -> its whole-size buffer, while it fills
        self._fresh = [True] * len(self.outputs)  # the shard holds nothing yet: a reduction writes into it
        self._reduced = False  # a backward's gradients reduced since the last step
        self._new_round()
        with torch.no_grad():
            for out in self.outputs:
                out.zero_()
        for i, _, _ in self._where.values():
            self.params[i].grad = None

    def _new_round(self) -> None:
        self._seen = [set() for _ in self.layout.buffers]
        self._next = 0  # the next bucket to reduce in this backward pass (every rank in layout order)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate the whole gradients in the buckets without reducing them (all micro-batches
        but the last): one reduction for all, the whole gradient in memory meanwhile."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    @torch.no_grad()
    def _ready(self, param: torch.Tensor) -> None:
        i, bi, off = self._where[id(param)]
        if self._syncing and bi < self._next:  # the last backward left some params without a gradient
            missing = self._missing(self._next)
            self._new_round()
            raise no_gradient(self.metas[missing].name)
        bucket = self._buckets.get(bi)
        if bucket is None:
            bucket = self._buckets[bi] = torch.zeros(self.layout.buffers[bi].padded_numel,
                                                     dtype=self.outputs[bi].dtype, device=self.outputs[bi].device)
        bucket[off:off + self.metas[i].numel].add_(param.grad.reshape(-1))
        param.grad = None  # ZeRO-2: the bucket holds it until its reduction; the shard after
        if not self._syncing:
            return
        self._seen[bi].add(i)
        while self._next < len(self.outputs) and self._complete(self._next):
            self._start(self._next)
            self._next += 1
        if self._next == len(self.outputs):
            self._new_round()

    def _complete(self, bi: int) -> bool:
        return len(self._seen[bi]) == len(self.layout.buffers[bi].params)

    def _missing(self, bi: int) -> int:
        return next(i for b in range(bi, len(self.outputs)) for i in self.layout.buffers[b].params
                    if i not in self._seen[b])

    def _start(self, bi: int) -> None:
        bucket = self._buckets.pop(bi)  # complete: every param of it added its gradient
        into = self.outputs[bi] if self._fresh[bi] else torch.empty_like(self.outputs[bi])
        self._fresh[bi] = False
        self._flight.append((bi, comm.reduce_scatter_sum(into, bucket, self.group), bucket, into))
        while len(self._flight) > IN_FLIGHT:
            self._land()

    def _land(self) -> None:
        """Wait for the oldest reduction in flight and add its mean into its shard."""
        bi, work, _, into = self._flight.popleft()
        # Gloo's reduce-scatter copies its result into the output on wait(): wait exactly once.
        wait_for(work, self.group, "the gradients' reduce-scatter")
        world = self.layout.world_size
        if into is self.outputs[bi]:
            into.div_(world)
        else:
            self.outputs[bi].add_(into, alpha=1 / world)
        self._reduced = True

    def _drain(self, suppress: bool = False) -> None:
        while self._flight:
            if not suppress:
                self._land()
                continue
            _, work, _, _ = self._flight.popleft()
            with contextlib.suppress(RuntimeError):  # its failure, if any, was the error raised already
                work.wait()

    def finish(self) -> None:
        """Start the reductions backward did not, wait for all: ``outputs`` are then this rank's
        shards of the mean gradient (accumulated over the backward passes since the last step)."""
        self.start_rest()
        self._drain()
        self.end_iteration()

    def start_rest(self) -> None:
        """Start, in order, the reductions backward did not: every param must have its gradient,
        and some backward must have run since the last step."""
        if self._next == 0 and not any(self._seen):
            if self._reduced or self._flight or not self.outputs:  # (a hybrid plan may keep every param whole)
                return
            self.end_iteration()
            raise no_gradient(self.metas[self.layout.buffers[0].params[0]].name)
        for bi in range(self._next, len(self.outputs)):
            if not self._complete(bi):
                missing = self._missing(bi)
                self.end_iteration()
                raise no_gradient(self.metas[missing].name)
            self._start(bi)
        self._new_round()

    def wait(self, bi: int) -> None:
        """Wait for bucket ``bi``'s reductions (after `start_rest`); its shard is then the mean."""
        while any(b == bi for b, *_ in self._flight):
            self._land()

    def end_iteration(self) -> None:
        """After a step (or an error): the next backward starts a new round, and must run before
        the next step."""
        self._drain(suppress=True)
        self._new_round()
        self._reduced = False

    def held_bytes(self) -> int:
        """Bytes of whole-size bucket buffers held now (filling, or being reduced): with the shards,
        all the gradient memory a rank holds."""
        buffers = [*self._buckets.values(), *(b for _, _, b, _ in self._flight)]
        scratch = [into for bi, _, _, into in self._flight if into is not self.outputs[bi]]
        return sum(t.numel() * t.element_size() for t in buffers + scratch)

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
        self.shards.finish()
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
        """The shards' gradients are zeroed in place (the params hold none); a hybrid plan's whole
        params' as torch zeroes them."""
        if self.whole:
            default()
        self.shards.zero_grads()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate the whole gradients (as ``DDP.no_sync``); the
        first backward after it reduces the sum: less traffic, the whole gradient in memory."""
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
                shards.wait(k)
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
