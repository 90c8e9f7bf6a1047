"""Clipping (``optax.clip``, ``clip_by_global_norm``, ``clip_by_block_rms``, ``adaptive_grad_clip``,
``per_example_global_norm_clip``). Global and per-tensor norms come from `zero.functional.sharding`,
so they are the whole model's under a sharded step."""

from __future__ import annotations

from typing import Any

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    NO_PARAMS_MSG,
    EmptyState,
    GradientTransformation,
    Spec,
    check_non_negative,
    stateless_tx,
    tree_leaves,
    tree_map,
)
from zero.functional.fast.elementwise import abs_sq
from zero.functional.fast.packing import elementwise_map

__all__ = ["clip", "global_norm", "clip_by_global_norm", "clip_by_block_rms", "adaptive_grad_clip",
           "per_example_global_norm_clip"]


def clip(max_delta: float) -> GradientTransformation:
    """Clip every element of the updates to ``[-max_delta, max_delta]``."""
    check_non_negative("max_delta", max_delta)
    return GradientTransformation(
        lambda params: EmptyState(),
        lambda u, s, p=None: (elementwise_map(lambda g: g.clamp(-max_delta, max_delta), u), s))


def global_norm(updates: Any) -> torch.Tensor:
    """The L2 norm of all leaves together (of the whole model's, under a sharded optimizer)."""
    return sharding.global_norm(tree_leaves(updates))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Rescale the updates so their global L2 norm is at most ``max_norm``."""
    check_non_negative("max_norm", max_norm)

    def update(updates, state, params=None):
        norm = global_norm(updates)
        if norm < max_norm:
            return updates, state
        return elementwise_map(lambda g: g / norm.to(g.dtype) * max_norm, updates), state

    # A chain starting with it folds it into its kernel (zero.functional.fast.chains): its spec says so.
    return GradientTransformation(lambda params: EmptyState(), update, spec=Spec("clip_by_global_norm",
                                                                                 {"max_norm": max_norm}))


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """Scale each update so its root mean square is at most ``threshold`` (``optax.clip_by_block_rms``)."""
    def update(updates, state, params=None):
        sharding.whole_tensors(tree_leaves(updates), "clip_by_block_rms")
        return tree_map(lambda u: u / torch.clamp(torch.sqrt(abs_sq(u).mean()) / threshold, min=1.0), updates), state

    return stateless_tx(update)


_UNIT_AXES = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def _unitwise_norm(x: torch.Tensor, axis: int | tuple[int, ...] | None) -> torch.Tensor:
    """Optax's ``unitwise_norm``: per output unit (axis 0 of a linear layer's IO kernel, the
    spatial and input axes of a HWIO conv), or the whole tensor for scalars and vectors."""
    if axis is None and x.squeeze().dim() <= 1:
        axis = tuple(range(x.dim()))
    elif axis is None:
        if x.dim() not in _UNIT_AXES:
            raise ValueError(f"adaptive_grad_clip expects params of 1 to 5 dimensions, got shape {tuple(x.shape)}: "
                             "pass axis= to name the reduction axes")
        axis = _UNIT_AXES[x.dim()]
    squared = abs_sq(x).sum(dim=axis, keepdim=True) if x.dim() else abs_sq(x)
    return torch.sqrt(squared).expand(x.shape)


def adaptive_grad_clip(clipping: float, eps: float = 1e-3,
                       axis: int | tuple[int, ...] | None = None) -> GradientTransformation:
    """Clip each unit's gradient to ``clipping * max(|param unit|, eps)`` (AGC, NFNets;
    ``optax.adaptive_grad_clip``). Needs whole tensors (not a flat plan's pieces)."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        sharding.whole_tensors(tree_leaves(updates), "adaptive_grad_clip")

        def one(g, p):
            g_norm, max_norm = _unitwise_norm(g, axis), clipping * torch.clamp(_unitwise_norm(p, axis), min=eps)
            return torch.where(g_norm < max_norm, g, g * (max_norm / torch.clamp(g_norm, min=1e-6)))

        return tree_map(one, updates, params), state

    return stateless_tx(update)


def per_example_global_norm_clip(grads: Any, l2_norm_clip: float) -> tuple[Any, torch.Tensor]:
    """Clip each example's gradient (axis 0 of every leaf) to global norm ``l2_norm_clip`` and sum
    over examples; returns the sum and how many were clipped (``optax.per_example_global_norm_clip``)."""
    leaves, treedef = optree.tree_flatten(grads)
    if not leaves or any(g.dim() == 0 for g in leaves) or len({g.shape[0] for g in leaves}) != 1:
        raise ValueError("per_example_global_norm_clip expects grads with a batch dimension in the 0th axis")
    norms = torch.sqrt(sum(abs_sq(g).reshape(g.shape[0], -1).sum(1) for g in leaves))
    multipliers = torch.nan_to_num(torch.clamp(l2_norm_clip / norms, max=1.0), nan=1.0)
    clipped = [torch.tensordot(multipliers, g.to(torch.promote_types(g.dtype, multipliers.dtype)), dims=1)
               for g in leaves]
    return optree.tree_unflatten(treedef, clipped), (multipliers < 1.0).sum()
