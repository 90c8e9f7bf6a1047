"""Differentially private SGD (mirrors ``optax.contrib.dpsgd``, ``differentially_private_aggregate``
and ``DifferentiallyPrivateAggregateState``): per-example gradients clipped and summed, Gaussian
noise added, divided by the batch. It takes per-example gradients (a batch axis first, e.g. from
``torch.func.vmap(torch.func.grad(loss))``): gradients shaped like the params, as a backward and
so every `zero.functional.Optimizer` and sharded executor gives them, are refused by name.

The noise comes from a torch generator seeded by the state's ``rng_key`` (a 0-d int64 that each
step advances): reproducible and checkpointable; JAX's keys have no torch counterpart, so the
noise differs from Optax's draw for draw, not in law."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import optree
import torch

from zero.functional import transforms as T
from zero.functional.aliases import ScalarOrSchedule, alias
from zero.functional.base import GradientTransformation, identity
from zero.functional.combine import chain
from zero.functional.transforms.clipping import per_example_global_norm_clip

__all__ = ["DifferentiallyPrivateAggregateState", "differentially_private_aggregate", "dpsgd"]


class DifferentiallyPrivateAggregateState(NamedTuple):
    """State of ``differentially_private_aggregate``: ``rng_key``, the next noise seed (0-d int64)."""

    rng_key: torch.Tensor


def _seed(key: int | torch.Tensor | None, seed: int | None) -> int:
    if seed is not None:
        warnings.warn('"seed" is deprecated and will be removed in optax 0.2.7, use "key".', DeprecationWarning,
                      stacklevel=3)
        if key is not None:
            raise ValueError("Only one of seed or key can be specified.")
        return int(seed)
    if key is None:
        warnings.warn("Specifying a key will be required in optax 0.2.7.", stacklevel=3)
        return 0
    return int(key)


def differentially_private_aggregate(l2_norm_clip: float, noise_multiplier: float,
                                     key: int | torch.Tensor | None = None, *,
                                     seed: int | None = None) -> GradientTransformation:
    """Clip each example's gradient to global norm ``l2_norm_clip``, sum, add noise of std
    ``l2_norm_clip * noise_multiplier`` and divide by the batch size
    (``optax.contrib.differentially_private_aggregate``)."""
    start = _seed(key, seed)
    std = l2_norm_clip * noise_multiplier

    def update(updates, state, params=None):
        leaves, treedef = optree.tree_flatten(updates)
        if params is not None and all(g.shape == p.shape for g, p in zip(leaves, treedef.flatten_up_to(params))):
            raise ValueError("differentially_private_aggregate takes per-example gradients (a batch axis first, e.g. "
                             "torch.func.vmap(torch.func.grad(loss))); these are shaped like the params, as a "
                             "backward sums them: step it on the pure path with per-example gradients")
        batch = leaves[0].shape[0]
        clipped = per_example_global_norm_clip(leaves, l2_norm_clip)[0]
        gen = torch.Generator().manual_seed(int(state.rng_key))
        noised = [(g + std * torch.randn(g.shape, generator=gen, dtype=g.dtype)) / batch for g in clipped]
        return treedef.unflatten(noised), DifferentiallyPrivateAggregateState(state.rng_key + 1)

    return GradientTransformation(lambda params: DifferentiallyPrivateAggregateState(
        torch.tensor(start, dtype=torch.int64)), update)


@alias
def dpsgd(learning_rate: ScalarOrSchedule, l2_norm_clip: float, noise_multiplier: float, seed: int,
          momentum: float | None = None, nesterov: bool = False) -> GradientTransformation:
    """DP-SGD (``optax.contrib.dpsgd``): `differentially_private_aggregate`, an optional
    (Nesterov) momentum, the learning rate.

    Reference: Abadi et al., Deep Learning with Differential Privacy, 2016 (arXiv:1607.00133).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.contrib.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
        >>> p = {"w": torch.zeros(2)}
        >>> per_example = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}  # norms 5 (clipped to 1) and 0.5
        >>> u, _ = tx.update(per_example, tx.init(p), p)
        >>> u["w"]
        tensor([-0.0450, -0.0600])
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Optax's own dpsgd passes seed= too
        aggregate = differentially_private_aggregate(l2_norm_clip, noise_multiplier, seed=seed)
    return chain(aggregate, T.trace(momentum, nesterov) if momentum is not None else identity(),
                 T.scale_by_learning_rate(learning_rate))
