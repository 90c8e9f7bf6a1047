"""COCOB-Backprop: learning-rate-free steps from coin betting (mirrors ``optax.contrib.scale_by_cocob``,
``cocob`` and ``COCOBState``). Element-wise."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import NO_PARAMS_MSG, GradientTransformation, full_like, tree_map, zeros_like
from zero.functional.combine import chain
from zero.functional.foreach import elementwise_map

__all__ = ["COCOBState", "scale_by_cocob", "cocob"]


class COCOBState(NamedTuple):
    """State of ``scale_by_cocob`` (``optax.contrib.COCOBState``): pytrees like the params.

    Fields:
        init_particles: the start; cumulative_gradients: minus the sum of the gradients;
        scale: the largest gradient magnitude seen (from ``eps``); subgradients: the sum of the
        gradients' magnitudes; reward: the bettor's wealth.
    """

    init_particles: Any
    cumulative_gradients: Any
    scale: Any
    subgradients: Any
    reward: Any


def scale_by_cocob(alpha: float = 100.0, eps: float = 1e-8) -> GradientTransformation:
    r"""COCOB's step (``optax.contrib.scale_by_cocob``): the new param is

    .. math:: x_0 + \frac{C}{L \max(G + L, \alpha L)} (L + R)

    with ``C`` minus the gradients' sum, ``L`` the largest magnitude, ``G`` the sum of magnitudes
    and ``R`` the reward; its updates carry their own sign."""

    def init(params):
        return COCOBState(tree_map(lambda p: p.detach().clone(), params), zeros_like(params),
                          full_like(params, eps), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        scale = elementwise_map(lambda m, g: torch.maximum(m, g.abs()), state.scale, updates)
        subgradients = elementwise_map(lambda s, g: s + g.abs(), state.subgradients, updates)
        reward = elementwise_map(lambda r, g, p, p0: torch.clamp(r - g * (p - p0), min=0), state.reward, updates,
                                 params, state.init_particles)
        cumulative = elementwise_map(lambda c, g: c - g, state.cumulative_gradients, updates)
        out = elementwise_map(lambda p, p0, c, m, s, r: -p + (p0 + c / (m * torch.maximum(s + m, alpha * m)) * (m + r)),
                              params, state.init_particles, cumulative, scale, subgradients, reward)
        return out, COCOBState(state.init_particles, cumulative, scale, subgradients, reward)

    return GradientTransformation(init, update)


@alias
def cocob(learning_rate: ScalarOrSchedule = 1.0, alpha: float = 100.0, eps: float = 1e-8, weight_decay: float = 0.0,
          mask: Mask | None = None) -> GradientTransformation:
    """COCOB-Backprop (``optax.contrib.cocob``): the gradients (decayed, scaled by
    ``learning_rate`` without flipping the sign) bet on by `scale_by_cocob`.

    Reference: Orabona and Tommasi, Training Deep Networks without Learning Rates Through Coin
    Betting, 2017 (arXiv:1705.07795).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.cocob()
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)
        >>> float(u) < 0
        True
    """
    return chain(T.add_decayed_weights(weight_decay, mask), T.scale_by_learning_rate(learning_rate, flip_sign=False),
                 scale_by_cocob(alpha, eps))
