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
)
from zero.functional.elementwise import abs_sq
from zero.functional.foreach import elementwise_map, traced

__all__ = ["clip", "global_norm", "clip_by_global_norm", "clip_by_block_rms", "adaptive_grad_clip",
           "per_example_global_norm_clip", "per_example_layer_norm_clip"]


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
        if not traced() and norm < max_norm:  # nothing to clip: no pass over the updates
            return updates, state
        small = norm < max_norm  # traced: a tensor, so one graph holds both outcomes
        return elementwise_map(lambda g: torch.where(small, g, g / norm.to(g.dtype) * max_norm), updates), state

    # A chain starting with it folds it into its kernel (zero.functional.kernels.chains): its spec says so.
    return GradientTransformation(lambda params: EmptyState(), update, spec=Spec("clip_by_global_norm",
                                                                                 {"max_norm": max_norm}))


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """Scale each update so its root mean square is at most ``threshold`` (``optax.clip_by_block_rms``);
    under a flat plan each mean square is its whole tensor's (`zero.functional.sharding.axis_means`)."""
    def update(updates, state, params=None):
        leaves, treedef = optree.tree_flatten(updates)
        squares = sharding.axis_means([abs_sq(u) for u in leaves], sharding.every_axis)
        return treedef.unflatten([u / torch.clamp(torch.sqrt(ms) / threshold, min=1.0)
                                  for u, ms in zip(leaves, squares)]), state

    return stateless_tx(update)


_UNIT_AXES = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def _unit_axes(axis: int | tuple[int, ...] | None):
    """Optax's ``unitwise_norm``'s axes for a tensor of a shape: per output unit (axis 0 of a
    linear layer's IO kernel, the spatial and input axes of a HWIO conv), or every axis for
    scalars and vectors; ``axis`` given: those."""
    def axes_of(shape: tuple[int, ...]) -> tuple[int, ...]:
        if axis is not None:
            return (axis,) if isinstance(axis, int) else tuple(axis)
        if sum(d != 1 for d in shape) <= 1:
            return tuple(range(len(shape)))
        if len(shape) not in _UNIT_AXES:
            raise ValueError(f"adaptive_grad_clip expects params of 1 to 5 dimensions, got shape {shape}: "
                             "pass axis= to name the reduction axes")
        return _UNIT_AXES[len(shape)]
    return axes_of


def _unitwise_norms(leaves: list[torch.Tensor], axis: int | tuple[int, ...] | None) -> list[torch.Tensor]:
    """Each leaf's unit norms, broadcastable to it (whole tensors' under a flat plan)."""
    return [torch.sqrt(s) for s in sharding.axis_sums([abs_sq(x) for x in leaves], _unit_axes(axis))]


def adaptive_grad_clip(clipping: float, eps: float = 1e-3,
                       axis: int | tuple[int, ...] | None = None) -> GradientTransformation:
    """Clip each unit's gradient to ``clipping * max(|param unit|, eps)`` (AGC, NFNets;
    ``optax.adaptive_grad_clip``). Under a flat plan the units are whole tensors' (one small
    all-reduce for the gradients' norms and one for the params')."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        grads, treedef = optree.tree_flatten(updates)
        g_norms, p_norms = _unitwise_norms(grads, axis), _unitwise_norms(treedef.flatten_up_to(params), axis)

        def one(g, g_norm, p_norm):
            max_norm = clipping * torch.clamp(p_norm, min=eps)
            return torch.where(g_norm < max_norm, g, g * (max_norm / torch.clamp(g_norm, min=1e-6)))

        return treedef.unflatten([one(*x) for x in zip(grads, g_norms, p_norms)]), state

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


def per_example_layer_norm_clip(grads: Any, global_l2_norm_clip: float, uniform: bool = True) -> tuple[Any, Any]:
    """Clip each example's gradient layer by layer (axis 0 of every leaf is the batch) and sum over
    examples; returns the sums and, per layer, how many examples were clipped
    (``optax.per_example_layer_norm_clip``). Each layer's bound is ``global_l2_norm_clip``
    shared out equally (``uniform``) or by the layer's share of the elements, so the layers'
    bounds square-sum to the global one."""
    leaves, treedef = optree.tree_flatten(grads)
    if not leaves or any(g.dim() == 0 for g in leaves):
        raise ValueError("Unlike other transforms, `per_example_layer_norm_clip` expects `grads` to have a batch "
                         f"dimension in the 0th axis; got shapes: {[tuple(g.shape) for g in leaves]}")
    total = sum(g[0].numel() for g in leaves)
    bounds = [global_l2_norm_clip * ((1.0 / len(leaves)) if uniform else g[0].numel() / total) ** 0.5 for g in leaves]
    pairs = [per_example_global_norm_clip(g, bound) for g, bound in zip(leaves, bounds)]
    return treedef.unflatten([s for s, _ in pairs]), treedef.unflatten([n for _, n in pairs])
