"""Clipping transformations (``optax.clip``, ``optax.clip_by_global_norm``)."""

from __future__ import annotations

from typing import Any

import torch

from zero.functional import sharding
from zero.functional.base import EmptyState, GradientTransformation, check_non_negative, tree_leaves
from zero.functional.packing import elementwise_map

__all__ = ["clip", "clip_by_global_norm", "global_norm"]


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

    return GradientTransformation(lambda params: EmptyState(), update)
