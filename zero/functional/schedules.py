"""Optax's schedules: functions from a step count to a hyperparameter value.

They take an int or a 0-d tensor and return a Python float, so a schedule can drive both a
transformation and a torch param group's ``lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["Schedule", "constant_schedule", "linear_schedule", "polynomial_schedule",
           "cosine_decay_schedule", "exponential_decay", "warmup_cosine_decay_schedule",
           "piecewise_constant_schedule", "join_schedules"]

Schedule = Callable[[int], float]


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step (``optax.constant_schedule``)."""
    return lambda count: value


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    """From ``init_value`` to ``end_value`` over ``transition_steps`` as ``(1 - t)**power``."""
    if transition_steps <= 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(count):
        t = min(max(int(count) - transition_begin, 0), transition_steps)
        return (init_value - end_value) * (1 - t / transition_steps) ** power + end_value

    return schedule


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

    return schedule


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

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i]`` from ``boundaries[i - 1]`` on, each counting from its boundary."""
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(f"{len(schedules)} schedules need {len(schedules) - 1} boundaries, "
                         f"got {len(boundaries)}")

    def schedule(count):
        count = int(count)
        value = schedules[0](count)
        for boundary, s in zip(boundaries, schedules[1:]):
            if count >= boundary:
                value = s(count - boundary)
        return value

    return schedule


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0,
                                 exponent: float = 1.0) -> Schedule:
    """Linear warm-up to ``peak_value``, then cosine decay to ``end_value`` at ``decay_steps``."""
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
                           cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)],
                          [warmup_steps])


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

    return schedule
