"""MoMo and MoMo-Adam: momentum with a model-based (Polyak-like) step size read from the loss
(mirrors ``optax.contrib.momo``, ``momo_adam`` and their states). They need the loss
(``update(..., value=loss)``; ``Optimizer.step(closure)`` passes the closure's) and inner products
over the whole model: asked of `zero.functional.sharding` (`total_sums`, one all-reduce a step).
Under a data-parallel optimizer pass the loss averaged over the ranks, as the gradients are."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import (
    NO_PARAMS_MSG,
    GradientTransformation,
    count_inc,
    count_zero,
    first_or,
    lowest_dtype,
    step_count,
    tree_leaves,
    tree_map,
    zeros_like,
)
from zero.functional.sharding import total_sums

__all__ = ["MomoState", "momo", "MomoAdamState", "momo_adam"]

_TINY = torch.finfo(torch.float64).eps  # Optax's jnp.finfo(float).eps


class MomoState(NamedTuple):
    """State of ``momo`` (``optax.contrib.MomoState``).

    Fields:
        exp_avg: the momentum; barf: the averaged loss; gamma: the averaged ``<g, x>``; lb: the
        loss's lower bound; count: steps taken (0-d int32). Scalars in the params' lowest dtype.
    """

    exp_avg: Any
    barf: torch.Tensor
    gamma: torch.Tensor
    lb: torch.Tensor
    count: torch.Tensor


class MomoAdamState(NamedTuple):
    """State of ``momo_adam`` (``optax.contrib.MomoAdamState``): `MomoState` with Adam's second
    moment ``exp_avg_sq``."""

    exp_avg: Any
    exp_avg_sq: Any
    barf: torch.Tensor
    gamma: torch.Tensor
    lb: torch.Tensor
    count: torch.Tensor


def _loss(value: Any, dtype: torch.dtype) -> torch.Tensor:
    if value is None:
        raise ValueError("momo needs the loss: update(updates, state, params, value=loss), or "
                         "optimizer.step(closure) with a closure that returns it")
    return torch.as_tensor(value, dtype=dtype).detach()


def _scalars(dtype: torch.dtype, lower_bound: float) -> tuple[torch.Tensor, ...]:
    return torch.zeros((), dtype=dtype), torch.zeros((), dtype=dtype), torch.tensor(lower_bound, dtype=dtype)


def _step_size(alpha, wd, barf, gamma, lb, iprod, norm, lower_bound, adapt, bc1=1.0):
    """MoMo's truncated step ``tau`` and the new lower bound (``bc1``: MoMo-Adam's correction)."""
    k = 1 + alpha * wd
    if adapt:
        cap = k * (barf - gamma) + iprod
        lb = torch.where(cap < k * bc1 * lb, torch.clamp(cap / (2 * bc1 * k), min=lower_bound), lb)
    t1 = torch.clamp(k * (barf - bc1 * lb - gamma) + iprod, min=0.0) / norm
    t1 = torch.where(norm <= _TINY, torch.zeros_like(t1), t1)
    tau = torch.clamp(t1, max=alpha / bc1)
    new_lb = torch.clamp(((barf + iprod - gamma) - 0.5 * tau * norm) / bc1, min=lower_bound) if adapt else lb
    return tau, new_lb


@alias
def momo(learning_rate: ScalarOrSchedule = 1.0, beta: float = 0.9, lower_bound: float = 0.0, weight_decay: float = 0.0,
         adapt_lower_bound: bool = False) -> GradientTransformation:
    """MoMo (``optax.contrib.momo``): SGD with momentum at the step
    ``min(lr, (f_bar - lb - gamma + <d, x>)_+ / |d|^2)``, from the loss passed as ``value``.

    Reference: Schaipp et al., MoMo: Momentum Models for Adaptive Learning Rates, 2023
    (arXiv:2305.07583).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.momo()
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p, value=1.0)  # loss 1, |g|^2 = 4
        >>> u
        tensor([-0.5000])
    """

    def init(params):
        return MomoState(zeros_like(params), *_scalars(lowest_dtype(params), lower_bound), count_zero())

    def update(updates, state, params=None, *, value=None, **extra_args):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        count = step_count(state.count)
        bt = first_or(count, 0.0, beta)
        barf = bt * state.barf + (1 - bt) * _loss(value, state.barf.dtype)
        exp_avg = tree_map(lambda m, g: bt * m + (1 - bt) * g, state.exp_avg, updates)
        ms, gs, ps = tree_leaves(exp_avg), tree_leaves(updates), tree_leaves(params)
        g_x, norm, iprod = total_sums([g * p for g, p in zip(gs, ps)], [m * m for m in ms],
                                      [m * p for m, p in zip(ms, ps)])
        dtype = state.barf.dtype
        gamma = bt * state.gamma + (1 - bt) * g_x.to(dtype)
        alpha = learning_rate(count) if callable(learning_rate) else learning_rate
        tau, lb = _step_size(alpha, weight_decay, barf, gamma, state.lb, iprod.to(dtype), norm.to(dtype),
                             lower_bound, adapt_lower_bound)
        decay = alpha * weight_decay / (1 + alpha * weight_decay)
        out = tree_map(lambda m, p: -decay * p - tau * m, exp_avg, params)
        return out, MomoState(exp_avg, barf, gamma, lb, count_inc(state.count))

    return GradientTransformation(init, update)


@alias
def momo_adam(learning_rate: ScalarOrSchedule = 1e-2, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
              lower_bound: float = 0.0, weight_decay: float = 0.0, adapt_lower_bound: bool = False
              ) -> GradientTransformation:
    """MoMo-Adam (``optax.contrib.momo_adam``): MoMo's step size on Adam's preconditioned momentum.

    Reference: Schaipp et al., MoMo: Momentum Models for Adaptive Learning Rates, 2023
    (arXiv:2305.07583).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.momo_adam()
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p, value=1.0)
        >>> float(u) < 0
        True
    """

    def init(params):
        dtype = lowest_dtype(params)
        return MomoAdamState(zeros_like(params), zeros_like(params), *_scalars(dtype, lower_bound), count_zero())

    def update(updates, state, params=None, *, value=None, **extra_args):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        dtype = state.barf.dtype
        t = count_inc(state.count)
        c = step_count(t)
        barf = b1 * state.barf + (1 - b1) * _loss(value, dtype)
        exp_avg = tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.exp_avg, updates)
        exp_avg_sq = tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state.exp_avg_sq, updates)
        bc2 = torch.as_tensor(1 - b2 ** c, dtype=dtype)
        precond = tree_map(lambda v: eps + torch.sqrt(v / bc2), exp_avg_sq)
        ms, gs, ps, qs = tree_leaves(exp_avg), tree_leaves(updates), tree_leaves(params), tree_leaves(precond)
        norm, g_x, iprod = total_sums([m * (m / q) for m, q in zip(ms, qs)], [g * p for g, p in zip(gs, ps)],
                                      [m * p for m, p in zip(ms, ps)])
        gamma = b1 * state.gamma + (1 - b1) * g_x.to(dtype)
        alpha = learning_rate(step_count(state.count)) if callable(learning_rate) else learning_rate
        bc1 = torch.as_tensor(1 - b1 ** c, dtype=dtype)
        tau, lb = _step_size(alpha, weight_decay, barf, gamma, state.lb, iprod.to(dtype), norm.to(dtype),
                             lower_bound, adapt_lower_bound, bc1)
        decay = alpha * weight_decay / (1 + alpha * weight_decay)
        out = tree_map(lambda m, q, p: -decay * p - tau * m / q, exp_avg, precond, params)
        return out, MomoAdamState(exp_avg, exp_avg_sq, barf, gamma, lb, t)

    return GradientTransformation(init, update)
