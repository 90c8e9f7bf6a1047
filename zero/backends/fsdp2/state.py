"""The optimizer state of zero's rules over FSDP2's params in DCP's layout, and back.

Each per-param state tensor of a param a rank steps in pieces is a DTensor in the param's
placement (its local tensor is the state itself, so DCP saves it without a copy and loads into it
in place, resharding to any mesh size); the state of a param an owner steps whole is a plain
tensor on the owner (DCP reads any box of it into another layout's pieces, and writes a whole one
from pieces). The keys are the state's paths, as zero's ZeRO checkpoints name them (``"0.mu"``),
so a ZeRO-1/2 checkpoint continues here and this one there. Shared leaves (counts,
hyperparameters) are saved under every param that shares them.

Under a plan over HSDP's replicas a rank's state is a run of its piece's elements, which no
placement describes: it is a ``ShardedTensor`` of the boxes of the param's shape the run covers,
views into the state, as zero's flat ZeRO plans save theirs. Master copies (``master_dtype``) are
saved as per-element state under ``"master"``; a checkpoint without them starts them from the params.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zero.backends import comm
from zero.backends.checkpoint.dcp_pieces import quiet, saved_entry
from zero.backends.precision import MASTER_KEY
from zero.functional.adapters.state_tree import as_tree, map_state_leaves, state_leaves
from zero.plans.chunks import range_boxes

__all__ = ["fsdp2_state_dict", "load_fsdp2_state_dict"]


def _sets(optimizer: Any) -> Iterator[tuple[int, dict, tuple[int, ...], list[str] | None]]:
    """Each group's state sets (every param given a state first, as a step would start it)."""
    executor = optimizer.executor
    for k, group in enumerate(optimizer.param_groups):
        idx = tuple(i for i, p in enumerate(group["params"]) if p.requires_grad)
        if not optimizer.set_states(k) and idx:
            with executor.starting(k, idx) as (keep, leaves):
                optimizer.ensure_state(k, keep, leaves)
        states = optimizer.set_states(k)
        for keep in list(states):
            yield k, states, keep, optimizer.names_of(k, keep)


def _entries(optimizer: Any, names: list[str], masters: bool = True
             ) -> Iterator[tuple[int, str, str, int | None, Any, int]]:
    """``(t, the param's FQN, key, position, leaf, per)`` of every state leaf, per param it belongs
    to. ``per``, from the rule's leaf for the whole param (asked on meta tensors: a placeholder
    that happens to have a piece's shape is not one): -1 when it is shaped like the param (this
    rank's like its piece); ``k >= 1`` when it is 1-D with one element per ``k`` of the flattened
    param's (a quantized moment's codes, ``k`` 1 or 1/2 a byte... its scales, one per block); 0
    for any other (a placeholder, a factored statistic)."""
    executor = optimizer.executor
    for k, states, keep, tree_names in _sets(optimizer):
        first = executor.layout.firsts[k]
        shapes = _whole_shapes(optimizer, k, keep, tree_names)
        for key, pos, leaf in state_leaves(states[keep], len(keep), tree_names):
            for i in keep if pos is None else [keep[pos]]:
                meta = executor.plan.metas[first + i]
                yield first + i, names[first + i], key, pos, leaf, _per(shapes.get((key, pos)), meta.shape)
        for pos, i in enumerate(keep):
            if masters and first + i in executor.masters:
                yield first + i, names[first + i], MASTER_KEY, pos, executor.masters[first + i], -1


def _per(leaf_shape: tuple[int, ...] | None, shape: tuple[int, ...]) -> int:
    if leaf_shape is None:
        return 0
    if leaf_shape == shape:
        return -1
    numel, n = math.prod(shape), math.prod(leaf_shape)
    return numel // n if len(leaf_shape) == 1 and 0 < n <= numel and numel % n == 0 else 0


def _whole_shapes(optimizer: Any, k: int, keep: tuple[int, ...], tree_names: list[str] | None) -> dict:
    """``(key, position) -> shape`` of the state the rule starts for the whole params of a set."""
    first, metas = optimizer.executor.layout.firsts[k], optimizer.executor.plan.metas
    meta = [torch.empty(metas[first + i].shape, dtype=getattr(torch, metas[first + i].dtype), device="meta")
            for i in keep]
    state = optimizer.rule(k).init(as_tree(meta, tree_names))
    return {(key, pos): tuple(leaf.shape) for key, pos, leaf in state_leaves(state, len(keep), tree_names)
            if isinstance(leaf, torch.Tensor)}


def fsdp2_state_dict(optimizer: Any, names: list[str], masters: bool = True) -> dict[str, Any]:
    """``{"state": {fqn: {key: tensor}}, "param_groups": [..., {"params": [fqn, ...]}]}`` of a
    `zero.functional.Optimizer` over FSDP2's params (``names``: every param's FQN, in order);
    ``masters=False`` leaves out the master copies."""
    executor, state, shared = optimizer.executor, {}, []
    for t, fqn, key, pos, leaf, per in _entries(optimizer, names, masters):
        pieces = pos is not None and executor.plan.owner[t] < 0 and isinstance(leaf, torch.Tensor)
        per = per if per <= 0 or executor.plan.runs_cut_at(t, per) else 0  # a placeholder's k: not runs
        if pieces and per == 0:
            shared.append((fqn, key, leaf))
        if pieces and per != 0 and executor.plan.replicas > 1 and not leaf.numel():
            continue  # no part of this param here: no entry (as a flat ZeRO plan's rank that holds none)
        state.setdefault(fqn, {})[key] = leaf if not pieces or per == 0 else \
            _per_element(executor, t, leaf) if per < 0 else _as_runs(executor, t, leaf, per, key)
    _check_shared(executor, shared)
    groups, first = [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                       "params": names[first:first + n]})
        first += n
    return {"state": state, "param_groups": groups}


def _per_element(executor: Any, t: int, leaf: torch.Tensor) -> Any:
    """This rank's part of a per-element state leaf of param ``t``: a DTensor in the param's
    placement where it is the rank's whole piece, else (a plan over the replicas) a
    ``ShardedTensor`` of the boxes its run covers."""
    meta, plan = executor.plan.metas[t], executor.plan
    if plan.replicas == 1:
        placements = executor.placements(t)
        return DTensor.from_local(leaf, executor.mesh, placements, run_check=False, shape=torch.Size(meta.shape),
                                  stride=_stride(meta.shape))
    from torch.distributed._shard.sharded_tensor import Shard as Box
    from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    flat = leaf.reshape(-1)
    mine = _boxes(executor, t, executor.me, leaf.device)
    local = [Box(flat[at:at + n].view(box.shard_sizes), box) for box, at, n in mine]
    everyone = [box for m in range(plan.ranks) for box, _, _ in _boxes(executor, t, m, leaf.device)]
    whole = ShardedTensorMetadata(everyone, torch.Size(meta.shape), TensorProperties(dtype=leaf.dtype))
    with quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, whole, process_group=_world(executor))


def _boxes(executor: Any, t: int, rank: int, device: torch.device) -> list[tuple[Any, int, int]]:
    """``(ShardMetadata, start, numel)`` of each box of param ``t`` that mesh rank ``rank``'s part
    covers (``start``: where it begins in the part)."""
    from torch.distributed._shard.metadata import ShardMetadata

    plan = executor.plan
    shard, dim = rank % plan.world_size, plan.dims[t]
    at, n = plan.part(t, rank)
    first_row = plan.rows(t)[shard][0] if plan.metas[t].shape else 0
    out = []
    for b in range_boxes(plan.local_shape(t, shard), at, at + n):
        offsets = [o + (first_row if d == dim else 0) for d, o in enumerate(b.offsets)]
        out.append((ShardMetadata(offsets, list(b.sizes), f"rank:{_global(executor, rank)}/{device}"), b.start - at,
                    b.numel))
    return out


def _world(executor: Any) -> Any:
    """The group a ``ShardedTensor`` of the plan's ranks' parts lives in: the shard group at one
    replica, else the mesh's (`Fsdp2Executor.mesh_group`)."""
    return executor.layout.group if executor.plan.replicas == 1 else executor.mesh_group


def _global(executor: Any, rank: int) -> int:
    """The global rank of mesh rank ``rank`` (of the plan's ranks: the shard group's at one replica)."""
    if executor.plan.replicas == 1:
        return comm.global_rank(executor.layout.group, rank)
    return int(executor.mesh.mesh.reshape(-1)[rank])


def _as_runs(executor: Any, t: int, leaf: torch.Tensor, k: int, key: str) -> Any:
    """This rank's piece of a 1-D state of param ``t`` (one element per ``k`` of the flattened
    param's) as a ``ShardedTensor`` of the whole 1-D state: its rows are one run of it, as a flat
    ZeRO plan's pieces are, which a DTensor's placements cannot describe (DCP reads either)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as Box
    from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    plan, rank = executor.plan, executor.me
    runs = [(plan.start(t, r % plan.world_size) + plan.part(t, r)[0], plan.part(t, r)[1], r)
            for r in range(plan.ranks) if plan.part(t, r)[1]]
    if leaf.numel() * k != plan.part(t, rank)[1]:
        raise ValueError(f"state {key!r} of {plan.metas[t].name!r} holds {leaf.numel()} elements on rank {rank}, "
                         f"one per {k} of the whole param's, for {plan.part(t, rank)[1]} of the param's here")

    def meta(start: int, n: int, r: int) -> ShardMetadata:
        return ShardMetadata([start // k], [n // k], f"rank:{_global(executor, r)}/{leaf.device}")

    local = [Box(leaf.reshape(-1), meta(s, n, r)) for s, n, r in runs if r == rank]
    whole = ShardedTensorMetadata([meta(*run) for run in runs], torch.Size([plan.metas[t].numel // k]),
                                  TensorProperties(dtype=leaf.dtype))
    with quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, whole, process_group=_world(executor))


def _check_shared(executor: Any, shared: list[tuple[str, str, torch.Tensor]]) -> None:
    """Per-param leaves of stepped pieces that are not shaped like the piece (Adafactor's
    placeholders for unfactored params) are saved once, as the same tensor on every rank: a
    ``ValueError`` naming the first that differs between ranks (a quantized state of rows,
    which has no layout DCP can reshard)."""
    mine = [(fqn, key, leaf.detach().cpu()) for fqn, key, leaf in shared]
    for other in comm.all_gather_object(mine, executor.layout.group):
        for (fqn, key, a), (_, _, b) in zip(mine, other):
            if a.shape != b.shape or not torch.equal(a, b):
                raise ValueError(f"state {key!r} of {fqn!r} differs between ranks and is not shaped like the param's "
                                 "rows (a quantized or factored state of each rank's rows): it cannot be saved by FQN "
                                 "yet; opt.state_dict() saves it for the same layout")


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def load_fsdp2_state_dict(optimizer: Any, names: list[str], sd: dict[str, Any]) -> None:
    """Load ``sd`` (`fsdp2_state_dict`'s layout, filled by ``dcp.load``) into ``optimizer``'s
    states, leaf by leaf, skipping what DCP loaded in place; then the groups' settings."""
    executor = optimizer.executor
    for k, states, keep, tree_names in list(_sets(optimizer)):
        first = executor.layout.firsts[k]
        _load_masters(executor, names, sd, [first + i for i in keep])

        def fill(key: str, pos: int | None, leaf: Any, keep=keep, first=first) -> Any:
            t = first + keep[0 if pos is None else pos]
            if isinstance(leaf, torch.Tensor) and not leaf.numel() and executor.plan.replicas > 1:
                return leaf  # no part of this param here, nor an entry
            value = saved_entry(sd, names[t], key)
            if not isinstance(leaf, torch.Tensor):
                return value
            got = _local_of(value, leaf)
            if not isinstance(got, torch.Tensor) or got.shape != leaf.shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise ValueError(f"optim_state_dict's {key!r} of {names[t]!r} has shape {shape} here, the state "
                                 f"{tuple(leaf.shape)}")
            if got.data_ptr() != leaf.data_ptr():
                leaf.copy_(got)
            return leaf
        states[keep] = map_state_leaves(states[keep], len(keep), fill, tree_names)
    for group, saved in zip(optimizer.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _load_masters(executor: Any, names: list[str], sd: dict[str, Any], ts: list[int]) -> None:
    """Each master of params ``ts`` from ``sd`` (in place where DCP loaded into it); one ``sd``
    has none of (torch's, or saved with ``masters=False``) is started again from its param."""
    for t in ts:
        master = executor.masters.get(t)
        if master is None:
            continue
        saved = sd.get("state", {}).get(names[t], {})
        if MASTER_KEY not in saved:
            del executor.masters[t]  # the next step takes it from the loaded param
            continue
        got = _local_of(saved[MASTER_KEY], master)
        if got.data_ptr() != master.data_ptr():
            master.copy_(got.view(master.shape))


def _local_of(value: Any, leaf: torch.Tensor) -> Any:
    """This rank's part of a loaded value, in ``leaf``'s shape: a DTensor's local tensor, a
    ShardedTensor's local shards (none: an empty piece; several: boxes, views into ``leaf`` that
    DCP loaded in place), or the value itself."""
    if isinstance(value, DTensor):
        return value.to_local()
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        if len(shards) == 1 and shards[0].tensor.numel() == leaf.numel():
            return shards[0].tensor.view(leaf.shape)
        if all(s.tensor.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr() for s in shards):
            return leaf
        raise ValueError(f"a loaded state's {len(shards)} boxes here are not views of the state they load into")
    return value

