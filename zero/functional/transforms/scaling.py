"""Scaling by a constant, a schedule, a learning rate or the Polyak step size (``optax.scale``,
``scale_by_schedule``, ``scale_by_learning_rate``, ``scale_by_polyak``), by norms
(``normalize_by_update_norm``, ``scale_by_param_block_norm``, layer-wise DoG's
``scale_by_distance_over_gradients``: asked of `zero.functional.sharding`, so exact over pieces),
and of gradients in autograd (``scale_gradient``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    NO_PARAMS_MSG,
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    Schedule,
    Spec,
    as_dtype,
    count_inc,
    count_zero,
    identity,
    tree_leaves,
    tree_map,
)
from zero.functional.foreach import elementwise_map, foreach_map, ops

__all__ = ['ScaleByScheduleState', 'scale', 'scale_by_schedule', 'scale_by_learning_rate', 'scale_by_polyak',
           'normalize_by_update_norm', 'scale_by_param_block_norm', 'ScaleByDistanceOverGradientsState',
           'scale_by_distance_over_gradients', 'scale_gradient']


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


def normalize_by_update_norm(scale_factor: float = 1.0, eps: float = 1e-6) -> GradientTransformation:
    """Divide the updates by their global norm (plus ``eps``) and multiply by ``scale_factor``
    (``optax.normalize_by_update_norm``); the norm is the whole model's under a sharded optimizer."""

    def update(updates, state, params=None):
        norm = sharding.global_norm(tree_leaves(updates))
        factor = (norm + eps) / scale_factor
        return elementwise_map(lambda u: u / factor.to(u.dtype), updates), state

    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_param_block_norm(min_scale: float = 1e-3) -> GradientTransformation:
    """Multiply each update by its whole param's norm, at least ``min_scale``
    (``optax.scale_by_param_block_norm``); per-tensor norms over every rank's pieces when sharded."""

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        leaves, treedef = optree.tree_flatten(updates)
        norms = sharding.tensor_norms(treedef.flatten_up_to(params))
        return treedef.unflatten([u * torch.clamp(n, min=min_scale).to(u.dtype) for u, n in zip(leaves, norms)]), state

    return GradientTransformation(lambda params: EmptyState(), update)


class ScaleByDistanceOverGradientsState(NamedTuple):
    """State of ``scale_by_distance_over_gradients`` (Optax's, of the same name).

    Fields:
        max_dist: per param, the largest distance from its start (or the first ``reps_rel``);
        grad_sum_of_squares: per param, the sum of its gradients' squared norms;
        init_params: the params at the start (in ``param_dtype``).
    Under a sharded optimizer each per-param value is a leaf-shaped tensor holding its whole
    param's value at each element (a rank's piece may hold several params).
    """

    max_dist: Any
    grad_sum_of_squares: Any
    init_params: Any


def scale_by_distance_over_gradients(reps_rel: float = 1e-6, eps: float = 1e-8, param_dtype: Any = torch.float32,
                                     global_scale: float = 1.0) -> GradientTransformation:
    r"""Layer-wise DoG (``optax.scale_by_distance_over_gradients``): each param's step size is
    :math:`s\, \bar r_t / \sqrt{\sum_{i \le t} \lVert g_i\rVert^2 + \epsilon}`, with :math:`\bar r_t`
    its largest distance from its start (at least ``reps_rel (1 + |x_0|)``). Per-tensor norms,
    over every rank's pieces when sharded."""
    dtype = as_dtype(param_dtype, "param_dtype")

    def init(params):
        norms = sharding.tensor_norms(tree_leaves(params))
        leaves, treedef = optree.tree_flatten(params)
        return ScaleByDistanceOverGradientsState(
            treedef.unflatten([reps_rel * (1 + n) for n in norms]),
            # 0-d per param (Optax's shape (1,) would turn a 0-d param's update into shape (1,))
            treedef.unflatten([torch.zeros_like(n) for n in norms]),
            tree_map(lambda p: p.detach().to(dtype, copy=True), params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        grads, treedef = optree.tree_flatten(updates)
        ps, starts = treedef.flatten_up_to(params), treedef.flatten_up_to(state.init_params)
        dists = sharding.tensor_norms([p - x0 for p, x0 in zip(ps, starts)])
        g_norms = sharding.tensor_norms(grads)
        max_dist = [torch.maximum(d, n) for d, n in zip(treedef.flatten_up_to(state.max_dist), dists)]
        g_sos = [s + n * n for s, n in zip(treedef.flatten_up_to(state.grad_sum_of_squares), g_norms)]
        out = [global_scale * (d / torch.sqrt(s + eps)) * g for g, d, s in zip(grads, max_dist, g_sos)]
        return treedef.unflatten(out), ScaleByDistanceOverGradientsState(
            treedef.unflatten(max_dist), treedef.unflatten(g_sos), state.init_params)

    return GradientTransformation(init, update)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, factor, *inputs):
        ctx.factor = factor
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(None if g is None else g * ctx.factor for g in grads))


def scale_gradient(inputs: Any, scale: float) -> Any:
    """``inputs`` unchanged on the way forward, their gradients multiplied by ``scale`` on the way
    back (``optax.scale_gradient``): 0 detaches them, 1 returns them as they are."""
    if scale == 1.0:
        return inputs
    if scale == 0.0:
        return tree_map(lambda x: x.detach(), inputs)
    leaves, treedef = optree.tree_flatten(inputs)
    return treedef.unflatten(list(_ScaleGradient.apply(scale, *leaves)))
