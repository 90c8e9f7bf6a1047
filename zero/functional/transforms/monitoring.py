"""Measurements of the updates kept in the state, for logging (``optax.snapshot``,
``measure_with_ema``, ``monitor``): `zero.functional.Optimizer.measurements` reads them.

A measure is a function of the updates tree. Under a sharded optimizer it sees this rank's
pieces: one that asks `zero.functional.sharding` (``zero.functional.global_norm``) measures the
whole model on every rank; another measures this rank's pieces only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from zero.functional.base import (
    GradientTransformation,
    stateless,
    with_extra_args_support,
)
from zero.functional.combine import chain
from zero.functional.transforms.momentum import ema

__all__ = ["SnapshotState", "MonitorState", "snapshot", "measure_with_ema", "monitor", "measurements_in"]


class SnapshotState(NamedTuple):
    """State of ``snapshot`` (``optax.SnapshotState``).

    Fields:
        measurement: ``{name: measure(updates)}`` of the last step (of the params at init).
    """

    measurement: dict


class MonitorState(NamedTuple):
    """State of ``monitor`` (``optax.MonitorState``).

    Fields:
        measurements: ``{name: value}`` of the last step; measure_states: each measure's state.
    """

    measurements: dict
    measure_states: tuple


def snapshot(measure_name: str, measure: Callable[[Any], Any]) -> GradientTransformation:
    """Keep ``measure(updates)`` in the state under ``measure_name``; updates pass unchanged
    (``optax.snapshot``)."""

    def init(params):
        return SnapshotState({measure_name: measure(params)})

    def update(updates, state, params=None):
        return updates, SnapshotState({measure_name: measure(updates)})

    return GradientTransformation(init, update)


def measure_with_ema(measure: Callable[[Any], Any], decay: float, debias: bool = True,
                     accumulator_dtype: Any = None) -> GradientTransformation:
    """An exponential moving average of ``measure(updates)``; its updates are the (debiased) average,
    so use it inside `monitor` (``optax.measure_with_ema``)."""
    base_ema = ema(decay, debias, accumulator_dtype)
    measured = base_ema._replace(init=lambda params: base_ema.init(measure(params)), update=base_ema.update)
    return chain(stateless(lambda updates, _: measure(updates)), measured)


def monitor(measures: dict[str, Any]) -> GradientTransformation:
    """Measure the updates each step, leaving them unchanged (``optax.monitor``): each entry of
    ``measures`` is a function of the updates or a transformation whose updates are the
    measurement (`measure_with_ema`); the step's values are ``state.measurements``."""
    txs = {name: with_extra_args_support(m if _is_tx(m) else stateless(lambda u, _, m=m: m(u)))
           for name, m in measures.items()}
    names = tuple(txs)

    def init(params):
        return MonitorState({}, tuple(txs[n].init(params) for n in names))

    def update(updates, state, params=None, **extra_args):
        values, states = {}, []
        for n, s in zip(names, state.measure_states):
            values[n], new = txs[n].update(updates, s, params, **extra_args)
            states.append(new)
        return updates, MonitorState(values, tuple(states))

    return GradientTransformation(init, update)


def _is_tx(x: Any) -> bool:
    return isinstance(x, tuple) and callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))


def measurements_in(state: Any) -> list[tuple[str, Any]]:
    """Every ``(name, value)`` the ``monitor`` and ``snapshot`` states inside ``state`` hold."""
    import optree

    def is_node(x: Any) -> bool:
        return isinstance(x, (MonitorState, SnapshotState))

    out = []
    for node in optree.tree_leaves(state, is_leaf=is_node, none_is_leaf=True):
        if isinstance(node, MonitorState):
            out += list(node.measurements.items())
        elif isinstance(node, SnapshotState):
            out += list(node.measurement.items())
    return out
