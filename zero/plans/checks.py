"""Validation at the boundary, one rule each: errors name the argument and the value it got; and
the checksum ranks compare to find out they were given different things."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

__all__ = ["check_int", "checksum"]


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


def checksum(value: Any) -> int:
    """A small checksum of plain data, the same in every process and run (unlike ``hash``).

    Numbers, strings, bools and ``None`` count by value (floats exactly), sequences and mappings
    by their items, small tensors by their values; anything else (a function, a module) by its
    type only, since its ``repr`` holds a memory address that differs between processes.
    """
    return zlib.crc32(repr(_plain(value)).encode())


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return sorted((str(k), _plain(v)) for k, v in value.items())
    if hasattr(value, "tolist") and getattr(value, "numel", lambda: 0)() <= 64:  # a small tensor
        return ["tensor", value.tolist()]
    return ["object", type(value).__qualname__]
