"""The optimizer step inside DDP's gradient communication (``overlap_with_ddp=True``).

`hook_with_zero_step` wraps a DDP comm hook: when a bucket's gradients are reduced, each rank
steps the params of that bucket it owns, while backward goes on with earlier layers; at the end
of backward the updated params are all-gathered. `hook_with_zero_step_interleaved` steps each
bucket on the backward thread as soon as its all-reduce is done and starts that bucket's param
broadcasts at once, interleaving them with the next buckets' all-reduces.

Ownership is per param, planned from DDP's bucket layout (`zero.plans.ddp_buckets.ddp_bucket_partition`)
when the hook is made, before the first backward: so the first iteration updates the params,
and when DDP rebuilds its buckets after it, ownership and state stay with the params (a rebuilt
bucket may hold params of several owners; each is stepped once, by its owner). The hook keeps
the optimizer, never the DDP model, so no reference cycle keeps DDP alive.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

from zero.backends import comm
from zero.backends.local_optimizer import is_functional, make_local_optimizer
from zero.functional import sharding
from zero.plans.ddp_buckets import ddp_bucket_partition

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved", "OverlapSteps"]


def hook_with_zero_step(hook: Callable, ddp: Any, zero: Any, shard_buckets: bool = False) -> Callable:
    """``hook`` (e.g. DDP's ``allreduce_hook``) followed, per bucket, by ``zero``'s step of the
    params of the bucket it owns; register the result with ``ddp.register_comm_hook(None, ...)``.

    ``zero`` is a `zero.ZeroRedundancyOptimizer` built with ``overlap_with_ddp=True`` over the
    same params as ``ddp``; ``shard_buckets`` splits each bucket over the ranks instead of giving
    whole buckets to ranks in turn. ``zero.step()`` in the loop is then a no-op.
    """
    return _as_function(_ZeroStepHook(hook, ddp, zero, shard_buckets, interleaved=False))


def hook_with_zero_step_interleaved(hook: Callable, ddp: Any, zero: Any, shard_buckets: bool = False) -> Callable:
    """As `hook_with_zero_step`, but each bucket is stepped as soon as it is reduced and its params
    are broadcast at once, interleaved with the later buckets' all-reduces."""
    return _as_function(_ZeroStepHook(hook, ddp, zero, shard_buckets, interleaved=True))


def _as_function(step_hook: _ZeroStepHook) -> Callable:
    """A plain function, as DDP wants its hooks (it reads their ``__name__`` and annotations)."""
    def zero_step_hook(state, bucket):
        return step_hook(state, bucket)

    return zero_step_hook


class _ZeroStepHook:
    def __init__(self, hook: Callable, ddp: Any, zero: Any, shard_buckets: bool, interleaved: bool):
        if not callable(hook):
            raise TypeError(f"hook must be a DDP comm hook (state, bucket) -> Future, got {hook!r}")
        if not getattr(zero, "_overlap", False):
            raise ValueError("the optimizer was built with overlap_with_ddp=False: build it with "
                             "overlap_with_ddp=True to step inside DDP's comm hook")
        _check_same_params(ddp, zero)
        zero._attach_to_ddp(ddp.bucket_bytes_cap / 2**20, bool(shard_buckets))
        self._hook, self._zero, self._interleaved = hook, zero, interleaved
        self._index = {id(p): i for i, p in enumerate(zero._all_params)}
        self._lock = threading.Lock()  # bucket callbacks may run on several communication threads
        self._works: list[Any] = []
        self._in_backward = False

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future:
        if torch._C._current_graph_task_id() == -1:
            return self._shadow(state, bucket)
        if not self._in_backward:  # the first bucket of this backward pass
            self._in_backward = True
            self._zero._push_hyperparams()
            Variable._execution_engine.queue_callback(self._end_of_backward)
        indices = [self._index[id(p)] for p in bucket.parameters()]
        fut = self._hook(state, bucket)
        if not self._interleaved:
            stepped = fut.then(lambda f: self._step(bucket, indices, f.value()))
            self._works.append(stepped)  # the end-of-backward callback may run before DDP waits for it
            return stepped
        fut.wait()
        self._step(bucket, indices, fut.value())
        self._works += self._zero._broadcast_params(indices)
        return fut

    def _shadow(self, state: Any, bucket: Any) -> torch.futures.Future:
        """Outside backward: a rank that ran out of inputs shadows DDP's all-reduces (``Join``). It
        still owns params: it steps them with the others' averaged gradients and takes part in
        the param sync, so every replica stays equal."""
        self._zero._push_hyperparams()
        indices = [self._index[id(p)] for p in bucket.parameters()]
        fut = self._hook(state, bucket)
        fut.wait()
        self._step(bucket, indices, fut.value())
        if self._interleaved:
            self._works += self._zero._broadcast_params(indices)
        if bucket.is_last():
            self._end_of_backward()
        return fut

    def _step(self, bucket: Any, indices: list[int], reduced: Any) -> torch.Tensor:
        reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
        with self._lock, torch.no_grad():
            if reduced is not bucket.buffer():  # a hook may return a new tensor (e.g. decompressed)
                bucket.buffer().copy_(reduced)
            self._zero._step_bucket(indices, bucket.gradients())
        return reduced

    def _end_of_backward(self) -> None:
        self._in_backward = False
        for work in self._works:
            work.wait()
        self._works = []
        self._zero._end_overlapped_step(synced=self._interleaved)


class OverlapSteps:
    """`ZeroRedundancyOptimizer`'s side of ``overlap_with_ddp=True``: what the hook calls on it."""

    def _attach_to_ddp(self, bucket_cap_mb: float, shard_buckets: bool) -> None:
        """Own params by DDP's buckets (before the first step), rebuilding the local optimizer."""
        if self._attached or self._steps:
            raise ValueError("this optimizer is already stepping inside a DDP comm hook (or has stepped): "
                             "register hook_with_zero_step once, before training")
        part = ddp_bucket_partition(self._metas, self.world_size, bucket_cap_mb, shard_buckets)
        self.plan = self.plan.with_partition(part)
        self._build_sync()
        self.optim = make_local_optimizer(self._optimizer_class, self._local_groups(), self._defaults, per_param=True)
        self._pull_hyperparams()
        self._rules = self._overlap_rules()
        self._attached = True

    def _overlap_rules(self) -> sharding.Sharding:
        def refuse(t: torch.Tensor) -> torch.Tensor:
            raise ValueError("this rule needs the whole model's gradients (a global norm, a finiteness check ...), "
                             "but overlap_with_ddp=True steps one DDP bucket at a time: use overlap_with_ddp=False")

        pieces = {id(p): sharding.Pieces((i,), (p.numel(),)) for i, p in self._stand_ins.items()}
        return sharding.Sharding(pieces, tuple(p.dtype for p in self._all_params), refuse, every_group=False,
                                 numels=tuple(p.numel() for p in self._all_params))

    def _step_bucket(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        """Step the params of one reduced DDP bucket that this rank owns."""
        mine = [(self._stand_ins[i], g) for i, g in zip(indices, grads)
                if i in self._stand_ins and self._all_params[i].requires_grad]
        if not mine:
            return
        for stand_in, g in mine:
            stand_in.grad = g.view_as(stand_in)
        try:
            rules = sharding.installed(self._rules) if is_functional(self.optim) else contextlib.nullcontext()
            with rules:
                self.optim.step()
        finally:
            for stand_in, _ in mine:
                stand_in.grad = None

    def _broadcast_params(self, indices: list[int]) -> list[Any]:
        """Start sending each trainable param of a bucket from its owner (interleaved hook)."""
        owner = self.plan.partition.owner
        return [comm.broadcast_from(self._all_params[i].data, owner[i], self.process_group, async_op=True)
                for i in indices if self._all_params[i].requires_grad]

    def _end_overlapped_step(self, synced: bool) -> None:
        if self._trainability_changed():
            raise ValueError("params were frozen or unfrozen after the comm hook was registered: with "
                             "overlap_with_ddp=True build the optimizer and the hook again")
        if not synced:
            self._sync.sync()
        self._steps += 1

    def _overlapped_step(self, closure: Callable[[], float] | None) -> float | None:
        """With overlap_with_ddp the step ran inside backward: only a closure (which runs backward) is left."""
        if not self._attached:
            raise RuntimeError("overlap_with_ddp=True: register zero.backends.hook_with_zero_step(hook, ddp, "
                               "optimizer) on the DDP model before training; the step then runs inside backward")
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()



def _check_same_params(ddp: Any, zero: Any) -> None:
    module = getattr(ddp, "module", None)
    if module is None or not hasattr(ddp, "register_comm_hook"):
        raise TypeError(f"ddp must be a DistributedDataParallel model, got {type(ddp).__name__}")
    theirs = {id(p) for p in module.parameters() if p.requires_grad}
    ours = {id(p) for p in zero._all_params if p.requires_grad}
    if theirs != ours:
        extra, missing = len(theirs - ours), len(ours - theirs)
        raise ValueError(f"the DDP model's trainable params differ from the optimizer's ({extra} only in the model, "
                         f"{missing} only in the optimizer): build the optimizer over ddp.module.parameters()")
