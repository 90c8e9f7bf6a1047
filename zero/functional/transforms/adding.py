"""Terms added to the update: weight decay, noise, and the mean taken out (``optax.add_decayed_weights``,
``add_noise``, ``centralize``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    NO_PARAMS_MSG,
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    Spec,
    check_non_negative,
    count_inc,
    count_zero,
    stateless_tx,
    tree_map,
)
from zero.functional.elementwise import nonzero, plus_scaled, times
from zero.functional.foreach import foreach_map
from zero.functional.transforms.scaling import scale_tree

__all__ = ['AddNoiseState', 'WeightDecaySchedule', 'add_decayed_weights', 'add_noise', 'centralize']


class AddNoiseState(NamedTuple):
    """State of ``add_noise`` (``optax.AddNoiseState``; the key seeds a torch generator, not JAX's PRNG).

    Fields:
        count: steps taken, 0-d int32.
        rng_key: the seed, a 0-d int64 tensor.
    """

    count: torch.Tensor
    rng_key: torch.Tensor


class WeightDecaySchedule(NamedTuple):
    """State of ``add_decayed_weights`` with a scheduled decay.

    Fields:
        count: steps taken, 0-d int32 (the schedule's argument).
    """

    count: torch.Tensor


def add_decayed_weights(weight_decay: ScalarOrSchedule = 0.0,
                        mask: Any | None = None) -> GradientTransformation:
    """Add ``weight_decay * params`` (a float or schedule); ``optax.add_decayed_weights``."""
    check_non_negative("weight_decay", weight_decay)
    scheduled = callable(weight_decay)

    def init(params):
        return WeightDecaySchedule(count_zero()) if scheduled else EmptyState()

    def scaled(factor=1.0):
        def update(updates, state, params=None):
            if params is None:
                raise ValueError(NO_PARAMS_MSG)
            new_state = WeightDecaySchedule(count_inc(state.count)) if scheduled else state
            if not scheduled and not nonzero(weight_decay):
                return scale_tree(updates, factor) if factor != 1.0 else updates, new_state
            s = weight_decay(state.count) if scheduled else weight_decay
            if any(g is None for g in optree.tree_leaves(updates, none_is_leaf=True)):
                # A None update (a leaf with no gradient) stays None, as in Optax.
                return optree.tree_map(lambda g, p: None if g is None else (g + s * p) * factor, updates, params,
                                       none_is_leaf=True), new_state

            return foreach_map(lambda gs, ps: times(plus_scaled(gs, ps, s), factor, own=True), updates, params), \
                new_state

        return update

    tx = GradientTransformation(init, scaled(), spec=Spec("add_decayed_weights",
                                                          {"weight_decay": weight_decay, "mask": mask}),
                                scaled=scaled)
    if mask is not None:
        from zero.functional.transforms.masking import masked

        return masked(tx, mask)
    return tx


def add_noise(eta: float, gamma: float, key: int = 0) -> GradientTransformation:
    """Add Gaussian noise of variance ``eta / (1 + t)**gamma`` (``optax.add_noise``).

    The noise comes from a torch generator seeded with ``key`` and advanced by the step count,
    so runs are reproducible; the samples differ from JAX's PRNG.
    """
    check_non_negative("eta", eta)

    def update(updates, state, params=None):
        count = count_inc(state.count)
        std = (eta / int(count) ** gamma) ** 0.5
        gen = torch.Generator().manual_seed(int(state.rng_key) * 1_000_003 + int(count))
        out = tree_map(lambda g: g + std * torch.randn(g.shape, generator=gen, dtype=g.dtype).to(g.device),
                       updates)
        return out, AddNoiseState(count, state.rng_key)

    return GradientTransformation(lambda p: AddNoiseState(count_zero(), torch.tensor(key, dtype=torch.int64)),
                                  update)


def _all_but_first(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    return tuple(range(1, len(shape))) if len(shape) > 1 else None


def centralize() -> GradientTransformation:
    """Subtract from each update of 2 or more dimensions its mean over all but the first (gradient
    centralisation; ``optax.centralize``). Under a flat plan the means are over whole tensors
    (`zero.functional.sharding.axis_means`: one small all-reduce)."""
    def update(updates, state, params=None):
        leaves, treedef = optree.tree_flatten(updates)
        means = sharding.axis_means(leaves, _all_but_first)
        return treedef.unflatten([g if m is None else g - m for g, m in zip(leaves, means)]), state

    return stateless_tx(update)
