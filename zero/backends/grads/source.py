"""The gradient source of ZeRO-2: a plan's gradients reduced during backward, in place of DDP.

DDP + ZeRO-1 moves about 3x the model per iteration: DDP all-reduces every gradient (2x), then
the optimizer all-gathers the updated params (1x). But a rank steps only its shard, so it needs
only its shard of the averaged gradients: one reduce-scatter (1x), and the iteration moves 2x,
as plain DDP does. And it needs to keep only that shard: ZeRO-2's memory.

A post-accumulate-grad hook hands each param's gradient to the `BucketEngine` (its unit's
bucket) and frees the param's own. Units start in the plan's order on every rank
(`zero.plans.layout.reduction_units`, the order backward completes them), each as soon as it is
complete, so every rank issues the same collectives in the same order; `settle` starts the rest
and lands everything. Each backward pass reduces its gradients and the shards accumulate them,
averaged, as DDP's ``.grad`` accumulates over micro-batches; inside `no_sync` the buckets
accumulate instead and the first backward after it reduces their sum. With ``find_unused`` a
param a backward did not reach counts as zeros (`zero.backends.grads.unused`).

The mode reads what the source hands it once settled: ``outputs`` (this rank's shard of each
flat buffer's mean) and ``kept`` (the whole params it owns, their means).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.backends.grads.engine import BucketEngine, Unit
from zero.backends.grads.unused import Unused
from zero.plans.layout import FlatLayout, reduction_units
from zero.plans.meta import ParamMeta

__all__ = ["GradientSource", "no_gradient", "after_settle"]


class GradientSource:
    """The reduced gradients of ``params`` under ``layout`` (and a hybrid plan's ``whole`` params,
    each reduced to its ``owner``), by the ``reducer`` (default: `comm.MeanReducer`)."""

    def __init__(self, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], layout: FlatLayout, group: Any, *,
                 whole: Sequence[int] = (), owner: Sequence[int] = (), rank: int = 0,
                 reduce_dtype: torch.dtype | None = None, find_unused: bool = False,
                 reducer: comm.Reducer | None = None):
        self.params, self.metas = list(params), metas
        units = _units(self.params, layout, whole, reduce_dtype)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.engine = BucketEngine(units, layout, device, group, reducer or comm.MeanReducer(), owner, rank,
                                   check=not comm.is_fake(group), names=[m.name for m in metas])
        self.unused = Unused([m.name for m in metas], whole, group, device) if find_unused else None
        self._where = {id(self.params[i]): (i, u, off) for u, unit in enumerate(units) for i, off in unit.members}
        self._hooks = [self.params[i].register_post_accumulate_grad_hook(self._ready)
                       for i, _, _ in self._where.values()]
        self._syncing, self._settled = True, False
        self.zero_grads()

    @property
    def outputs(self) -> list[torch.Tensor]:
        """This rank's shard of each flat buffer's mean gradient (settled: see `settle`)."""
        return self.engine.outputs

    @property
    def kept(self) -> dict[int, torch.Tensor]:
        """The mean gradients of the whole params this rank owns (flat), by param."""
        return self.engine.kept

    def zero_grads(self) -> None:
        """Zero the shards, drop the kept gradients and every bucket; the params keep no gradient."""
        self.engine.reset()
        self._settled = False
        self.end_iteration()
        for i, _, _ in self._where.values():
            self.params[i].grad = None

    def _new_round(self) -> None:
        self._seen: list[set[int]] = [set() for _ in self.engine.units]
        self._next = 0  # the next unit to start in this backward pass (every rank in the plan's order)

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
        i, u, off = self._where[id(param)]
        if self._settled:
            raise after_settle(self.metas[i].name)
        if self._syncing and u < self._next:  # the last backward left some params without a gradient
            if self.unused is not None:  # they count as zeros: reduce what it left, then this backward's
                self._finish_round()
            else:
                missing = self._missing(self._next)
                self._new_round()
                raise no_gradient(self.metas[missing].name)
        self.engine.add(u, i, off, param.grad.reshape(-1))
        param.grad = None  # ZeRO-2: the bucket holds it until its reduction; the shard (or owner) after
        if not self._syncing:
            return
        self._seen[u].add(i)
        if self.unused is not None:
            self.unused.reached.add(i)
        units = self.engine.units
        while self._next < len(units) and len(self._seen[self._next]) == len(units[self._next].members):
            self.engine.start(self._next)
            self._next += 1
        if self._next == len(units):
            self._new_round()

    def _missing(self, u: int) -> int:
        units = self.engine.units
        return next(i for v in range(u, len(units)) for i, _ in units[v].members if i not in self._seen[v])

    def settle(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """Start the reductions backward did not, land all; returns ``outputs``, this rank's
        shards of the mean gradient, and ``kept``, its whole params' (accumulated over the
        backward passes since the last ``zero_grad``), to step or clip. Until the step, a backward
        is an error."""
        self.start_rest()
        self.engine.drain()
        kept = self.engine.kept
        for k in (self.unused.everywhere if self.unused else set()) & set(kept):
            del kept[k]  # no rank reached it: no gradient, as in DDP
        self._settled = True
        return self.engine.outputs, kept

    def start_rest(self) -> None:
        """Start, in order, the reductions backward did not: every param must have its gradient
        (or, with ``find_unused``, counts as zeros), and some backward must have run since the last step."""
        idle = self._next == 0 and not any(self._seen)
        reduced = self.engine.landed or self.engine.in_flight
        if idle and not (reduced or not self.engine.units) and self.unused is None:
            self.end_iteration()
            raise no_gradient(self.metas[self.engine.units[0].members[0][0]].name)
        if not idle or not reduced:
            self._finish_round()
        self._new_round()
        if self.unused is not None:
            self.unused.agree([i for unit in self.engine.units for i, _ in unit.members])

    def start_pending(self) -> None:
        """With ``find_unused``: start the units the last backward left incomplete (zeros for its
        missing params), before any other collective of the step (its check-in), in order."""
        if self.unused is not None and self._syncing and (self._next or any(self._seen)):
            self._finish_round()

    def _finish_round(self) -> None:
        """Start the units of this round not started yet, in order; an incomplete one is an error
        naming its first missing param, or with ``find_unused`` has zeros for them."""
        for u in range(self._next, len(self.engine.units)):
            for i, off in self.engine.units[u].members:
                if i in self._seen[u]:
                    continue
                if self.unused is None:
                    self.end_iteration()
                    raise no_gradient(self.metas[i].name)
                self.engine.zeros(u, i, off, self.params[i].numel(), self.params[i].device)
                self._seen[u].add(i)
            self.engine.start(u)
        self._new_round()

    @property
    def idle(self) -> bool:
        """No reduction started and not landed, no bucket filling: the shards hold all there is."""
        return not self.engine.busy and self._next == 0 and not any(self._seen)

    def end_iteration(self) -> None:
        """After a step (or an error): the next backward starts a new round, and must run before
        the next step."""
        self.engine.end()
        self._settled = False
        self._new_round()
        if self.unused is not None:
            self.unused.reset()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _units(params: list[torch.Tensor], layout: FlatLayout, whole: Sequence[int],
           reduce_dtype: torch.dtype | None) -> list[Unit]:
    """The plan's reduction units in its order, each with its params, dtype and sizes."""
    out = []
    for kind, k in reduction_units(layout, whole):
        if kind == "flat":
            b = layout.buffers[k]
            dtype = reduce_dtype or params[b.params[0]].dtype
            out.append(Unit(kind, k, tuple(zip(b.params, b.offsets)), dtype, b.padded_numel, b.numel))
        else:
            p = params[k]
            out.append(Unit(kind, k, ((k, 0),), reduce_dtype or p.dtype, p.numel(), p.numel()))
    return out


def no_gradient(name: str) -> ValueError:
    return ValueError(f"param {name} got no gradient in this iteration: with reduce_scatter_grads=True every "
                      "trainable param needs one (as DDP without find_unused_parameters): pass "
                      "find_unused_parameters=True if some params sit out some iterations (conditional compute, "
                      "experts), or freeze it before building the optimizer")


def after_settle(name: str) -> ValueError:
    return ValueError(f"a backward pass reached param {name} after the gradients were clipped or unscaled, before "
                      "the step: they were reduced already, and this backward's would be lost. Clip (or unscale_) "
                      "after the last backward of the iteration, then step")
