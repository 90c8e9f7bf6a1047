"""Hyperparameters in the state: ``inject_hyperparams`` and stateful schedules (Optax's
``optax.schedules._inject``).

A hyperparameter given as a number lives in the state as a 0-d tensor that can be read and set
between steps; one given as a schedule is evaluated each step, and a *stateful* schedule (an
object with ``init()``, ``update(state, **extra_args)`` and ``__call__(state, **extra_args)``)
also keeps a state there, fed by the extra args of ``update`` (a loss, say).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from zero.functional.base import (
    GradientTransformation,
    Spec,
    as_dtype,
    count_inc,
    count_zero,
    tree_leaves,
    update_with,
)
from zero.functional.foreach import traced
from zero.functional.kernels.builds import Builds
from zero.functional.kernels.chains import explain

__all__ = ["InjectHyperparamsState", "InjectStatefulHyperparamsState", "WrappedScheduleState", "WrappedSchedule",
           "inject_hyperparams", "inject_stateful_hyperparams"]


class InjectHyperparamsState(NamedTuple):
    """The state ``inject_hyperparams`` had before stateful schedules (``optax.InjectHyperparamsState``,
    which Optax keeps for old checkpoints); `inject_hyperparams` now returns
    `InjectStatefulHyperparamsState`.

    Fields:
        count: steps taken, 0-d int32.
        hyperparams: name -> current value.
        inner_state: the inner transformation's state.
    """

    count: torch.Tensor
    hyperparams: dict
    inner_state: Any


class InjectStatefulHyperparamsState(NamedTuple):
    """State of ``inject_hyperparams`` (``optax.InjectStatefulHyperparamsState``).

    Fields:
        count: steps taken, 0-d int32.
        hyperparams: name -> current value, a 0-d tensor (set a numeric one to change it from the
            next step; a scheduled one is recomputed each step).
        hyperparams_states: name -> the state of that hyperparameter's schedule.
        inner_state: the inner transformation's state.
    """

    count: torch.Tensor
    hyperparams: dict
    hyperparams_states: dict
    inner_state: Any


class WrappedScheduleState(NamedTuple):
    """State of `WrappedSchedule` (``optax.WrappedScheduleState``).

    Fields:
        count: steps taken, 0-d int32.
    """

    count: torch.Tensor


class WrappedSchedule:
    """A schedule of the step count as a stateful schedule (``optax.WrappedSchedule``)."""

    def __init__(self, schedule_fn: Callable[[Any], Any]):
        self.schedule_fn = schedule_fn

    def init(self) -> WrappedScheduleState:
        return WrappedScheduleState(count_zero())

    def update(self, state: WrappedScheduleState, **extra_args) -> WrappedScheduleState:
        return WrappedScheduleState(count_inc(state.count))

    def __call__(self, state: WrappedScheduleState, **extra_args) -> Any:
        return self.schedule_fn(state.count)


def _is_stateful_schedule(value: Any) -> bool:
    return callable(value) and callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))


def _params_dtype(params: Any) -> torch.dtype:
    """The widest floating dtype of the params (Optax's ``tree.dtype(params, 'highest')``); the
    default dtype when there are none or none are floating."""
    dtypes = [p.dtype for p in tree_leaves(params) if isinstance(p, torch.Tensor)]
    floating = [d if d.is_floating_point else torch.empty(0, dtype=d).real.dtype for d in dtypes if d.is_complex
                or d.is_floating_point]
    return functools.reduce(torch.promote_types, floating) if floating else torch.get_default_dtype()


def _as_hyperparam(value: Any, dtype: torch.dtype) -> torch.Tensor:
    """A hyperparameter as stored: a tensor keeps its dtype, a Python float takes ``dtype``, an
    int stays an int (as Optax, which casts only weakly typed floats)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=dtype if isinstance(value, float) else None)


def _scheduled(value: Any, dtype: torch.dtype) -> torch.Tensor:
    """A schedule's value as stored: in ``dtype`` when it is a float, whether the schedule gave a
    Python float (eager) or a float64 tensor (traced), so the state keeps one dtype throughout."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return _as_hyperparam(value, dtype)


# Arguments that are never hyperparameters, whatever ``static_args`` says (Optax's contrib tests
# name the same ones static): a function of the step that is not a schedule of the value (ADOPT's
# ``clip_value_fn``, which a schedule's call would replace by its value), lengths that shape the
# rule's state or its schedule (a float tensor there would break them). (Muon's ``ns_steps``, which
# Optax's tests also keep static for JAX's loops, stays a group setting here: torch loops in Python.)
UNINJECTABLE = frozenset({"block_size", "warmup_steps", "num_betas", "clip_value_fn", "rank", "memory_size",
                          "update_proj_gap"})


def _split(bound: dict, static: set[str]) -> tuple[dict, dict, dict]:
    """The factory's arguments as (scheduled, numeric, fixed)."""
    scheduled, numeric, fixed = {}, {}, {}
    for name, value in bound.items():
        if name in static or name in UNINJECTABLE or isinstance(value, bool) or value is None:
            fixed[name] = value
        elif _is_stateful_schedule(value):
            scheduled[name] = value
        elif callable(value):
            scheduled[name] = WrappedSchedule(value)
        elif isinstance(value, int | float) or (isinstance(value, torch.Tensor) and value.dim() == 0):
            numeric[name] = value
        else:
            fixed[name] = value
    return scheduled, numeric, fixed


def inject_hyperparams(inner_factory: Callable[..., GradientTransformation],
                       static_args: str | Iterable[str] = (),
                       hyperparam_dtype: torch.dtype | str | None = None) -> Callable[..., GradientTransformation]:
    """Make a factory's numeric hyperparameters part of the state (mirrors ``optax.inject_hyperparams``).

    ``inject_hyperparams(adam)(learning_rate=0.1)`` steps as ``adam(0.1)`` but keeps
    ``state.hyperparams = {"learning_rate": tensor(0.1), "b1": tensor(0.9), ...}``, which can be
    read and set between steps. A hyperparameter given as a schedule (a function of the step count,
    or a stateful schedule, see the module) is evaluated each step and its value stored there too.
    Bools, ``None``, non-numbers, the names in ``static_args`` and those never hyperparameters
    (`UNINJECTABLE`: ``warmup_steps``, ``clip_value_fn``, ``ns_steps`` ..., which Optax needs named
    in ``static_args``) stay fixed.

    Float hyperparameters are kept in ``hyperparam_dtype``, by default the widest floating dtype of
    the params (so bf16 params give bf16 hyperparameters, as in Optax); a tensor keeps its own
    dtype. The inner transformation gets them as Python numbers. `zero.functional.Optimizer`
    keeps them in float64 and shows them as param-group keys, so torch's lr schedulers drive them.

    Extra args of ``update`` go to the stateful schedules and to the inner transformation if it
    takes them. The in-place step (what `zero.functional.Optimizer` runs) builds the inner
    transformation once and its kernel reads each step's values when called, so a scheduler's new
    learning rate costs no rebuild (`zero.functional.kernels.builds`); the pure ``update`` builds
    it for each set of values (the last few kept), as Optax's does under ``jit``.
    """
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(inner_factory)
    if not static <= set(signature.parameters):
        raise ValueError(f"static_args {sorted(static)} are not all parameters of "
                         f"{getattr(inner_factory, '__name__', inner_factory)}")
    hyperparam_dtype = as_dtype(hyperparam_dtype, "hyperparam_dtype")

    @functools.wraps(inner_factory)
    def wrapped(*args, **kwargs) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        injected = _Injected(inner_factory, *_split(bound.arguments, static), hyperparam_dtype)
        return GradientTransformation(injected.init, injected.update, injected,
                                      Spec("inject_hyperparams", {"hyperparams": injected.initial,
                                                                  "source": (inner_factory, dict(bound.arguments))}))

    return wrapped


class _Injected:
    """One `inject_hyperparams` transformation: its schedules, its first values and the inner
    transformation's builds (`Builds`: per set of values for ``update``, once for the in-place
    step, which is the object itself: ``tx.inplace(params, grads, state)``)."""

    def __init__(self, factory: Callable[..., GradientTransformation], scheduled: dict, numeric: dict, fixed: dict,
                 dtype: torch.dtype | None):
        self.scheduled, self.numeric, self.dtype = scheduled, numeric, dtype
        self.builds = Builds(factory, fixed)
        self.initial = {k: _initial(v) for k, v in numeric.items()}
        self.initial.update({k: _initial(f(f.init())) for k, f in scheduled.items()})

    def current(self, state: InjectStatefulHyperparamsState, params: Any, extra_args: dict) -> tuple[dict, dict]:
        """This step's hyperparameters (the state's, the schedules' new values) and schedule states."""
        dtype = self.dtype or _params_dtype(params)
        hp = {k: _as_hyperparam(v, dtype) for k, v in state.hyperparams.items()}
        hp.update({k: _scheduled(f(state.hyperparams_states[k], **extra_args), dtype)
                   for k, f in self.scheduled.items()})
        schedule_states = {k: f.update(state.hyperparams_states[k], **extra_args) for k, f in self.scheduled.items()}
        return hp, schedule_states

    def init(self, params: Any) -> InjectStatefulHyperparamsState:
        dtype = self.dtype or _params_dtype(params)
        schedule_states = {k: f.init() for k, f in self.scheduled.items()}
        hp = {k: _as_hyperparam(v, dtype) for k, v in self.numeric.items()}
        hp.update({k: _scheduled(f(schedule_states[k]), dtype) for k, f in self.scheduled.items()})
        return InjectStatefulHyperparamsState(count_zero(), hp, schedule_states, self.builds.init(params, hp))

    def update(self, updates: Any, state: InjectStatefulHyperparamsState, params: Any = None, **extra_args: Any):
        hp, schedule_states = self.current(state, params, extra_args)
        updates, inner = update_with(self.builds.full(hp), updates, state.inner_state, params, extra_args)
        return updates, InjectStatefulHyperparamsState(count_inc(state.count), hp, schedule_states, inner)

    def __call__(self, params: Any, grads: Any,
                 state: InjectStatefulHyperparamsState) -> InjectStatefulHyperparamsState:
        """The in-place step (the transformation's ``inplace``; `describe` says its path)."""
        hp, schedule_states = self.current(state, params, {})
        inner = self.builds.step(params, grads, state.inner_state, hp)
        return InjectStatefulHyperparamsState(count_inc(state.count), hp, schedule_states, inner)

    def describe(self, params: Any) -> Any:
        inner_tx = self.builds.full({k: torch.tensor(v) for k, v in self.initial.items()})
        return explain(inner_tx, params).after("inject_hyperparams: read from the state each step")


def _initial(value: Any) -> Any:
    """A hyperparameter's first value as the spec shows it: a float, or the tensor itself when it
    cannot be read (traced by ``torch.func`` or ``torch.compile``)."""
    if isinstance(value, torch.Tensor):
        return value if traced() else float(value.detach())
    return float(value)



def inject_stateful_hyperparams(inner_factory: Callable[..., GradientTransformation],
                                static_args: str | Iterable[str] = (),
                                hyperparam_dtype: torch.dtype | str | None = None
                                ) -> Callable[..., GradientTransformation]:
    """`inject_hyperparams`, under Optax's deprecated name (``optax.inject_stateful_hyperparams``,
    which now warns the same and does the same): stateful schedules are taken there too."""
    warnings.warn("inject_stateful_hyperparams is deprecated, use inject_hyperparams instead", DeprecationWarning,
                  stacklevel=2)
    return inject_hyperparams(inner_factory, static_args, hyperparam_dtype)
