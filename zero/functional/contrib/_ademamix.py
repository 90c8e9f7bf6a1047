"""AdEMAMix and its simplified form: Adam with a second, slow EMA of the gradients mixed into
the step (mirrors ``optax.contrib.scale_by_ademamix``, ``ademamix``,
``scale_by_simplified_ademamix``, ``simplified_ademamix`` and their states, argument for
argument). Element-wise: a piece of a tensor steps as the whole would."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import (
    GradientTransformation,
    as_dtype,
    check_non_negative,
    check_unit,
    count_inc,
    count_zero,
    step_count,
    zeros_like,
)
from zero.functional.combine import chain
from zero.functional.elementwise import debias, moment
from zero.functional.foreach import as_scalar_for, elementwise_map

__all__ = ["ScaleByAdemamixState", "scale_by_ademamix", "ademamix", "ScaleBySimplifiedAdEMAMixState",
           "scale_by_simplified_ademamix", "simplified_ademamix"]


class ScaleByAdemamixState(NamedTuple):
    """State of ``scale_by_ademamix`` (``optax.contrib.ScaleByAdemamixState``).

    Fields:
        count: steps taken, 0-d int32; count_m2: steps of the slow EMA (its schedules' count).
        m1: the fast EMA; m2: the slow EMA; nu: the second moment (pytrees like the params).
    """

    count: torch.Tensor
    count_m2: torch.Tensor
    m1: Any
    m2: Any
    nu: Any


class ScaleBySimplifiedAdEMAMixState(NamedTuple):
    """State of ``scale_by_simplified_ademamix`` (``optax.contrib.ScaleBySimplifiedAdEMAMixState``).

    Fields:
        t: steps taken, 0-d int32; m: the (undamped) momentum; n: the second moment.
    """

    t: torch.Tensor
    m: Any
    n: Any


def _at(value: Any, count: torch.Tensor) -> Any:
    """A hyperparameter or a schedule read at ``count`` (a number eager, a tensor traced)."""
    return value(step_count(count)) if callable(value) else value


def scale_by_ademamix(b1: float = 0.9, b2: float = 0.999, b3: ScalarOrSchedule = 0.9999,
                      alpha: ScalarOrSchedule = 6.0, eps: float = 1e-8, eps_root: float = 0.0,
                      mu_dtype: Any = None) -> GradientTransformation:
    r"""AdEMAMix's rescaling (``optax.contrib.scale_by_ademamix``).

    .. math::
        m_1 \leftarrow \beta_1 m_1 + (1-\beta_1) g,\quad m_2 \leftarrow \beta_3 m_2 + (1-\beta_3) g,\quad
        \nu \leftarrow \beta_2 \nu + (1-\beta_2) g^2,\quad
        u = \frac{\hat m_1 + \alpha m_2}{\sqrt{\hat\nu + \epsilon_{root}} + \epsilon}

    ``b3`` and ``alpha`` may be schedules of ``count_m2`` (the paper warms both up).
    """
    check_unit("b1", b1)
    check_unit("b2", b2)
    check_non_negative("eps", eps)
    mu_dtype = as_dtype(mu_dtype, "mu_dtype")

    def init(params):
        return ScaleByAdemamixState(count_zero(), count_zero(), zeros_like(params, mu_dtype),
                                    zeros_like(params, mu_dtype), zeros_like(params, mu_dtype))

    def update(updates, state, params=None):
        c_b3, c_alpha = _at(b3, state.count_m2), _at(alpha, state.count_m2)
        m1 = elementwise_map(lambda g, m: moment(g, m, b1, 1), updates, state.m1)
        m2 = elementwise_map(lambda g, m: moment(g, m, as_scalar_for(c_b3, m), 1), updates, state.m2)
        nu = elementwise_map(lambda g, v: moment(g, v, b2, 2), updates, state.nu)
        count = count_inc(state.count)
        c = step_count(count)
        out = elementwise_map(lambda a, b, v: (debias(a, b1, c) + as_scalar_for(c_alpha, b) * b)
                              / (torch.sqrt(debias(v, b2, c) + eps_root) + eps), m1, m2, nu)
        return out, ScaleByAdemamixState(count, count_inc(state.count_m2), m1, m2, nu)

    return GradientTransformation(init, update)


@alias
def ademamix(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, b3: ScalarOrSchedule = 0.9999,
             alpha: ScalarOrSchedule = 5.0, eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Any = None,
             weight_decay: float = 0.0, mask: Mask | None = None) -> GradientTransformation:
    r"""AdEMAMix: Adam plus ``alpha`` times a slow EMA of the gradients (``optax.contrib.ademamix``).

    Args:
        learning_rate: a float or a schedule.
        b1, b2: Adam's decays; b3: the slow EMA's decay (or a schedule of it).
        alpha: the slow EMA's weight (or a schedule); eps, eps_root: outside and inside the root.
        mu_dtype: dtype of the moments; weight_decay, mask: decoupled weight decay.

    Returns:
        ``chain(scale_by_ademamix, add_decayed_weights, scale_by_learning_rate)``.

    Reference: Pagliardini et al., The AdEMAMix Optimizer: Better, Faster, Older, 2024
    (arXiv:2409.03137).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.ademamix(0.1, alpha=0.0)  # alpha 0: Adam's first step
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.1000])
    """
    return chain(scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root, mu_dtype),
                 T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_learning_rate(learning_rate))


def scale_by_simplified_ademamix(b1: float = 0.99, b2: float = 0.95, alpha: ScalarOrSchedule = 0.0,
                                 eps: float = 1e-8, eps_root: float = 0.0) -> GradientTransformation:
    r"""Simplified AdEMAMix's rescaling (``optax.contrib.scale_by_simplified_ademamix``).

    .. math::
        m \leftarrow \beta_1 m + g,\quad n \leftarrow \beta_2 n + (1-\beta_2) g^2,\quad
        u = \frac{m + \alpha g}{\sqrt{\hat n + \epsilon_{root}} + \epsilon}
    """
    check_unit("b2", b2)
    check_non_negative("eps", eps)

    def init(params):
        return ScaleBySimplifiedAdEMAMixState(count_zero(), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None):
        c_alpha = _at(alpha, state.t)
        m = elementwise_map(lambda g, m: g + b1 * m, updates, state.m)
        n = elementwise_map(lambda g, n: moment(g, n, b2, 2), updates, state.n)
        t = count_inc(state.t)
        c = step_count(t)
        out = elementwise_map(lambda m, g, n: (m + as_scalar_for(c_alpha, g) * g)
                              / (torch.sqrt(debias(n, b2, c) + eps_root) + eps), m, updates, n)
        return out, ScaleBySimplifiedAdEMAMixState(t, m, n)

    return GradientTransformation(init, update)


@alias
def simplified_ademamix(learning_rate: ScalarOrSchedule, b1: float = 0.99, b2: float = 0.95,
                        alpha: ScalarOrSchedule = 0.0, eps: float = 1e-8, eps_root: float = 0.0,
                        weight_decay: float = 0.0, mask: Mask | None = None) -> GradientTransformation:
    r"""Simplified AdEMAMix: one undamped momentum plus ``alpha`` times the gradient
    (``optax.contrib.simplified_ademamix``).

    Args:
        learning_rate: a float or a schedule.
        b1: the momentum's decay (no ``1 - b1`` damping); b2: the second moment's decay.
        alpha: the gradient's weight (or a schedule); eps, eps_root: outside and inside the root.
        weight_decay, mask: decoupled weight decay.

    Returns:
        ``chain(scale_by_simplified_ademamix, add_decayed_weights, scale_by_learning_rate)``.

    Reference: Morwani et al., Connections between Schedule-Free Optimizers, AdEMAMix, and
    Accelerated SGD Variants, 2025 (arXiv:2502.02431).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.simplified_ademamix(0.1)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> u
        tensor([-0.1000])
    """
    return chain(scale_by_simplified_ademamix(b1, b2, alpha, eps, eps_root), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_learning_rate(learning_rate))
