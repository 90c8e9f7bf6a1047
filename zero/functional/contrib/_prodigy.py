"""Prodigy: Adam whose learning rate is estimated from the distance travelled (mirrors
``optax.contrib.prodigy`` and ``ProdigyState``, argument for argument).

Its estimate needs two sums over the whole model each step (the dot product of the gradients with
the distance from the start, and the total of ``|s|``): asked of `zero.functional.sharding`
(`total_sums`), so under a sharded optimizer each rank sums its pieces and one all-reduce joins
them; everything else is element-wise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional.aliases import alias
from zero.functional.base import (
    NO_PARAMS_MSG,
    GradientTransformation,
    ScalarOrSchedule,
    check_non_negative,
    check_positive,
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

__all__ = ["ProdigyState", "prodigy"]


class ProdigyState(NamedTuple):
    """State of ``prodigy`` (``optax.contrib.ProdigyState``).

    Fields:
        exp_avg, exp_avg_sq: Adam's moments of ``d * g``; grad_sum: the weighted sum ``s`` of
            ``d * g``; params0: the params at the start (pytrees like the params).
        estim_lr: the estimate ``d``; numerator_weighted: its numerator (0-d, params' dtype).
        count: steps taken, 0-d int32.
    """

    exp_avg: Any
    exp_avg_sq: Any
    grad_sum: Any
    params0: Any
    estim_lr: torch.Tensor
    numerator_weighted: torch.Tensor
    count: torch.Tensor


@alias
def prodigy(learning_rate: ScalarOrSchedule = 1.0, betas: tuple[float, float] = (0.9, 0.999),
            beta3: float | None = None, eps: float = 1e-8, estim_lr0: float = 1e-6, estim_lr_coef: float = 1.0,
            weight_decay: float = 0.0, safeguard_warmup: bool = False) -> GradientTransformation:
    r"""Prodigy (``optax.contrib.prodigy``): Adam on ``d g`` with the step size ``d`` estimated as

    .. math::
        r_t = \beta_3 r_{t-1} + \frac{d_t}{d_0}\, d_t \eta_t \langle g_t, x_0 - x_t\rangle,\quad
        s_t = \beta_3 s_{t-1} + \frac{d_t \eta_t}{d_0} d_t g_t,\quad
        d_{t+1} = \max\Big(d_t,\ c\,\frac{r_t}{\lVert s_t\rVert_1}\Big)

    Args:
        learning_rate: a multiplier of the estimate (1.0: none), or a schedule.
        betas: Adam's decays; beta3: the sums' decay (``sqrt(beta2)`` by default).
        eps: Adam's, scaled by ``d``; estim_lr0: the first estimate ``d_0``;
        estim_lr_coef: ``c``; weight_decay: decoupled, times ``d * lr``;
        safeguard_warmup: leave the learning rate out of ``s`` (for a warm-up schedule).

    Reference: Mishchenko and Defazio, Prodigy: An Expeditiously Adaptive Parameter-Free
    Learner, 2023 (arXiv:2306.06101).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.prodigy()
        >>> p = torch.tensor([1.0, -1.0])
        >>> u, state = tx.update(torch.tensor([2.0, -2.0]), tx.init(p), p)
        >>> u  # the first step moves by d_0 * lr
        tensor([-1.0000e-06,  1.0000e-06])
    """
    beta1, beta2 = betas
    check_unit("beta1", beta1)
    check_unit("beta2", beta2)
    beta3 = beta2 ** 0.5 if beta3 is None else beta3
    check_non_negative("eps", eps)
    check_positive("estim_lr0", estim_lr0)
    check_non_negative("weight_decay", weight_decay)

    def init(params):
        dtype = lowest_dtype(params)
        return ProdigyState(zeros_like(params), zeros_like(params), zeros_like(params),
                            tree_map(lambda p: p.detach().clone(), params), torch.tensor(estim_lr0, dtype=dtype),
                            torch.zeros((), dtype=dtype), count_zero())

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        t = count_inc(state.count)
        sched = learning_rate(step_count(state.count)) if callable(learning_rate) else learning_rate
        c = step_count(t)
        bc = (1 - beta2 ** c) ** 0.5 / (1 - beta1 ** c)
        d = state.estim_lr
        dlr = torch.as_tensor(d * sched * bc, dtype=d.dtype)
        dg = tree_map(lambda g: d * g, updates)
        exp_avg = tree_map(lambda m, x: beta1 * m + (1 - beta1) * x, state.exp_avg, dg)
        exp_avg_sq = tree_map(lambda v, x: beta2 * v + (1 - beta2) * x * x, state.exp_avg_sq, dg)
        weight = d if safeguard_warmup else dlr
        grad_sum = tree_map(lambda s, x: beta3 * s + weight * x / estim_lr0, state.grad_sum, dg)
        # the two sums over the whole model, in one collective when sharded
        products = [g * (p0 - p) for g, p0, p in zip(tree_leaves(updates), tree_leaves(state.params0),
                                                      tree_leaves(params))]
        numerator_acum, denominator = total_sums(products, [s.abs() for s in tree_leaves(grad_sum)])
        numerator = beta3 * state.numerator_weighted + (d / estim_lr0) * dlr * numerator_acum.to(d.dtype)
        estimate = estim_lr_coef * numerator / denominator.to(d.dtype)
        estim_lr = torch.maximum(d, estimate)
        out = tree_map(lambda m, v, p: -weight_decay * dlr * p - dlr * m / (torch.sqrt(v) + estim_lr * eps),
                       exp_avg, exp_avg_sq, params)
        return out, ProdigyState(exp_avg, exp_avg_sq, grad_sum, state.params0, estim_lr, numerator, t)

    return GradientTransformation(init, update)

