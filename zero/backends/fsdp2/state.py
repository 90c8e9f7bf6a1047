"""The optimizer state of zero's rules over FSDP2's params as torch's per-param entries, and back:
what ``optimizer.state`` shows and ``state_dict()`` holds over DTensor params (so torch's
``get_state_dict`` and DCP save and reshard it).

Each per-param state tensor of a param a rank steps in pieces is a DTensor in the param's
placement (its local tensor is the state itself, so DCP saves it without a copy and loads into it
in place, resharding to any mesh size); the state of a param an owner steps whole is a plain
tensor on the owner (DCP reads any box of it into another layout's pieces, and writes a whole one
from pieces). The keys are the state's paths, as zero's ZeRO checkpoints name them
(`zero.functional.adapters.state_names`: torch's names for a rule that mirrors a ``torch.optim``
class), so a ZeRO-1/2 checkpoint continues here and this one there. Shared leaves (counts) are
saved under every param that shares them.

Under a plan over HSDP's replicas a rank's state is a run of its piece's elements, which no
placement describes: it is a ``ShardedTensor`` of the boxes of the param's shape the run covers,
views into the state, as zero's flat ZeRO plans save theirs. So is the state of a per-head param
stepped by whole heads (`zero.plans.fsdp2.HEADS`): the rows of the heads a rank steps. Master
copies (``master_dtype``) are saved as per-element state under ``"master"``; a checkpoint without
them starts them from the params.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zero.backends import comm
from zero.backends.checkpoint.dcp_pieces import quiet
from zero.backends.precision import MASTER_KEY
from zero.functional.adapters.executor import load_leaf, load_sets
from zero.functional.adapters.state_names import named_leaves, per_param
from zero.functional.adapters.state_tree import as_tree
from zero.plans.chunks import range_boxes
from zero.plans.fsdp2 import HEADS

__all__ = ["fsdp2_entries", "load_fsdp2_entries", "start_states"]


def start_states(executor: Any, optimizer: Any) -> None:
    """Start every trainable param's state, as its first step would (every rank calls this: an
    owner's matrices are gathered whole), so that reading ``optimizer.state`` needs no collective."""
    for k, group in enumerate(optimizer.param_groups):
        _start(executor, optimizer, k, tuple(i for i, p in enumerate(group["params"]) if p.requires_grad))


def fsdp2_entries(executor: Any, optimizer: Any, saving: bool = True) -> Iterator[tuple[int, str, Any]]:
    """``(param position, key, value)`` of this rank's state, each value in its param's placement:
    a per-element leaf of a piece as a DTensor like the param (over the replicas: a
    ``ShardedTensor`` of the boxes its run covers), a 1-D leaf of one element per ``k`` of a
    piece's (quantized codes, block scales) as a ``ShardedTensor`` of runs, a leaf an owner keeps
    whole as it is; masters under ``"master"``. A param this rank neither holds a piece of nor
    owns has none. Not ``saving`` (``optimizer.state``, which torch's tools read as tensors), a
    run is the state itself, not a ``ShardedTensor``."""
    plan = executor.plan
    for k, group in enumerate(optimizer.param_groups):
        first, sets = executor.layout.firsts[k], optimizer.set_states_of(k)
        for keep in sets.sets():
            tree_names = optimizer.names_of(k, keep)
            shapes = executor.whole_shapes(k, keep, lambda k=k, keep=keep, tree_names=tree_names:
                                           _whole_shapes(optimizer, executor, k, keep, tree_names))
            for i, key, pos, leaf in per_param(sets.named(keep, tree_names), keep):
                t = first + i
                if pos is None or plan.owner[t] >= 0 or not isinstance(leaf, torch.Tensor):
                    yield t, key, leaf
                    continue
                per = _per(shapes.get((key, pos)), plan.metas[t].shape)
                per = per if per <= 0 or plan.runs_cut_at(t, per) else 0  # a placeholder's k: not runs
                if per == 0:
                    yield t, key, _whole_shaped(plan, t, key, leaf, shapes.get((key, pos)))
                elif not _runs(plan, t) or leaf.numel():  # (a run may hold no part of it here)
                    yield t, key, _placed_leaf(executor, t, leaf, per, key, saving)
        for i in range(len(group["params"])):
            if first + i in executor.masters:
                master = executor.masters[first + i]
                yield first + i, MASTER_KEY, master if plan.owner[first + i] >= 0 else \
                    _placed_leaf(executor, first + i, master, -1, MASTER_KEY, saving)


def _placed_leaf(executor: Any, t: int, leaf: torch.Tensor, per: int, key: str, saving: bool) -> Any:
    """A leaf of a piece in its param's placement: per element (``per`` -1) a DTensor like the
    param, or over the replicas a ``ShardedTensor`` of its run's boxes; ``per`` k a
    ``ShardedTensor`` of runs (not ``saving``: a run is the leaf itself)."""
    if not saving and (per >= 0 or _runs(executor.plan, t)):
        return leaf
    # a leaf stepped in place is the same tensor from save to save: its wrapper is made once
    if per < 0:
        return executor.placed(t, key, leaf, lambda: _per_element(executor, t, leaf))
    return executor.placed(t, key, leaf, lambda: _as_runs(executor, t, leaf, per, key))


def _whole_shaped(plan: Any, t: int, key: str, leaf: torch.Tensor, whole: tuple[int, ...] | None) -> torch.Tensor:
    """A leaf of a piece that is neither per element nor in runs: saved as it is (the same on every
    rank, DCP writes it once) when the rule keeps it in that shape for the whole param too (a
    placeholder, a statistic summed over the ranks); otherwise a ``ValueError`` naming it."""
    if whole is not None and tuple(leaf.shape) == whole:
        return leaf
    raise ValueError(f"state {key!r} of {plan.metas[t].name!r} is kept per rank's rows in a shape of its own "
                     f"({tuple(leaf.shape)}; the whole param's is {whole}): it has no layout DCP can reshard, so it "
                     "cannot be saved by FQN; step this param whole on an owner")


def _whole_shapes(optimizer: Any, executor: Any, k: int, keep: tuple[int, ...], tree_names: list[str] | None
                  ) -> dict:
    """``(key, position) -> shape`` of the state the rule starts for the whole params of a set
    (asked on meta tensors: a placeholder that happens to have a piece's shape is not one)."""
    first, metas = executor.layout.firsts[k], executor.plan.metas
    meta = [torch.empty(metas[first + i].shape, dtype=getattr(torch, metas[first + i].dtype), device="meta")
            for i in keep]
    sets = optimizer.set_states_of(k)
    state = sets.tx.init(as_tree(meta, tree_names))
    return {(key, pos): tuple(leaf.shape) for key, pos, leaf in named_leaves(state, len(keep), tree_names, sets.names)
            if isinstance(leaf, torch.Tensor)}


def _per(leaf_shape: tuple[int, ...] | None, shape: tuple[int, ...]) -> int:
    if leaf_shape is None:
        return 0
    if leaf_shape == shape:
        return -1
    numel, n = math.prod(shape), math.prod(leaf_shape)
    return numel // n if len(leaf_shape) == 1 and 0 < n <= numel and numel % n == 0 else 0


def _per_element(executor: Any, t: int, leaf: torch.Tensor) -> Any:
    """This rank's part of a per-element state leaf of param ``t``: a DTensor in the param's
    placement where it is the rank's whole piece, else (a plan over the replicas) a
    ``ShardedTensor`` of the boxes its run covers."""
    meta, plan = executor.plan.metas[t], executor.plan
    if not _runs(plan, t):
        placements = executor.placements(t)
        return placed(leaf, executor.mesh, placements, meta.shape)
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


def _runs(plan: Any, t: int) -> bool:
    """Whether what a rank steps of param ``t`` is a run of it no placement describes (over the
    replicas; a per-head param's whole heads)."""
    return plan.replicas > 1 or plan.owner[t] == HEADS


def _boxes(executor: Any, t: int, rank: int, device: torch.device) -> list[tuple[Any, int, int]]:
    """``(ShardMetadata, start, numel)`` of each box of param ``t`` that mesh rank ``rank``'s part
    covers (``start``: where it begins in the part)."""
    from torch.distributed._shard.metadata import ShardMetadata

    plan = executor.plan
    if plan.owner[t] == HEADS:
        at, n = plan.head_run(t, rank)
        return [(ShardMetadata(list(b.offsets), list(b.sizes), f"rank:{_global(executor, rank)}/{device}"),
                 b.start - at, b.numel) for b in range_boxes(plan.metas[t].shape, at, at + n)]
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
    return executor.mesh_ranks[rank]


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


def placed(local: torch.Tensor, mesh: Any, placements: tuple, shape: tuple[int, ...]) -> DTensor:
    """``local`` (the live state, not a copy) as this rank's part of a DTensor of ``shape``.

    torch 2.13 pickles a DTensor whose local tensor is a view at a storage offset (a small state
    leaf of a packed step is one) through that view's storage and fails ("an invalid python
    storage"); a wrapper made over a fresh tensor of the same layout, then given the view as its
    local tensor, pickles through the view as any tensor does (``torch.save``, or
    ``broadcast_object_list``) and is the same DTensor to every op and to DCP."""
    if not local.storage_offset():
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=_stride(shape))
    out = DTensor.from_local(torch.empty_like(local), mesh, placements, run_check=False, shape=torch.Size(shape),
                             stride=_stride(shape))
    out._local_tensor = local
    return out


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def load_fsdp2_entries(executor: Any, optimizer: Any, entries: dict[int, dict[str, Any]]) -> None:
    """Load ``entries`` (by param position: this rank's parts, as `fsdp2_entries` gives them and
    ``dcp.load`` fills them in place, or whole tensors of each param's shape, cut here by the plan)
    into the states, leaf by leaf; masters a dict lacks start again from their params."""
    plan = executor.plan
    for t, master in list(executor.masters.items()):
        saved = (entries.get(t) or {}).get(MASTER_KEY)
        if saved is None:
            del executor.masters[t]  # the next step takes it from the loaded param
            continue
        _into(executor, t, master, saved, MASTER_KEY)

    def into(t: int, pos: int | None, key: str, leaf: Any, saved: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            return load_leaf(leaf, saved, plan.metas[t].name, key)
        if not leaf.numel() and _runs(plan, t):
            return leaf  # no part of this param here, nor an entry
        return _into(executor, t, leaf, saved, key)

    load_sets(optimizer, entries, lambda k, idx: _start(executor, optimizer, k, idx), into)


def _start(executor: Any, optimizer: Any, k: int, idx: tuple[int, ...]) -> None:
    """Start the state of group ``k``'s params at ``idx`` (with saved state, none here: not stepped
    yet in this run) as a step would (every rank loads together: an owner's matrices are gathered)."""
    with executor.starting(k, idx) as (keep, leaves):
        optimizer.ensure_state(k, keep, leaves)


def _into(executor: Any, t: int, leaf: torch.Tensor, saved: Any, key: str) -> torch.Tensor:
    """``saved`` (this rank's part, or the whole tensor of param ``t``'s shape) into ``leaf``."""
    got = _local_of(executor, t, saved, leaf)
    if isinstance(got, torch.Tensor) and got.shape != leaf.shape and tuple(got.shape) == executor.plan.metas[t].shape \
            and tuple(leaf.shape) != tuple(got.shape):
        got = executor.cut(t, got)  # a whole tensor (a plain optimizer's state): this rank's part of it
    if not isinstance(got, torch.Tensor) or got.shape != leaf.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"the state dict's {key!r} of {executor.plan.metas[t].name!r} has shape {shape} here, the "
                         f"state {tuple(leaf.shape)}")
    if got.data_ptr() != leaf.data_ptr():
        leaf.copy_(got)
    return leaf


def _local_of(executor: Any, t: int, value: Any, leaf: torch.Tensor) -> Any:
    """This rank's part of a loaded value of param ``t``, in ``leaf``'s shape: a DTensor's local
    tensor, a ShardedTensor's local shards (one: as it is; several: the boxes of this rank's part
    of the param, each written into its place in ``leaf`` unless DCP loaded it there), or the value."""
    if isinstance(value, DTensor):
        return value.to_local()
    if not hasattr(value, "local_shards"):
        return value
    shards = value.local_shards()
    if len(shards) == 1 and shards[0].tensor.numel() == leaf.numel():
        return shards[0].tensor.view(leaf.shape)
    flat = leaf.reshape(-1)
    mine = {(tuple(box.shard_offsets), tuple(box.shard_sizes)): (at, n)
            for box, at, n in _boxes(executor, t, executor.me, leaf.device)}
    for shard in shards:
        where = mine.get((tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes)))
        if where is None or where[1] != shard.tensor.numel():
            raise ValueError(f"a loaded state of {executor.plan.metas[t].name!r} holds a box at "
                             f"{shard.metadata.shard_offsets} that is not one of this rank's")
        at, n = where
        if shard.tensor.data_ptr() != flat[at:].data_ptr():
            flat[at:at + n].copy_(shard.tensor.reshape(-1))
    return leaf
