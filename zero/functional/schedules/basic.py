"""Optax's schedules, one formula each: functions from a step count to a hyperparameter value.

Each formula is written once, over the few operations it names from ``ops`` (`_elementwise`):
torch's on a float64 tensor of counts, or Python's on one count as a float. A schedule given an
int or a 0-d tensor returns a Python float, so it can drive both a transformation and a torch
param group's ``lr``; it is then worked out in Python floats (IEEE doubles, as the float64
tensor ops), some microseconds where ten 0-d tensor ops cost 50 or more on every step. Given a
tensor of counts it is elementwise, as Optax's, and returns a tensor of values in the default
dtype. Under ``torch.compile`` or ``torch.func`` (`zero.functional.foreach.traced`) it returns a
0-d float64 tensor: the compiled update then reads the next value from the count tensor without
recompiling.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from zero.functional.base import Schedule
from zero.functional.foreach import traced

__all__ = ["Schedule", "constant_schedule", "polynomial_schedule", "linear_schedule", "cosine_decay_schedule",
           "exponential_decay", "piecewise_constant_schedule", "piecewise_interpolate_schedule"]

class TensorOps:
    """A formula's operations on a float64 tensor of counts."""

    cos, floor, where, full_like, zeros_like = torch.cos, torch.floor, torch.where, torch.full_like, torch.zeros_like

    @staticmethod
    def clamp(x: torch.Tensor, min: float | None = None, max: float | None = None) -> torch.Tensor:  # noqa: A002
        return x.clamp(min, max)


class FloatOps:
    """The same operations on one count as a Python float (a formula's comparisons are bools)."""

    cos, floor = math.cos, math.floor

    @staticmethod
    def where(condition: bool, a: float, b: float) -> float:
        return a if condition else b

    @staticmethod
    def full_like(t: float, value: float) -> float:
        return float(value)

    @staticmethod
    def zeros_like(t: float) -> float:
        return 0.0

    @staticmethod
    def clamp(x: float, min: float | None = None, max: float | None = None) -> float:  # noqa: A002
        x = x if min is None or x >= min else float(min)
        return x if max is None or x <= max else float(max)


Ops = type[TensorOps] | type[FloatOps]
Formula = Callable[[Any, Ops], Any]


def _elementwise(formula: Formula) -> Schedule:
    """The schedule of ``formula(t, ops)``, which maps counts to their values (see the module).
    The formula stays reachable as the schedule's ``formula``, for joins."""
    @functools.wraps(formula)
    def schedule(count):
        if not traced() and _one(count):
            return float(formula(float(count), FloatOps))
        t = torch.as_tensor(count).to(torch.float64)
        value = formula(t, TensorOps)
        return value if traced() else value.to(torch.get_default_dtype())

    schedule.formula = formula
    return schedule


def _one(count: Any) -> bool:
    """Whether ``count`` is one count (an int, a float, a 0-d tensor), not a tensor of them."""
    return not isinstance(count, torch.Tensor) or count.dim() == 0


def value_at(schedule: Schedule, t: Any, ops: Ops) -> Any:
    """``schedule`` at the counts ``t`` (float64 tensor, or a float with `FloatOps`): its formula
    when it is one of these, else the schedule itself (given an int when eager, as it would be by
    a transformation)."""
    formula = getattr(schedule, "formula", None)
    if formula is not None:
        return formula(t, ops)
    if ops is FloatOps:
        return float(schedule(int(t)))
    if t.dim() == 0 and not traced():
        return torch.tensor(float(schedule(int(t))), dtype=torch.float64)
    return torch.as_tensor(schedule(t)).to(torch.float64)


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step (``optax.constant_schedule``)."""
    return _elementwise(lambda t, ops: ops.full_like(t, value))


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    """From ``init_value`` to ``end_value`` over ``transition_steps`` as ``(1 - t)**power``."""
    if transition_steps <= 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(t, ops):
        t = ops.clamp(t - transition_begin, 0, transition_steps)
        return (init_value - end_value) * (1 - t / transition_steps) ** power + end_value

    return _elementwise(schedule)


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """From ``init_value`` to ``end_value`` linearly over ``transition_steps``, starting at step
    ``transition_begin`` (``optax.linear_schedule``)."""
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    """``init_value * ((1 - alpha) * (0.5 (1 + cos(pi t / decay_steps)))**exponent + alpha)``."""
    if not decay_steps > 0:
        raise ValueError(f"cosine_decay_schedule needs decay_steps > 0, got {decay_steps!r}")

    def schedule(t, ops):
        cosine = 0.5 * (1 + ops.cos(math.pi * ops.clamp(t, max=decay_steps) / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return _elementwise(schedule)


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float,
                      transition_begin: int = 0, staircase: bool = False,
                      end_value: float | None = None) -> Schedule:
    """``init_value * decay_rate ** ((count - transition_begin) / transition_steps)``."""
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(t, ops):
        steps = t - transition_begin
        p = steps / transition_steps
        if staircase:
            p = ops.floor(p)
        value = ops.where(steps <= 0, init_value, init_value * decay_rate**p)
        if end_value is None:
            return value
        return ops.clamp(value, min=end_value) if decay_rate < 1.0 else ops.clamp(value, max=end_value)

    return _elementwise(schedule)


def piecewise_constant_schedule(init_value: float,
                                boundaries_and_scales: dict[int, float] | None = None) -> Schedule:
    """``init_value`` times every scale whose boundary the count has passed."""
    items = sorted((boundaries_and_scales or {}).items())
    if any(scale < 0 for _, scale in items):
        raise ValueError(f"piecewise_constant_schedule needs non-negative scales, got {dict(items)}")

    def schedule(t, ops):
        value = ops.full_like(t, init_value)
        for boundary, scale in items:
            value = ops.where(t >= boundary, value * scale, value)
        return value

    return _elementwise(schedule)


_INTERPOLATE = {
    "linear": lambda start, end, pct, ops: (end - start) * pct + start,
    "cosine": lambda start, end, pct, ops: end + (start - end) / 2.0 * (ops.cos(math.pi * pct) + 1),
}


def piecewise_interpolate_schedule(interpolate_type: str, init_value: float,
                                   boundaries_and_scales: dict[int, float] | None = None) -> Schedule:
    """From boundary to boundary, interpolate (``"linear"`` or ``"cosine"``) between the values
    ``init_value`` times the product of the scales so far (``optax.piecewise_interpolate_schedule``)."""
    if interpolate_type not in _INTERPOLATE:
        raise ValueError(f"interpolate_type must be 'cosine' or 'linear', got {interpolate_type!r}")
    interpolate = _INTERPOLATE[interpolate_type]
    items = sorted((boundaries_and_scales or {}).items())
    if any(scale < 0 for _, scale in items):
        raise ValueError(f"piecewise_interpolate_schedule needs non-negative scales, got {dict(items)}")
    bounds = [0] + [b for b, _ in items]
    values = [init_value]
    for _, scale in items:
        values.append(values[-1] * scale)

    def schedule(t, ops):
        value = ops.zeros_like(t)  # a negative count, before every interval (Optax gives 0 there too)
        for i in range(len(bounds) - 1):
            pct = (t - bounds[i]) / max(bounds[i + 1] - bounds[i], 1)
            inside = (bounds[i] <= t) & (t < bounds[i + 1])
            value = ops.where(inside, interpolate(values[i], values[i + 1], pct, ops), value)
        return ops.where(t >= bounds[-1], values[-1], value)

    return _elementwise(schedule)


def _check_transition_steps(transition_steps: int, who: str) -> None:
    if transition_steps <= 0:
        raise ValueError(f"{who} needs transition_steps > 0, got {transition_steps!r}")
