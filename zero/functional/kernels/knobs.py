"""Hyperparameters a kernel reads when it is called, so a learning rate is read, not rebuilt.

`inject_hyperparams` keeps its hyperparameters in the state, and a scheduler changes them every
step. Building the inner chain for each new value (alias, chain, kernel match) cost a third of
a small step. Instead the chain is built once with each float hyperparameter as a `Knob`: a
float that says which hyperparameter it is. The kernel steps read their numbers through `now`,
which gives a knob's value for this call (set by `reading`); everywhere else a knob is the float
it was built with.

What keeps that exact: a build is reused only for values that make the same decisions. While a
build runs (`recording`), every comparison or truth test of a knob is recorded (``if
weight_decay``, ``lr > 0``, Rprop's ``step_size == -1``), and, while a kernel is matched
(`matching`), any arithmetic or ``float()`` on one too (a value captured at match time). A build
serves the values whose recorded outcomes equal its own; other values get a build of their own.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

__all__ = ["Knob", "now", "reading", "recording", "matching", "outcomes", "specs_only", "fusing"]

_VALUES: ContextVar[dict[int, float] | None] = ContextVar("zero_knob_values", default=None)
_SEEN: ContextVar[list | None] = ContextVar("zero_knob_seen", default=None)
_MATCHING: ContextVar[bool] = ContextVar("zero_knob_matching", default=False)
_NO_FUSE: ContextVar[bool] = ContextVar("zero_no_fuse", default=False)


class Knob(float):
    """A float hyperparameter named ``name``, passed to a factory in place of its number."""

    def __new__(cls, value: float, name: str) -> Knob:
        knob = super().__new__(cls, value)
        knob.name = name
        return knob

    def __hash__(self) -> int:
        return float.__hash__(self)

    def __reduce__(self) -> tuple:  # copied or pickled with the optimizer that holds its kernel
        return Knob, (float(self), self.name)

    def __repr__(self) -> str:
        return f"Knob({self.name}={float.__repr__(self)})"

    def __bool__(self) -> bool:
        _saw(self, "bool", None)
        return float.__bool__(self)


def _comparison(op: str) -> Any:
    base = getattr(float, op)

    def compare(self: Knob, other: Any) -> Any:
        _saw(self, op, other)
        return base(self, other)

    return compare


def _arithmetic(op: str) -> Any:
    base = getattr(float, op)

    def apply(self: Knob, *other: Any) -> Any:
        if _MATCHING.get():  # a number a kernel would keep: this build serves this value only
            _saw(self, "exact", None)
        return base(self, *other)

    return apply


for _op in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(Knob, _op, _comparison(_op))
for _op in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
            "__pow__", "__rpow__", "__neg__", "__abs__", "__float__", "__int__", "__round__", "__floordiv__",
            "__rfloordiv__", "__mod__", "__rmod__"):
    setattr(Knob, _op, _arithmetic(_op))


def _saw(knob: Knob, op: str, other: Any) -> None:
    seen = _SEEN.get()
    if seen is not None:
        seen.append((knob.name, op, ("knob", other.name) if isinstance(other, Knob) else other))


def now(value: Any) -> Any:
    """``value`` as this call sees it: a knob's current value (see `reading`), anything else as it is."""
    if type(value) is not Knob:
        return value
    values = _VALUES.get()
    return float.__float__(value) if values is None else values.get(id(value), float.__float__(value))


class reading:  # used as a function; a class, not a generator, since kernels enter it every step
    """Kernels called inside read ``values`` (by name) for the ``knobs`` (nested: an outer
    `inject_hyperparams`'s knobs stay readable)."""

    __slots__ = ("current", "token")

    def __init__(self, knobs: dict[str, Knob], values: dict[str, Any]):
        outer = _VALUES.get()
        self.current = {id(knob): float(values[name]) for name, knob in knobs.items()} if outer is None else \
            {**outer, **{id(knob): float(values[name]) for name, knob in knobs.items()}}

    def __enter__(self) -> None:
        self.token = _VALUES.set(self.current)

    def __exit__(self, *exc: Any) -> None:
        _VALUES.reset(self.token)


@contextlib.contextmanager
def _setting(var: ContextVar, value: Any) -> Iterator[Any]:
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def recording() -> contextlib.AbstractContextManager[list]:
    """Record the decisions taken on knobs inside: ``(name, op, other)`` entries (see the module)."""
    return _setting(_SEEN, [])


def matching() -> contextlib.AbstractContextManager[bool]:
    """A kernel is matched inside: a number it computes from a knob pins that knob's value."""
    return _setting(_MATCHING, True)


def specs_only() -> contextlib.AbstractContextManager[bool]:
    """Chains built inside skip their kernel match (a build read for its specs only)."""
    return _setting(_NO_FUSE, True)


def fusing() -> bool:
    """Whether a chain built now should match a kernel (not inside `specs_only`)."""
    return not _NO_FUSE.get()


_OUTCOMES = {"bool": lambda v, o: bool(v), "exact": lambda v, o: v, "__eq__": operator.eq, "__ne__": operator.ne,
             "__lt__": operator.lt, "__le__": operator.le, "__gt__": operator.gt, "__ge__": operator.ge}


def outcomes(decisions: list, values: dict[str, Any]) -> tuple:
    """What each recorded decision comes to for ``values``: a build made for other values
    serves these exactly when the outcomes are its own."""
    out = []
    for name, op, other in decisions:
        if isinstance(other, tuple) and len(other) == 2 and other[0] == "knob":
            other = values[other[1]]
        try:
            out.append(_OUTCOMES[op](values[name], other))
        except TypeError:  # a comparison with something that is not a number: keep the value itself
            out.append(values[name])
    return tuple(out)
