"""Schedules made of others, joined at boundaries (``optax.join_schedules``,
``warmup_cosine_decay_schedule``, the one-cycle schedules, ``sgdr_schedule``)."""

from __future__ import annotations

from collections.abc import Sequence

from zero.functional.schedules.basic import (
    Schedule,
    _check_transition_steps,
    _elementwise,
    cosine_decay_schedule,
    exponential_decay,
    linear_schedule,
    piecewise_interpolate_schedule,
    value_at,
)

__all__ = ["join_schedules", "warmup_cosine_decay_schedule", "warmup_constant_schedule",
           "warmup_exponential_decay_schedule", "linear_onecycle_schedule", "cosine_onecycle_schedule",
           "sgdr_schedule"]


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i]`` from ``boundaries[i - 1]`` on, each counting from its boundary."""
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(f"{len(schedules)} schedules need {len(schedules) - 1} boundaries, "
                         f"got {len(boundaries)}")

    def schedule(t, ops):
        value = value_at(schedules[0], t, ops)
        for boundary, s in zip(boundaries, schedules[1:]):
            # where the count is short of the boundary, the later schedule is read at 0 (never used)
            value = ops.where(t >= boundary, value_at(s, ops.clamp(t - boundary, min=0), ops), value)
        return value

    return _elementwise(schedule)


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0,
                                 exponent: float = 1.0) -> Schedule:
    """Linear warm-up to ``peak_value``, then cosine decay to ``end_value`` at ``decay_steps``."""
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
                           cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)],
                          [warmup_steps])


def warmup_constant_schedule(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """Linear warm-up to ``peak_value``, then constant (``optax.warmup_constant_schedule``): the
    schedule schedule-free rules take, since they need no decay."""
    return linear_schedule(init_value, peak_value, warmup_steps)


def warmup_exponential_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                      transition_steps: int, decay_rate: float, transition_begin: int = 0,
                                      staircase: bool = False, end_value: float | None = None) -> Schedule:
    """Linear warm-up to ``peak_value``, then `exponential_decay` from it (counting from the end of
    the warm-up), as ``optax.warmup_exponential_decay_schedule``."""
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
                           exponential_decay(peak_value, transition_steps, decay_rate, transition_begin, staircase,
                                             end_value)], [warmup_steps])


def linear_onecycle_schedule(transition_steps: int, peak_value: float, pct_start: float = 0.3,
                             pct_final: float = 0.85, div_factor: float = 25.0,
                             final_div_factor: float = 1e4) -> Schedule:
    """One cycle, linearly: up to ``peak_value`` by ``pct_start``, back down by ``pct_final``,
    then to ``peak / (div_factor * final_div_factor)`` (``optax.linear_onecycle_schedule``)."""
    _check_transition_steps(transition_steps, "linear_onecycle_schedule")
    return piecewise_interpolate_schedule("linear", peak_value / div_factor, {
        int(pct_start * transition_steps): div_factor,
        int(pct_final * transition_steps): 1.0 / div_factor,
        transition_steps: 1.0 / final_div_factor})


def cosine_onecycle_schedule(transition_steps: int, peak_value: float, pct_start: float = 0.3,
                             div_factor: float = 25.0, final_div_factor: float = 1e4) -> Schedule:
    """One cycle with cosine ramps: up to ``peak_value`` by ``pct_start``, then down to
    ``peak / (div_factor * final_div_factor)`` (``optax.cosine_onecycle_schedule``)."""
    _check_transition_steps(transition_steps, "cosine_onecycle_schedule")
    return piecewise_interpolate_schedule("cosine", peak_value / div_factor, {
        int(pct_start * transition_steps): div_factor,
        int(transition_steps): 1.0 / (div_factor * final_div_factor)})


def sgdr_schedule(cosine_kwargs: Sequence[dict]) -> Schedule:
    """Warm restarts: `warmup_cosine_decay_schedule` for each dict of arguments in turn, each
    lasting its ``decay_steps`` (``optax.sgdr_schedule``)."""
    schedules, boundaries, step = [], [], 0
    for kwargs in cosine_kwargs:
        schedules.append(warmup_cosine_decay_schedule(**kwargs))
        step += kwargs["decay_steps"]
        boundaries.append(step)
    return join_schedules(schedules, boundaries[:-1])
