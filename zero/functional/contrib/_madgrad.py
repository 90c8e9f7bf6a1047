"""MADGRAD: dual averaging with a cube-root denominator and momentum (mirrors
``optax.contrib.scale_by_madgrad``, ``madgrad`` and ``MadgradState``). Element-wise."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import (
    NO_PARAMS_MSG,
    GradientTransformation,
    check_unit,
    count_inc,
    count_zero,
    step_count,
    tree_map,
    zeros_like,
)
from zero.functional.combine import chain
from zero.functional.foreach import as_scalar_for, elementwise_map

__all__ = ["MadgradState", "scale_by_madgrad", "madgrad"]


class MadgradState(NamedTuple):
    """State of ``scale_by_madgrad`` (``optax.contrib.MadgradState``).

    Fields:
        count: steps taken, 0-d int32; grad_sum_sq: the weighted sum of squared gradients;
        s: the weighted sum of gradients; x0: the params at the start.
    """

    count: torch.Tensor
    grad_sum_sq: Any
    s: Any
    x0: Any


def scale_by_madgrad(learning_rate: ScalarOrSchedule, momentum: float = 0.9, eps: float = 1e-6
                     ) -> GradientTransformation:
    r"""MADGRAD's step (``optax.contrib.scale_by_madgrad``): with :math:`\lambda_k = (\eta + \epsilon)\sqrt{k+1}`,

    .. math::
        s_k = s_{k-1} + \lambda_k g_k,\quad \nu_k = \nu_{k-1} + \lambda_k g_k^2,\quad
        z = x_0 - s_k / (\nu_k^{1/3} + \epsilon),\quad x_{k+1} = (1-\beta) z + \beta x_k

    Its updates already carry the learning rate (and the sign): chain no ``scale_by_learning_rate``.
    The weight :math:`\lambda_k` is a Python float here; Optax's is float32 (``jnp.sqrt`` of its int32
    count), so float64 runs agree with Optax's to float32's rounding of it.
    """
    check_unit("momentum", momentum, closed=True)

    def init(params):
        return MadgradState(count_zero(), zeros_like(params), zeros_like(params),
                            tree_map(lambda p: p.detach().clone(), params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        count = step_count(state.count)
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        lamb = (lr + eps) * (math.sqrt(count + 1) if isinstance(count, int) else torch.sqrt(count + 1))
        sums_sq = elementwise_map(lambda v, g: v + (as_scalar_for(lamb, g) * g * g).to(g.dtype), state.grad_sum_sq,
                                  updates)
        sums = elementwise_map(lambda s, g: s + (as_scalar_for(lamb, g) * g).to(g.dtype), state.s, updates)
        out = elementwise_map(lambda x0, s, v, x: (1 - momentum) * (x0 - s / (torch.pow(v, 1 / 3) + eps))
                              + momentum * x - x, state.x0, sums, sums_sq, params)
        return out, MadgradState(count_inc(state.count), sums_sq, sums, state.x0)

    return GradientTransformation(init, update)


@alias
def madgrad(learning_rate: ScalarOrSchedule, momentum: float = 0.9, weight_decay: float = 0.0,
            eps: float = 1e-6) -> GradientTransformation:
    """MADGRAD (``optax.contrib.madgrad``): ``chain(add_decayed_weights, scale_by_madgrad)``.

    Reference: Defazio and Jelassi, Adaptivity without Compromise: A Momentumized, Adaptive,
    Dual Averaged Gradient Method for Stochastic Optimization, 2021 (arXiv:2101.11075).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.madgrad(0.1, momentum=0.0)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([8.0]), tx.init(p), p)
        >>> round(float(u), 4)  # -(lr s / nu^(1/3)): -0.1 * 8 / (0.1 * 64) ** (1/3)
        -0.4309
    """
    return chain(T.add_decayed_weights(weight_decay), scale_by_madgrad(learning_rate, momentum, eps))
