"""Accumulating gradients over several calls (``optax.MultiSteps``, its ``skip_*`` predicates,
``apply_every``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zero.functional.base import (
    GradientTransformation,
    Spec,
    as_dtype,
    count_inc,
    count_zero,
    flatten_like,
    select,
    step_in_place,
    tree_leaves,
    tree_map,
    update_with,
    zeros_like,
)
from zero.functional.foreach import elementwise_map, traced
from zero.functional.kernels.chains import Path, described, explain

__all__ = ['MultiStepsState', 'MultiSteps', 'skip_not_finite', 'skip_large_updates', 'ApplyEvery', 'apply_every']


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
        if traced():
            return self._traced_update(updates, state, params, extra_args)
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

    def _traced_update(self, updates: Any, state: MultiStepsState, params: Any, extra_args: dict):
        """`update` under torch.compile / torch.func: the counts stay tensors and the inner step
        is taken at every micro-step, kept on the k-th by `select` (Optax's ``lax.cond``), so one
        graph serves every micro-step. It costs an inner step per micro-step."""
        skip, skip_state = (False, ()) if self._skip is None else self._skip(updates, state.gradient_step, params)
        n, k = state.mini_step, self._k(state.gradient_step)
        if self._use_grad_mean:
            acc = elementwise_map(lambda g, a: a + (g - a) / (n + 1), updates, state.acc_grads)
        else:
            acc = elementwise_map(lambda g, a: g + a, updates, state.acc_grads)
        inner_updates = elementwise_map(lambda a, g: a.to(g.dtype), acc, updates)
        final, inner_state = update_with(self._opt, inner_updates, state.inner_opt_state, params, extra_args)
        last = n == k - 1
        taken = MultiStepsState(count_zero(), count_inc(state.gradient_step), inner_state,
                                zeros_like(acc, self._acc_dtype), skip_state)
        kept = MultiStepsState(count_inc(state.mini_step), state.gradient_step, state.inner_opt_state,
                               elementwise_map(lambda a: a.to(self._acc_dtype), acc), skip_state)
        new = select(last, taken, kept)
        out = tree_map(lambda u: torch.where(last & ~torch.as_tensor(skip), u, torch.zeros_like(u)), final)
        return out, select(torch.as_tensor(skip), state._replace(skip_state=skip_state), new)

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

    @torch.no_grad()
    def inplace(self, params: Any, grads: Any, state: MultiStepsState) -> MultiStepsState:
        """`update` in place: the accumulators take each micro-step's grads where they are, and
        the inner optimizer's in-place step runs on the k-th (its kernel, or its update and an add)."""
        n, k = int(state.mini_step), int(self._k(state.gradient_step))
        leaves, acc = flatten_like(grads, state.acc_grads, "the accumulated grads")
        if not leaves:
            return state._replace(mini_step=count_zero() if n == k - 1 else count_inc(state.mini_step))
        delta = torch._foreach_sub(leaves, acc) if self._use_grad_mean else leaves
        if self._use_grad_mean:
            torch._foreach_div_(delta, float(n + 1))
        if n != k - 1:
            torch._foreach_add_(acc, delta)  # rounded to the accumulator's dtype, as `update` keeps it
            return state._replace(mini_step=count_inc(state.mini_step))
        total = torch._foreach_add(acc, delta)  # the last micro-step's mean, unrounded, as `update` steps with
        inner_grads = [t.to(g.dtype) for t, g in zip(total, leaves)]
        inner_state = step_in_place(self._opt, params, optree.tree_structure(grads).unflatten(inner_grads),
                                   state.inner_opt_state)
        torch._foreach_zero_(acc)
        return MultiStepsState(count_zero(), count_inc(state.gradient_step), inner_state, state.acc_grads,
                               state.skip_state)

    def _describe(self, params: Any) -> Path:
        return explain(self._opt, params).after("MultiSteps: accumulated in place, the inner step every k-th call")

    def gradient_transformation(self) -> GradientTransformation:
        """As an Optax transformation; it steps in place when the inner optimizer does (and no
        ``should_skip_update_fn`` is set: that runs `update`)."""
        fast = self._opt.inplace is not None and self._skip is None
        inplace = described(lambda p, g, s: self.inplace(p, g, s), self._describe) if fast else None
        return GradientTransformation(self.init, self.update, inplace, Spec("MultiSteps", {"inner": self._opt}))


def skip_not_finite(updates: Any, gradient_step: Any, params: Any) -> tuple[torch.Tensor, dict]:
    """For `MultiSteps`' ``should_skip_update_fn``: skip when any update is NaN or infinite
    (``optax.skip_not_finite``)."""
    leaves = tree_leaves(updates)
    num = sum((~torch.isfinite(u)).sum() for u in leaves) if leaves else torch.tensor(0)
    skip = torch.as_tensor(num > 0)
    return skip, {"should_skip": skip, "num_not_finite": torch.as_tensor(num, dtype=torch.int32)}


def skip_large_updates(updates: Any, gradient_step: Any, params: Any,
                       max_squared_norm: float) -> tuple[torch.Tensor, dict]:
    """For `MultiSteps`' ``should_skip_update_fn`` (bind ``max_squared_norm`` with
    ``functools.partial``): skip when the squared norm of the updates reaches it (``optax.skip_large_updates``)."""
    leaves = tree_leaves(updates)
    norm_sq = sum(torch.sum(u * u) for u in leaves) if leaves else torch.tensor(0.0)
    skip = torch.as_tensor(~(norm_sq < max_squared_norm))
    return skip, {"should_skip": skip, "norm_squared": torch.as_tensor(norm_sq)}


class ApplyEvery(NamedTuple):
    """State of ``apply_every`` (``optax.ApplyEvery``).

    Fields:
        count: steps modulo ``k``, 0-d int32.
        grad_acc: the sum of the updates since the last emitted step.
    """

    count: torch.Tensor
    grad_acc: Any


def apply_every(k: int = 1) -> GradientTransformation:
    """Sum the updates over ``k`` steps and emit the sum every ``k``-th step, zeros in between
    (``optax.apply_every``)."""
    if k < 1:
        raise ValueError(f"apply_every needs k >= 1, got {k!r}")

    def update(updates, state, params=None):
        c = int(state.count) % k
        acc = elementwise_map(lambda g, a: g + a if c else g.clone(), updates, state.grad_acc)
        out = acc if c == k - 1 else zeros_like(acc)
        return out, ApplyEvery(torch.tensor(int(count_inc(state.count)) % k, dtype=torch.int32), acc)

    return GradientTransformation(lambda params: ApplyEvery(count_zero(), zeros_like(params)), update)
