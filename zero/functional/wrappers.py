"""Transformations that wrap others: masking, per-label routing, NaN guards, accumulation and
hyperparameters in the state (Optax's ``masked``, ``multi_transform``, ``apply_if_finite``,
``MultiSteps``, ``inject_hyperparams``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from zero.functional import sharding
from zero.functional.base import (
    GradientTransformation,
    Spec,
    count_inc,
    count_zero,
    inplace_step,
    tree_leaves,
    tree_map,
    zeros_like,
)

__all__ = ["MaskedNode", "MaskedState", "masked", "MultiTransformState", "multi_transform",
           "ApplyIfFiniteState", "apply_if_finite", "MultiStepsState", "MultiSteps",
           "InjectHyperparamsState", "inject_hyperparams"]


class MaskedNode(NamedTuple):
    """Stands in for a masked-out leaf: an empty subtree the inner transformation never sees."""


class MaskedState(NamedTuple):
    """State of ``masked`` (``optax.MaskedState``).

    Fields:
        inner_state: the inner transformation's state, over the masked-in leaves only.
    """

    inner_state: Any


def _mask_tree(tree, mask_tree):
    return tree_map(lambda m, x: x if m else MaskedNode(), mask_tree, tree)


def masked(inner: GradientTransformation, mask: Any | Callable[[Any], Any]) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` (a tree of bools, or a function of params) is True."""

    def resolve(tree):
        return mask(tree) if callable(mask) else mask

    def init(params):
        return MaskedState(inner.init(_mask_tree(params, resolve(params))))

    def update(updates, state, params=None):
        mask_tree = resolve(updates)
        inner_params = None if params is None else _mask_tree(params, mask_tree)
        new, inner_state = inner.update(_mask_tree(updates, mask_tree), state.inner_state, inner_params)
        return tree_map(lambda m, n, old: n if m else old, mask_tree, new, updates), MaskedState(inner_state)

    return GradientTransformation(init, update)


class MultiTransformState(NamedTuple):
    """State of ``multi_transform`` (``optax.MultiTransformState``).

    Fields:
        inner_states: label -> that label's transformation's (masked) state.
    """

    inner_states: dict


def multi_transform(transforms: Mapping[Hashable, GradientTransformation],
                    param_labels: Any | Callable[[Any], Any]) -> GradientTransformation:
    """Route each leaf to ``transforms[label]`` by its label in ``param_labels``."""

    def masks(tree):
        labels = param_labels(tree) if callable(param_labels) else param_labels
        missing = set(tree_leaves(labels)) - set(transforms)
        if missing:
            raise ValueError(f"labels {sorted(map(str, missing))} have no transformation; "
                             f"transforms has {sorted(map(str, transforms))}")
        return {k: tree_map(lambda lab, k=k: lab == k, labels) for k in transforms}

    def init(params):
        m = masks(params)
        return MultiTransformState({k: masked(tx, m[k]).init(params) for k, tx in transforms.items()})

    def update(updates, state, params=None):
        m = masks(updates)
        new_states = {}
        for k, tx in transforms.items():
            updates, new_states[k] = masked(tx, m[k]).update(updates, state.inner_states[k], params)
        return updates, MultiTransformState(new_states)

    return GradientTransformation(init, update)


class ApplyIfFiniteState(NamedTuple):
    """State of ``apply_if_finite`` (``optax.ApplyIfFiniteState``).

    Fields:
        notfinite_count: non-finite steps in a row, 0-d int32.
        last_finite: whether the last step was finite, 0-d bool.
        total_notfinite: non-finite steps in all, 0-d int32.
        inner_state: the inner transformation's state (unchanged by skipped steps).
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int) -> GradientTransformation:
    """Skip (zero updates, keep state) steps whose updates hold a NaN or inf, unless more than
    ``max_consecutive_errors`` in a row have been skipped."""
    if max_consecutive_errors < 0:
        raise ValueError(f"max_consecutive_errors must be >= 0, got {max_consecutive_errors!r}")

    def init(params):
        return ApplyIfFiniteState(count_zero(), torch.tensor(True), count_zero(), inner.init(params))

    def update(updates, state, params=None):
        finite = sharding.all_finite(tree_leaves(updates))
        notfinite = count_zero() if finite else count_inc(state.notfinite_count)
        if finite or int(notfinite) > max_consecutive_errors:
            updates, inner_state = inner.update(updates, state.inner_state, params)
        else:
            updates, inner_state = zeros_like(updates), state.inner_state
        total = state.total_notfinite if finite else count_inc(state.total_notfinite)
        return updates, ApplyIfFiniteState(notfinite, torch.tensor(finite), total, inner_state)

    return GradientTransformation(init, update)


class MultiStepsState(NamedTuple):
    """State of ``MultiSteps`` (gradient accumulation; ``optax.MultiStepsState``).

    Fields:
        mini_step: micro-steps since the last real step, 0-d int32.
        gradient_step: real steps taken, 0-d int32.
        inner_opt_state: the inner optimizer's state.
        acc_grads: the accumulated mean (or sum) of updates, a pytree like the params in ``accumulator_dtype``.
        skip_state: the state of ``should_skip_update_fn``, ``()`` without one.
    """

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()


class MultiSteps:
    """Gradient accumulation: apply ``opt`` once every ``every_k_schedule`` calls to the mean
    (or sum) of the updates seen since (``optax.MultiSteps``); in between, updates are zero."""

    def __init__(self, opt: GradientTransformation, every_k_schedule: int | Callable[[Any], int],
                 use_grad_mean: bool = True, should_skip_update_fn: Callable | None = None,
                 accumulator_dtype: torch.dtype = torch.float32):
        if isinstance(every_k_schedule, int) and every_k_schedule < 1:
            raise ValueError(f"every_k_schedule must be >= 1, got {every_k_schedule!r}")
        self._opt = opt
        self._k = every_k_schedule if callable(every_k_schedule) else (lambda step: every_k_schedule)
        self._use_grad_mean = use_grad_mean
        self._skip = should_skip_update_fn
        self._acc_dtype = accumulator_dtype

    @property
    def inner_opt(self) -> GradientTransformation:
        return self._opt

    def init(self, params: Any) -> MultiStepsState:
        skip_state = () if self._skip is None else self._skip(zeros_like(params), count_zero(), params)[1]
        return MultiStepsState(count_zero(), count_zero(), self._opt.init(params),
                               zeros_like(params, self._acc_dtype), skip_state)

    def update(self, updates: Any, state: MultiStepsState, params: Any = None):
        skip, skip_state = (False, ()) if self._skip is None else self._skip(updates, state.gradient_step, params)
        if bool(skip):
            return zeros_like(updates), state._replace(skip_state=skip_state)
        n = int(state.mini_step)
        k = int(self._k(state.gradient_step))
        if self._use_grad_mean:
            acc = tree_map(lambda g, a: a + (g - a) / (n + 1), updates, state.acc_grads)
        else:
            acc = tree_map(lambda g, a: g + a, updates, state.acc_grads)
        if n != k - 1:
            acc = tree_map(lambda a: a.to(self._acc_dtype), acc)
            return zeros_like(updates), MultiStepsState(count_inc(state.mini_step), state.gradient_step,
                                                        state.inner_opt_state, acc, skip_state)
        final, inner_state = self._opt.update(tree_map(lambda a, g: a.to(g.dtype), acc, updates),
                                              state.inner_opt_state, params)
        return final, MultiStepsState(count_zero(), count_inc(state.gradient_step), inner_state,
                                      zeros_like(acc, self._acc_dtype), skip_state)

    def has_updated(self, state: MultiStepsState) -> bool:
        return int(state.mini_step) == 0 and int(state.gradient_step) > 0

    def gradient_transformation(self) -> GradientTransformation:
        return GradientTransformation(self.init, self.update)


class InjectHyperparamsState(NamedTuple):
    """State of ``inject_hyperparams`` (``optax.InjectHyperparamsState``).

    Fields:
        count: steps taken, 0-d int32 (schedules are evaluated at it).
        hyperparams: name -> current value (floats); set one to change it from the next step.
        inner_state: the inner transformation's state.
    """

    count: torch.Tensor
    hyperparams: dict
    inner_state: Any


def inject_hyperparams(inner_factory: Callable[..., GradientTransformation],
                       static_args: str | Iterable[str] = ()) -> Callable[..., GradientTransformation]:
    """Make a factory's numeric hyperparameters part of the state (mirrors ``optax.inject_hyperparams``).

    ``inject_hyperparams(adam)(learning_rate=0.1)`` steps as ``adam(0.1)`` but keeps
    ``state.hyperparams = {"learning_rate": 0.1, "b1": 0.9, ...}``, which can be read and set
    between steps; a hyperparameter given as a schedule is evaluated at the step count and its
    value stored there too. Numbers, bools and ``None`` in ``static_args`` (and every non-number)
    stay fixed. `zero.functional.Optimizer` shows these values as param-group keys, so torch's lr
    schedulers drive them.

    The inner transformation is rebuilt only when the values change (the last few are kept), so
    a run with fixed hyperparameters builds it once and keeps its fused kernel.
    """
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)
    if not static <= set(signature.parameters):
        raise ValueError(f"static_args {sorted(static)} are not all parameters of "
                         f"{getattr(inner_factory, '__name__', inner_factory)}")

    def wrapped(*args, **kwargs) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        scheduled, numeric, other = {}, {}, {}
        for name, value in bound.arguments.items():
            if name in static or isinstance(value, bool) or value is None:
                other[name] = value
            elif callable(value):
                scheduled[name] = value
            elif isinstance(value, (int, float, torch.Tensor)):
                numeric[name] = float(value)
            else:
                other[name] = value

        @functools.lru_cache(maxsize=4)
        def inner(values: tuple[tuple[str, float], ...]) -> GradientTransformation:
            return inner_factory(**other, **dict(values))

        def values(state):
            hp = dict(state.hyperparams)
            hp.update({k: float(f(state.count)) for k, f in scheduled.items()})
            return hp

        def init(params):
            hp = numeric | {k: float(f(0)) for k, f in scheduled.items()}
            return InjectHyperparamsState(count_zero(), hp, inner(tuple(hp.items())).init(params))

        def update(updates, state, params=None):
            hp = values(state)
            updates, inner_state = inner(tuple(hp.items())).update(updates, state.inner_state, params)
            return updates, InjectHyperparamsState(count_inc(state.count), hp, inner_state)

        def inplace(params, grads, state):
            hp = values(state)
            inner_state = inplace_step(inner(tuple(hp.items())), params, grads, state.inner_state)
            return InjectHyperparamsState(count_inc(state.count), hp, inner_state)

        initial = numeric | {k: float(f(0)) for k, f in scheduled.items()}
        return GradientTransformation(init, update, inplace, Spec("inject_hyperparams", {"hyperparams": initial}))

    return wrapped
