"""Flat plans (element-level ZeRO): executes a `zero.FlatLayout` (a plan made with ``strategy="flat"``).

Per buffer of the layout (one per param group, device and dtype) the trainable params become
views into one flat tensor. This rank's local optimizer steps one 1-D tensor per buffer: its
shard of it, itself a view, so the step writes straight into the params. Its gradient is a
shard-sized tensor, filled by the mode's `Gradients`: with the pieces of the params' gradients
that fall in the shard (DDP left them on every rank), or by a reduce-scatter
(`zero.backends.modes.reduce_scatter`). After the step one all-gather per buffer writes every
rank's shard into every replica, in place. State per rank is exactly the plan's: one set per
buffer, shaped like the shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zero.backends import clipping, comm
from zero.backends.consistency import wait_for
from zero.backends.modes.base import Begin, Mode, build_sharding
from zero.backends.modes.gradients import CopiedGradients, Gradients
from zero.backends.rank_state import RankState
from zero.backends.sync import ParamSync, ViewWatch
from zero.plans.holdings import LocalTensor
from zero.plans.layout import FlatBuffer, bucket_views
from zero.plans.meta import ParamMeta

__all__ = ["FlatShards"]

# Makes a flat mode's gradients from its flat buffers and this rank's shard of each.
MakeGradients = Callable[[list[torch.Tensor], list[torch.Tensor]], Gradients]


class FlatShards(Mode):
    """The flat buffers of the plan's layout, this rank's shard of each, and their sync; under a
    hybrid plan (`zero.plans.hybrid`) also the whole params, stepped by their owners and synced by
    their owners' rows (``rows``, a `ParamSync` over bucket views of the plan's partition, which
    holds the whole params only): per param group the local optimizer steps this rank's whole
    params, then its shards (`zero.plans.holdings`; a rule routing by rank, as Muon does, sends the
    matrices to Newton-Schulz and the 1-D shards to AdamW). Its gradients are DDP's, copied
    (`CopiedGradients`), or reduced in place of DDP (``gradients``: `ReducedGradients`, which sum
    each whole param's gradient into its owner during backward)."""

    def __init__(self, state: RankState, metas: list[ParamMeta], bucket_view: bool | None = None,
                 chunk_bytes: int = 16 * 2**20, gradients: MakeGradients | None = None):
        rows = ParamSync(state.params, bucket_views(metas, state.plan.partition), state.rank,
                         state.process_group, bucket_view, chunk_bytes) if state.plan.hybrid else None
        self.rows, self.metas, self.layout, rank = rows, metas, state.plan.flat, state.rank
        self.flats = [_flatten(state.params, b) for b in self.layout.buffers]
        self.shards = [f[rank * b.shard_numel:(rank + 1) * b.shard_numel].detach()
                       for f, b in zip(self.flats, self.layout.buffers)]
        self.heads = HeadViews(state.holdings.tensors, self.shards)
        made = (gradients or (lambda flats, shards: CopiedGradients(state, shards)))(self.flats, self.shards)
        super().__init__(state, made)
        self._pieces = [b.pieces(rank) for b in self.layout.buffers]
        self.wide: dict[int, torch.Tensor] = {}  # see take_grads
        self.storage = ViewWatch(self.params, [i for b in self.layout.buffers for i in b.params],
                                 comm.is_fake(state.process_group))
        if rows is not None:
            self.storage = self.storage.joined(rows.watch)
        self.sharding = build_sharding(state, self.tensor)
        if not made.scaler_sees_grads:  # the shards' reduced gradients are kept here: clip those
            clipping.register(self, [p for p, m in zip(self.params, metas) if m.requires_grad])

    def tensor(self, t: LocalTensor) -> torch.Tensor:
        if t.piece is not None:
            return self.heads.view(t)
        return self.params[t.param] if t.whole else self.shards[t.buffer]  # whole: a hybrid plan's

    def step(self, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        verify = begin()
        loss = None
        if closure is not None:  # the shards' gradients are copies: take them after the closure ran
            with torch.enable_grad():
                loss = closure()
        try:
            self.take_grads(self.state.masters.dtype)
            out = self.state.run(self.sharding, grads=self.wide, **self.state.with_loss(kwargs, loss))
        finally:
            self.clear_grads()
        verify()  # before any param moves: ranks that diverged get a ValueError, not mismatched collectives
        self.state.stepped()
        self.sync()
        return loss if loss is not None else out

    def take_grads(self, master_dtype: torch.dtype | None) -> None:
        """Give each shard (and owned whole param) its gradient (``self.wide``: those kept wider
        than their tensor's dtype, for its master)."""
        got = self.gradients.settled()
        if got is None:
            self.load_grads()
            self.wide = {}
            self.heads.take_grads(self.wide)
            return
        self.gradients.end()
        outputs, kept = got
        self.wide = self.use_reduced_grads(master_dtype, outputs)
        for i, grad in kept.items():  # as their .grad until the step ends, or straight to their masters
            p = self.params[i]
            grad = grad.view_as(p)
            if grad.dtype == p.dtype:
                p.grad = grad
            elif grad.dtype == master_dtype:
                self.wide[id(p)] = grad
            else:
                p.grad = grad.to(p.dtype)
        self.heads.take_grads(self.wide)

    def retrain(self, metas: list[ParamMeta]) -> None:
        raise ValueError("params were frozen or unfrozen after building a flat plan's optimizer; a flat "
                         "plan packs the trainable params at construction: build the optimizer again "
                         "(moving its state_dict), or use a whole-param plan")

    def check_extendable(self) -> None:
        raise ValueError("add_param_group cannot extend a flat plan (its buffers would be packed again): "
                         "build the optimizer with every group, or use a whole-param plan")

    @torch.no_grad()
    def load_grads(self) -> None:
        """Give each shard the gradient pieces that fall in it (None where its buffer has none)."""
        for shard, grad, buf, pieces in zip(self.shards, self.gradients.outputs, self.layout.buffers, self._pieces):
            have = [self.params[i].grad is not None for i in buf.params]
            if not any(have):
                shard.grad = None
                continue
            if not all(have):
                missing = self.metas[buf.params[have.index(False)]].name
                raise ValueError(f"param {missing} has no gradient but others in its flat buffer (param group "
                                 f"{buf.group}, {buf.dtype}) do: a flat plan steps whole buffers. Give it a "
                                 "gradient (e.g. zero_grad(set_to_none=False)), freeze it before building the "
                                 "optimizer, or use a whole-param plan")
            if pieces:
                src = [self.params[p.param].grad.reshape(-1)[p.start:p.end] for p in pieces]
                torch._foreach_copy_([grad[p.offset:p.offset + p.end - p.start] for p in pieces], src)
            shard.grad = grad

    def use_reduced_grads(self, master_dtype: torch.dtype | None, grads: list[torch.Tensor],
                          only: int | None = None) -> dict[int, torch.Tensor]:
        """Step the shards (or shard ``only``) with their reduce-scattered ``grads``. A gradient in
        another dtype than its shard's (``reduce_dtype``) goes to the shard's master as it is when
        it has the master's dtype (returned, by ``id(shard)``), else is cast to the shard's."""
        wide = {}
        for k, (shard, grad) in enumerate(zip(self.shards, grads)):
            if only is not None and k != only:
                shard.grad = None
            elif grad.dtype == shard.dtype:
                shard.grad = grad
            elif grad.dtype == master_dtype:
                shard.grad, wide[id(shard)] = None, grad
            else:
                shard.grad = grad.to(shard.dtype)
        return wide

    def clear_grads(self) -> None:
        """After a step: the shards hold no gradient, and the wider ones kept for masters go."""
        for shard in self.shards:
            shard.grad = None
        self.heads.clear_grads()
        self.wide = {}
        if not self.gradients.scaler_sees_grads:  # reduced: whole params' means stay kept until zero_grad
            for i in self.plan.whole:
                self.params[i].grad = None

    def sync_params(self) -> None:
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """The whole params by their owners' rows, then one all-gather per buffer: every rank's
        shard into every replica, in place."""
        if self.rows is not None:
            self.rows.sync()
        for k in range(len(self.flats)):
            for work in self.start_sync(k):
                wait_for(work, self.state.process_group, "the params' all-gather")

    def start_sync(self, k: int, async_op: bool = True) -> list[Any]:
        """Start buffer ``k``'s all-gather; returns the works to wait on."""
        rows = self.flats[k].view(self.layout.world_size, self.layout.buffers[k].shard_numel)
        return comm.all_gather_rows(rows, self.state.rank, self.state.process_group, async_op)


class HeadViews:
    """A head buffer's shard (`zero.plans.layout.FlatBuffer.head`) as the local optimizer steps it:
    a view of each param's whole heads in it, in the param's shape with only those rows (so the
    rule reads them as heads of that param, by its name), given the rows of the shard's gradient."""

    def __init__(self, tensors: tuple[LocalTensor, ...], shards: list[torch.Tensor]):
        # per (buffer, param): the view, its shard, and where it lies in the shard
        self.held = {(t.buffer, t.piece): (shards[t.buffer][t.offset:t.offset + t.numel].view(t.shape),
                                           shards[t.buffer], t.offset, t.offset + t.numel)
                     for t in tensors if t.piece is not None}

    def view(self, t: LocalTensor) -> torch.Tensor:
        return self.held[t.buffer, t.piece][0]

    def take_grads(self, wide: dict[int, torch.Tensor]) -> None:
        """Each view's gradient: the rows of its shard's (or, into ``wide``, of the wider one kept
        by the shard's ``id`` for masters)."""
        for view, shard, start, end in self.held.values():
            view.grad = None if shard.grad is None else shard.grad[start:end].view_as(view)
            if id(shard) in wide:
                wide[id(view)] = wide[id(shard)][start:end].view_as(view)

    def clear_grads(self) -> None:
        for view, *_ in self.held.values():
            view.grad = None


def _flatten(params: list[torch.Tensor], buf: FlatBuffer) -> torch.Tensor:
    """``buf``'s flat tensor, its params' values copied in and each param made a view into it."""
    example = params[buf.params[0]]
    flat = torch.zeros(buf.padded_numel, dtype=example.dtype, device=example.device)
    with torch.no_grad():
        for i, off in zip(buf.params, buf.offsets):
            p = params[i]
            view = flat[off:off + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
    return flat
