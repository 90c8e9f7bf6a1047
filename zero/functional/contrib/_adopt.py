"""ADOPT: Adam whose step is normalised by the second moment *before* this gradient joins it
(mirrors ``optax.contrib.scale_by_adopt`` and ``adopt``, argument for argument; its state is
``ScaleByAdamState``, as Optax's is). Element-wise: a piece of a tensor steps as the whole would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import (
    GradientTransformation,
    as_dtype,
    check_non_negative,
    check_unit,
    count_inc,
    count_zero,
    first_or,
    step_count,
    tree_map,
    zeros_like,
)
from zero.functional.combine import chain
from zero.functional.elementwise import moment
from zero.functional.foreach import as_scalar_for, elementwise_map
from zero.functional.transforms.adam import ScaleByAdamState

__all__ = ["scale_by_adopt", "adopt"]


def _quarter_root(count: Any) -> Any:
    return count ** 0.25


def scale_by_adopt(b1: float = 0.9, b2: float = 0.9999, eps: float = 1e-6, mu_dtype: Any = None, *,
                   nesterov: bool = False, use_clipping: bool = True,
                   clip_value_fn: Callable[[Any], Any] = _quarter_root) -> GradientTransformation:
    r"""ADOPT's rescaling (``optax.contrib.scale_by_adopt``).

    .. math::
        u_t = \mathrm{clip}\big(g_t / \max(\sqrt{\nu_{t-1}}, \epsilon),\ c(t)\big),\quad
        m_t = \beta_1 m_{t-1} + (1-\beta_1) u_t,\quad \nu_t = \beta_2 \nu_{t-1} + (1-\beta_2) g_t^2

    At the first step ``nu`` takes ``g^2`` whole and ``mu`` stays zero (the update is 0), as in
    the paper and Optax. ``clip_value_fn(count)`` bounds the normalised gradient (``count`` is the
    steps taken before this one: a Python int, or a 0-d tensor when traced).
    """
    check_unit("b1", b1)
    check_unit("b2", b2)
    check_non_negative("eps", eps)
    mu_dtype = as_dtype(mu_dtype, "mu_dtype")

    def init(params):
        return ScaleByAdamState(count_zero(), zeros_like(params, mu_dtype), zeros_like(params))

    def update(updates, state, params=None):
        count = step_count(state.count)
        b1_, b2_ = first_or(count, 1.0, b1), first_or(count, 0.0, b2)
        clip = clip_value_fn(count) if use_clipping else None

        def normalised(g, nu):
            u = g / torch.clamp(torch.sqrt(nu), min=eps)
            return u if clip is None else torch.clamp(u, -clip, clip)

        mu_updates = elementwise_map(normalised, updates, state.nu)
        nu = elementwise_map(lambda g, v: moment(g, v, as_scalar_for(b2_, v), 2), updates, state.nu)
        mu = elementwise_map(lambda u, m: moment(u, m, as_scalar_for(b1_, u), 1), mu_updates, state.mu)
        out = elementwise_map(lambda u, m: moment(u, m, as_scalar_for(b1_, u), 1), mu_updates, mu) if nesterov else mu
        if mu_dtype is not None:
            mu = tree_map(lambda m: m.to(mu_dtype), mu)
        return out, ScaleByAdamState(count_inc(state.count), mu, nu)

    return GradientTransformation(init, update)


@alias
def adopt(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.9999, eps: float = 1e-6,
          mu_dtype: Any = None, *, nesterov: bool = False, use_clipping: bool = True,
          clip_value_fn: Callable[[Any], Any] = _quarter_root) -> GradientTransformation:
    r"""ADOPT: Adam converging with any :math:`\beta_2` (``optax.contrib.adopt``).

    Args:
        learning_rate: a float or a schedule.
        b1, b2: decays of the first and second moments; eps: the floor of the root.
        mu_dtype: dtype the first moment is kept in.
        nesterov: Nesterov's look-ahead on the first moment.
        use_clipping, clip_value_fn: clip the normalised gradient at ``clip_value_fn(count)``
            (``count ** 0.25`` by default, the paper's stable variant).

    Returns:
        ``chain(scale_by_adopt(...), scale_by_learning_rate(learning_rate))``.

    Reference: Taniguchi et al., ADOPT: Modified Adam Can Converge with Any β2 with the Optimal
    Rate, 2024 (arXiv:2411.02853).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.adopt(0.1)
        >>> p = torch.tensor([1.0])
        >>> state = tx.init(p)
        >>> u, state = tx.update(torch.tensor([2.0]), state, p)  # the first step only measures nu
        >>> u, _ = tx.update(torch.tensor([2.0]), state, p)
        >>> u
        tensor([-0.0100])
    """
    return chain(scale_by_adopt(b1, b2, eps, mu_dtype, nesterov=nesterov, use_clipping=use_clipping,
                                clip_value_fn=clip_value_fn), T.scale_by_learning_rate(learning_rate))
