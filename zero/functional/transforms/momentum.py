"""Momentum and averages of past updates (``optax.trace``, ``ema``,
``scale_by_optimistic_gradient``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional.base import (
    GradientTransformation,
    Spec,
    as_dtype,
    check_non_negative,
    check_unit,
    count_inc,
    count_zero,
    step_count,
    zeros_like,
)
from zero.functional.elementwise import (
    moments,
    plus_scaled,
    times,
)
from zero.functional.foreach import elementwise_map, foreach_map, ops

__all__ = ['TraceState', 'trace', 'EmaState', 'ema', 'ScaleByOptimisticGradientState', 'scale_by_optimistic_gradient']


class TraceState(NamedTuple):
    """State of ``trace`` (momentum; ``optax.TraceState``).

    Fields:
        trace: the momentum buffer, a pytree like the params (in ``accumulator_dtype`` if given).
    """

    trace: Any


def trace(decay: float, nesterov: bool = False, accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Momentum: ``t = g + decay * t`` (``optax.trace``)."""
    accumulator_dtype = as_dtype(accumulator_dtype, "accumulator_dtype")
    check_non_negative("decay", decay)

    def scaled(factor=1.0):
        def rule(gs, ts):
            new = plus_scaled(gs, ts, decay)
            out = times(plus_scaled(gs, new, decay), factor, own=True) if nesterov else times(new, factor, own=False)
            return out, (new if accumulator_dtype is None else [t.to(accumulator_dtype) for t in new])

        def update(updates, state, params=None):
            out, new = foreach_map(rule, updates, state.trace, outputs=2)
            return out, TraceState(new)

        return update

    spec = Spec("trace", {"decay": decay, "nesterov": nesterov, "accumulator_dtype": accumulator_dtype})
    init = lambda p: TraceState(zeros_like(p, accumulator_dtype))  # noqa: E731
    return GradientTransformation(init, scaled(), spec=spec, scaled=scaled)


class EmaState(NamedTuple):
    """State of ``ema`` (``optax.EmaState``).

    Fields:
        count: steps taken, 0-d int32.
        ema: the moving average, a pytree like the params.
    """

    count: torch.Tensor
    ema: Any


def ema(decay: float, debias: bool = True, accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Exponential moving average of updates (``optax.ema``)."""
    accumulator_dtype = as_dtype(accumulator_dtype, "accumulator_dtype")
    check_unit("decay", decay, closed=True)

    def update(updates, state, params=None):
        count = count_inc(state.count)

        def rule(gs, es):
            new = moments(gs, es, decay, 1)
            out = ops.div(new, 1 - decay ** step_count(count)) if debias else new
            return out, (new if accumulator_dtype is None else [e.to(accumulator_dtype) for e in new])

        out, new = foreach_map(rule, updates, state.ema, outputs=2)
        return out, EmaState(count, new)

    return GradientTransformation(lambda p: EmaState(count_zero(), zeros_like(p, accumulator_dtype)), update)


class ScaleByOptimisticGradientState(NamedTuple):
    """State of ``scale_by_optimistic_gradient`` (``optax.ScaleByOptimisticGradientState``).

    Fields:
        is_initial_step: 0-d bool, True until the first update.
        previous_gradient: the last updates seen, a pytree like the params.
    """

    is_initial_step: torch.Tensor
    previous_gradient: Any


def scale_by_optimistic_gradient(alpha: float = 1.0, beta: float = 1.0) -> GradientTransformation:
    """``(alpha + beta) g_t - beta g_{t-1}`` (``g_0`` for ``g_{-1}``); ``optax.scale_by_optimistic_gradient``."""

    def init(params):
        return ScaleByOptimisticGradientState(torch.tensor(True), zeros_like(params))

    def update(updates, state, params=None):
        first = state.is_initial_step  # a tensor: the same graph at every step (torch.compile)
        out = elementwise_map(lambda g, prev: (alpha + beta) * g - beta * torch.where(first, g, prev),
                       updates, state.previous_gradient)
        return out, ScaleByOptimisticGradientState(torch.tensor(False), updates)

    return GradientTransformation(init, update)
