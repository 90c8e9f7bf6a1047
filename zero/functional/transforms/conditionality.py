"""Guards: steps that happen only when a condition holds (``optax.apply_if_finite``,
``conditionally_mask``, ``conditionally_transform``, ``zero_nans``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from zero.functional import sharding
from zero.functional.base import (
    GradientTransformation,
    Spec,
    count_inc,
    count_zero,
    select,
    step_in_place,
    tree_leaves,
    tree_map,
    update_with,
    zeros_like,
)
from zero.functional.foreach import elementwise_map
from zero.functional.kernels.chains import described, explain

__all__ = ["ApplyIfFiniteState", "apply_if_finite", "ZeroNansState", "zero_nans", "ConditionallyMaskState",
           "ConditionallyTransformState", "conditionally_mask", "conditionally_transform"]


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

    def update(updates, state, params=None, **extra_args):
        finite = sharding.all_finite(tree_leaves(updates))
        if isinstance(finite, torch.Tensor):
            return traced_update(updates, state, params, extra_args, finite)
        notfinite = count_zero() if finite else count_inc(state.notfinite_count)
        if finite or int(notfinite) > max_consecutive_errors:
            updates, inner_state = update_with(inner, updates, state.inner_state, params, extra_args)
        else:
            updates, inner_state = zeros_like(updates), state.inner_state
        total = state.total_notfinite if finite else count_inc(state.total_notfinite)
        return updates, ApplyIfFiniteState(notfinite, torch.tensor(finite), total, inner_state)

    def traced_update(updates, state, params, extra_args, finite):
        """`update` under torch.compile / torch.func: the inner step is taken, and kept or not by
        `select`, so the graph is the same whatever the updates hold (Optax's ``lax.cond``)."""
        notfinite = torch.where(finite, count_zero(), count_inc(state.notfinite_count))
        keep = finite | (notfinite > max_consecutive_errors)
        new, inner_state = update_with(inner, updates, state.inner_state, params, extra_args)
        updates = tree_map(lambda u: torch.where(keep, u, torch.zeros_like(u)), new)
        total = torch.where(finite, state.total_notfinite, count_inc(state.total_notfinite))
        return updates, ApplyIfFiniteState(notfinite, finite, total, select(keep, inner_state, state.inner_state))

    @torch.no_grad()
    def inplace(params, grads, state):
        """One finiteness check, then ``inner``'s in-place step, or nothing (a skipped step's zero
        updates leave the params as they are)."""
        finite = sharding.all_finite(tree_leaves(grads))
        notfinite = count_zero() if finite else count_inc(state.notfinite_count)
        inner_state = state.inner_state
        if finite or int(notfinite) > max_consecutive_errors:
            inner_state = step_in_place(inner, params, grads, inner_state)
        total = state.total_notfinite if finite else count_inc(state.total_notfinite)
        return ApplyIfFiniteState(notfinite, torch.tensor(finite), total, inner_state)

    def describe(params):
        return explain(inner, params).after("apply_if_finite: one finiteness check")

    return GradientTransformation(init, update, described(inplace, describe) if inner.inplace else None,
                                  Spec("apply_if_finite", {"inner": inner,
                                                           "max_consecutive_errors": max_consecutive_errors}))


class ZeroNansState(NamedTuple):
    """State of ``zero_nans`` (``optax.ZeroNansState``).

    Fields:
        found_nan: per leaf, a 0-d bool: whether the last updates held a NaN there.
    """

    found_nan: Any


def zero_nans() -> GradientTransformation:
    """Replace NaNs in the updates by 0 and record, per leaf, whether there were any (``optax.zero_nans``)."""
    def update(updates, state, params=None):
        found = tree_map(lambda u: torch.isnan(u).any(), updates)
        return elementwise_map(lambda u: torch.where(torch.isnan(u), 0.0, u), updates), ZeroNansState(found)

    return GradientTransformation(lambda params: ZeroNansState(tree_map(lambda p: torch.tensor(False), params)),
                                  update)


class ConditionallyMaskState(NamedTuple):
    """State of ``conditionally_mask`` (``optax.ConditionallyMaskState``).

    Fields:
        step: calls so far, 0-d int32; inner_state: the inner transformation's state.
    """

    step: torch.Tensor
    inner_state: Any


class ConditionallyTransformState(NamedTuple):
    """State of ``conditionally_transform`` (``optax.ConditionallyTransformState``).

    Fields:
        inner_state: the inner transformation's state; step: calls so far, 0-d int32.
    """

    inner_state: Any
    step: torch.Tensor


def _conditionally(inner, should_transform_fn, forward_extra_args, on_reject, state_class):
    """Both conditional wrappers: ``inner`` where the condition holds, ``on_reject(updates)`` (inner
    state kept) elsewhere; ``state_class`` has ``step`` and ``inner_state`` fields (in either order)."""
    def update(updates, state, params=None, **extra_args):
        inner_state = state.inner_state
        if bool(should_transform_fn(state.step, **(extra_args if forward_extra_args else {}))):
            updates, inner_state = update_with(inner, updates, inner_state, params, extra_args)
        else:
            updates = on_reject(updates)
        return updates, state_class(step=count_inc(state.step), inner_state=inner_state)

    return GradientTransformation(lambda params: state_class(step=count_zero(), inner_state=inner.init(params)),
                                  update)


def conditionally_mask(inner: GradientTransformation, should_transform_fn: Callable[..., Any],
                       forward_extra_args: bool = False) -> GradientTransformation:
    """Apply ``inner`` at steps where ``should_transform_fn(step)`` holds, zero updates (state
    kept) elsewhere (``optax.conditionally_mask``)."""
    return _conditionally(inner, should_transform_fn, forward_extra_args, zeros_like, ConditionallyMaskState)


def conditionally_transform(inner: GradientTransformation, should_transform_fn: Callable[..., Any],
                            forward_extra_args: bool = False) -> GradientTransformation:
    """Apply ``inner`` at steps where ``should_transform_fn(step)`` holds, pass updates through
    elsewhere (``optax.conditionally_transform``)."""
    return _conditionally(inner, should_transform_fn, forward_extra_args, lambda u: u, ConditionallyTransformState)
