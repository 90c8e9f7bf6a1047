"""Optax's schedules, one formula each: functions from a step count to a hyperparameter value.

They take an int or a 0-d tensor and return a Python float, so a schedule can drive both a
transformation and a torch param group's ``lr``. Given a tensor of counts they are elementwise,
as Optax's, and return a tensor of values in the default dtype.
"""

from __future__ import annotations

import functools
import math

import torch

from zero.functional.base import Schedule

__all__ = ["Schedule", "constant_schedule", "polynomial_schedule", "linear_schedule", "cosine_decay_schedule",
           "exponential_decay", "piecewise_constant_schedule", "piecewise_interpolate_schedule"]


def _elementwise(fn: Schedule) -> Schedule:
    """``fn`` of a scalar count, also taking a tensor of counts (value by value)."""
    @functools.wraps(fn)
    def schedule(count):
        if isinstance(count, torch.Tensor) and count.dim() > 0:
            values = [float(fn(c)) for c in count.reshape(-1).tolist()]
            return torch.tensor(values, dtype=torch.get_default_dtype()).reshape(count.shape)
        return fn(count)

    return schedule


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step (``optax.constant_schedule``)."""
    return _elementwise(lambda count: value)


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    """From ``init_value`` to ``end_value`` over ``transition_steps`` as ``(1 - t)**power``."""
    if transition_steps <= 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(count):
        t = min(max(int(count) - transition_begin, 0), transition_steps)
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

    def schedule(count):
        t = min(float(count), decay_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return _elementwise(schedule)


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float,
                      transition_begin: int = 0, staircase: bool = False,
                      end_value: float | None = None) -> Schedule:
    """``init_value * decay_rate ** ((count - transition_begin) / transition_steps)``."""
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)
    clip = max if decay_rate < 1.0 else min

    def schedule(count):
        steps = int(count) - transition_begin
        p = steps / transition_steps
        if staircase:
            p = math.floor(p)
        value = init_value if steps <= 0 else init_value * decay_rate**p
        return value if end_value is None else clip(value, end_value)

    return _elementwise(schedule)


def piecewise_constant_schedule(init_value: float,
                                boundaries_and_scales: dict[int, float] | None = None) -> Schedule:
    """``init_value`` times every scale whose boundary the count has passed."""
    items = sorted((boundaries_and_scales or {}).items())
    if any(scale < 0 for _, scale in items):
        raise ValueError(f"piecewise_constant_schedule needs non-negative scales, got {dict(items)}")

    def schedule(count):
        value = init_value
        for boundary, scale in items:
            if int(count) >= boundary:
                value *= scale
        return value

    return _elementwise(schedule)


_INTERPOLATE = {
    "linear": lambda start, end, pct: (end - start) * pct + start,
    "cosine": lambda start, end, pct: end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1),
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

    def schedule(count):
        count = int(count)
        if count >= bounds[-1]:
            return values[-1]
        for i in range(len(bounds) - 1):
            if bounds[i] <= count < bounds[i + 1]:
                pct = (count - bounds[i]) / max(bounds[i + 1] - bounds[i], 1)
                return interpolate(values[i], values[i + 1], pct)
        return 0.0  # a negative count, before every interval (Optax gives 0 there too)

    return _elementwise(schedule)


def _check_transition_steps(transition_steps: int, who: str) -> None:
    if transition_steps <= 0:
        raise ValueError(f"{who} needs transition_steps > 0, got {transition_steps!r}")
