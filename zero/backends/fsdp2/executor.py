"""`Fsdp2Executor`: how `zero.functional.Optimizer` steps FSDP2's DTensor params exactly.

Each group's step runs the rule once over plain tensors: this rank's local piece of every param
the rule steps element by element (on its fused and foreach kernels), and, whole, the params this
rank owns among those the rule needs whole (`zero.plans.fsdp2`). A `zero.functional.sharding.Sharding`
installed around the step says which piece of which whole tensor each leaf is, so the rule's
global and per-tensor norms and sums over axes are one partial sum per piece and one all-reduce
over the mesh; low-bit state is quantized in each param's own blocks, which the plan keeps whole
on one rank. The owners' params come whole by `exchange.to_owners` and go back by
`exchange.back_from_owners`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.backends.fsdp2.exchange import back_from_owners, to_owners
from zero.backends.fsdp2.layout import Layout, plan_for, read_layout
from zero.functional import sharding
from zero.plans.fsdp2 import Fsdp2Plan

__all__ = ["Fsdp2Executor", "executor"]


def executor(optimizer: Any) -> Fsdp2Executor:
    """The executor `zero.functional.adapters.sharded_storage` finds for DTensor params."""
    return Fsdp2Executor(optimizer)


class Fsdp2Executor:
    """Steps a `zero.functional.Optimizer`'s DTensor params by the plan of its rules
    (``self.plan``, the same on every rank: its fingerprint is compared when made)."""

    def __init__(self, optimizer: Any):
        self.layout: Layout = read_layout(optimizer)
        self._groups = optimizer.param_groups
        self.plan: Fsdp2Plan = plan_for(self.layout, [optimizer.rule(k) for k in range(len(optimizer.param_groups))])
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.mesh = params[0].device_mesh
        self._check_pieces(params)
        self._check_same_plan()
        device = params[0].device
        metas = self.layout.metas
        self._base = sharding.Sharding(
            {}, tuple(p.dtype for p in params), comm.summed(self.layout.group, device),
            comm.maxed(self.layout.group, device), every_group=True, names=tuple(m.name for m in metas),
            numels=tuple(m.numel for m in metas), shapes=tuple(m.shape for m in metas))

    @property
    def layout_key(self) -> str:
        """Which rank of which plan this is, as a state_dict records it."""
        return f"rank {self.layout.rank} of FSDP2 plan {self.plan.fingerprint} ({self.layout.world_size} ranks)"

    def step_group(self, k: int, idx: tuple[int, ...], params: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor], run: Any) -> None:
        plan, rank = self.plan, self.layout.rank
        ts = [self.layout.firsts[k] + i for i in idx]
        local = {t: p.to_local() for t, p in zip(ts, params)}
        local_grads = {t: _local(g, self.layout.metas[t].name) for t, g in zip(ts, grads)}
        wholes = to_owners(plan, rank, self.layout.group, ts, local, local_grads)
        keep, leaves, leaf_grads, pieces = [], [], [], {}
        for i, t in zip(idx, ts):
            if plan.owner[t] < 0:
                leaf, grad, piece = local[t], local_grads[t], self._piece(t)
            elif plan.owner[t] == rank:
                (leaf, grad), piece = wholes[t], self._whole_piece(t)
            else:
                continue
            keep.append(i)
            leaves.append(leaf)
            leaf_grads.append(grad)
            pieces[id(leaf)] = piece
        with sharding.installed(dataclasses.replace(self._base, pieces=pieces)):
            run(tuple(keep), leaves, leaf_grads)
        back_from_owners(plan, rank, self.layout.group, ts, {t: w[0] for t, w in wholes.items()}, local)

    @contextlib.contextmanager
    def starting(self, k: int, idx: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], list[torch.Tensor]]]:
        """The positions and tensors a step of group ``k``'s params at ``idx`` hands the rule on
        this rank (its pieces, and whole the params it owns, gathered: every rank calls this),
        with the step's sharding installed: to start their state outside a step (to load a
        checkpoint into) as a step would (low-bit state decided by each whole param)."""
        params = self.layout_params(k)
        keep, leaves, pieces = [], [], {}
        for i in idx:
            t, p = self.layout.firsts[k] + i, params[i]
            whole = p.detach().full_tensor() if self.plan.owner[t] >= 0 else None
            if self.plan.owner[t] in (-1, self.layout.rank):
                keep.append(i)
                leaves.append(p.detach().to_local() if whole is None else whole)
                pieces[id(leaves[-1])] = self._piece(t) if whole is None else self._whole_piece(t)
        with sharding.installed(dataclasses.replace(self._base, pieces=pieces)):
            yield tuple(keep), leaves

    def layout_params(self, k: int) -> list[torch.Tensor]:
        return self._groups[k]["params"]

    def _piece(self, t: int) -> sharding.Pieces:
        """This rank's local tensor of param ``t`` as a piece of the whole: where it starts in the
        flattened param when it is one run of it (``Shard(0)``), and its quantization block."""
        plan, rank = self.plan, self.layout.rank
        start = plan.start(t, rank)
        starts = () if start is None else (start,)
        return sharding.Pieces((t,), (plan.local_numel(t, rank),), starts, plan.blocks[t])

    def _whole_piece(self, t: int) -> sharding.Pieces:
        return sharding.Pieces((t,), (self.layout.metas[t].numel,), (0,))

    def _check_pieces(self, params: list[torch.Tensor]) -> None:
        for t, p in enumerate(params):
            want = self.plan.local_shape(t, self.layout.rank)
            if tuple(p.to_local().shape) != want:
                raise ValueError(f"param {self.layout.metas[t].name!r}'s local tensor is {tuple(p.to_local().shape)} "
                                 f"on rank {self.layout.rank}, where torch.chunk's rows (FSDP2's) give {want}: "
                                 "zero.functional.Optimizer steps params as fully_shard cuts them")

    def _check_same_plan(self) -> None:
        """Every rank made this plan; else a ``ValueError`` naming the first param whose shape,
        dtype, dim, owner or block differs, and the ranks' values of it."""
        prints = comm.all_gather_object(self.plan.fingerprint, self.layout.group)
        if len(set(prints)) == 1:
            return
        plan = self.plan
        rows = [(m.name, m.shape, m.dtype, plan.dims[i], plan.owner[i], plan.blocks[i])
                for i, m in enumerate(plan.metas)]
        everyone = comm.all_gather_object(rows, self.layout.group)
        at = next((j for j in range(max(map(len, everyone))) if len({str(r[j:j + 1]) for r in everyone}) > 1), None)
        said = "" if at is None else f"; param {at} (name, shape, dtype, dim, owner, block) by rank: " + \
            ", ".join(f"{r}: {rows_r[at] if at < len(rows_r) else 'none'}" for r, rows_r in enumerate(everyone))
        raise ValueError(f"the ranks made different FSDP2 plans (their params or rules differ){said}")


def _local(grad: torch.Tensor, name: str) -> torch.Tensor:
    if not hasattr(grad, "to_local"):
        raise TypeError(f"param {name!r} is a DTensor but its gradient is a {type(grad).__name__}: FSDP2 gives "
                        "DTensor gradients; set p.grad to a DTensor of the param's placement")
    return grad.to_local()
