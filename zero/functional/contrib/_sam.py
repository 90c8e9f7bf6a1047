"""Sharpness-aware minimisation (mirrors ``optax.contrib.sam``, ``normalize``, ``SAMState`` and
``NormalizeState``). Transparent mode alternates adversarial and real steps through the ordinary
step (every executor; ``normalize``'s norm is the whole model's, asked of
`zero.functional.sharding`); opaque mode takes the adversarial steps inside one update, asking
``grad_fn(params, i)`` for gradients at the adversarial points (the pure form; a sharded
optimizer cannot evaluate its rank's pieces alone, so there it is refused by name)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from zero.functional import sharding
from zero.functional.base import (
    EmptyState,
    GradientTransformation,
    select,
    tree_leaves,
    tree_map,
)
from zero.functional.update import apply_updates

__all__ = ["NormalizeState", "normalize", "SAMState", "sam"]

NormalizeState = EmptyState  # as Optax's


def normalize() -> GradientTransformation:
    """Divide the updates by their global norm (``optax.contrib.normalize``): SAM's adversarial
    direction; the whole model's norm under a sharded optimizer."""

    def update(updates, state, params=None):
        norm = sharding.global_norm(tree_leaves(updates))
        return tree_map(lambda g: g / norm.to(g.dtype), updates), state

    return GradientTransformation(lambda params: NormalizeState(), update)


class SAMState(NamedTuple):
    """State of ``sam`` (``optax.contrib.SAMState``).

    Fields:
        steps_since_sync: 0-d int32; opt_state, adv_state: the outer and adversarial rules'
        states; cache: the params before the adversarial steps (None in opaque mode).
    """

    steps_since_sync: torch.Tensor
    opt_state: Any
    adv_state: Any
    cache: Any


def sam(optimizer: GradientTransformation, adv_optimizer: GradientTransformation, sync_period: int = 2,
        reset_state: bool = True, opaque_mode: bool = False, batch_axis_name: str | None = None
        ) -> GradientTransformation:
    """SAM (``optax.contrib.sam``): ``sync_period - 1`` steps up the loss by ``adv_optimizer``
    (e.g. ``chain(normalize(), sgd(rho))``), then ``optimizer``'s step taken from the params before
    them with the gradient at the adversarial point.

    ``batch_axis_name`` (JAX's ``pmean``) has no torch meaning: gradients a data-parallel optimizer
    gets are already averaged; it must be None.

    Reference: Foret et al., Sharpness-Aware Minimization for Efficiently Improving
    Generalization, 2021 (arXiv:2010.01412).
    """
    if sync_period < 1:
        raise ValueError("Synchronization period must be >= 1.")
    if batch_axis_name is not None:
        raise ValueError(f"batch_axis_name={batch_axis_name!r} names a JAX pmap axis; zero's gradients are averaged "
                         "over the ranks before the rule sees them: leave it None")

    def init(params):
        cache = None if opaque_mode else tree_map(lambda p: p.detach().clone(), params)
        return SAMState(torch.zeros((), dtype=torch.int32), optimizer.init(params), adv_optimizer.init(params), cache)

    def transparent(updates, state, params=None, *, grad_fn=None, **extra_args):
        k = int(state.steps_since_sync)
        first, last = torch.tensor(k == 0), torch.tensor(k == sync_period - 1)
        adv_updates, adv_state = adv_optimizer.update(updates, state.adv_state, params)
        adv_updates = tree_map(lambda x: -x, adv_updates)
        opt_updates, opt_state = optimizer.update(updates, state.opt_state, state.cache)
        opt_updates = tree_map(lambda c, p, u: c - p + u, state.cache, params, opt_updates)
        cache = select(first, tree_map(lambda p: p.detach().clone(), params), state.cache)
        out = select(last, opt_updates, adv_updates)
        if reset_state:
            adv_state = adv_optimizer.init(params) if k == sync_period - 1 else adv_state
        elif k == sync_period - 1:
            adv_state = state.adv_state
        opt_state = opt_state if k == sync_period - 1 else state.opt_state
        steps = torch.tensor((k + 1) % sync_period, dtype=torch.int32)
        return out, SAMState(steps, opt_state, adv_state, cache)

    def opaque(updates, state, params=None, *, grad_fn: Callable[[Any, int], Any] | None = None, **extra_args):
        if grad_fn is None:
            raise ValueError("grad_fn must be provided when opaque_mode=True: update(..., grad_fn=lambda params, i: "
                             "gradients at params); a sharded optimizer cannot give it (use transparent mode there)")
        adv_params, adv_updates, adv_state = params, updates, state.adv_state
        for i in range(sync_period - 1):
            adv_updates, adv_state = adv_optimizer.update(adv_updates, adv_state, adv_params)
            adv_params = apply_updates(adv_params, tree_map(lambda x: -x, adv_updates))
            adv_updates = grad_fn(adv_params, i)
        if reset_state:
            adv_state = adv_optimizer.init(params)
        out, opt_state = optimizer.update(adv_updates, state.opt_state, params)
        return out, SAMState(torch.zeros((), dtype=torch.int32), opt_state, adv_state, None)

    return GradientTransformation(init, opaque if opaque_mode else transparent)
