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

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.join import JoinHook

from zero.backends import comm
from zero.backends.consistency import wait_for
from zero.backends.modes.base import Begin, Mode, no_accumulation
from zero.backends.nonfinite import all_finite
from zero.backends.rank_state import RankState
from zero.backends.sync import ParamSync, ViewWatch
from zero.plans.holdings import LocalTensor
from zero.plans.layout import FlatBuffer, bucket_views
from zero.plans.meta import ParamMeta

__all__ = ["FlatShards", "Gradients", "CopiedGradients"]


class Gradients:
    """Where a flat mode's shards get their gradients, and what ``zero_grad``, ``no_sync`` and
    ``Join`` mean for them (one object per mode, chosen by it; it keeps no reference to the mode)."""

    scaler_sees_grads = True  # the params' .grad are the gradients stepped, as a GradScaler reads them
    outputs: list[torch.Tensor] | None = None  # the shards' gradients where these gradients own them (reduced)

    def take(self, mode: FlatShards, master_dtype: torch.dtype | None) -> dict[int, torch.Tensor]:
        """Give each of ``mode``'s shards (and whole params) the gradient it steps with; returns
        the gradients kept wider than their tensor's dtype, for its master (by ``id(tensor)``)."""
        raise NotImplementedError

    def reduced(self, mode: FlatShards) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """See `Mode.held_grads`: None where the params' ``.grad`` hold DDP's averaged gradients."""
        return None

    def clear(self, mode: FlatShards) -> None:
        """After a step: what the gradients leave on the params (by default, DDP's: untouched)."""

    def start_pending(self) -> None:
        """See `Mode.start_reductions` (nothing to start where DDP reduces)."""

    def zero_grad(self, default: Callable[[], None]) -> None:
        default()

    def no_sync(self) -> contextlib.AbstractContextManager:
        return no_accumulation()

    def check_join(self) -> None:
        """``NotImplementedError`` if a rank that ran out of inputs cannot shadow these gradients."""

    checks_local = False  # see `Mode.checks_local_grads`

    def pieces(self, mode: FlatShards) -> list[tuple[int, torch.Tensor]]:
        """See `Mode.grad_pieces` (by default: the params' ``.grad``, DDP's averages)."""
        return mode.param_grad_pieces()

    def local_nonfinite(self, mode: FlatShards) -> bool:
        """See `Mode.local_nonfinite`."""
        return not all_finite([g for _, g in self.pieces(mode)])


class CopiedGradients(Gradients):
    """The params' gradients, averaged by DDP on every rank: each shard gets copies of the pieces
    of them that fall in it; whole params (a hybrid plan's) step with their own."""

    def take(self, mode: FlatShards, master_dtype: torch.dtype | None) -> dict[int, torch.Tensor]:
        mode.load_grads()
        return {}


class FlatShards(Mode):
    """The flat buffers of the plan's layout, this rank's shard of each, and their sync; under a
    hybrid plan (`zero.plans.hybrid`) also the whole params, stepped by their owners and synced by
    their owners' rows (``rows``, a `ParamSync` over bucket views of the plan's partition, which
    holds the whole params only): per param group the local optimizer steps this rank's whole
    params, then its shards (`zero.plans.holdings`; a rule routing by rank, as Muon does, sends the
    matrices to Newton-Schulz and the 1-D shards to AdamW). With ``reduce_scatter_grads`` each
    whole param's gradient is summed into its owner during backward (`zero.backends.grads`)."""

    def __init__(self, state: RankState, metas: list[ParamMeta], bucket_view: bool | None = None,
                 chunk_bytes: int = 16 * 2**20, gradients: Callable[[FlatShards], Gradients] | None = None):
        super().__init__(state)
        self.rows = ParamSync(state.params, bucket_views(metas, state.plan.partition), state.rank,
                              state.process_group, bucket_view, chunk_bytes) if state.plan.hybrid else None
        self.metas, self.layout = metas, self.plan.flat
        self.flats = [self._allocate(b) for b in self.layout.buffers]
        self.shards = [f[self.rank * b.shard_numel:(self.rank + 1) * b.shard_numel].detach()
                       for f, b in zip(self.flats, self.layout.buffers)]
        self._pieces = [b.pieces(self.rank) for b in self.layout.buffers]
        self.wide: dict[int, torch.Tensor] = {}  # see take_grads
        self.storage = ViewWatch(self.params, [i for b in self.layout.buffers for i in b.params],
                                 comm.is_fake(self.group))
        if self.rows is not None:
            self.storage = self.storage.joined(self.rows.watch)
        self.sharding = self.build_sharding()
        self.gradients = gradients(self) if gradients is not None else CopiedGradients()
        # the shards' gradients: copies of DDP's pieces live here; reduced ones where they land (the source's)
        self._grads = [torch.zeros_like(s) for s in self.shards] if self.gradients.outputs is None else []

    def _allocate(self, buf: FlatBuffer) -> torch.Tensor:
        example = self.params[buf.params[0]]
        flat = torch.zeros(buf.padded_numel, dtype=example.dtype, device=example.device)
        with torch.no_grad():
            for i, off in zip(buf.params, buf.offsets):
                p = self.params[i]
                view = flat[off:off + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        return flat

    def tensor(self, t: LocalTensor) -> torch.Tensor:
        return self.params[t.param] if t.whole else self.shards[t.buffer]  # whole: a hybrid plan's

    @property
    def scaler_sees_grads(self) -> bool:
        return self.gradients.scaler_sees_grads

    @property
    def checks_local_grads(self) -> bool:
        return self.gradients.checks_local

    def grad_pieces(self) -> list[tuple[int, torch.Tensor]]:
        return self.gradients.pieces(self)

    def local_nonfinite(self) -> bool:
        return self.gradients.local_nonfinite(self)

    def step(self, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        verify = begin()
        loss = None
        if closure is not None:  # the shards' gradients are copies: take them after the closure ran
            with torch.enable_grad():
                loss = closure()
        try:
            self.take_grads(self.state.masters.dtype)
            out = self.state.run(self.sharding, grads=self.wide, **kwargs)
        finally:
            self.clear_grads()
        verify()  # before any param moves: ranks that diverged get a ValueError, not mismatched collectives
        self.state.stepped()
        self.sync()
        return loss if loss is not None else out

    def take_grads(self, master_dtype: torch.dtype | None) -> None:
        """Give each shard its gradient (``self.wide``: those kept wider than their shard's
        dtype, for its master)."""
        self.wide = self.gradients.take(self, master_dtype)

    def zero_grad(self, default: Callable[[], None]) -> None:
        self.gradients.zero_grad(default)

    def held_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        return self.gradients.reduced(self)

    def start_reductions(self) -> None:
        self.gradients.start_pending()

    def no_sync(self):
        return self.gradients.no_sync()

    def join_hook(self, step: Callable[[], Any]) -> JoinHook:
        self.gradients.check_join()
        return super().join_hook(step)

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
        for shard, grad, buf, pieces in zip(self.shards, self._grads, self.layout.buffers, self._pieces):
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

    @property
    def grads(self) -> list[torch.Tensor]:
        """Each shard's gradient tensor: the copies' (DDP's pieces), or where the reductions land."""
        outputs = self.gradients.outputs
        return self._grads if outputs is None else outputs

    def clear_grads(self) -> None:
        """After a step: the shards hold no gradient, and the wider ones kept for masters go."""
        for shard in self.shards:
            shard.grad = None
        self.wide = {}
        self.gradients.clear(self)

    @torch.no_grad()
    def sync(self) -> None:
        """The whole params by their owners' rows, then one all-gather per buffer: every rank's
        shard into every replica, in place."""
        if self.rows is not None:
            self.rows.sync()
        for k in range(len(self.flats)):
            for work in self.start_sync(k):
                wait_for(work, self.group, "the params' all-gather")

    def start_sync(self, k: int, async_op: bool = True) -> list[Any]:
        """Start buffer ``k``'s all-gather; returns the works to wait on."""
        rows = self.flats[k].view(self.layout.world_size, self.layout.buffers[k].shard_numel)
        return comm.all_gather_rows(rows, self.rank, self.group, async_op)
