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
``IN_FLIGHT`` being reduced, never the whole gradient. A hybrid plan's whole params are units of
their own: each one's gradient is summed into its owner as soon as it is made, the owner keeps
the mean and the other ranks drop theirs. Units start in the plan's order on every rank
(`zero.plans.layout.reduction_units`, the order backward completes them), so every rank issues
the same collectives in the same order.

Each backward pass reduces its gradients and the shards accumulate them, averaged, as DDP's
``.grad`` accumulates over micro-batches; inside `GradShards.no_sync` the buckets accumulate
instead and the first backward after it reduces their sum (one reduce-scatter per bucket for
all micro-batches, but the whole gradient in memory meanwhile).
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from zero.backends import clipping, comm
from zero.backends.consistency import wait_for
from zero.backends.local_optimizer import is_functional
from zero.backends.modes.base import Begin
from zero.backends.modes.flat import FlatShards, Gradients
from zero.backends.nonfinite import l1_norm
from zero.backends.rank_state import RankState
from zero.plans.layout import IN_FLIGHT_BUCKETS, FlatLayout, reduction_units
from zero.plans.meta import ParamMeta

__all__ = ["GradShards", "ReducedGradients", "ReduceScatteredShards", "no_gradient", "after_settle", "IN_FLIGHT"]

IN_FLIGHT = IN_FLIGHT_BUCKETS  # buckets being reduced at once; one more waits for the oldest (memory, not speed)


class GradShards:
    """Per reduction unit of the plan (`zero.plans.layout.reduction_units`), its gradients reduced
    as soon as the unit is complete, in the plan's order: a flat buffer (a bucket) reduce-scattered
    into this rank's shard of the mean (``outputs``, accumulated), a hybrid plan's whole param
    summed into its owner, who keeps the mean (``kept``, by param; accumulated)."""

    def __init__(self, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], layout: FlatLayout,
                 outputs: Sequence[torch.Tensor], group: Any, whole: Sequence[int] = (), owner: Sequence[int] = (),
                 rank: int = 0, reduce_dtype: torch.dtype | None = None, find_unused: bool = False):
        self.params, self.metas, self.layout, self.outputs, self.group = list(params), metas, layout, outputs, group
        self.find_unused = find_unused  # DDP's find_unused_parameters: a param without a gradient counts as zeros
        self._check = not comm.is_fake(group)  # a simulated rank's gradients hold no values to check
        self.whole = tuple(whole)
        self.owner, self.rank, self.world = owner, rank, layout.world_size
        self.units = reduction_units(layout, whole)
        self._where: dict[int, tuple[int, int, int]] = {}  # id(param) -> (param, unit, offset in its bucket)
        # per unit: its bucket's dtype, its params, its elements (padded), its elements before the padding
        self._dtype, self._size, self._numel, self._used = [], [], [], []
        self._written: dict[int, set[int]] = {}  # flat unit -> the params whose gradient its bucket holds
        for u, (kind, k) in enumerate(self.units):
            members = zip(layout.buffers[k].params, layout.buffers[k].offsets) if kind == "flat" else [(k, 0)]
            self._where.update({id(self.params[i]): (i, u, off) for i, off in members})
            flat = kind == "flat"
            self._dtype.append(outputs[k].dtype if flat else reduce_dtype or self.params[k].dtype)
            self._size.append(len(layout.buffers[k].params) if flat else 1)
            self._numel.append(layout.buffers[k].padded_numel if flat else self.params[k].numel())
            self._used.append(layout.buffers[k].numel if flat else self.params[k].numel())
        self._hooks = [self.params[i].register_post_accumulate_grad_hook(self._ready)
                       for i, _, _ in self._where.values()]
        self._syncing = True
        self._told = False
        self._flight: collections.deque = collections.deque()
        self.zero_grads()

    def zero_grads(self) -> None:
        """Zero the shards, drop the kept gradients and every bucket (an iteration that failed half
        way too); the params keep no gradient."""
        self._drain(suppress=True)
        self._buckets: dict[int, torch.Tensor] = {}  # unit -> its whole-size buffer, while it fills
        self._fresh = [True] * len(self.outputs)  # the shard holds nothing yet: a reduction writes into it
        self.kept: dict[int, torch.Tensor] = {}  # whole param -> its mean gradient (its owner's), flat
        self._reduced = False  # a backward's gradients reduced since the last step
        self._flagged = False  # find_unused: the params no rank reached found, this iteration
        self._settled = False  # every reduction waited for (`settle`) and no step since
        self._reached: set[int] = set()  # params some backward reached since zero_grad (find_unused)
        self._norms: list[torch.Tensor] = []  # of each bucket of this rank's own gradients reduced, since the step
        self.unused_everywhere: set[int] = set()  # find_unused: params no backward reached on any rank
        self._new_round()
        with torch.no_grad():
            for out in self.outputs:
                out.zero_()
        for i, _, _ in self._where.values():
            self.params[i].grad = None

    def _new_round(self) -> None:
        self._seen = [set() for _ in self.units]
        self._next = 0  # the next unit to reduce in this backward pass (every rank in the plan's order)

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
            if self.find_unused:  # they count as zeros: reduce what it left, then this backward's
                self._finish_round()
            else:
                missing = self._missing(self._next)
                self._new_round()
                raise no_gradient(self.metas[missing].name)
        self._add(u, i, off, param)
        if not self._syncing:
            return
        self._seen[u].add(i)
        self._reached.add(i)
        while self._next < len(self.units) and self._complete(self._next):
            self._start(self._next)
            self._next += 1
        if self._next == len(self.units):
            self._new_round()

    def _add(self, u: int, i: int, off: int, param: torch.Tensor) -> None:
        """Add param ``i``'s gradient into unit ``u``'s bucket and free the param's own. A bucket is
        made at its unit's first gradient: a whole param's is that gradient (cast to the reduce
        dtype), a flat buffer's is uninitialised but for its padding, each param's region copied
        at its first gradient and added to after (``no_sync``)."""
        grad, bucket = param.grad.reshape(-1), self._buckets.get(u)
        param.grad = None  # ZeRO-2: the bucket holds it until its reduction; the shard (or owner) after
        if self.units[u][0] == "whole":
            if bucket is None:
                self._buckets[u] = grad if grad.dtype == self._dtype[u] else grad.to(self._dtype[u])
            else:
                bucket.add_(grad)
            return
        if bucket is None:
            bucket = self._buckets[u] = torch.empty(self._numel[u], dtype=self._dtype[u], device=grad.device)
            bucket[self._used[u]:].zero_()
            self._written[u] = set()
        region = bucket[off:off + grad.numel()]
        if i in self._written[u]:
            region.add_(grad)
        else:
            region.copy_(grad)
            self._written[u].add(i)

    def _complete(self, u: int) -> bool:
        return len(self._seen[u]) == self._size[u]

    def _members(self, u: int) -> tuple[int, ...]:
        kind, k = self.units[u]
        return self.layout.buffers[k].params if kind == "flat" else (k,)

    def _missing(self, u: int) -> int:
        return next(i for v in range(u, len(self.units)) for i in self._members(v) if i not in self._seen[v])

    def _start(self, u: int) -> None:
        bucket = self._buckets.pop(u)  # complete: every param of it added its gradient
        if self._check:
            self._norms.append(l1_norm(bucket))  # NaN or inf where this rank's own gradients hold one
        kind, k = self.units[u]
        if kind == "whole":  # summed into the owner's bucket, in place
            self._flight.append((u, comm.reduce_sum_to(bucket, self.owner[k], self.group), bucket, bucket))
        else:
            into = self.outputs[k] if self._fresh[k] else torch.empty_like(self.outputs[k])
            self._fresh[k] = False
            self._flight.append((u, comm.reduce_scatter_sum(into, bucket, self.group), bucket, into))
        while len(self._flight) > IN_FLIGHT:
            self._land()

    def _land(self) -> None:
        """Wait for the oldest reduction in flight and add its mean into its shard (or its owner's
        kept gradient)."""
        u, work, _, into = self._flight.popleft()
        # Gloo's reduce-scatter copies its result into the output on wait(): wait exactly once.
        kind, k = self.units[u]
        wait_for(work, self.group, "the gradients' reduce-scatter" if kind == "flat" else
                 f"the gradient's reduce to its owner (param {self.metas[k].name})")
        if kind == "whole":
            if self.owner[k] == self.rank:
                kept = self.kept.get(k)
                self.kept[k] = into.div_(self.world) if kept is None else kept.add_(into, alpha=1 / self.world)
        elif into is self.outputs[k]:
            into.div_(self.world)
        else:
            self.outputs[k].add_(into, alpha=1 / self.world)
        self._reduced = True

    def _drain(self, suppress: bool = False) -> None:
        while self._flight:
            if not suppress:
                self._land()
                continue
            _, work, _, _ = self._flight.popleft()
            with contextlib.suppress(RuntimeError):  # its failure, if any, was the error raised already
                work.wait()

    def settle(self) -> None:
        """Start the reductions backward did not, wait for all: ``outputs`` are then this rank's
        shards of the mean gradient, ``kept`` its whole params' (accumulated over the backward
        passes since the last ``zero_grad``), to step or clip. Until the step, a backward is an error."""
        self.start_rest()
        self._drain()
        for k in self.unused_everywhere & set(self.kept):  # no rank reached it: no gradient, as in DDP
            del self.kept[k]
        self._settled = True

    def finish(self) -> None:
        """`settle`, then the iteration ends (the step takes the gradients)."""
        self.settle()
        self.end_iteration()

    def start_rest(self) -> None:
        """Start, in order, the reductions backward did not: every param must have its gradient
        (or, with ``find_unused``, counts as zeros), and some backward must have run since the last step."""
        idle = self._next == 0 and not any(self._seen)
        if idle and not (self._reduced or self._flight or not self.units) and not self.find_unused:
            self.end_iteration()
            raise no_gradient(self.metas[self._members(0)[0]].name)
        if not idle or not (self._reduced or self._flight):
            self._finish_round()
        self._new_round()
        if self.find_unused and not self._flagged:
            self._unused_everywhere()
            self._flagged = True

    def start_pending(self) -> None:
        """With ``find_unused``: start the units the last backward left incomplete (zeros for its
        missing params), before any other collective of the step (its check-in), in order."""
        if self.find_unused and self._syncing and (self._next or any(self._seen)):
            self._finish_round()

    def _finish_round(self) -> None:
        """Start the units of this round not started yet, in order; an incomplete one is an error
        naming its first missing param, or with ``find_unused`` has zeros for them."""
        for u in range(self._next, len(self.units)):
            if not self._complete(u):
                if not self.find_unused:
                    missing = self._missing(u)
                    self.end_iteration()
                    raise no_gradient(self.metas[missing].name)
                self._zeros_for_unused(u)
            self._start(u)
        self._new_round()

    @torch.no_grad()
    def _zeros_for_unused(self, u: int) -> None:
        """The params of unit ``u`` this backward did not reach count as zeros (DDP's
        ``find_unused_parameters``): their regions of the bucket, or a whole param's bucket."""
        kind, k = self.units[u]
        for i in self._members(u):
            if i in self._seen[u]:
                continue
            if kind == "whole":
                self._buckets[u] = torch.zeros(self._numel[u], dtype=self._dtype[u], device=self.params[i].device)
            else:
                bucket = self._buckets.get(u)
                if bucket is None:
                    bucket = self._buckets[u] = torch.zeros(self._numel[u], dtype=self._dtype[u],
                                                            device=self.outputs[k].device)
                    self._written[u] = set()
                off = self.layout.buffers[k].offsets[self.layout.buffers[k].params.index(i)]
                bucket[off:off + self.params[i].numel()].zero_()
                self._written[u].add(i)
            self._seen[u].add(i)

    def _unused_everywhere(self) -> None:
        """After every reduction has started (the same collectives in the same order on every rank):
        one all-reduce of which params each rank reached, as DDP does with find_unused_parameters.
        A whole param no rank reached keeps no gradient, so its owner does not step it (as torch's
        optimizers skip a ``None`` gradient); a flat shard steps as one tensor, so a param in one
        that no rank reached steps with a zero gradient: said once, by name."""
        members = [i for u in range(len(self.units)) for i in self._members(u)]
        reached = torch.zeros(len(self.params), dtype=torch.float32, device=self.outputs[0].device
                              if self.outputs else torch.device("cpu"))
        reached[sorted(self._reached)] = 1.0
        comm.all_reduce_max(reached, self.group)
        self.unused_everywhere = {i for i in members if reached[i] == 0}
        flat = sorted(i for i in self.unused_everywhere if i not in set(self.whole))
        if flat and not self._told:
            self._told = True
            names = ", ".join(self.metas[i].name for i in flat[:5]) + (" ..." if len(flat) > 5 else "")
            warnings.warn(f"{len(flat)} params got no gradient on any rank in this iteration ({names}): they sit in "
                          "flat shards, which step as one tensor, so they step with a zero gradient (their "
                          "momentum and weight decay go on), where DDP(find_unused_parameters=True) + torch would "
                          "leave them alone. Keep such params whole (a hybrid plan's whole=) for DDP's behaviour. "
                          "Said once.", stacklevel=2)

    @property
    def idle(self) -> bool:
        """No reduction started and not landed, no bucket filling: the shards hold all there is."""
        return not self._flight and not self._buckets and self._next == 0 and not any(self._seen)

    def local_nonfinite(self) -> bool:
        """Whether this rank's own gradients, in the buckets reduced since the last step, held
        NaN or inf (read once a step: the next step's start afresh)."""
        norms, self._norms = self._norms, []
        return bool(norms) and not bool(torch.isfinite(torch.stack([n.double().cpu() for n in norms]).sum()))

    def wait(self, bi: int) -> None:
        """Wait for flat buffer ``bi``'s reductions (after `start_rest`); its shard is then the mean."""
        while any(self.units[u] == ("flat", bi) for u, *_ in self._flight):
            self._land()

    def end_iteration(self) -> None:
        """After a step (or an error): the next backward starts a new round, and must run before
        the next step."""
        self._drain(suppress=True)
        self._new_round()
        self._reached = set()
        self._reduced = self._settled = self._flagged = False

    def held_bytes(self) -> int:
        """Bytes of whole-size buckets held now (filling, or being reduced, with their scratch
        outputs): with the shards and ``kept``, all the gradient memory a rank holds."""
        buffers = [*self._buckets.values(), *(b for _, _, b, _ in self._flight)]
        scratch = [into for _, _, b, into in self._flight if into is not b and not any(into is o for o in self.outputs)]
        return sum(t.numel() * t.element_size() for t in buffers + scratch)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class ReducedGradients(Gradients):
    """Gradients averaged here, in place of DDP, by `GradShards` during backward: the shards'
    reduce-scattered, and a hybrid plan's whole params' each summed into its owner, who keeps it
    (the other ranks drop theirs).

    Params start from rank 0's (as DDP's do). Until the first step, a DDP model around these
    params is a ``ValueError`` at its forward: it would all-reduce the gradients a second time.
    """

    scaler_sees_grads = False  # a rank holds only its shards' reduced gradients

    def __init__(self, mode: FlatShards, reduce_dtype: torch.dtype | None = None, find_unused: bool = False):
        params, metas, group, plan = mode.params, mode.metas, mode.group, mode.plan
        self.whole = plan.whole
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
        self.shards = GradShards(params, metas, plan.flat, mode.grads, group, plan.whole,
                                 plan.partition.owner if plan.whole else (), mode.rank, reduce_dtype, find_unused)
        clipping.register(mode, [p for p, m in zip(params, metas) if m.requires_grad])
        self.ddp_watch = register_module_forward_pre_hook(_refuse_ddp({id(p) for p in params}))
        weakref.finalize(self, self.ddp_watch.remove)  # an optimizer dropped before stepping leaves no hook

    @property
    def kept(self) -> dict[int, torch.Tensor]:
        """The mean gradients of the whole params this rank owns (flat), by param."""
        return self.shards.kept

    def start_pending(self) -> None:
        self.shards.start_pending()

    def settle(self, mode: FlatShards) -> None:
        """Every reduction of the iteration waited for: the shards hold their means, each whole
        param's owner its mean (`GradShards.settle`)."""
        self.ddp_watch.remove()
        self.shards.settle()

    def reduced(self, mode: FlatShards) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The gradients this rank steps, settled, each beside the tensor it steps: the shards'
        and its whole params' (`zero.backends.clipping` clips them)."""
        self.settle(mode)
        return [*zip(mode.shards, mode.grads), *((mode.params[i], g) for i, g in self.kept.items())]

    def take(self, mode: FlatShards, master_dtype: torch.dtype | None) -> dict[int, torch.Tensor]:
        """The shards' means, then the whole params' this rank owns (as their ``.grad`` until the
        step ends, or straight to their masters when in the masters' dtype)."""
        self.settle(mode)
        self.shards.end_iteration()
        wide = mode.use_reduced_grads(master_dtype)
        for i, grad in self.kept.items():
            p = mode.params[i]
            grad = grad.view_as(p)
            if grad.dtype == p.dtype:
                p.grad = grad
            elif grad.dtype == master_dtype:  # straight to the master, as the shards' (use_reduced_grads)
                wide[id(p)] = grad
            else:
                p.grad = grad.to(p.dtype)
        return wide

    def clear(self, mode: FlatShards) -> None:
        """After the step: the whole params hold no ``.grad`` (their means stay kept until
        ``zero_grad``, as the shards' do, so a backward without it accumulates, as DDP's would)."""
        for i in self.whole:
            mode.params[i].grad = None

    def end(self) -> None:
        """After a step that took the shards' gradients itself (pipelined), or an error."""
        self.shards.end_iteration()

    def zero_grad(self, default: Callable[[], None]) -> None:
        """The shards' gradients are zeroed in place and the kept ones dropped (the params hold
        none); a hybrid plan's whole params' as torch zeroes them."""
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
                                  "the gradients' reductions too; use DDP + Join for uneven inputs")

    checks_local = True  # each rank checks its own gradients as their buckets are reduced

    def local_nonfinite(self, mode: FlatShards) -> bool:
        return self.shards.local_nonfinite()

    def pieces(self, mode: FlatShards) -> list[tuple[int, torch.Tensor]]:
        """The averaged gradients this rank steps, by the pieces of params in them (reductions
        still in flight waited for first; after the step they are where it took them)."""
        if not self.shards.idle:
            self.settle(mode)
        held, out = mode.holdings, []
        for h in held.held:
            t = held.tensors[h.local]
            if not t.whole:
                out.append((h.param, mode.grads[t.buffer][h.offset:h.offset + h.end - h.start]))
            elif h.param in self.kept:
                out.append((h.param, self.kept[h.param].reshape(-1)[h.start:h.end]))
        return out


class ReduceScatteredShards(FlatShards):
    """A flat plan with ``reduce_scatter_grads=True``: DDP's place is taken by `ReducedGradients`.

    With an element-wise ``torch.optim`` rule the step is pipelined buffer by buffer with the
    all-gathers.
    """

    def __init__(self, state: RankState, metas: list[ParamMeta], reduce_dtype: torch.dtype | None = None,
                 find_unused: bool = False):
        super().__init__(state, metas, lambda mode: ReducedGradients(mode, reduce_dtype, find_unused))

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
            settings = state.settings()
            for k in range(len(self.shards)):
                shards.wait(k)
                if k:
                    state.rewind(settings)
                state.run(self.sharding, grads=self.use_reduced_grads(state.masters.dtype, only=k))
                if k == 0:
                    verify()
                works += self.start_sync(k)
            state.stepped()
        finally:
            self.gradients.end()
            self.clear_grads()
        for work in works:
            wait_for(work, self.group, "the params' all-gather")


def no_gradient(name: str) -> ValueError:
    return ValueError(f"param {name} got no gradient in this iteration: with reduce_scatter_grads=True every "
                      "trainable param needs one (as DDP without find_unused_parameters): pass "
                      "find_unused_parameters=True if some params sit out some iterations (conditional compute, "
                      "experts), or freeze it before building the optimizer")


def after_settle(name: str) -> ValueError:
    return ValueError(f"a backward pass reached param {name} after the gradients were clipped or unscaled, before "
                      "the step: they were reduced already, and this backward's would be lost. Clip (or unscale_) "
                      "after the last backward of the iteration, then step")


def _refuse_ddp(ids: set[int]) -> Callable:
    """A global forward pre-hook: ``ValueError`` when a DDP model over any of these params runs."""
    def hook(module: nn.Module, args: Any) -> None:
        if isinstance(module, DistributedDataParallel) and any(id(p) in ids for p in module.module.parameters()):
            raise ValueError("reduce_scatter_grads=True averages the gradients itself, but these params are also in a "
                             "DistributedDataParallel model, which would all-reduce them again (the gradients would "
                             "cross the network twice): run the bare model (ddp.module), or keep DDP and drop "
                             "reduce_scatter_grads")

    return hook
