"""The inner transformation of an `inject_hyperparams`, built once for its in-place step.

`Builds` keeps, per param list and per set of decisions (see `zero.functional.kernels.knobs`), a
build of the inner factory whose float hyperparameters are knobs; its kernel reads the step's
values when called, so a scheduler's new learning rate costs no rebuild. The first time a
hyperparameter takes a new value, the factory is also run with the plain values, specs only (no
kernel match), and its specs must equal the knob build's read at those values: a factory that
derives a number from a hyperparameter (``scale(2 * lr)``) fails that check, and that
`inject_hyperparams` then builds its inner transformation for each set of values (cached), as
its pure ``update`` always does.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from zero.functional.base import GradientTransformation, step_in_place, tree_leaves
from zero.functional.foreach import traced
from zero.functional.kernels.knobs import Knob, now, outcomes, reading, recording, specs_only
from zero.functional.scalars import value_of

__all__ = ["Builds"]

_KEPT = 8  # builds kept per injected transformation (param lists x decision sets)


class _Build(NamedTuple):
    tx: GradientTransformation
    knobs: dict[str, Knob]
    values: dict[str, Any]


class _Chosen(NamedTuple):
    """The build the last in-place step chose, and what it chose it for: the param list (its
    first param's identity), the hyperparameter tensors and their versions (an in-place write,
    a checkpoint loaded into one, bumps its version), and the values read from them."""
    at: int
    tensors: tuple
    versions: list[int]
    values: dict[str, Any]
    build: _Build


_VERSION = operator.attrgetter("_version")


class Builds:
    """``factory(**fixed, **hyperparams)``: built for each set of values (``full``), and once
    for the in-place step (``step``)."""

    def __init__(self, factory: Callable[..., GradientTransformation], fixed: dict):
        self.factory, self.fixed = factory, fixed
        self.decisions: list = []  # what builds decided on knobs (see knobs.recording)
        self.builds: dict[tuple, _Build] = {}
        self.verified: set[str] = set()  # hyperparameters whose new values the specs were checked to follow
        self.off = False  # the factory derives numbers from its hyperparameters: build per value set
        self._cached = functools.lru_cache(maxsize=4)(self._plain)
        self._chosen: _Chosen | None = None

    def full(self, hyperparams: dict[str, torch.Tensor]) -> GradientTransformation:
        """The inner transformation built for these values (cached for the last few)."""
        if _unreadable(hyperparams):
            return self.factory(**self.fixed, **hyperparams)  # tensors: differentiated, swept or compiled
        return self._cached(tuple((k, v.item()) for k, v in hyperparams.items()))

    def _plain(self, values: tuple[tuple[str, Any], ...]) -> GradientTransformation:
        return self.factory(**self.fixed, **dict(values))

    def init(self, params: Any, hyperparams: dict[str, torch.Tensor]) -> Any:
        """The inner state for ``params``: from the build their in-place steps will use when it is
        made for exactly these values (an init may hand a knob to torch, which reads the number
        it was built with), else from ``full``."""
        if not self.off and not _unreadable(hyperparams):
            values = {k: value_of(v) for k, v in hyperparams.items()}
            build = self._build_for(values, _first_id(params))
            if build is not None and build.values == values:
                return build.tx.init(params)
        return self.full(hyperparams).init(params)

    def step(self, params: Any, grads: Any, inner_state: Any, hyperparams: dict[str, torch.Tensor]) -> Any:
        """One in-place step of the inner transformation at these values; the new inner state."""
        if not self.off and not _unreadable(hyperparams):
            values, build = self._choose(hyperparams, _first_id(params))
            if build is not None:
                with reading(build.knobs, values):
                    new = build.tx.inplace(params, grads, inner_state)
                if new is not None:
                    return new
        return step_in_place(self.full(hyperparams), params, grads, inner_state)

    def _choose(self, hyperparams: dict[str, torch.Tensor], at: int) -> tuple[dict[str, Any], _Build | None]:
        """The values of ``hyperparams`` and the build for them: the last step's choice while
        the tensors are the same, unwritten (a step's state keeps them while the group's numbers
        stay), else found again (a decision's outcomes, the build's specs checked)."""
        tensors, chosen = tuple(hyperparams.values()), self._chosen
        if chosen is not None and chosen.at == at and len(tensors) == len(chosen.tensors) and \
                all(map(operator.is_, tensors, chosen.tensors)) and list(map(_VERSION, tensors)) == chosen.versions:
            return chosen.values, chosen.build
        values = {k: value_of(v) for k, v in hyperparams.items()}
        build = self._build_for(values, at)
        self._chosen = None if build is None else _Chosen(at, tensors, list(map(_VERSION, tensors)), values, build)
        return values, build

    def _key(self, values: dict[str, Any], at: int) -> tuple:
        fixed_numbers = tuple(v for v in values.values() if not isinstance(v, float))
        return outcomes(self.decisions, values), fixed_numbers, at

    def _build_for(self, values: dict[str, Any], at: int) -> _Build | None:
        build = self.builds.get(self._key(values, at))
        if build is None:
            build = self._knobbed(values)
            if build is None:
                self.off = True
                return None
            if len(self.builds) >= _KEPT:
                self.builds.pop(next(iter(self.builds)))
            self.builds[self._key(values, at)] = build
        if not self._follows(build, values):
            self.off = True
            return None
        return build

    def _knobbed(self, values: dict[str, Any]) -> _Build | None:
        """A build whose float hyperparameters are knobs, if its in-place step is a kernel's (a
        kernel reads its numbers through `knobs.now`; other in-place steps may fall back to their
        pure update, which keeps the numbers it was built with)."""
        knobs = {k: Knob(v, k) for k, v in values.items() if isinstance(v, float)}
        with recording() as seen:
            tx = self.factory(**self.fixed, **{**values, **knobs})
        if getattr(tx.inplace, "kernel", None) is None:
            return None
        for decision in seen:
            if not any(decision is d or _same_decision(decision, d) for d in self.decisions):
                self.decisions.append(decision)
        return _Build(tx, knobs, dict(values))

    def _follows(self, build: _Build, values: dict[str, Any]) -> bool:
        """Whether the build's specs, read at ``values``, are the plain build's (checked once per
        hyperparameter, the first time it moves)."""
        moved = {k for k in build.knobs if values[k] != build.values[k]} - self.verified
        if not moved:
            return True
        with specs_only():
            plain = self.factory(**self.fixed, **values)
        with reading(build.knobs, values):
            same = spec_values(build.tx) == spec_values(plain)
        if same:
            self.verified |= moved
        return same


def _same_decision(a: tuple, b: tuple) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # a tensor compared: keep both
        return False


def _unreadable(hyperparams: dict[str, torch.Tensor]) -> bool:
    return traced() or any(v.requires_grad for v in hyperparams.values())


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def spec_values(x: Any) -> Any:
    """A transformation's specs as comparable data: knobs read as `now` gives them, other
    objects (masks, tensors) by identity."""
    if isinstance(x, GradientTransformation):
        spec = x.spec
        if spec is None:
            return ("built by hand", id(x))
        return (spec.name, spec_values(spec.args), tuple(map(spec_values, spec.links)))
    if isinstance(x, Knob):
        return now(x)
    if isinstance(x, dict):
        return tuple((k, spec_values(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(map(spec_values, x)))
    return x if isinstance(x, _PLAIN) else ("object", id(x))


def _first_id(params: Any) -> int:
    """An identity of a param tree that lasts from step to step (its first param's), read without
    flattening a list or a dict by name, as `zero.functional.Optimizer` steps them (0 when empty)."""
    if isinstance(params, dict) and params:
        return id(next(iter(params.values())))
    if isinstance(params, list) and params and isinstance(params[0], torch.Tensor):
        return id(params[0])
    leaves = tree_leaves(params)
    return id(leaves[0]) if leaves else 0
