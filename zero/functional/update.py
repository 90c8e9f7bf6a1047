"""Applying updates to params (``optax.apply_updates``, ``incremental_update``,
``periodic_update``)."""

from __future__ import annotations

from typing import Any

import optree
import torch

from zero.functional.base import check_structure
from zero.functional.foreach import map_lists, ops, traced

__all__ = ['apply_updates', 'incremental_update', 'periodic_update']


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf, in each param's dtype (a new tree; inputs untouched).
    A ``None`` param stays ``None``, a ``None`` update leaves its param as it is.

    Differentiable, as Optax's, when the updates are: under ``torch.func`` or ``torch.compile``,
    or when an update requires grad (an unrolled inner loop, a learned learning rate). Else it
    records nothing for autograd, so params that require grad (an ``nn.Module``'s) give new
    params that do not keep the old ones' graph."""
    if params is None:
        return None
    p_leaves, treedef = optree.tree_flatten(params)
    u_leaves, u_treedef = optree.tree_flatten(updates)
    if u_treedef != treedef:
        check_structure(updates, params)  # raises, naming the leaves that differ
    differentiable = traced() or any(isinstance(u, torch.Tensor) and u.requires_grad for u in u_leaves)
    with torch.set_grad_enabled(torch.is_grad_enabled() and differentiable):
        return map_lists(_add_in_dtypes, treedef, [p_leaves, u_leaves])


def _add_in_dtypes(ps: list, us: list) -> list:
    """``p + u`` in each param's dtype."""
    return ops.add(ps, [u if u.dtype == p.dtype else u.to(p.dtype) for p, u in zip(ps, us)])


def incremental_update(new_tensors: Any, old_tensors: Any, step_size: float) -> Any:
    """``step_size * new + (1 - step_size) * old`` leaf by leaf, e.g. a target network's Polyak
    average (``optax.incremental_update``); a ``None`` leaf of ``new_tensors`` stays ``None``."""
    return optree.tree_map(lambda new, old: None if new is None else step_size * new + (1.0 - step_size) * old,
                           new_tensors, old_tensors, none_is_leaf=True)


def periodic_update(new_tensors: Any, old_tensors: Any, steps: Any, update_period: int) -> Any:
    """``new_tensors`` every ``update_period`` steps, else ``old_tensors`` (``optax.periodic_update``)."""
    return new_tensors if int(steps) % int(update_period) == 0 else old_tensors
