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

from zero.plans.checks import check_int
from zero.plans.shards import LocalIndices, group_ranges, local_order

__all__ = ["to_global", "to_local", "assemble", "local_dict", "check_compatible", "state_nbytes", "is_per_element"]


def to_global(shards: Sequence[dict], indices: Sequence[LocalIndices], param_groups: list[dict],
              owner: Sequence[int]) -> dict[str, Any]:
    """Merge each rank's local ``state_dict()`` into the global one (``indices``: `local_indices`)."""
    state: dict[int, Any] = {}
    for shard, per_group in zip(shards, indices):
        flat_local = [j for g in shard["param_groups"] for j in g["params"]]
        for j, i in zip(flat_local, local_order(per_group)):
            if j in shard["state"]:
                state[i] = shard["state"][j]
    return assemble(state, shards, param_groups, list(owner))


def assemble(state: dict[int, Any], shards: Sequence[dict], param_groups: list[dict], placement: Any) -> dict:
    """The global state dict of per-param ``state`` (global indices), with the groups' settings.

    `zero.functional` local states (``tx_states``) cannot be split per param: they travel per
    rank, with the ``placement`` they reload onto (``owner``: the partition's owners, or a flat
    plan's fingerprint).
    """
    ranges = group_ranges([len(g["params"]) for g in param_groups])
    groups = [{**_settings(g), "params": list(r)} for g, r in zip(param_groups, ranges)]
    out: dict[str, Any] = {"state": dict(sorted(state.items())), "param_groups": groups}
    tx_states = [shard["tx_states"] for shard in shards if "tx_states" in shard]
    if tx_states:
        out["tx_states"], out["owner"] = tx_states, placement
    return out


def _settings(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


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
        check_int("state_dict's param index", index, 0, len(params))
        for key, value in (st or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                raise ValueError(f"state_dict's {key!r} for param {index} has shape {tuple(value.shape)} but the "
                                 f"param has shape {tuple(params[index].shape)}: it was saved for a different model")


def to_local(state_dict: dict, per_group: LocalIndices, rank: int, owner: Sequence[int]) -> dict[str, Any]:
    """This rank's local ``state_dict`` out of a global one (its owned params, local indices)."""
    state = {j: state_dict["state"][i] for j, i in enumerate(local_order(per_group)) if i in state_dict["state"]}
    return local_dict(state, [len(idx) for idx in per_group], state_dict, rank, list(owner))


def local_dict(state: dict[int, Any], group_sizes: Sequence[int], state_dict: dict, rank: int,
               placement: Any) -> dict[str, Any]:
    """A local ``state_dict`` of ``state`` (local indices) and the global one's group settings."""
    ranges = group_ranges(group_sizes)
    groups = [{**_settings(g), "params": list(r)} for g, r in zip(state_dict["param_groups"], ranges)]
    local: dict[str, Any] = {"state": state, "param_groups": groups}
    if "tx_states" in state_dict:
        saved = state_dict["owner"]
        if (list(saved) if isinstance(saved, (list, tuple)) else saved) != placement \
                or rank >= len(state_dict["tx_states"]):
            raise ValueError("this state_dict holds zero.functional transformation states, which reload only onto "
                             "the same plan and world size they were saved with; use a torch.optim class as "
                             "optimizer_class to reshard state")
        local["tx_states"] = state_dict["tx_states"][rank]
    return local


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state a torch optimizer holds (what `zero.make_plan` predicts per rank)."""
    return sum(v.nbytes for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def is_per_element(key: str, value: Any, per_element: set[str] | None) -> bool:
    """Whether a state entry is shaped like its param (``per_element``: those keys; None: every
    tensor with dimensions), as opposed to per-param scalars such as ``step``."""
    if not isinstance(value, torch.Tensor):
        return False
    return key in per_element if per_element is not None else value.dim() > 0
