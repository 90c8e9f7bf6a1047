"""The size a notebook runs at: ``ZERO_NOTEBOOK_SIZE``, ``full`` (unset: a reader's run) or
``small`` (the test suite's, set in tests/conftest.py: fewer steps, every check kept)."""

from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["SIZES", "size", "by_size"]

SIZES = ("full", "small")
T = TypeVar("T")


def size() -> str:
    """``ZERO_NOTEBOOK_SIZE``, checked: ``"full"`` where it is unset."""
    value = os.environ.get("ZERO_NOTEBOOK_SIZE", "full")
    if value not in SIZES:
        raise ValueError(f"ZERO_NOTEBOOK_SIZE must be one of {SIZES}, got {value!r}")
    return value


def by_size(full: T, small: T) -> T:
    """``full``, or ``small`` when the notebook runs small (``STEPS = by_size(150, 60)``)."""
    return full if size() == "full" else small
