"""Optax's other transformations on torch tensors: building blocks (``stateless``,
``set_to_zero``, ``named_chain``), guards (``zero_nans``, ``conditionally_mask``,
``conditionally_transform``, and the ``skip_*`` functions for `MultiSteps`), accumulation
(``apply_every``) and clipping (``clip_by_block_rms``, ``adaptive_grad_clip``,
``per_example_global_norm_clip``).

Each mirrors the Optax function of the same name (same arguments and state fields).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    NO_PARAMS_MSG,
    EmptyState,
    GradientTransformation,
    count_inc,
    count_zero,
    tree_leaves,
    tree_map,
    update_with,
    zeros_like,
)
from zero.functional.elementwise import abs_sq
from zero.functional.packing import elementwise_map

__all__ = ["ZeroNansState", "ApplyEvery", "ConditionallyMaskState", "ConditionallyTransformState",
           "set_to_zero", "stateless", "stateless_with_tree_map", "zero_nans", "centralize", "apply_every",
           "named_chain", "conditionally_mask", "conditionally_transform", "skip_not_finite",
           "skip_large_updates", "clip_by_block_rms", "adaptive_grad_clip", "per_example_global_norm_clip"]


class ZeroNansState(NamedTuple):
    """State of ``zero_nans`` (``optax.ZeroNansState``).

    Fields:
        found_nan: per leaf, a 0-d bool: whether the last updates held a NaN there.
    """

    found_nan: Any


class ApplyEvery(NamedTuple):
    """State of ``apply_every`` (``optax.ApplyEvery``).

    Fields:
        count: steps modulo ``k``, 0-d int32.
        grad_acc: the sum of the updates since the last emitted step.
    """

    count: torch.Tensor
    grad_acc: Any


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


def _stateless_tx(update: Callable) -> GradientTransformation:
    return GradientTransformation(lambda params: EmptyState(), update)


def set_to_zero() -> GradientTransformation:
    """Zero updates (``optax.set_to_zero``); e.g. freezes the params it is routed to."""
    return _stateless_tx(lambda u, s, p=None: (zeros_like(u), s))


def stateless(f: Callable[[Any, Any], Any]) -> GradientTransformation:
    """A transformation from ``f(updates, params) -> updates`` (``optax.stateless``)."""
    return _stateless_tx(lambda u, s, p=None: (f(u, p), EmptyState()))


def stateless_with_tree_map(f: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> GradientTransformation:
    """``f(update, param)`` leaf by leaf (``param`` is None without params); ``optax.stateless_with_tree_map``."""
    def update(updates, state, params=None):
        if params is None:
            return tree_map(lambda u: f(u, None), updates), EmptyState()
        return tree_map(f, updates, params), EmptyState()

    return _stateless_tx(update)


def zero_nans() -> GradientTransformation:
    """Replace NaNs in the updates by 0 and record, per leaf, whether there were any (``optax.zero_nans``)."""
    def update(updates, state, params=None):
        found = tree_map(lambda u: torch.isnan(u).any(), updates)
        return elementwise_map(lambda u: torch.where(torch.isnan(u), 0.0, u), updates), ZeroNansState(found)

    return GradientTransformation(lambda params: ZeroNansState(tree_map(lambda p: torch.tensor(False), params)),
                                  update)


def centralize() -> GradientTransformation:
    """Subtract from each update of 2 or more dimensions its mean over all but the first (gradient
    centralisation; ``optax.centralize``). Needs whole tensors (not a flat plan's pieces)."""
    def update(updates, state, params=None):
        sharding.whole_tensors(tree_leaves(updates), "centralize")
        return tree_map(lambda g: g - g.mean(tuple(range(1, g.dim())), keepdim=True) if g.dim() > 1 else g,
                        updates), state

    return _stateless_tx(update)


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


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """`chain` whose state is a dict by name (``optax.named_chain``); names must be unique."""
    names = [name for name, _ in transforms]
    if len(names) != len(set(names)):
        raise ValueError(f"named_chain needs unique names, got {names}")

    def init(params):
        return {name: tx.init(params) for name, tx in transforms}

    def update(updates, state, params=None, **extra_args):
        new_state = {}
        for name, tx in transforms:
            updates, new_state[name] = update_with(tx, updates, state[name], params, extra_args)
        return updates, new_state

    return GradientTransformation(init, update)


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


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """Scale each update so its root mean square is at most ``threshold`` (``optax.clip_by_block_rms``)."""
    def update(updates, state, params=None):
        sharding.whole_tensors(tree_leaves(updates), "clip_by_block_rms")
        return tree_map(lambda u: u / torch.clamp(torch.sqrt(abs_sq(u).mean()) / threshold, min=1.0), updates), state

    return _stateless_tx(update)


_UNIT_AXES = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def _unitwise_norm(x: torch.Tensor, axis: int | tuple[int, ...] | None) -> torch.Tensor:
    """Optax's ``unitwise_norm``: per output unit (axis 0 of a linear layer's IO kernel, the
    spatial and input axes of a HWIO conv), or the whole tensor for scalars and vectors."""
    if axis is None and x.squeeze().dim() <= 1:
        axis = tuple(range(x.dim()))
    elif axis is None:
        if x.dim() not in _UNIT_AXES:
            raise ValueError(f"adaptive_grad_clip expects params of 1 to 5 dimensions, got shape {tuple(x.shape)}: "
                             "pass axis= to name the reduction axes")
        axis = _UNIT_AXES[x.dim()]
    squared = abs_sq(x).sum(dim=axis, keepdim=True) if x.dim() else abs_sq(x)
    return torch.sqrt(squared).expand(x.shape)


def adaptive_grad_clip(clipping: float, eps: float = 1e-3,
                       axis: int | tuple[int, ...] | None = None) -> GradientTransformation:
    """Clip each unit's gradient to ``clipping * max(|param unit|, eps)`` (AGC, NFNets;
    ``optax.adaptive_grad_clip``). Needs whole tensors (not a flat plan's pieces)."""
    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        sharding.whole_tensors(tree_leaves(updates), "adaptive_grad_clip")

        def one(g, p):
            g_norm, max_norm = _unitwise_norm(g, axis), clipping * torch.clamp(_unitwise_norm(p, axis), min=eps)
            return torch.where(g_norm < max_norm, g, g * (max_norm / torch.clamp(g_norm, min=1e-6)))

        return tree_map(one, updates, params), state

    return _stateless_tx(update)


def per_example_global_norm_clip(grads: Any, l2_norm_clip: float) -> tuple[Any, torch.Tensor]:
    """Clip each example's gradient (axis 0 of every leaf) to global norm ``l2_norm_clip`` and sum
    over examples; returns the sum and how many were clipped (``optax.per_example_global_norm_clip``)."""
    leaves, treedef = optree.tree_flatten(grads)
    if not leaves or any(g.dim() == 0 for g in leaves) or len({g.shape[0] for g in leaves}) != 1:
        raise ValueError("per_example_global_norm_clip expects grads with a batch dimension in the 0th axis")
    norms = torch.sqrt(sum(abs_sq(g).reshape(g.shape[0], -1).sum(1) for g in leaves))
    multipliers = torch.nan_to_num(torch.clamp(l2_norm_clip / norms, max=1.0), nan=1.0)
    clipped = [torch.tensordot(multipliers, g.to(torch.promote_types(g.dtype, multipliers.dtype)), dims=1)
               for g in leaves]
    return optree.tree_unflatten(treedef, clipped), (multipliers < 1.0).sum()
