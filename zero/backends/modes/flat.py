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

__all__ = ["FlatShards", "Gradients"]


class Gradients:
    """Where a flat mode's shards get their gradients, and what ``zero_grad``, ``no_sync`` and
    ``Join`` mean for them (one object per mode, chosen by it). It is never handed the mode: it
    says what it holds (`settled`), and the mode puts the gradients where it steps them.

    This base is DDP's: the params' ``.grad`` hold the averaged gradients on every rank, and the
    mode copies the pieces of them that fall in its shards."""

    scaler_sees_grads = True  # the params' .grad are the gradients stepped, as a GradScaler reads them
    checks_local = False  # see `Mode.checks_local_grads`
    outputs: list[torch.Tensor] | None = None  # the shards' gradients where these gradients own them (reduced)

    def settled(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]] | None:
        """Every reduction waited for: each shard's mean gradient and each owned whole param's
        (flat), or None where DDP's are on the params."""
        return None

    def current(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]] | None:
        """What `settled` gives, without ending anything a finished iteration left (None: DDP's)."""
        return None

    def end(self) -> None:
        """After a step (its gradients taken), or an error."""

    def start_pending(self) -> None:
        """See `Mode.start_reductions` (nothing to start where DDP reduces)."""

    def zero_grad(self, default: Callable[[], None]) -> None:
        default()

    def no_sync(self) -> contextlib.AbstractContextManager:
        return no_accumulation()

    def check_join(self) -> None:
        """``NotImplementedError`` if a rank that ran out of inputs cannot shadow these gradients."""

    def local_nonfinite(self) -> bool | None:
        """Whether this rank's own gradients held NaN or inf, where these gradients check them
        as they are reduced; None: check the pieces the rank steps."""
        return None


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
        self.gradients = gradients(self) if gradients is not None else Gradients()  # DDP's, copied
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
        """The averaged gradients this rank steps, by the pieces of params in them: DDP's on the
        params, or the reduced ones (reductions in flight waited for first)."""
        got = self.gradients.current()
        if got is None:
            return self.param_grad_pieces()
        outputs, kept = got
        out = []
        for h in self.holdings.held:
            t = self.holdings.tensors[h.local]
            if not t.whole:
                out.append((h.param, outputs[t.buffer][h.offset:h.offset + h.end - h.start]))
            elif h.param in kept:
                out.append((h.param, kept[h.param].reshape(-1)[h.start:h.end]))
        return out

    def local_nonfinite(self) -> bool:
        found = self.gradients.local_nonfinite()
        return not all_finite([g for _, g in self.grad_pieces()]) if found is None else found

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
        """Give each shard (and owned whole param) its gradient (``self.wide``: those kept wider
        than their tensor's dtype, for its master)."""
        got = self.gradients.settled()
        if got is None:
            self.load_grads()
            self.wide = {}
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

    def zero_grad(self, default: Callable[[], None]) -> None:
        self.gradients.zero_grad(default)

    def held_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        got = self.gradients.settled()
        if got is None:
            return None
        outputs, kept = got
        return [*zip(self.shards, outputs), *((self.params[i], g) for i, g in kept.items())]

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
        if self.gradients.outputs is not None:  # whole params' means stay kept until zero_grad, as DDP's .grad
            for i in self.plan.whole:
                self.params[i].grad = None

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
