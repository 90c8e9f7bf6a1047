"""Validation at the boundary, one rule each: errors name the argument and the value it got."""

from __future__ import annotations

__all__ = ["check_int"]


def check_int(name: str, value: object, minimum: int = 0, below: int | None = None) -> int:
    """``value`` if it is an int (not a bool) with ``minimum <= value`` (``< below`` when given).

    ``TypeError`` for a non-int, ``ValueError`` for one out of range, both naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if below is not None and not minimum <= value < below:
        raise ValueError(f"{name} must be in [{minimum}, {below}), got {value}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
