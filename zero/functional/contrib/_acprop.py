"""ACProp: Adam with the centred second moment of the step before (mirrors
``optax.contrib.scale_by_acprop`` and ``acprop``; its state is ``ScaleByBeliefState``, as
Optax's). Element-wise."""

from __future__ import annotations

import torch

from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import GradientTransformation, count_inc, count_zero, step_count, zeros_like
from zero.functional.combine import chain
from zero.functional.elementwise import debias, moment
from zero.functional.foreach import elementwise_map
from zero.functional.transforms.adam import ScaleByBeliefState

__all__ = ["scale_by_acprop", "acprop"]


def scale_by_acprop(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16, eps_root: float = 1e-16
                    ) -> GradientTransformation:
    r"""ACProp's rescaling (``optax.contrib.scale_by_acprop``): the gradient over the root of the
    bias-corrected EMA of :math:`(g - m)^2` *before* this step (1 at the first)."""

    def init(params):
        return ScaleByBeliefState(count_zero(), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None):
        mu = elementwise_map(lambda g, m: moment(g, m, b1, 1), updates, state.mu)
        nu = elementwise_map(lambda g, m, v: moment(g - m, v, b2, 2) + eps_root, updates, state.mu, state.nu)
        c = step_count(state.count)  # the step before's moment, debiased by its own count (1 at the first step)
        if isinstance(c, int):
            root = (lambda v: 1.0) if c == 0 else (lambda v: torch.sqrt(debias(v, b2, c)))
        else:  # traced: one graph for every step
            root = lambda v: torch.where(c == 0, 1.0, torch.sqrt(debias(v, b2, torch.clamp(c, min=1))))  # noqa: E731
        out = elementwise_map(lambda g, v: g / (root(v) + eps), updates, state.nu)
        count = count_inc(state.count)
        return out, ScaleByBeliefState(count, mu, nu)

    return GradientTransformation(init, update)


@alias
def acprop(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16,
           eps_root: float = 1e-16, weight_decay: float = 0.0, mask: Mask | None = None) -> GradientTransformation:
    """ACProp (``optax.contrib.acprop``): ``chain(scale_by_acprop, add_decayed_weights,
    scale_by_learning_rate)``.

    Reference: Zhuang et al., Momentum Centering and Asynchronous Update for Adaptive Gradient
    Methods, 2021 (arXiv:2110.05454).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.acprop(0.1)
        >>> p = torch.tensor([1.0])
        >>> u, _ = tx.update(torch.tensor([2.0]), tx.init(p), p)  # the first step: the gradient itself
        >>> u
        tensor([-0.2000])
    """
    return chain(scale_by_acprop(b1, b2, eps, eps_root), T.add_decayed_weights(weight_decay, mask),
                 T.scale_by_learning_rate(learning_rate))
