"""Composing transformations: `chain` (``optax.chain``)."""

from __future__ import annotations

from zero.functional.base import GradientTransformation, Spec, check_structure, update_with
from zero.functional.kernels import fuse

__all__ = ["chain"]


def chain(*transformations: GradientTransformation) -> GradientTransformation:
    """Apply ``transformations`` in sequence; the state is the tuple of their states.

    Mirrors ``optax.chain``. When the links spell a rule torch has a fused kernel for (e.g.
    ``scale_by_adam`` then ``scale_by_learning_rate``: Adam), the chain also gets that kernel as
    its ``inplace`` step (`zero.functional.kernels`); ``update`` is always the links in turn.
    Extra keyword arguments to ``update`` (Optax's extra args, e.g. ``value=``) go to the links
    that take them; the others never see them.
    """
    for i, tx in enumerate(transformations):
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"chain argument {i} is a {type(tx).__name__}, not a GradientTransformation")

    def init(params):
        return tuple(tx.init(params) for tx in transformations)

    def update(updates, state, params=None, **extra_args):
        if len(state) != len(transformations):
            raise ValueError(f"chain of {len(transformations)} got a state of {len(state)} parts")
        if params is not None:
            check_structure(updates, params)
        new_state = []
        for tx, s in zip(transformations, state):
            updates, s = update_with(tx, updates, s, params, extra_args)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update, fuse(transformations), Spec("chain", {"links": transformations}))
