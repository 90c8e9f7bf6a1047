"""Second moments in less memory than the params: Adafactor's row and column factors and SM3's
covers (``optax.scale_by_factored_rms``, ``scale_by_param_block_rms``, ``scale_by_sm3``).

A matrix's second moment is stored as its row means and column means (over the two largest
axes), so the state of an ``m x n`` weight costs ``m + n`` numbers instead of ``m n``. These
rules read whole tensors' shapes: under a flat plan, which steps pieces, they are a ``ValueError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    NO_PARAMS_MSG,
    EmptyState,
    GradientTransformation,
    count_inc,
    count_zero,
    step_count,
    tree_leaves,
    tree_map,
    zeros_like,
)
from zero.functional.elementwise import abs_sq, moment

__all__ = ['FactoredState', 'scale_by_factored_rms', 'scale_by_param_block_rms', 'ScaleBySM3State', 'scale_by_sm3']


class FactoredState(NamedTuple):
    """State of ``scale_by_factored_rms`` (``optax.FactoredState``).

    Fields:
        count: steps taken, 0-d int32.
        v_row, v_col: per factored param, its second moment's means over the largest and the
            second largest axis (a 1-element placeholder for a param not factored).
        v: per param not factored, its second moment (a 1-element placeholder otherwise).
    """

    count: torch.Tensor
    v_row: Any
    v_col: Any
    v: Any


def _decay_rate_pow(i: int | torch.Tensor, exponent: float = 0.8) -> torch.Tensor:
    """``1 - (i + 1)^-exponent``, in float32 as Optax computes it (``i`` an int, or a tensor
    when traced: see `step_count`)."""
    return 1.0 - torch.as_tensor(i + 1).to(torch.float32) ** (-exponent)


def _factored_dims(shape: torch.Size, factored: bool, min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """The (second largest, largest) axes to factor over, or None to keep the full moment."""
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda d: shape[d])  # stable, as NumPy's argsort on ties
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return order[-2], order[-1]


def _zero_moments(p: torch.Tensor, dims: tuple[int, int] | None) -> tuple[torch.Tensor, ...]:
    """(v_row, v_col, v) for one param: the factors' zeros, or the full moment's, with 1-element
    placeholders for the unused fields (as Optax keeps them)."""
    if dims is None:
        return sharding.placeholder(p), sharding.placeholder(p), torch.zeros_like(p)
    d1, d0 = dims
    return torch.zeros_like(p.sum(d0)), torch.zeros_like(p.sum(d1)), sharding.placeholder(p)


def scale_by_factored_rms(factored: bool = True, decay_rate: float = 0.8, step_offset: int = 0,
                          min_dim_size_to_factor: int = 128, epsilon: float = 1e-30,
                          decay_rate_fn: Callable[[int, float], Any] = _decay_rate_pow) -> GradientTransformation:
    """Scale by the root of a factored second moment (Adafactor's core; ``optax.scale_by_factored_rms``).

    Params with 2 or more axes whose second largest is at least ``min_dim_size_to_factor`` keep
    row and column means of ``g^2 + epsilon``; the others keep the full moment. The decay at step
    ``t`` is ``decay_rate_fn(t - step_offset, decay_rate)``.
    """

    def init(params):
        leaves, treedef = optree.tree_flatten(params)
        moments = [_zero_moments(p, _factored_dims(p.shape, factored, min_dim_size_to_factor)) for p in leaves]
        unflat = lambda i: optree.tree_unflatten(treedef, [m[i] for m in moments])
        return FactoredState(count_zero(), unflat(0), unflat(1), unflat(2))

    def one(g, v_row, v_col, v, p, decay):
        dims = _factored_dims(p.shape, factored, min_dim_size_to_factor)
        g_sq = abs_sq(g) + epsilon
        if dims is None:
            new_v = (decay * v + (1.0 - decay) * g_sq).to(p.dtype)
            return g * new_v ** -0.5, sharding.placeholder(p), sharding.placeholder(p), new_v
        d1, d0 = dims
        new_row = (decay * v_row + (1.0 - decay) * g_sq.mean(d0)).to(p.dtype)
        new_col = (decay * v_col + (1.0 - decay) * g_sq.mean(d1)).to(p.dtype)
        reduced_d1 = d1 - 1 if d1 > d0 else d1
        row_factor = (new_row / new_row.mean(reduced_d1, keepdim=True)) ** -0.5
        update = g * row_factor.unsqueeze(d0) * (new_col ** -0.5).unsqueeze(d1)
        return update, new_row, new_col, sharding.placeholder(p)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        g_leaves, treedef = optree.tree_flatten(updates)
        sharding.whole_tensors(g_leaves, "scale_by_factored_rms (adafactor)",  # the vectors step by element
                               needs=lambda shape: _factored_dims(shape, factored, min_dim_size_to_factor) is not None)
        decay = decay_rate_fn(step_count(state.count) - step_offset, decay_rate)
        columns = [treedef.flatten_up_to(t) for t in (state.v_row, state.v_col, state.v, params)]
        results = [one(g, *rest, decay) for g, *rest in zip(g_leaves, *columns)]
        unflat = lambda i: optree.tree_unflatten(treedef, [r[i] for r in results])
        return unflat(0), FactoredState(count_inc(state.count), unflat(1), unflat(2), unflat(3))

    return GradientTransformation(init, update)


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    """Multiply each update by its param's root mean square, at least ``min_scale``
    (``optax.scale_by_param_block_rms``); under a flat plan each mean square is its whole
    param's (`zero.functional.sharding.axis_means`)."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        leaves, treedef = optree.tree_flatten(updates)
        squares = sharding.axis_means([abs_sq(p) for p in treedef.flatten_up_to(params)], sharding.every_axis)
        return treedef.unflatten([u * torch.clamp(torch.sqrt(ms), min=min_scale)
                                  for u, ms in zip(leaves, squares)]), state

    return GradientTransformation(lambda params: EmptyState(), update)


class ScaleBySM3State(NamedTuple):
    """State of ``scale_by_sm3`` (``optax.ScaleBySM3State``).

    Fields:
        mu: per param, a list with one 1-D accumulator per axis (the maxima of the second moment
            over the other axes).
        nu: the momentum of the scaled updates, a pytree like the params.
    """

    mu: Any
    nu: Any


def _sm3_accumulate(g: torch.Tensor, covers: list[torch.Tensor], b2: float) -> torch.Tensor:
    """The second moment: ``g^2`` plus the smallest of the axes' covers (the cover itself for a vector)."""
    old_weight, new_weight = b2, (1.0 - b2) if b2 != 1.0 else 1.0
    shaped = [c.reshape([1] * i + [g.shape[i]] + [1] * (g.dim() - i - 1)) for i, c in enumerate(covers)]
    cover = shaped[0] if g.dim() < 2 else functools.reduce(torch.minimum, shaped)
    return new_weight * g * g + old_weight * cover


def _sm3_covers(accum: torch.Tensor) -> list[torch.Tensor]:
    """Per axis, the maxima of ``accum`` over the other axes (a vector's own values)."""
    if accum.dim() < 2:
        return [accum]
    return [accum.amax(dim=[d for d in range(accum.dim()) if d != i]) for i in range(accum.dim())]


def scale_by_sm3(b1: float = 0.9, b2: float = 1.0, eps: float = 1e-8) -> GradientTransformation:
    """SM3: a second moment kept as one accumulator per axis (memory ``sum`` of the dims, not
    their product), then momentum ``b1`` (``optax.scale_by_sm3``). Real params of at least one
    dimension, whole (not a flat plan's pieces)."""

    def init(params):
        for p in tree_leaves(params):
            if p.is_complex() or p.dim() == 0:
                raise ValueError(f"scale_by_sm3 needs real params of at least one dimension, got a {p.dtype} "
                                 f"param of shape {tuple(p.shape)}")
        mu = tree_map(lambda p: [torch.zeros(n, dtype=p.dtype, device=p.device) for n in p.shape], params)
        return ScaleBySM3State(mu, zeros_like(params))

    def update(updates, state, params=None):
        g_leaves, treedef = optree.tree_flatten(updates)
        # a vector's cover is the vector: its pieces in a flat shard step as they would whole
        sharding.whole_tensors(g_leaves, "scale_by_sm3", needs=lambda shape: len(shape) >= 2)
        covers, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        accums = [_sm3_accumulate(g, c, b2) for g, c in zip(g_leaves, covers)]
        scaled = [g * torch.where(a > 0, torch.rsqrt(a + eps), 0.0) for g, a in zip(g_leaves, accums)]
        nu = [moment(u, n, b1, 1) for u, n in zip(scaled, nus)]
        unflat = lambda xs: optree.tree_unflatten(treedef, xs)
        return unflat(nu), ScaleBySM3State(unflat([_sm3_covers(a) for a in accums]), unflat(nu))

    return GradientTransformation(init, update)
