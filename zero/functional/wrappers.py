"""Transformations that wrap others: masking, per-label routing, NaN guards and accumulation
(Optax's ``masked``, ``partition`` alias ``multi_transform``, ``apply_if_finite``, ``MultiSteps``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    GradientTransformation,
    as_dtype,
    count_inc,
    count_zero,
    tree_leaves,
    tree_map,
    update_with,
    zeros_like,
)
from zero.functional.packing import elementwise_map

__all__ = ["MaskedNode", "MaskedState", "masked", "PartitionState", "partition", "MultiTransformState",
           "multi_transform",
           "ApplyIfFiniteState", "apply_if_finite", "MultiStepsState", "MultiSteps"]


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


def masked(inner: GradientTransformation, mask: Any | Callable[[Any], Any], *,
           mask_compatible_extra_args: bool = False) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` (a tree of bools, or a function of params) is True
    (``optax.masked``). With ``mask_compatible_extra_args``, extra args shaped like the updates
    are masked too before they reach ``inner``."""

    def resolve(tree):
        return mask(tree) if callable(mask) else mask

    def init(params):
        return MaskedState(inner.init(_mask_tree(params, resolve(params))))

    def update(updates, state, params=None, **extra_args):
        mask_tree = resolve(updates)
        inner_params = None if params is None else _mask_tree(params, mask_tree)
        if mask_compatible_extra_args:
            shape = optree.tree_structure(updates)
            extra_args = {k: _mask_tree(v, mask_tree) if optree.tree_structure(v) == shape else v
                          for k, v in extra_args.items()}
        new, inner_state = update_with(inner, _mask_tree(updates, mask_tree), state.inner_state, inner_params,
                                       extra_args)
        return tree_map(lambda m, n, old: n if m else old, mask_tree, new, updates), MaskedState(inner_state)

    return GradientTransformation(init, update)


class PartitionState(NamedTuple):
    """State of ``partition`` and ``multi_transform`` (``optax.PartitionState``, which Optax also
    calls ``MultiTransformState``).

    Fields:
        inner_states: label -> that label's transformation's (masked) state.
    """

    inner_states: dict


MultiTransformState = PartitionState


def partition(transforms: Mapping[Hashable, GradientTransformation], param_labels: Any | Callable[[Any], Any], *,
              mask_compatible_extra_args: bool = False) -> GradientTransformation:
    """Route each leaf to ``transforms[label]`` by its label in ``param_labels`` (a tree of labels
    or a function of params returning one; ``optax.partition``, also ``multi_transform``). A label
    without a transformation is a ``ValueError`` naming it."""

    def masks(tree):
        labels = param_labels(tree) if callable(param_labels) else param_labels
        missing = set(tree_leaves(labels)) - set(transforms)
        if missing:
            raise ValueError(f"labels {sorted(map(str, missing))} have no transformation; "
                             f"transforms has {sorted(map(str, transforms))}")
        return {k: tree_map(lambda lab, k=k: lab == k, labels) for k in transforms}

    def route(tx, mask_tree):
        return masked(tx, mask_tree, mask_compatible_extra_args=mask_compatible_extra_args)

    def init(params):
        m = masks(params)
        return PartitionState({k: route(tx, m[k]).init(params) for k, tx in transforms.items()})

    def update(updates, state, params=None, **extra_args):
        m = masks(updates)
        new_states = {}
        for k, tx in transforms.items():
            updates, new_states[k] = route(tx, m[k]).update(updates, state.inner_states[k], params, **extra_args)
        return updates, PartitionState(new_states)

    return GradientTransformation(init, update)


multi_transform = partition


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
        notfinite = count_zero() if finite else count_inc(state.notfinite_count)
        if finite or int(notfinite) > max_consecutive_errors:
            updates, inner_state = update_with(inner, updates, state.inner_state, params, extra_args)
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
        self._acc_dtype = as_dtype(accumulator_dtype, "accumulator_dtype")
        self._out_dtypes: dict[tuple, Any] = {}

    @property
    def inner_opt(self) -> GradientTransformation:
        return self._opt

    def init(self, params: Any) -> MultiStepsState:
        skip_state = () if self._skip is None else self._skip(zeros_like(params), count_zero(), params)[1]
        return MultiStepsState(count_zero(), count_zero(), self._opt.init(params),
                               zeros_like(params, self._acc_dtype), skip_state)

    def update(self, updates: Any, state: MultiStepsState, params: Any = None, **extra_args):
        skip, skip_state = (False, ()) if self._skip is None else self._skip(updates, state.gradient_step, params)
        if bool(skip):
            return zeros_like(updates), state._replace(skip_state=skip_state)
        n = int(state.mini_step)
        k = int(self._k(state.gradient_step))
        if self._use_grad_mean:
            acc = elementwise_map(lambda g, a: a + (g - a) / (n + 1), updates, state.acc_grads)
        else:
            acc = elementwise_map(lambda g, a: g + a, updates, state.acc_grads)
        inner_updates = elementwise_map(lambda a, g: a.to(g.dtype), acc, updates)
        if n != k - 1:
            acc = elementwise_map(lambda a: a.to(self._acc_dtype), acc)
            zeros = self._zeros_like_inner(inner_updates, state.inner_opt_state, params, extra_args)
            return zeros, MultiStepsState(count_inc(state.mini_step), state.gradient_step,
                                          state.inner_opt_state, acc, skip_state)
        final, inner_state = update_with(self._opt, inner_updates, state.inner_opt_state, params, extra_args)
        return final, MultiStepsState(count_zero(), count_inc(state.gradient_step), inner_state,
                                      zeros_like(acc, self._acc_dtype), skip_state)

    def _zeros_like_inner(self, updates: Any, inner_state: Any, params: Any, extra_args: dict) -> Any:
        """Zeros in the dtypes the inner optimizer's updates would have (Optax's mini-steps return
        ``0 * inner_update``: f16 gradients with f32 params give f32 zeros under Adam). The dtypes
        are learnt by one discarded inner step per combination of input dtypes."""
        key = tuple(t.dtype for t in tree_leaves((updates, params)))
        dtypes = self._out_dtypes.get(key)
        if dtypes is None:
            out, _ = update_with(self._opt, updates, inner_state, params, extra_args)
            dtypes = self._out_dtypes[key] = tree_map(lambda u: u.dtype, out)
        return tree_map(lambda u, d: torch.zeros_like(u, dtype=d), updates, dtypes)

    def has_updated(self, state: MultiStepsState) -> bool:
        return int(state.mini_step) == 0 and int(state.gradient_step) > 0

    def gradient_transformation(self) -> GradientTransformation:
        return GradientTransformation(self.init, self.update)
