"""D-Adaptation AdamW: AdamW whose step size is estimated as it trains (mirrors
``optax.contrib.dadapt_adamw`` and ``DAdaptAdamWState``). Its estimate needs two sums over the
whole model a step: asked of `zero.functional.sharding` (`total_sums`, one all-reduce)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import (
    NO_PARAMS_MSG,
    GradientTransformation,
    check_unit,
    count_inc,
    count_zero,
    lowest_dtype,
    step_count,
    tree_leaves,
    tree_map,
    zeros_like,
)
from zero.functional.sharding import total_sums

__all__ = ["DAdaptAdamWState", "dadapt_adamw"]


class DAdaptAdamWState(NamedTuple):
    """State of ``dadapt_adamw`` (``optax.contrib.DAdaptAdamWState``).

    Fields:
        exp_avg, exp_avg_sq: Adam's moments (the first of ``d g``); grad_sum: the weighted sum
        ``s`` of ``d g``; estim_lr: the estimate ``d``; numerator_weighted: its numerator (0-d);
        count: steps taken, 0-d int32.
    """

    exp_avg: Any
    exp_avg_sq: Any
    grad_sum: Any
    estim_lr: torch.Tensor
    numerator_weighted: torch.Tensor
    count: torch.Tensor


@alias
def dadapt_adamw(learning_rate: ScalarOrSchedule = 1.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 estim_lr0: float = 1e-6, weight_decay: float = 0.0) -> GradientTransformation:
    r"""D-Adaptation AdamW (``optax.contrib.dadapt_adamw``): AdamW at step size ``d * lr``, with

    .. math::
        r_t = \sqrt{\beta_2} r_{t-1} + (1-\sqrt{\beta_2})\, d_t \eta_t \langle g_t, s_{t-1}/(\sqrt{v_{t-1}}
        + \epsilon)\rangle,\quad d_{t+1} = \max\Big(d_t, \frac{r_t}{(1-\sqrt{\beta_2}) \lVert s_t\rVert_1}\Big)

    Reference: Defazio and Mishchenko, Learning-Rate-Free Learning by D-Adaptation, 2023
    (arXiv:2301.07733).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.dadapt_adamw()
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> float(u) < 0
        True
    """
    beta1, beta2 = betas
    check_unit("beta1", beta1)
    check_unit("beta2", beta2)
    sb2 = beta2 ** 0.5

    def init(params):
        dtype = lowest_dtype(params)
        return DAdaptAdamWState(zeros_like(params), zeros_like(params), zeros_like(params),
                                torch.tensor(estim_lr0, dtype=dtype), torch.zeros((), dtype=dtype), count_zero())

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        sched = learning_rate(step_count(state.count)) if callable(learning_rate) else learning_rate
        t = count_inc(state.count)
        c = step_count(t)
        bc = (1 - beta2 ** c) ** 0.5 / (1 - beta1 ** c)
        dlr = (state.estim_lr * sched * bc).to(state.numerator_weighted.dtype)
        sums, squares = tree_leaves(state.grad_sum), tree_leaves(state.exp_avg_sq)
        weighted = [s / (torch.sqrt(v) + eps) for s, v in zip(sums, squares)]
        exp_avg = tree_map(lambda m, g: beta1 * m + (1 - beta1) * dlr * g, state.exp_avg, updates)
        exp_avg_sq = tree_map(lambda v, g: beta2 * v + (1 - beta2) * g * g, state.exp_avg_sq, updates)
        grad_sum = tree_map(lambda s, g: sb2 * s + (1 - sb2) * dlr * g, state.grad_sum, updates)
        products = [g * w for g, w in zip(tree_leaves(updates), weighted)]
        numerator_acum, l1 = total_sums(products, [s.abs() for s in tree_leaves(grad_sum)])
        dtype = state.numerator_weighted.dtype
        numerator = sb2 * state.numerator_weighted + (1 - sb2) * dlr * numerator_acum.to(dtype)
        estim_lr = torch.maximum(state.estim_lr, numerator / ((1 - sb2) * l1.to(dtype)))
        out = tree_map(lambda m, v, p: -weight_decay * dlr * p - m / (torch.sqrt(v) + eps), exp_avg, exp_avg_sq, params)
        return out, DAdaptAdamWState(exp_avg, exp_avg_sq, grad_sum, estim_lr, numerator, t)

    return GradientTransformation(init, update)
