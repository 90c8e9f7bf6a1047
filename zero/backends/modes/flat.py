"""Flat plans (element-level ZeRO): executes a `zero.FlatLayout` (a plan made with ``strategy="flat"``).

Per buffer of the layout (one per param group, device and dtype) the trainable params become
views into one flat tensor. This rank's local optimizer steps one 1-D tensor per buffer: its
shard of it, itself a view, so the step writes straight into the params. Its gradient is a
shard-sized tensor, filled with the pieces of the params' gradients that fall in the shard (or
written there directly by a reduce-scatter). After the step one all-gather per buffer writes
every rank's shard into every replica, in place. State per rank is exactly the plan's: one set
per buffer, shaped like the shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.backends.local_optimizer import LocalStep
from zero.backends.modes.base import Begin, Mode
from zero.backends.state_dict import assemble, is_per_element, local_dict
from zero.backends.sync import ViewWatch
from zero.functional.sharding import Pieces, Sharding
from zero.plans.chunks import Held, held_by, param_chunks
from zero.plans.layout import FlatBuffer, FlatLayout
from zero.plans.meta import ParamMeta
from zero.plans.plan import Plan

__all__ = ["FlatShards", "flat_to_global", "flat_to_local"]


class FlatShards(Mode):
    """The flat buffers of the plan's layout, this rank's shard of each, and their sync."""

    def __init__(self, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], plan: Plan, rank: int,
                 group: Any):
        super().__init__(params, plan, rank, group)
        self.metas, self.layout = metas, plan.flat
        layout = plan.flat
        self.flats = [self._allocate(b) for b in layout.buffers]
        self.shards = [f[rank * b.shard_numel:(rank + 1) * b.shard_numel].detach()
                       for f, b in zip(self.flats, layout.buffers)]
        self._grads = [torch.zeros_like(s) for s in self.shards]
        self._pieces = [b.pieces(rank) for b in layout.buffers]
        self.wide: dict[int, torch.Tensor] = {}  # see take_grads
        self.storage = ViewWatch(self.params, [i for b in layout.buffers for i in b.params])
        self.rules = self._rules(comm.summed(group, self.params[0].device))

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

    def local_groups(self, param_groups: list[dict]) -> list[dict]:
        """Every group's settings, with this rank's shards of that group's buffers as its params
        (a shard holds pieces of several params: it has no name)."""
        return [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                 "params": [s for s, b in zip(self.shards, self.layout.buffers) if b.group == k]}
                for k, g in enumerate(param_groups)]

    def _rules(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> Sharding:
        """What `zero.functional.sharding` needs: the pieces of whole params each shard holds."""
        pieces = {id(s): Pieces(tuple(p.param for p in ps), tuple(p.end - p.start for p in ps),
                                tuple(p.start for p in ps))
                  for s, ps in zip(self.shards, self._pieces)}
        return Sharding(pieces, tuple(p.dtype for p in self.params), reduce,
                        numels=tuple(p.numel() for p in self.params), shapes=tuple(tuple(p.shape) for p in self.params),
                        names=tuple(m.name for m in self.metas))

    def step(self, local: LocalStep, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        verify = begin()
        loss = None
        if closure is not None:  # the shards' gradients are copies: take them after the closure ran
            with torch.enable_grad():
                loss = closure()
        try:
            self.take_grads(local.masters.dtype)
            out = local.run(self.rules, grads=self.wide, **kwargs)
        finally:
            self.clear_grads()
        verify()  # before any param moves: ranks that diverged get a ValueError, not mismatched collectives
        local.stepped()
        self.sync()
        return loss if loss is not None else out

    def take_grads(self, master_dtype: torch.dtype | None) -> None:
        """Give each shard its gradient: here, the pieces of the params' gradients that fall in it.
        (``self.wide``: gradients kept in a wider dtype than their shard's, for its master.)"""
        self.load_grads()
        self.wide = {}

    def retrain(self, metas: Sequence[ParamMeta]) -> None:
        raise ValueError("params were frozen or unfrozen after building a flat plan's optimizer; a flat "
                         "plan packs the trainable params at construction: build the optimizer again "
                         "(moving its state_dict), or use a whole-param plan")

    def check_extendable(self) -> None:
        raise ValueError("add_param_group cannot extend a flat plan (its buffers would be packed again): "
                         "build the optimizer with every group, or use a whole-param plan")

    def holdings(self) -> tuple[Held, ...]:
        order = local_buffer_order(self.layout, 1 + max((b.group for b in self.layout.buffers), default=-1))
        return held_by(self.rank, None, self.layout, order, [p.numel() for p in self.params])

    def chunks(self, index: int) -> tuple[tuple[int, int, int], ...]:
        return param_chunks(index, self.params[index].numel(), None, self.layout)

    def to_global(self, shards: Sequence[dict], param_groups: list[dict], per_element: set[str] | None) -> dict:
        return flat_to_global(shards, self.plan, param_groups, per_element)

    def to_local(self, saved: dict, per_element: set[str] | None) -> dict:
        return flat_to_local(saved, self.plan, self.rank, per_element)

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

    def use_reduced_grads(self, master_dtype: torch.dtype | None, only: int | None = None) -> dict[int, torch.Tensor]:
        """Step the shards (or shard ``only``) with their reduce-scattered gradients. A gradient in
        another dtype than its shard's (``reduce_dtype``) goes to the shard's master as it is when
        it has the master's dtype (returned, by ``id(shard)``), else is cast to the shard's."""
        wide = {}
        for k, (shard, grad) in enumerate(zip(self.shards, self._grads)):
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
        """Each shard's gradient tensor, where a reduce-scatter writes it."""
        return self._grads

    def clear_grads(self) -> None:
        for shard in self.shards:
            shard.grad = None

    @torch.no_grad()
    def sync(self) -> None:
        """One all-gather per buffer: every rank's shard into every replica, in place."""
        for k in range(len(self.flats)):
            for work in self.start_sync(k):
                comm.wait_for(work, self.group, "the params' all-gather")

    def start_sync(self, k: int, async_op: bool = True) -> list[Any]:
        """Start buffer ``k``'s all-gather; returns the works to wait on."""
        rows = self.flats[k].view(self.layout.world_size, self.layout.buffers[k].shard_numel)
        return comm.all_gather_rows(rows, self.rank, self.group, async_op)



def local_buffer_order(layout: FlatLayout, n_groups: int) -> list[int]:
    return [bi for k in range(n_groups) for bi, b in enumerate(layout.buffers) if b.group == k]


def flat_to_global(shards: Sequence[dict], plan: Plan, param_groups: list[dict],
                   per_element: set[str] | None) -> dict[str, Any]:
    """The global (plain ``torch.optim``) state dict out of every rank's local one.

    ``per_element``: the state keys shaped like the param (None: those with dimensions); the
    rest (``step`` ...) are equal on every rank and copied to every param of the buffer.
    """
    layout, metas = plan.flat, plan.metas
    state: dict[int, dict] = {}
    for j, bi in enumerate(local_buffer_order(layout, len(param_groups))):
        buf = layout.buffers[bi]
        held = [shard["state"].get(j) for shard in shards]
        if not all(held):
            continue
        for key, value in held[0].items():
            if is_per_element(key, value, per_element):
                full = torch.cat([h[key].reshape(-1) for h in held])
                for i, off in zip(buf.params, buf.offsets):
                    state.setdefault(i, {})[key] = full[off:off + metas[i].numel].view(metas[i].shape).clone()
            else:
                for i in buf.params:
                    state.setdefault(i, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return assemble(state, shards, param_groups, plan.fingerprint)


def flat_to_local(saved: dict, plan: Plan, rank: int, per_element: set[str] | None) -> dict[str, Any]:
    """This rank's local state dict (one entry per shard) cut out of a global one."""
    states = flat_local_states(saved, plan, rank, per_element)
    state = {j: st for j, st in enumerate(states) if st}
    order = local_buffer_order(plan.flat, len(saved["param_groups"]))
    sizes = [sum(plan.flat.buffers[bi].group == k for bi in order) for k in range(len(saved["param_groups"]))]
    return local_dict(state, sizes, saved, rank, plan.fingerprint)


def flat_local_states(saved: dict, plan: Plan, rank: int, per_element: set[str] | None) -> list[dict]:
    """Each of this rank's shards' state (in the local optimizer's order), cut out of a global
    state dict (empty where its params have none)."""
    order = local_buffer_order(plan.flat, len(saved["param_groups"]))
    return [_shard_state(plan.flat.buffers[bi], saved["state"], plan.metas, rank, per_element) for bi in order]


def _shard_state(buf: FlatBuffer, saved_state: dict, metas: Sequence[ParamMeta], rank: int,
                 per_element: set[str] | None) -> dict:
    held = [(i, off, saved_state[i]) for i, off in zip(buf.params, buf.offsets) if saved_state.get(i)]
    if not held:
        return {}
    lo, hi = rank * buf.shard_numel, (rank + 1) * buf.shard_numel
    st = {}
    for key, value in held[0][2].items():
        if is_per_element(key, value, per_element):
            full = torch.zeros(buf.padded_numel, dtype=value.dtype, device=value.device)
            for i, off, s in held:
                full[off:off + metas[i].numel] = s[key].reshape(-1)
            st[key] = full[lo:hi].clone()
        else:
            st[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return st
