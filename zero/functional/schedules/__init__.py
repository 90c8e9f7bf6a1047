"""Optax's schedules: `basic` (one formula each) and `join` (schedules joined at boundaries). A new
schedule goes in the module of its kind and is re-exported here and from `zero.functional`.
"""

from zero.functional.schedules.basic import (
    Schedule,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    linear_schedule,
    piecewise_constant_schedule,
    piecewise_interpolate_schedule,
    polynomial_schedule,
)
from zero.functional.schedules.join import (
    cosine_onecycle_schedule,
    join_schedules,
    linear_onecycle_schedule,
    sgdr_schedule,
    warmup_cosine_decay_schedule,
)

__all__ = [
    "Schedule",
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_onecycle_schedule",
    "linear_schedule",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "polynomial_schedule",
    "sgdr_schedule",
    "warmup_cosine_decay_schedule",
]
