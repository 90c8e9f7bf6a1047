"""The optimizer state of zero's rules over FSDP2's params in DCP's layout, and back.

Each per-param state tensor of a param a rank steps in pieces is a DTensor in the param's
placement (its local tensor is the state itself, so DCP saves it without a copy and loads into it
in place, resharding to any mesh size); the state of a param an owner steps whole is a plain
tensor on the owner (DCP reads any box of it into another layout's pieces, and writes a whole one
from pieces). The keys are the state's paths, as zero's ZeRO checkpoints name them (``"0.mu"``),
so a ZeRO-1/2 checkpoint continues here and this one there. Shared leaves (counts,
hyperparameters) are saved under every param that shares them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from zero.backends import comm
from zero.functional.adapters.state_tree import as_tree, map_state_leaves, state_leaves

__all__ = ["fsdp2_state_dict", "load_fsdp2_state_dict"]


def _sets(optimizer: Any) -> Iterator[tuple[int, dict, tuple[int, ...], list[str] | None]]:
    """Each group's state sets (every param given a state first, as a step would start it)."""
    executor = optimizer.executor
    for k, group in enumerate(optimizer.param_groups):
        idx = tuple(i for i, p in enumerate(group["params"]) if p.requires_grad)
        if not optimizer.set_states(k) and idx:
            keep, leaves = executor.whole_leaves(k, idx)
            optimizer.ensure_state(k, keep, leaves)
        states = optimizer.set_states(k)
        for keep in list(states):
            yield k, states, keep, optimizer.names_of(k, keep)


def _entries(optimizer: Any, names: list[str]) -> Iterator[tuple[int, str, str, int | None, Any, bool]]:
    """``(t, the param's FQN, key, position, leaf, per element)`` of every state leaf, per param it
    belongs to. ``per element``: the rule's leaf for the whole param is shaped like the param (so
    this rank's is shaped like its piece), asked of the rule on meta tensors: a placeholder that
    happens to have a piece's shape is not one."""
    executor = optimizer.executor
    for k, states, keep, tree_names in _sets(optimizer):
        first = executor.layout.firsts[k]
        shapes = _whole_shapes(optimizer, k, keep, tree_names)
        for key, pos, leaf in state_leaves(states[keep], len(keep), tree_names):
            for i in keep if pos is None else [keep[pos]]:
                whole = executor.plan.metas[first + i].shape
                yield first + i, names[first + i], key, pos, leaf, shapes.get((key, pos)) == whole


def _whole_shapes(optimizer: Any, k: int, keep: tuple[int, ...], tree_names: list[str] | None) -> dict:
    """``(key, position) -> shape`` of the state the rule starts for the whole params of a set."""
    first, metas = optimizer.executor.layout.firsts[k], optimizer.executor.plan.metas
    meta = [torch.empty(metas[first + i].shape, dtype=getattr(torch, metas[first + i].dtype), device="meta")
            for i in keep]
    state = optimizer.rule(k).init(as_tree(meta, tree_names))
    return {(key, pos): tuple(leaf.shape) for key, pos, leaf in state_leaves(state, len(keep), tree_names)
            if isinstance(leaf, torch.Tensor)}


def fsdp2_state_dict(optimizer: Any, names: list[str]) -> dict[str, Any]:
    """``{"state": {fqn: {key: tensor}}, "param_groups": [..., {"params": [fqn, ...]}]}`` of a
    `zero.functional.Optimizer` over FSDP2's params (``names``: every param's FQN, in order)."""
    executor, state, shared = optimizer.executor, {}, []
    for t, fqn, key, pos, leaf, per_element in _entries(optimizer, names):
        pieces = pos is not None and executor.plan.owner[t] < 0 and isinstance(leaf, torch.Tensor)
        if pieces and not per_element:
            shared.append((fqn, key, leaf))
        state.setdefault(fqn, {})[key] = _as_dtensor(executor, t, leaf) if pieces and per_element else leaf
    _check_shared(executor, shared)
    groups, first = [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                       "params": names[first:first + n]})
        first += n
    return {"state": state, "param_groups": groups}


def _as_dtensor(executor: Any, t: int, leaf: torch.Tensor) -> DTensor:
    """This rank's piece of a per-element state leaf of param ``t`` as a DTensor in its placement."""
    meta, plan = executor.plan.metas[t], executor.plan
    return DTensor.from_local(leaf, executor.mesh, [Shard(plan.dims[t])], run_check=False, shape=torch.Size(meta.shape),
                              stride=_stride(meta.shape))


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

        def fill(key: str, pos: int | None, leaf: Any, keep=keep, first=first) -> Any:
            t = first + keep[0 if pos is None else pos]
            value = _value(sd, names[t], key)
            if not isinstance(leaf, torch.Tensor):
                return value
            got = value.to_local() if isinstance(value, DTensor) else value
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


def _value(sd: dict, fqn: str, key: str) -> Any:
    st = sd["state"].get(fqn)
    if not st or key not in st:
        raise ValueError(f"optim_state_dict has no {key!r} for {fqn!r} (it has {sorted(st or ())}): it was saved "
                         "by another transformation or optimizer")
    return st[key]

