"""Optax's schedules, one formula each: functions from a step count to a hyperparameter value.

Each formula is written once, in torch ops on a float64 tensor of counts (`_elementwise`). A
schedule given an int or a 0-d tensor returns a Python float, so it can drive both a
transformation and a torch param group's ``lr``; given a tensor of counts it is elementwise, as
Optax's, and returns a tensor of values in the default dtype. Under ``torch.compile`` or
``torch.func`` (`zero.functional.foreach.traced`) it returns a 0-d float64 tensor: the compiled
update then reads the next value from the count tensor without recompiling.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from zero.functional.base import Schedule
from zero.functional.foreach import traced

__all__ = ["Schedule", "constant_schedule", "polynomial_schedule", "linear_schedule", "cosine_decay_schedule",
           "exponential_decay", "piecewise_constant_schedule", "piecewise_interpolate_schedule"]

Formula = Callable[[torch.Tensor], torch.Tensor]


def _elementwise(formula: Formula) -> Schedule:
    """The schedule of ``formula``, which maps a float64 tensor of counts to their values (see
    the module). The formula stays reachable as the schedule's ``formula``, for joins."""
    @functools.wraps(formula)
    def schedule(count):
        t = torch.as_tensor(count).to(torch.float64)
        value = formula(t)
        if traced():
            return value
        return value.to(torch.get_default_dtype()) if t.dim() > 0 else float(value)

    schedule.formula = formula
    return schedule


def value_at(schedule: Schedule, t: torch.Tensor) -> torch.Tensor:
    """``schedule`` at the float64 counts ``t``, as a float64 tensor: its formula when it is one
    of these, else the schedule itself (given an int when eager, as it would be by a transformation)."""
    formula = getattr(schedule, "formula", None)
    if formula is not None:
        return formula(t)
    if t.dim() == 0 and not traced():
        return torch.tensor(float(schedule(int(t))), dtype=torch.float64)
    return torch.as_tensor(schedule(t)).to(torch.float64)


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step (``optax.constant_schedule``)."""
    return _elementwise(lambda t: torch.full_like(t, value))


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    """From ``init_value`` to ``end_value`` over ``transition_steps`` as ``(1 - t)**power``."""
    if transition_steps <= 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(t):
        t = (t - transition_begin).clamp(0, transition_steps)
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

    def schedule(t):
        cosine = 0.5 * (1 + torch.cos(math.pi * t.clamp(max=decay_steps) / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return _elementwise(schedule)


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float,
                      transition_begin: int = 0, staircase: bool = False,
                      end_value: float | None = None) -> Schedule:
    """``init_value * decay_rate ** ((count - transition_begin) / transition_steps)``."""
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(t):
        steps = t - transition_begin
        p = steps / transition_steps
        if staircase:
            p = torch.floor(p)
        value = torch.where(steps <= 0, init_value, init_value * decay_rate**p)
        if end_value is None:
            return value
        return value.clamp(min=end_value) if decay_rate < 1.0 else value.clamp(max=end_value)

    return _elementwise(schedule)


def piecewise_constant_schedule(init_value: float,
                                boundaries_and_scales: dict[int, float] | None = None) -> Schedule:
    """``init_value`` times every scale whose boundary the count has passed."""
    items = sorted((boundaries_and_scales or {}).items())
    if any(scale < 0 for _, scale in items):
        raise ValueError(f"piecewise_constant_schedule needs non-negative scales, got {dict(items)}")

    def schedule(t):
        value = torch.full_like(t, init_value)
        for boundary, scale in items:
            value = torch.where(t >= boundary, value * scale, value)
        return value

    return _elementwise(schedule)


_INTERPOLATE = {
    "linear": lambda start, end, pct: (end - start) * pct + start,
    "cosine": lambda start, end, pct: end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1),
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

    def schedule(t):
        value = torch.zeros_like(t)  # a negative count, before every interval (Optax gives 0 there too)
        for i in range(len(bounds) - 1):
            pct = (t - bounds[i]) / max(bounds[i + 1] - bounds[i], 1)
            inside = (bounds[i] <= t) & (t < bounds[i + 1])
            value = torch.where(inside, interpolate(values[i], values[i + 1], pct), value)
        return torch.where(t >= bounds[-1], values[-1], value)

    return _elementwise(schedule)


def _check_transition_steps(transition_steps: int, who: str) -> None:
    if transition_steps <= 0:
        raise ValueError(f"{who} needs transition_steps > 0, got {transition_steps!r}")
