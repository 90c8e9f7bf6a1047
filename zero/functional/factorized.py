"""Adafactor: second moments kept as row and column factors (``optax.scale_by_factored_rms``,
``optax.scale_by_param_block_rms``, ``optax.adafactor``).

A matrix's second moment is stored as its row means and column means (over the two largest
axes), so the state of an ``m x n`` weight costs ``m + n`` numbers instead of ``m n``. These
rules read whole tensors' shapes: under a flat plan, which steps pieces, they are a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional import transform as T
from zero.functional.alias import ScalarOrSchedule, _alias
from zero.functional.base import NO_PARAMS_MSG, EmptyState, GradientTransformation, count_inc, count_zero, tree_leaves
from zero.functional.combine import chain
from zero.functional.elementwise import abs_sq

__all__ = ["FactoredState", "scale_by_factored_rms", "scale_by_param_block_rms", "adafactor"]


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


def _decay_rate_pow(i: int, exponent: float = 0.8) -> torch.Tensor:
    """``1 - (i + 1)^-exponent``, in float32 as Optax computes it."""
    return 1.0 - torch.tensor(i + 1, dtype=torch.float32) ** (-exponent)


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
    placeholder = torch.zeros(1, dtype=p.dtype, device=p.device)
    if dims is None:
        return placeholder, placeholder, torch.zeros_like(p)
    d1, d0 = dims
    return torch.zeros_like(p.sum(d0)), torch.zeros_like(p.sum(d1)), placeholder


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
        placeholder = torch.zeros(1, dtype=p.dtype, device=p.device)
        g_sq = abs_sq(g) + epsilon
        if dims is None:
            new_v = (decay * v + (1.0 - decay) * g_sq).to(p.dtype)
            return g * new_v ** -0.5, placeholder, placeholder, new_v
        d1, d0 = dims
        new_row = (decay * v_row + (1.0 - decay) * g_sq.mean(d0)).to(p.dtype)
        new_col = (decay * v_col + (1.0 - decay) * g_sq.mean(d1)).to(p.dtype)
        reduced_d1 = d1 - 1 if d1 > d0 else d1
        row_factor = (new_row / new_row.mean(reduced_d1, keepdim=True)) ** -0.5
        update = g * row_factor.unsqueeze(d0) * (new_col ** -0.5).unsqueeze(d1)
        return update, new_row, new_col, placeholder

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        g_leaves, treedef = optree.tree_flatten(updates)
        sharding.whole_tensors(g_leaves, "scale_by_factored_rms (adafactor)")
        decay = decay_rate_fn(int(state.count) - step_offset, decay_rate)
        columns = [treedef.flatten_up_to(t) for t in (state.v_row, state.v_col, state.v, params)]
        results = [one(g, *rest, decay) for g, *rest in zip(g_leaves, *columns)]
        unflat = lambda i: optree.tree_unflatten(treedef, [r[i] for r in results])
        return unflat(0), FactoredState(count_inc(state.count), unflat(1), unflat(2), unflat(3))

    return GradientTransformation(init, update)


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    """Multiply each update by its param's root mean square, at least ``min_scale``
    (``optax.scale_by_param_block_rms``)."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        sharding.whole_tensors(tree_leaves(updates), "scale_by_param_block_rms")
        scale = lambda p: torch.clamp(torch.sqrt(abs_sq(p).mean()), min=min_scale)
        return optree.tree_map(lambda u, p: u * scale(p), updates, params), state

    return GradientTransformation(lambda params: EmptyState(), update)


@_alias
def adafactor(learning_rate: ScalarOrSchedule | None = None, min_dim_size_to_factor: int = 128,
              decay_rate: float = 0.8, decay_offset: int = 0, multiply_by_parameter_scale: bool = True,
              clipping_threshold: float | None = 1.0, momentum: float | None = None,
              dtype_momentum: torch.dtype | str = torch.float32, weight_decay_rate: ScalarOrSchedule | None = None,
              eps: float = 1e-30, factored: bool = True, weight_decay_mask: Any = None) -> GradientTransformation:
    r"""Adafactor: Adam-like steps with factored second moments and relative step sizes.

    .. math:: u_t = -\alpha_t\, \mathrm{RMS}(p)\, \mathrm{clip}\big(g_t / \sqrt{\hat V_t}\big),\quad
        \hat V_t = R_t C_t / \mathrm{mean}(R_t)

    Args:
        learning_rate: a float or a schedule (``None``: no scaling, as Optax).
        min_dim_size_to_factor, decay_rate, decay_offset, eps, factored: as in `scale_by_factored_rms`.
        multiply_by_parameter_scale: scale by each param's root mean square (`scale_by_param_block_rms`).
        clipping_threshold: clip each update's root mean square (``None``: no clipping).
        momentum, dtype_momentum: an optional moving average of the updates, and its dtype.
        weight_decay_rate, weight_decay_mask: optional decoupled weight decay, and where.

    Returns:
        The chain of ``optax.adafactor``. torch's ``Adafactor`` (2.5+) follows the paper's
        later form (no clipping by default, other decay); `from_torch` does not cover it.

    Reference: Shazeer and Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory Cost, 2018.

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.adafactor(0.1)
        >>> p = torch.full((2, 2), 3.0)
        >>> u, _ = tx.update(torch.ones(2, 2), tx.init(p), p)
        >>> u
        tensor([[-0.3000, -0.3000],
                [-0.3000, -0.3000]])
    """
    from zero.functional.more_transforms import clip_by_block_rms

    links = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        links.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        links.append(T.scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        links.append(scale_by_param_block_rms())
    if momentum is not None:
        links.append(T.ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        links.append(T.add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    links.append(T.scale(-1))
    return chain(*links)
