"""What a rank holds (its `RankState`), as the tensors DCP saves under each FQN, and back.

Each held piece (`zero.plans.chunks.Held`, from the plan's `zero.plans.holdings`) of each state
tensor becomes either the tensor itself (the rank holds the whole param's state) or a
``ShardedTensor`` of boxes of the param's shape, views into the state. ``torch.optim`` local
optimizers give their per-param state; `zero.functional` ones their Optax-shaped state, leaf by
leaf. Loading writes each piece back, skipping what DCP already loaded in place.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from math import prod
from typing import Any

import torch

from zero.backends import comm
from zero.backends.local_optimizer import initial_state, is_per_element
from zero.backends.precision import MASTER_KEY
from zero.backends.rank_state import RankState
from zero.functional import sharding
from zero.functional.adapters.state_names import per_param
from zero.plans.chunks import Held, range_boxes

__all__ = ["quiet", "torch_entries", "functional_entries", "functional_leaves", "held_elements", "saved_shape",
           "load_torch", "load_functional", "saved_entry"]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Without torch's deprecation notice for ``ShardedTensor``, which DCP still reads and writes
    natively and which is the one public type for several boxes of a tensor on one rank."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        yield


def torch_entries(state: RankState, saving: bool = True) -> Iterator[tuple[Held, str, Any]]:
    """``(held piece, key, value for DCP)`` of a ``torch.optim`` local optimizer's state (not
    ``saving``: a piece of a param as this rank's elements, not a ``ShardedTensor``: see `_piece`)."""
    local = _local_state(state)
    per_element = state.per_element_keys()
    for h in state.holdings.held:
        for key, value in local["state"].get(h.local, {}).items():
            yield h, key, _piece(state, h, value, 1, saving) if is_per_element(key, value, per_element) else value


def _local_state(state: RankState) -> dict:
    """The local optimizer's state dict (masters included), every param given a state first."""
    initial_state(state.optim, state.trainable_locals())  # a frozen param has no state, as in torch
    return state.state_dict()


def _functional_sets(state: RankState) -> Iterator[tuple[Any, tuple[int, ...], list[int], list[str] | None]]:
    """Each set of a `zero.functional` local optimizer's params stepped together: the group's
    `SetStates`, the set's positions in the group, their positions across groups, their names in
    the state's trees (None: lists). Params without state start from the transformation's
    ``init`` (stepped together, as a step would)."""
    optim, trainable, first = state.optim, state.trainable_locals(), 0
    for k, group in enumerate(optim.param_groups):
        n = len(group["params"])
        with state.answering():
            optim.ensure_state(k, tuple(i for i in range(n) if first + i in trainable))
        sets = optim.set_states_of(k)
        for idx in sets.sets():
            yield sets, idx, [first + i for i in idx], optim.names_of(k, idx)
        first += n


def functional_entries(state: RankState, saving: bool = True) -> Iterator[tuple[Held, str, Any]]:
    """``(held piece, key, value for DCP)`` of a `zero.functional` local optimizer's state (see
    `functional_leaves`; ``saving`` as `torch_entries`)."""
    for h, key, leaf, k in functional_leaves(state):
        yield h, key, _piece(state, h, leaf, k, saving) if k else leaf


def functional_leaves(state: RankState) -> Iterator[tuple[Held, str, Any, int]]:
    """The state of a `zero.functional` local optimizer, per held piece, as torch's per-param
    entries (`zero.functional.adapters.state_names`: each per-param leaf under its path, ``"0.mu"``
    ..., or torch's name for a rule that mirrors a torch.optim class; each shared leaf, a count,
    under every param of its set); masters under `MASTER_KEY`. With each, how many of the param's
    elements one of the leaf's stands for (`_per_element`; 0: the leaf is saved as it is)."""
    held = state.holdings
    params = [p for g in state.optim.param_groups for p in g["params"]]
    for sets, idx, js, names in _functional_sets(state):
        for j, key, pos, leaf in per_param(sets.named(idx, names), tuple(js)):
            for h in held.pieces(j):
                yield h, key, leaf, _per_element(leaf, params[j], h, state, key) if pos is not None else 0
    for j, p in enumerate(params):
        if state.masters.stepped(p) is not None:
            for h in held.pieces(j):
                yield h, MASTER_KEY, p, 1


def held_elements(h: Held, value: torch.Tensor, k: int) -> torch.Tensor:
    """The held piece's part of a local state tensor with one element per ``k`` of the param's
    (flat, a view)."""
    return value.reshape(-1)[h.offset // k:(h.offset + h.end - h.start) // k]


def _per_element(leaf: Any, local: torch.Tensor, h: Held, state: RankState, key: str) -> int:
    """How many of the param's elements each element of a per-param leaf stands for: 1 for a leaf
    shaped like the param (saved in pieces, like the param); ``k > 1`` for a 1-D leaf with one
    element per ``k`` of the param's, which the held piece cuts at multiples of ``k`` (a quantized
    moment's scales, one per block; 4-bit codes, two a byte), saved as pieces of a 1-D tensor of
    ``numel // k`` elements; 0 for a leaf of another shape (a factored statistic, a norm), saved
    whole, which needs the whole param, or a placeholder (SOAP's empty factor of an axis it leaves
    as it is, Adafactor's unused fields: `zero.functional.sharding.placeholder`), the same on every
    rank that holds a piece."""
    if isinstance(leaf, torch.Tensor) and (leaf.numel() == 0 or sharding.is_placeholder(leaf)):
        return 0
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape == local.shape:
        return 1
    if isinstance(leaf, torch.Tensor) and leaf.dim() == 1 and 0 < leaf.numel() < local.numel() \
            and local.numel() % leaf.numel() == 0:
        k = local.numel() // leaf.numel()
        if h.start % k == 0 and h.end % k == 0 and h.offset % k == 0:
            return k
    whole = state.params[h.param].numel()
    if h.end - h.start != whole or local.numel() != whole:
        raise ValueError(f"state {key!r} of param {h.param} is not shaped like the param, and this rank holds only "
                         "part of it (a flat plan): it cannot be saved by FQN; use a whole-param plan")
    return 0


def _piece(state: RankState, h: Held, value: torch.Tensor, k: int = 1, saving: bool = True) -> torch.Tensor:
    """This rank's piece of one state tensor (one element per ``k`` of the param's): the tensor
    itself (the param's shape, or 1-D for ``k > 1``) when it holds all of it, else a
    ``ShardedTensor`` of its boxes, views into ``value``; not ``saving`` (``optimizer.state``,
    which torch's tools read as tensors: a memory tracker asks each for its storage), the held
    elements themselves, a 1-D view."""
    shape = saved_shape(state, h, k)
    if tuple(value.shape) == shape and h.end - h.start == value.numel() * k:
        return value  # the whole tensor, as it is (a tensor subclass, torchao's state, may not reshape)
    flat = held_elements(h, value, k)
    chunks = state.holdings.chunks(h.param)
    if len(chunks) == 1:
        return flat.view(shape)
    if not saving:
        return flat
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    def placed(rank: int) -> str:
        return f"rank:{comm.global_rank(state.process_group, rank)}/{value.device}"

    start, end = h.start // k, h.end // k
    local = [Shard(flat[b.start - start:b.start - start + b.numel].view(b.sizes),
                   ShardMetadata(list(b.offsets), list(b.sizes), placed(state.rank)))
             for b in range_boxes(shape, start, end)]
    everyone = [ShardMetadata(list(b.offsets), list(b.sizes), placed(r))
                for r, s, e in chunks for b in range_boxes(shape, s // k, e // k)]
    meta = ShardedTensorMetadata(everyone, torch.Size(shape), TensorProperties(dtype=value.dtype))
    with quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta,
                                                                         process_group=state.process_group)


def load_torch(state: RankState, names: list[str], sd: dict) -> None:
    """Load into a ``torch.optim`` local optimizer: each held piece into its state (in place
    where DCP loaded into it), masters missing from ``sd`` started again from their params."""
    local = _local_state(state)
    restart: set[int] = set()  # local tensors whose masters start again from their params
    for h in state.holdings.held:
        fqn = names[h.param]
        saved, mine = sd["state"].get(fqn), local["state"].get(h.local)
        if not mine:  # a frozen param: no state here, none to load (it does not step)
            continue
        if saved is None:
            raise ValueError(f"optim_state_dict has no state for {fqn!r}, which this rank steps: it was saved for "
                             "another model or before that param had state")
        missing = sorted(set(mine) - set(saved) - {MASTER_KEY})
        if missing:
            keeps = sorted(set(mine) - {MASTER_KEY})
            raise ValueError(f"optim_state_dict's state for {fqn!r} has {sorted(saved)} but "
                             f"{type(state.optim).__name__} keeps {keeps} (missing {missing}): it was saved by "
                             "another optimizer")
        if MASTER_KEY in mine and MASTER_KEY not in saved:
            restart.add(h.local)
        for key, value in saved.items():
            if key not in mine:
                continue  # e.g. masters saved by a run with them, loaded where params step themselves
            if isinstance(mine[key], torch.Tensor) and mine[key].dim() > 0:
                _copy_piece(mine[key], h, value, fqn, key, tuple(state.params[h.param].shape))
            else:
                mine[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    kept = {j: {k: v for k, v in st.items() if not (k == MASTER_KEY and j in restart)}
            for j, st in local["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": mine["params"]}
              for g, mine in zip(sd["param_groups"], local["param_groups"])]
    state.load_state_dict({"state": kept, "param_groups": groups})


def load_functional(state: RankState, names: list[str], sd: dict) -> None:
    """Load into a `zero.functional` local optimizer's states, leaf by leaf (in place where DCP
    loaded into them), then its masters and the groups' settings."""
    held_by = state.holdings
    params = [p for g in state.optim.param_groups for p in g["params"]]
    for sets, idx, js, tree_names in _functional_sets(state):
        def fill(key: str, pos: int | None, leaf: Any, js: list[int] = js) -> Any:
            held = [h for j in (js if pos is None else [js[pos]]) for h in held_by.pieces(j)]
            for h in held if pos is not None else held[:1]:
                saved = saved_entry(sd, names[h.param], key)
                k = _per_element(leaf, params[h.local], h, state, key) if pos is not None else 0
                if k:
                    _copy_piece(leaf, h, saved, names[h.param], key, saved_shape(state, h, k), k)
                elif isinstance(leaf, torch.Tensor) and leaf.dim():
                    _copy_whole(leaf, saved, names[h.param], key)
                else:
                    leaf = saved
            return leaf
        sets.load(idx, tree_names, fill)
    for j, p in enumerate(params):
        stepped = state.masters.stepped(p)
        for h in held_by.pieces(j) if stepped is not None else ():
            saved = sd["state"].get(names[h.param], {}).get(MASTER_KEY)
            if saved is None:  # a checkpoint without masters: they start again from the loaded params
                p.copy_(stepped)
                break
            _copy_piece(p, h, saved, names[h.param], MASTER_KEY, tuple(state.params[h.param].shape))
    for group, saved in zip(state.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    state.push()


def saved_entry(sd: dict, fqn: str, key: str) -> Any:
    """``sd["state"][fqn][key]``; a ``ValueError`` naming what it has when absent."""
    st = sd["state"].get(fqn)
    if not st or key not in st:
        raise ValueError(f"optim_state_dict has no {key!r} for {fqn!r} (it has {sorted(st or ())}): it was saved "
                         "by another transformation or optimizer")
    return st[key]


def _copy_whole(dst: torch.Tensor, value: Any, fqn: str, key: str) -> None:
    if not isinstance(value, torch.Tensor) or value.shape != dst.shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"optim_state_dict's {key!r} of {fqn!r} has shape {got}, here {tuple(dst.shape)}")
    if value is not dst:
        dst.copy_(value)


def saved_shape(state: RankState, h: Held, k: int) -> tuple[int, ...]:
    """The shape a state tensor with one element per ``k`` of param ``h.param``'s is saved in."""
    return tuple(state.params[h.param].shape) if k == 1 else (state.params[h.param].numel() // k,)


def _copy_piece(dst: torch.Tensor, h: Held, value: Any, fqn: str, key: str, shape: tuple[int, ...],
                k: int = 1) -> None:
    """Write param ``h.param``'s elements ``h.start:h.end`` of ``value`` into ``dst`` at ``h.offset``
    (``value`` and ``dst`` holding one element per ``k`` of the param's: those positions divided
    by ``k``), skipped where ``value`` is a view of that very memory: DCP loaded into it."""
    h = Held(h.param, h.local, h.offset // k, h.start // k, h.end // k) if k > 1 else h
    region = dst.reshape(-1)[h.offset:h.offset + h.end - h.start]
    if hasattr(value, "local_shards"):
        strides = [prod(shape[d + 1:]) for d in range(len(shape))]
        covered = 0
        for shard in value.local_shards():
            start = sum(o * s for o, s in zip(shard.metadata.shard_offsets, strides)) - h.start
            piece = shard.tensor.reshape(-1)
            if start < 0 or start + piece.numel() > region.numel():
                raise ValueError(f"optim_state_dict's {key!r} of {fqn!r} holds a shard outside this rank's elements")
            if piece.data_ptr() != region[start:].data_ptr():
                region[start:start + piece.numel()].copy_(piece)
            covered += piece.numel()
        if covered != region.numel():
            raise ValueError(f"optim_state_dict's {key!r} of {fqn!r} covers {covered} of this rank's "
                             f"{region.numel()} elements")
        return
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"optim_state_dict's {key!r} of {fqn!r} has shape {got} but the param has shape {shape}")
    piece = value.reshape(-1)[h.start:h.end]
    if piece.data_ptr() != region.data_ptr():
        region.copy_(piece)
