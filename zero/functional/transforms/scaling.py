"""Scaling by a constant, a schedule, a learning rate or the Polyak step size (``optax.scale``,
``scale_by_schedule``, ``scale_by_learning_rate``, ``scale_by_polyak``)."""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    Schedule,
    Spec,
    count_inc,
    count_zero,
    identity,
    tree_leaves,
)
from zero.functional.foreach import elementwise_map, foreach_map, ops

__all__ = ['ScaleByScheduleState', 'scale', 'scale_by_schedule', 'scale_by_learning_rate', 'scale_by_polyak']


class ScaleByScheduleState(NamedTuple):
    """State of ``scale_by_schedule`` (``optax.ScaleByScheduleState``).

    Fields:
        count: steps taken, a 0-d int32 tensor (the schedule's argument).
    """

    count: torch.Tensor


def scale(step_size: float) -> GradientTransformation:
    """Multiply updates by ``step_size`` (``optax.scale``)."""
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, p=None: (scale_tree(u, step_size), s),
                                  spec=Spec("scale", {"step_size": step_size}))


def scale_tree(tree, factor):
    if not optree.tree_leaves(tree):
        return tree
    return foreach_map(lambda us: ops.mul(us, factor), tree)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply updates by ``step_size_fn(count)`` (``optax.scale_by_schedule``)."""
    if not callable(step_size_fn):
        raise TypeError(f"step_size_fn must be callable, got {type(step_size_fn).__name__}")

    def update(updates, state, params=None):
        step = step_size_fn(state.count)
        return scale_tree(updates, step), ScaleByScheduleState(count_inc(state.count))

    return GradientTransformation(lambda params: ScaleByScheduleState(count_zero()), update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule | None, *,
                           flip_sign: bool = True) -> GradientTransformation:
    """Multiply by ``-learning_rate`` (a float or a schedule); ``optax.scale_by_learning_rate``."""
    if learning_rate is None:
        return identity()
    if not (callable(learning_rate) or isinstance(learning_rate, (int, float, torch.Tensor))):
        raise TypeError(f"learning_rate must be a number or a schedule, got {type(learning_rate).__name__}")
    m = -1 if flip_sign else 1
    if callable(learning_rate):
        tx = scale_by_schedule(lambda count: m * learning_rate(count))
    else:
        tx = scale(m * learning_rate)
    return tx._replace(spec=Spec("scale_by_learning_rate", {"learning_rate": learning_rate, "flip_sign": flip_sign}))


def scale_by_polyak(f_min: float = 0.0, max_learning_rate: float = 1.0, eps: float = 0.0,
                    variant: str = "sps") -> GradientTransformation:
    """The Polyak step ``min((f - f_min) / (|g|^2 + eps), max_learning_rate)`` times the updates
    (``optax.scale_by_polyak``); ``update`` needs the objective's value as ``value=``.

    ``variant="sps+"`` uses the positive part of ``f - f_min``. An unknown variant is a
    ``ValueError`` here (Optax raises it at the first update).
    """
    if variant not in ("sps", "sps+"):
        raise ValueError(f"scale_by_polyak variant must be 'sps' or 'sps+', got {variant!r}")

    def update(updates, state, params=None, *, value, **extra_args):
        sq_norm = sharding.global_norm(tree_leaves(updates)) ** 2
        gap = torch.as_tensor(value - f_min).to(sq_norm.dtype)
        if variant == "sps+":
            gap = torch.relu(gap)
        denom = sq_norm + eps
        tiny = denom <= torch.finfo(sq_norm.dtype).eps
        step = torch.where(tiny, 0.0, torch.clamp(gap / denom, max=max_learning_rate))
        return elementwise_map(lambda g: step.to(g.dtype) * g, updates), state

    return GradientTransformation(lambda params: EmptyState(), update)
