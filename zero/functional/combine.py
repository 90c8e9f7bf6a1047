"""Composing transformations: `chain` and `named_chain` (``optax.chain``, ``optax.named_chain``)."""

from __future__ import annotations

from zero.functional.base import (
    GradientTransformation,
    Spec,
    check_structure,
    unscaled,
    update_with,
)
from zero.functional.foreach import traced
from zero.functional.kernels.chains import fuse
from zero.functional.kernels.knobs import fusing

__all__ = ['chain', 'named_chain']


def chain(*transformations: GradientTransformation) -> GradientTransformation:
    """Apply ``transformations`` in sequence; the state is the tuple of their states.

    Mirrors ``optax.chain``. When the links spell a rule torch has a fused kernel for (e.g.
    ``scale_by_adam`` then ``scale_by_learning_rate``: Adam), the chain also gets that kernel as
    its ``inplace`` step (`zero.functional.kernels.fused`); ``update`` is always the links in turn.
    Otherwise, when a link can write its new state into the old one's tensors (its ``owned``, as
    Shampoo's), the in-place step is the links in turn with each such link doing so, then an add.
    Extra keyword arguments to ``update`` (Optax's extra args, e.g. ``value=``) go to the links
    that take them; the others never see them.
    """
    for i, tx in enumerate(transformations):
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"chain argument {i} is a {type(tx).__name__}, not a GradientTransformation")

    steps, factors = _folded(transformations)

    def init(params):
        return tuple(tx.init(params) for tx in transformations)

    def run(updates, state, params, extra_args, own):
        if len(state) != len(transformations):
            raise ValueError(f"chain of {len(transformations)} got a state of {len(state)} parts")
        if params is not None:
            check_structure(updates, params)
        new_state = []
        for tx, step, factor, s in zip(transformations, steps, factors, state):
            if step is not None:  # None: a scale folded into the link before it (its state is empty)
                if own and tx.owned is not None:
                    step = tx.owned(factor)  # the chain's state is given up, so each link's is
                updates, s = update_with(tx._replace(update=step), updates, s, params, extra_args)
            new_state.append(s)
        return updates, tuple(new_state)

    def update(updates, state, params=None, **extra_args):
        return run(updates, state, params, extra_args, own=False)

    def given_up(updates, state, params=None, **extra_args):
        return run(updates, state, params, extra_args, own=True)

    owned = unscaled(given_up) if any(tx.owned is not None for tx in transformations) else None
    # traced (an inject_hyperparams update building its chain under torch.compile or torch.func):
    # no in-place kernel is wanted, and matching one would read the traced hyperparameters
    inplace = None if traced() or not fusing() else fuse(transformations, None if owned is None else given_up)
    return GradientTransformation(init, update, inplace, Spec("chain", {}, links=transformations), owned=owned)


def _folded(links) -> tuple[list, list[float]]:
    """Each link's update, with a constant scale folded into the link before it when that link
    can scale its own output (its ``scaled``); the folded scale's entry is ``None``. And per
    link the factor folded into it (1.0: none), which its ``owned`` takes."""
    steps, factors, i = [tx.update for tx in links], [1.0] * len(links), 0
    while i < len(links) - 1:
        factor = _constant_scale(links[i + 1])
        if links[i].scaled is not None and factor:
            steps[i], steps[i + 1], factors[i] = links[i].scaled(factor), None, factor
            i += 1  # the scale is taken: it cannot scale a link of its own
        i += 1
    return steps, factors


def _constant_scale(tx: GradientTransformation) -> float | None:
    """The factor of a ``scale`` or constant ``scale_by_learning_rate`` link, else ``None``."""
    spec = tx.spec
    if spec is None or spec.name not in ("scale", "scale_by_learning_rate"):
        return None
    factor = spec.args["step_size" if spec.name == "scale" else "learning_rate"]
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        return None  # a schedule or a tensor: scaled at each update by its own link
    return -float(factor) if spec.name == "scale_by_learning_rate" and spec.args["flip_sign"] else float(factor)


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
