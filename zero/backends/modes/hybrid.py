"""Hybrid plans (`zero.plans.hybrid`): the params the plan keeps whole are stepped by their owner,
as under a whole-param plan (`WholeParams`), and the rest in flat shards (`FlatShards`).

One local optimizer steps both: per param group, this rank's whole params, then its shards of
that group's buffers (a rule routing by rank, as Muon does, sends the matrices to
Newton-Schulz and the 1-D shards to AdamW). After the step the whole params travel by their
owners' rows and the shards by one all-gather per buffer.

With ``reduce_scatter_grads=True`` (`HybridReduceScattered`) the shards' gradients are
reduce-scattered during backward as under a flat plan, and each whole param's gradient is
summed into its owner by one reduce at the step; the other ranks then drop it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.backends.local_optimizer import LocalStep
from zero.backends.modes.base import Begin
from zero.backends.modes.flat import FlatShards, flat_local_states, flat_to_global, local_buffer_order
from zero.backends.modes.reduce_scatter import ReduceScatteredShards, no_gradient
from zero.backends.modes.whole import WholeParams
from zero.backends.state_dict import assemble, local_dict, to_global
from zero.backends.sync import ViewWatch
from zero.functional.sharding import Sharding
from zero.plans.chunks import Held, param_chunks
from zero.plans.meta import ParamMeta
from zero.plans.plan import Plan

__all__ = ["HybridShards", "HybridReduceScattered"]


class _Hybrid:
    """What a hybrid plan's whole params (``self.whole``, a `WholeParams`) add to a flat mode."""

    whole: WholeParams

    def __init__(self, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], plan: Plan, rank: int,
                 group: Any, n_groups: int, bucket_view: bool | None, chunk_bytes: int, **flat: Any):
        # First, so that the flat side's rules (built in its __init__) take in the whole params' pieces.
        self.whole = WholeParams(params, metas, plan, rank, group, n_groups, bucket_view, chunk_bytes)
        super().__init__(params, metas, plan, rank, group, **flat)
        self.storage = ViewWatch(self.params, self.storage.indices + self.whole.storage.indices)

    def _rules(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> Sharding:
        flat = super()._rules(reduce)
        return dataclasses.replace(flat, pieces={**flat.pieces, **self.whole.rules.pieces})

    def local_groups(self, param_groups: list[dict]) -> list[dict]:
        """Per group: this rank's whole params, then its shards. A named group names the shards
        ``<flat shard k>`` (buffer ``k``): a rule that routes by name (Muon's dimension numbers)
        sees the whole params by their names and is checked on the shards' pieces
        (`zero.functional.sharding.cut_tensors`)."""
        out = []
        for k, (w, f) in enumerate(zip(self.whole.local_groups(param_groups), super().local_groups(param_groups))):
            group = {**f, "params": w["params"] + f["params"]}
            if "param_names" in w:
                shards = [bi for bi, b in enumerate(self.layout.buffers) if b.group == k]
                group["param_names"] = w["param_names"] + [f"<flat shard {bi}>" for bi in shards]
            out.append(group)
        return out

    @torch.no_grad()
    def sync(self) -> None:
        self.whole.sync.sync()
        super().sync()

    def _split(self) -> list[tuple[int, int]]:
        """Per group: how many whole params and shards this rank's local optimizer holds."""
        n_groups = len(self.whole.indices[self.rank])
        order = local_buffer_order(self.layout, n_groups)
        return [(len(self.whole.indices[self.rank][k]), sum(self.layout.buffers[bi].group == k for bi in order))
                for k in range(n_groups)]

    def holdings(self) -> tuple[Held, ...]:
        whole = iter(self.whole.holdings())
        flat = super().holdings()
        out, j, shard = [], 0, 0
        for n_whole, n_shards in self._split():
            for _ in range(n_whole):
                out.append(dataclasses.replace(next(whole), local=j))
                j += 1
            for _ in range(n_shards):
                out += [dataclasses.replace(h, local=j) for h in flat if h.local == shard]
                j, shard = j + 1, shard + 1
        return tuple(out)

    def chunks(self, index: int) -> tuple[tuple[int, int, int], ...]:
        return param_chunks(index, self.params[index].numel(), self.plan.partition, self.layout)

    def to_global(self, shards: Sequence[dict], param_groups: list[dict], per_element: set[str] | None) -> dict:
        """Each rank's local dict cut into its whole params' and its shards' (by the counts per
        group every rank's plan gives), merged as each side merges its own."""
        whole_shards, flat_shards = [], []
        for rank, shard in enumerate(shards):
            counts = [len(idx) for idx in self.whole.indices[rank]]
            groups = [g["params"] for g in shard["param_groups"]]
            whole_shards.append({"state": shard["state"],
                                 "param_groups": [{"params": g[:n]} for g, n in zip(groups, counts)]})
            flat_js = [j for g, n in zip(groups, counts) for j in g[n:]]
            flat_shards.append({"state": {p: shard["state"][j] for p, j in enumerate(flat_js) if j in shard["state"]},
                                "param_groups": []})
        state = to_global(whole_shards, self.whole.indices, param_groups, self.plan.partition.owner)["state"]
        state |= flat_to_global(flat_shards, self.plan, param_groups, per_element)["state"]
        return assemble(state, shards, param_groups, self.plan.fingerprint)

    def to_local(self, saved: dict, per_element: set[str] | None) -> dict:
        flat = iter(flat_local_states(saved, self.plan, self.rank, per_element))
        states, sizes = [], []
        for idx, (_, n_shards) in zip(self.whole.indices[self.rank], self._split()):
            states += [saved["state"].get(i) for i in idx] + [next(flat) for _ in range(n_shards)]
            sizes.append(len(idx) + n_shards)
        return local_dict({j: st for j, st in enumerate(states) if st}, sizes, saved, self.rank, self.plan.fingerprint)


class HybridShards(_Hybrid, FlatShards):
    """A hybrid plan, its gradients left on every rank by DDP: the whole params are stepped by
    their owners with their own gradients, the shards with copies of theirs."""


class HybridReduceScattered(_Hybrid, ReduceScatteredShards):
    """A hybrid plan with ``reduce_scatter_grads=True``: no DDP. The shards' gradients are
    reduce-scattered during backward; each whole param's is summed into its owner at the step,
    one reduce per param in the plan's order (the same on every rank), and dropped elsewhere."""

    def __init__(self, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], plan: Plan, rank: int,
                 group: Any, n_groups: int, bucket_view: bool | None, chunk_bytes: int,
                 reduce_dtype: torch.dtype | None = None):
        super().__init__(params, metas, plan, rank, group, n_groups, bucket_view, chunk_bytes,
                         reduce_dtype=reduce_dtype)
        self.reduce_dtype = reduce_dtype
        with torch.no_grad():  # start from rank 0's params, as DDP does (the flat ones already did)
            for i in plan.whole:
                comm.broadcast_from(self.params[i].data, 0, group)

    def step(self, local: LocalStep, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        return FlatShards.step(self, local, closure, kwargs, begin)  # not pipelined per buffer: one local step

    def take_grads(self, master_dtype: torch.dtype | None) -> None:
        super().take_grads(master_dtype)
        world = self.layout.world_size
        for i in self.plan.whole:
            p, owner = self.params[i], self.plan.partition.owner[i]
            if p.grad is None:
                raise no_gradient(self.metas[i].name)
            grad = p.grad if self.reduce_dtype is None else p.grad.to(self.reduce_dtype)
            comm.wait_for(comm.reduce_sum_to(grad, owner, self.group), self.group, "the whole params' reduce")
            if owner != self.rank:
                p.grad = None  # ZeRO-2: only the owner keeps it
                continue
            grad.div_(world)
            if grad.dtype == p.dtype:
                p.grad = grad
            elif grad.dtype == master_dtype:  # straight to the master, as the shards' (use_reduced_grads)
                p.grad, self.wide[id(p)] = None, grad
            else:
                p.grad = grad.to(p.dtype)

    def zero_grad(self, default: Callable[[], None]) -> None:
        default()  # the whole params' grads
        super().zero_grad(default)  # the shards' buffers, zeroed in place, the flat params' grads viewing them
