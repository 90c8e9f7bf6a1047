"""Optimizer state dicts between the global (torch) indexing and each rank's local optimizer.

The global form is exactly a plain ``torch.optim`` state dict over all params: ``state`` keyed by
the param's position across ``param_groups``, each group's ``params`` listing those positions. It
loads into a plain optimizer, into torch's `ZeroRedundancyOptimizer`, and into ours at any world
size, because state is per parameter and each rank just picks what it owns.

A `zero.functional` local optimizer keeps one state per set of params stepped together, which
cannot be split per parameter; its shards travel as they are (``tx_states``) and reload only
onto the same ownership.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["to_global", "to_local", "check_compatible", "state_nbytes"]


def to_global(shards: Sequence[dict], indices: Sequence[list[list[int]]], param_groups: list[dict],
              owner: Sequence[int]) -> dict[str, Any]:
    """Merge each rank's local ``state_dict()`` into the global one.

    ``indices[r][k]`` lists the global indices of rank ``r``'s group ``k``, in local order.
    """
    state: dict[int, Any] = {}
    tx_states = []
    for shard, per_group in zip(shards, indices):
        local = [i for idx in per_group for i in idx]
        flat_local = [j for g in shard["param_groups"] for j in g["params"]]
        for j, i in zip(flat_local, local):
            if j in shard["state"]:
                state[i] = shard["state"][j]
        if "tx_states" in shard:
            tx_states.append(shard["tx_states"])
    groups, start = [], 0
    for g in param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n
    out: dict[str, Any] = {"state": dict(sorted(state.items())), "param_groups": groups}
    if tx_states:
        out["tx_states"], out["owner"] = tx_states, list(owner)
    return out


def check_compatible(state_dict: Any, params: Sequence[torch.Tensor], group_sizes: Sequence[int]) -> None:
    """``ValueError`` naming the mismatch when ``state_dict`` was saved for other params."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        keys = sorted(state_dict) if isinstance(state_dict, dict) else "-"
        raise ValueError("state_dict must be an optimizer state dict with 'state' and 'param_groups' keys, got "
                         f"{type(state_dict).__name__} with keys {keys}")
    saved = [len(g["params"]) for g in state_dict["param_groups"]]
    if saved != list(group_sizes):
        raise ValueError(f"state_dict has param groups of sizes {saved} but this optimizer has {list(group_sizes)}: "
                         "it was saved for a different model or different param groups")
    for index, st in state_dict["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"state_dict has state for param {index!r}, but there are {len(params)} params")
        for key, value in (st or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                raise ValueError(f"state_dict's {key!r} for param {index} has shape {tuple(value.shape)} but the "
                                 f"param has shape {tuple(params[index].shape)}: it was saved for a different model")


def to_local(state_dict: dict, per_group: list[list[int]], rank: int, owner: Sequence[int]) -> dict[str, Any]:
    """This rank's local ``state_dict`` out of a global one (its owned params, local indices)."""
    groups, state, j = [], {}, 0
    for g, idx in zip(state_dict["param_groups"], per_group):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(j, j + len(idx)))})
        for i in idx:
            if i in state_dict["state"]:
                state[j] = state_dict["state"][i]
            j += 1
    local: dict[str, Any] = {"state": state, "param_groups": groups}
    if "tx_states" in state_dict:
        if list(state_dict["owner"]) != list(owner) or rank >= len(state_dict["tx_states"]):
            raise ValueError("this state_dict holds zero.functional transformation states, which reload only onto "
                             "the same world size and ownership they were saved with; use a torch.optim class as "
                             "optimizer_class to reshard state")
        local["tx_states"] = state_dict["tx_states"][rank]
    return local


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state a torch optimizer holds (what `zero.make_plan` predicts per rank)."""
    return sum(v.nbytes for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
