"""Rules that step by signs: Lion, the sign of the update, Rprop (``optax.scale_by_lion``,
``scale_by_sign``, ``scale_by_rprop``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional.base import (
    EmptyState,
    GradientTransformation,
    Spec,
    as_dtype,
    check_positive,
    check_unit,
    count_inc,
    count_zero,
    full_like,
    zeros_like,
)
from zero.functional.elementwise import (
    moment,
)
from zero.functional.foreach import elementwise_map

__all__ = ['ScaleByLionState', 'scale_by_lion', 'scale_by_sign', 'ScaleByRpropState', 'scale_by_rprop']


class ScaleByLionState(NamedTuple):
    """State of ``scale_by_lion`` (``optax.ScaleByLionState``).

    Fields:
        count: steps taken, 0-d int32.
        mu: momentum, a pytree like the params (in ``mu_dtype`` if given).
    """

    count: torch.Tensor
    mu: Any


_LION_SIGNS = {
    "hard": lambda x, beta: torch.sign(x),
    "smooth": lambda x, beta: torch.tanh(beta * x),
    "refined": lambda x, beta: torch.where(x.abs() < 1.0, x, torch.sign(x)),
}


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None,
                  mode: str = "hard", smooth_beta: float = 1.0) -> GradientTransformation:
    """Lion: the sign of an interpolation of momentum and update (``optax.scale_by_lion``).

    ``mode`` picks the sign: ``"hard"`` (``sign``), ``"smooth"`` (``tanh(smooth_beta x)``) or
    ``"refined"`` (``x`` where ``|x| < 1``, else its sign). An unknown mode is a ``ValueError``
    here, where Optax raises it at the first update.
    """
    mu_dtype = as_dtype(mu_dtype, "mu_dtype")
    check_unit("b1", b1, closed=True)
    check_unit("b2", b2, closed=True)
    if mode not in _LION_SIGNS:
        raise ValueError(f"scale_by_lion mode must be one of {sorted(_LION_SIGNS)}, got {mode!r}")
    sign = _LION_SIGNS[mode]

    def init(params):
        return ScaleByLionState(count_zero(), zeros_like(params, mu_dtype))

    def update(updates, state, params=None):
        out = elementwise_map(lambda g, m: sign((1 - b1) * g + b1 * m, smooth_beta), updates, state.mu)
        # Accumulate in the wider dtype (mu_dtype=float32 with bf16 updates stays float32-exact).
        mu = elementwise_map(lambda g, m: moment(g.to(torch.promote_types(g.dtype, m.dtype)), m, b2, 1).to(m.dtype),
                      updates, state.mu)
        return out, ScaleByLionState(count_inc(state.count), mu)

    return GradientTransformation(init, update, spec=Spec("scale_by_lion", {"b1": b1, "b2": b2, "mu_dtype": mu_dtype,
                                                                           "mode": mode, "smooth_beta": smooth_beta}))


def scale_by_sign() -> GradientTransformation:
    """The sign of each update (``optax.scale_by_sign``)."""
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, p=None: (elementwise_map(torch.sign, u), s),
                                  spec=Spec("scale_by_sign", {}))


class ScaleByRpropState(NamedTuple):
    """State of ``scale_by_rprop`` (``optax.ScaleByRpropState``).

    Fields:
        step_sizes: each element's current step size, a pytree like the params.
        prev_updates: the previous step's signed updates, a pytree like the params.
    """

    step_sizes: Any
    prev_updates: Any


def scale_by_rprop(learning_rate: float, eta_minus: float = 0.5, eta_plus: float = 1.2,
                   min_step_size: float = 1e-6, max_step_size: float = 50.0) -> GradientTransformation:
    """Rprop's sign-based step sizes (``optax.scale_by_rprop``, including its update rule)."""
    check_positive("learning_rate", learning_rate)

    def update(updates, state, params=None):
        sign = elementwise_map(lambda g, prev: g * prev, updates, state.prev_updates)
        steps = elementwise_map(lambda s, st: torch.where(
            s == 0, st, torch.clamp(torch.where(s > 0, st * eta_plus, st * eta_minus), min_step_size, max_step_size)),
            sign, state.step_sizes)
        prev = elementwise_map(lambda s, g, st: torch.where(s < 0, torch.zeros_like(g), st * torch.sign(g)),
                        sign, updates, steps)
        out = elementwise_map(lambda s, old: torch.where(s < 0, torch.zeros_like(old), old), sign, state.prev_updates)
        return out, ScaleByRpropState(steps, prev)

    return GradientTransformation(
        lambda p: ScaleByRpropState(full_like(p, learning_rate), zeros_like(p)), update)
