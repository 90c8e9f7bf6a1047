"""Masks and routing by label: a transformation applied to some leaves only (``optax.masked``),
or each leaf routed to the transformation of its label (``optax.partition``, ``multi_transform``),
and the freezing built on them (``optax.freeze``, ``selective_transform``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    GradientTransformation,
    Spec,
    add_updates,
    step_in_place,
    tree_leaves,
    tree_map,
    update_with,
)
from zero.functional.kernels.chains import Path, described, explain

__all__ = ["MaskedNode", "MaskedState", "masked", "PartitionState", "MultiTransformState", "partition",
           "multi_transform", "freeze", "selective_transform"]


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


def _keep(tree, mask_tree) -> list[bool]:
    """Per leaf of ``tree``, whether ``mask_tree`` (a prefix of it) keeps it."""
    return tree_leaves(tree_map(lambda m, x: tree_map(lambda _: bool(m), x), mask_tree, tree))


def _inverse(mask_tree):
    return tree_map(lambda m: not bool(m), mask_tree)


def _masked_inplace(inner: GradientTransformation, resolve: Any) -> Any:
    """`masked`'s in-place step: ``inner``'s on the masked-in leaves (its kernel, or its update
    and an add), the updates added as they are to the others (what `masked` passes through)."""
    @torch.no_grad()
    def inplace(params, grads, state):
        mask_tree = resolve(grads)
        with sharding.subset(_keep(grads, mask_tree)):
            inner_state = step_in_place(inner, _mask_tree(params, mask_tree), _mask_tree(grads, mask_tree),
                                       state.inner_state)
        add_updates(_mask_tree(params, _inverse(mask_tree)), _mask_tree(grads, _inverse(mask_tree)))
        return MaskedState(inner_state)

    def describe(params):
        masked_in = _mask_tree(params, resolve(params))
        return explain(inner, masked_in).after("masked: the masked-out leaves take their updates as they are")

    return described(inplace, describe)


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
        with sharding.subset(_keep(updates, mask_tree)):
            new, inner_state = update_with(inner, _mask_tree(updates, mask_tree), state.inner_state, inner_params,
                                           extra_args)
        return tree_map(lambda m, n, old: n if m else old, mask_tree, new, updates), MaskedState(inner_state)

    inplace = _masked_inplace(inner, resolve) if inner.inplace is not None and not mask_compatible_extra_args else None
    return GradientTransformation(init, update, inplace, Spec("masked", {"inner": inner, "mask": mask}))


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

    @torch.no_grad()
    def inplace(params, grads, state):
        """Each label's transformation steps its own leaves in place (its kernel, or its update
        and an add): every leaf has exactly one label."""
        m, new_states = masks(grads), {}
        for k, tx in transforms.items():
            with sharding.subset(_keep(grads, m[k])):
                inner = step_in_place(tx, _mask_tree(params, m[k]), _mask_tree(grads, m[k]),
                                     state.inner_states[k].inner_state)
            new_states[k] = MaskedState(inner)
        return PartitionState(new_states)

    def describe(params):
        m = masks(params)
        parts = tuple((str(k), explain(tx, _mask_tree(params, m[k]))) for k, tx in transforms.items())
        kernels = [p.kernel for _, p in parts]
        kernel = " + ".join(kernels) if all(kernels) else None
        return Path(kernel, sum(p.calls for _, p in parts), "partition: each label's transformation on its leaves",
                    parts)

    fast = any(tx.inplace is not None for tx in transforms.values()) and not mask_compatible_extra_args
    return GradientTransformation(init, update, described(inplace, describe) if fast else None,
                                  Spec("partition", {"transforms": dict(transforms), "param_labels": param_labels}))


multi_transform = partition


def freeze(mask: bool | Any) -> GradientTransformation:
    """Zero updates where ``mask`` is True (a tree of bools like the params, or one bool):
    ``masked(set_to_zero(), mask)`` (``optax.freeze``). A frozen leaf keeps no state."""
    from zero.functional.base import set_to_zero

    return masked(set_to_zero(), mask)


def selective_transform(optimizer: GradientTransformation, *, freeze_mask: bool | Any) -> GradientTransformation:
    """``optimizer`` on the leaves ``freeze_mask`` leaves unfrozen (False), zero updates and no
    state on the frozen ones (``optax.selective_transform``)."""
    from zero.functional.base import set_to_zero

    def labels(params):
        if isinstance(freeze_mask, bool):
            return tree_map(lambda _: "freeze" if freeze_mask else "train", params)
        return tree_map(lambda m: "freeze" if m else "train", freeze_mask)

    return partition({"train": optimizer, "freeze": set_to_zero()}, labels)
