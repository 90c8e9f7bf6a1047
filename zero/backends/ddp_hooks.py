"""DDP comm hooks that step a `ZeroRedundancyOptimizer` inside backward (``overlap_with_ddp=True``).

`hook_with_zero_step` wraps a DDP comm hook: when a bucket's gradients are reduced, each rank
steps the params of that bucket it owns, while backward goes on with earlier layers; at the end
of backward the updated params are all-gathered. `hook_with_zero_step_interleaved` steps each
bucket on the backward thread as soon as its all-reduce is done and starts that bucket's param
broadcasts at once, interleaving them with the next buckets' all-reduces.

Ownership is per param, planned from DDP's bucket layout (`zero.plans.ddp_buckets.ddp_bucket_partition`)
when the hook is made, before the first backward: so the first iteration updates the params,
and when DDP rebuilds its buckets after it, ownership and state stay with the params (a rebuilt
bucket may hold params of several owners; each is stepped once, by its owner). The hook keeps
the optimizer's mode (`zero.backends.modes.DDPOverlap`, which steps the optimizer's
`RankState`), never the DDP model, so no reference cycle keeps DDP alive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

from zero.backends.consistency import wait_for
from zero.backends.modes import DDPOverlap

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]


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
        mode = getattr(zero, "mode", None)
        if not isinstance(mode, DDPOverlap):
            raise ValueError("the optimizer was built with overlap_with_ddp=False: build it with "
                             "overlap_with_ddp=True to step inside DDP's comm hook")
        _check_same_params(ddp, mode.params)
        mode.attach(ddp.bucket_bytes_cap / 2**20, bool(shard_buckets), getattr(zero, "nonfinite", None))
        self._hook, self._mode, self._interleaved = hook, mode, interleaved
        self._index = {id(p): i for i, p in enumerate(mode.params)}
        self._lock = threading.Lock()  # bucket callbacks may run on several communication threads
        self._works: list[Any] = []
        self._in_backward = False

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future:
        if torch._C._current_graph_task_id() == -1:
            return self._shadow(state, bucket)
        if not self._in_backward:  # the first bucket of this backward pass
            self._in_backward = True
            self._mode.state.push()
            Variable._execution_engine.queue_callback(self._end_of_backward)
        indices = [self._index[id(p)] for p in bucket.parameters()]
        fut = self._hook(state, bucket)
        if not self._interleaved:
            stepped = fut.then(lambda f: self._step(bucket, indices, f.value()))
            self._works.append(stepped)  # the end-of-backward callback may run before DDP waits for it
            return stepped
        fut.wait()
        self._step(bucket, indices, fut.value())
        self._works += self._mode.broadcast(indices)
        return fut

    def _shadow(self, state: Any, bucket: Any) -> torch.futures.Future:
        """Outside backward: a rank that ran out of inputs shadows DDP's all-reduces (``Join``). It
        still owns params: it steps them with the others' averaged gradients and takes part in
        the param sync, so every replica stays equal."""
        self._mode.state.push()
        indices = [self._index[id(p)] for p in bucket.parameters()]
        fut = self._hook(state, bucket)
        fut.wait()
        self._step(bucket, indices, fut.value())
        if self._interleaved:
            self._works += self._mode.broadcast(indices)
        if bucket.is_last():
            self._end_of_backward()
        return fut

    def _step(self, bucket: Any, indices: list[int], reduced: Any) -> torch.Tensor:
        reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
        with self._lock, torch.no_grad():
            if reduced is not bucket.buffer():  # a hook may return a new tensor (e.g. decompressed)
                bucket.buffer().copy_(reduced)
            self._mode.step_bucket(indices, bucket.gradients())
        return reduced

    def _end_of_backward(self) -> None:
        self._in_backward = False
        for work in self._works:
            wait_for(work, self._mode.state.process_group, "a bucket's step and param broadcast")
        self._works = []
        self._mode.end_of_backward(synced=self._interleaved)


def _check_same_params(ddp: Any, params: list[torch.Tensor]) -> None:
    module = getattr(ddp, "module", None)
    if module is None or not hasattr(ddp, "register_comm_hook"):
        raise TypeError(f"ddp must be a DistributedDataParallel model, got {type(ddp).__name__}")
    theirs = {id(p) for p in module.parameters() if p.requires_grad}
    ours = {id(p) for p in params if p.requires_grad}
    if theirs != ours:
        extra, missing = len(theirs - ours), len(ours - theirs)
        raise ValueError(f"the DDP model's trainable params differ from the optimizer's ({extra} only in the model, "
                         f"{missing} only in the optimizer): build the optimizer over ddp.module.parameters()")
