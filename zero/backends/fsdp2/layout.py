"""FSDP2's params as the plan layer sees them: each DTensor param's whole shape and the dim
``fully_shard`` cut it on, checked against the plan's rows (`zero.plans.fsdp2`), and the rule's
answers about them (which it needs whole, which it quantizes in blocks). On HSDP's 2-D mesh
(``(Replicate(), Shard(d))``) the shard dim's group is the one the pieces are cut over, and the
replicate dim's the one a plan over the replicas shards the step over too."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from zero.backends import comm
from zero.backends.local_optimizer import check_one_rank_steps_all, mentions
from zero.backends.options import low_bit_name, rule_cost_name, with_heads
from zero.functional.sharding import block_sizes, head_counts, needs_whole, reads_axes
from zero.plans.fsdp2 import Fsdp2Plan, make_fsdp2_plan
from zero.plans.meta import ParamMeta

__all__ = ["Layout", "read_layout", "plan_for"]


@dataclass(frozen=True)
class Layout:
    """Every param of the optimizer (across its groups, in order): its metadata, the dim FSDP2
    shards, and where each group's params start in that order; the group the pieces are cut over
    and this rank in it, and (HSDP) the replicate group and this rank's replica."""

    metas: tuple[ParamMeta, ...]
    dims: tuple[int, ...]
    firsts: tuple[int, ...]
    group: Any
    rank: int
    world_size: int
    replica_group: Any = None
    replica: int = 0
    replicas: int = 1


def read_layout(optimizer: Any) -> Layout:
    """The `Layout` of ``optimizer``'s DTensor params; a ``ValueError`` naming the param that is
    not one rank's ``Shard(d)`` piece on the mesh the others share."""
    metas, dims, firsts, mesh = [], [], [], None
    for k, group in enumerate(optimizer.param_groups):
        firsts.append(len(metas))
        names = group.get("param_names") or [f"{k}.{i}" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"]):
            mesh = _check_mesh(name, p, mesh)
            dims.append(_shard_dim(name, p))
            metas.append(ParamMeta(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), str(p.device), k,
                                   p.requires_grad))
    pg = mesh.get_group(mesh.ndim - 1)
    out = Layout(tuple(metas), tuple(dims), tuple(firsts), pg, comm.group_rank(pg), comm.group_size(pg))
    if mesh.ndim == 1:
        return out
    rg = mesh.get_group(0)
    return dataclasses.replace(out, replica_group=rg, replica=comm.group_rank(rg), replicas=comm.group_size(rg))


def _check_mesh(name: str, p: DTensor, mesh: Any) -> Any:
    if p.device_mesh.ndim not in (1, 2):
        raise ValueError(f"param {name!r} is on a {p.device_mesh.ndim}-D mesh ({p.device_mesh}): "
                         "zero steps FSDP2's params on a 1-D mesh and HSDP's on a 2-D (replicate, shard) mesh")
    if mesh is not None and p.device_mesh != mesh:
        raise ValueError(f"param {name!r} is on mesh {p.device_mesh}, the params before it on {mesh}: one optimizer "
                         "steps params of one mesh")
    return p.device_mesh


def _shard_dim(name: str, p: DTensor) -> int:
    *replicated, placement = p.placements
    if any(type(r) is not Replicate for r in replicated):
        raise ValueError(f"param {name!r} is placed {tuple(p.placements)} on its 2-D mesh: zero steps HSDP's params "
                         "(Replicate() over the first dim, Shard(d) over the second, as fully_shard makes them)")
    if type(placement) is not Shard:  # (a _StridedShard, a Shard subclass, is not one run of rows either)
        raise ValueError(f"param {name!r} is placed {placement} on its mesh: zero.functional.Optimizer steps params "
                         "FSDP2 shards (Shard(d), as fully_shard makes them)")
    return placement.dim


def plan_for(layout: Layout, rules: list[Any], replicas: int = 1) -> Fsdp2Plan:
    """The plan of the optimizer's groups, each stepped by ``rules[k]``, over ``replicas``
    replicas (1, or the layout's): the params each rule needs whole and the blocks it quantizes
    in, asked of the rule on meta tensors, and the params whose sums over axes it asks for where
    their pieces are not rows of the param (a dim past the first; any piece cut over the
    replicas, which is a run of elements); a ``from_optax`` rule's params all whole (Optax's code
    cannot be told it steps pieces)."""
    whole, blocks, low_bit, heads = [], {}, set(), {}
    for k, tx in enumerate(rules):
        metas = [m for m in layout.metas if m.group == k and m.requires_grad]
        shapes = {m.name: (m.shape, getattr(torch, m.dtype)) for m in metas}
        if mentions(tx, "from_optax"):  # declared per tensor (else refused): each param whole on its owner
            check_one_rank_steps_all(tx, layout.world_size * replicas)
            whole += list(shapes)
            continue
        by_heads = head_counts(tx, shapes)  # per-head Muon: whole heads suffice, where FSDP2's rows fall on head edges
        whole += [name for name in needs_whole(tx, shapes) if name not in by_heads]
        blocks.update({name: math.prod(shapes[name][0]) // h for name, h in by_heads.items()})
        heads.update(head_counts(tx, shapes, costs=True))  # the costs' heads: per-head SOAP's and Shampoo's too
        across = {m.name for m, d in zip(layout.metas, layout.dims)
                  if m.group == k and (replicas > 1 or any(s > 1 for s in m.shape[:d]))}
        whole += [name for name in reads_axes(tx, shapes) if name in across]  # Shard(1) rows are not runs
        found = block_sizes(tx, shapes)
        blocks.update({name: block for name, (_, block) in found.items()})
        low_bit.update(found.items())
    optimizer = low_bit_name(dict(low_bit)) or with_heads(next(filter(None, map(rule_cost_name, rules)), None),
                                                          heads) or "adam"
    return make_fsdp2_plan(layout.metas, layout.world_size, optimizer, dims=_by_name(layout), whole=whole,
                           blocks=blocks, replicas=replicas)


def _by_name(layout: Layout) -> dict[str, int]:
    return {m.name: d for m, d in zip(layout.metas, layout.dims)}

