"""Rules over each whole tensor's norm: the trust ratio of LAMB and LARS, and NovoGrad's
per-layer second moment (``optax.scale_by_trust_ratio``, ``scale_by_novograd``). Under a sharded
step the norms are completed across ranks by `zero.functional.sharding`."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    NO_PARAMS_MSG,
    EmptyState,
    GradientTransformation,
    as_dtype,
    count_inc,
    count_zero,
    tree_leaves,
    tree_map,
    zeros_like,
)
from zero.functional.elementwise import (
    moment,
)

__all__ = ['scale_by_trust_ratio', 'ScaleByNovogradState', 'scale_by_novograd']


def _safe(norm, min_norm):
    return torch.where(norm <= min_norm, torch.as_tensor(min_norm, dtype=norm.dtype), norm)


def scale_by_trust_ratio(min_norm: float = 0.0, trust_coefficient: float = 1.0,
                         eps: float = 0.0) -> GradientTransformation:
    """Scale each tensor's update by ``|param| / |update|`` (LARS/LAMB; ``optax.scale_by_trust_ratio``).

    The norms are of whole tensors, also when a sharded optimizer steps pieces of them
    (`zero.functional.sharding`).
    """

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        u_leaves, treedef = optree.tree_flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        p_norms, u_norms = sharding.tensor_norms(p_leaves), sharding.tensor_norms(u_leaves)

        def one(u, p_norm, u_norm):
            p_norm, u_norm = _safe(p_norm, min_norm), _safe(u_norm, min_norm)
            ratio = trust_coefficient * p_norm / (u_norm + eps)
            return u * torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio).to(u.dtype)

        return optree.tree_unflatten(treedef, list(map(one, u_leaves, p_norms, u_norms))), state

    return GradientTransformation(lambda params: EmptyState(), update)


class ScaleByNovogradState(NamedTuple):
    """State of ``scale_by_novograd`` (``optax.ScaleByNovogradState``).

    Fields:
        count: steps taken, 0-d int32.
        mu: first moment, a pytree like the params.
        nu: per-tensor second moment of the gradient norm, a 0-d tensor per param.
    """

    count: torch.Tensor
    mu: Any
    nu: Any


def scale_by_novograd(b1: float = 0.9, b2: float = 0.25, eps: float = 1e-8, eps_root: float = 0.0,
                      weight_decay: float = 0.0, mu_dtype: torch.dtype | str | None = None) -> GradientTransformation:
    """NovoGrad: a per-tensor second moment of the gradient's norm (``optax.scale_by_novograd``).

    ``nu = |g|^2`` at the first step, then ``b2 nu + (1 - b2) |g|^2``; ``mu = g / (sqrt(nu +
    eps_root) + eps) + weight_decay p`` at the first step, then ``b1 mu + `` that.
    """
    mu_dtype = as_dtype(mu_dtype, "mu_dtype")

    def init(params):
        return ScaleByNovogradState(count_zero(), zeros_like(params, mu_dtype),
                                    tree_map(lambda p: torch.zeros((), dtype=p.dtype, device=p.device), params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        sharding.whole_tensors(tree_leaves(updates), "scale_by_novograd")
        count = count_inc(state.count)
        first = count == 1  # a tensor: the same graph at every step (torch.compile)
        norms = tree_map(lambda g, n: (torch.linalg.vector_norm(g) ** 2).to(n.dtype), updates, state.nu)
        nu = tree_map(lambda s, n: torch.where(first, s, moment(s, n, b2, 1)), norms, state.nu)
        step = tree_map(lambda g, p, n: g / (torch.sqrt(n + eps_root) + eps) + weight_decay * p, updates, params, nu)
        mu = tree_map(lambda m, s: torch.where(first, s, b1 * m + s), state.mu, step)
        if mu_dtype is not None:
            mu = tree_map(lambda m: m.to(mu_dtype), mu)
        return mu, ScaleByNovogradState(count, mu, nu)

    return GradientTransformation(init, update)
