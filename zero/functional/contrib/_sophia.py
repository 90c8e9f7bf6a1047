"""Sophia: a clipped, Hessian-diagonal-preconditioned momentum (mirrors ``optax.contrib.sophia``,
``scale_by_sophia``, ``hutchinson_estimator_diag_hessian`` and their states). The step is
element-wise; Hutchinson's estimate needs ``obj_fn(params)`` (``update(..., obj_fn=loss_fn)``,
or ``Optimizer.step(obj_fn=loss_fn)``) to differentiate twice, which a rank holding pieces of the
params cannot evaluate: under a sharded optimizer it is refused by name (a ``hessian_diagonal_fn``
that reads only the gradients, a Gauss-Newton-Bartlett estimate, steps there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import transforms as T
from zero.functional.aliases import Mask, ScalarOrSchedule, alias
from zero.functional.base import (
    GradientTransformation,
    as_dtype,
    count_inc,
    count_zero,
    lowest_dtype,
    step_count,
    takes_extra_args,
    tree_map,
    update_with,
    zeros_like,
)
from zero.functional.combine import chain
from zero.functional.elementwise import debias, moment
from zero.functional.sharding.context import stepping_whole

__all__ = ["HutchinsonState", "hutchinson_estimator_diag_hessian", "SophiaState", "scale_by_sophia", "sophia"]


class HutchinsonState(NamedTuple):
    """State of ``hutchinson_estimator_diag_hessian``: ``key``, the next draw's seed (0-d int64)."""

    key: torch.Tensor


class SophiaState(NamedTuple):
    """State of ``scale_by_sophia`` (``optax.contrib.SophiaState``).

    Fields:
        count: steps taken (0-d int32); mu: the momentum; nu: the EMA of the Hessian's diagonal;
        hessian_fn_state: the estimator's state.
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    hessian_fn_state: Any


def hutchinson_estimator_diag_hessian(random_seed: int | torch.Tensor | None = None) -> GradientTransformation:
    """Hutchinson's estimate of the Hessian's diagonal, ``z * (H z)`` for Rademacher ``z``
    (``optax.contrib.hutchinson_estimator_diag_hessian``): ``update(..., obj_fn=loss_fn)``. The
    signs come from a torch generator seeded by the state's key (JAX's keys have no torch
    counterpart: other draws, the same law)."""

    def init(params):
        return HutchinsonState(torch.tensor(0 if random_seed is None else int(random_seed), dtype=torch.int64))

    def update(updates, state, params=None, obj_fn: Callable | None = None, **extra_args):
        if params is None:
            raise ValueError("params must be provided to hutchinson update function.")
        if obj_fn is None:
            raise ValueError("obj_fn must be provided to hutchinson update function: update(..., obj_fn=loss_fn), "
                             "or optimizer.step(obj_fn=loss_fn)")
        if not stepping_whole():
            raise ValueError("hutchinson_estimator_diag_hessian differentiates obj_fn(params) twice, which needs the "
                             "whole params: under a sharded optimizer (ZeRO's flat plans, FSDP2) it is not supported; "
                             "use a hessian_diagonal_fn that reads the gradients only")
        gen = torch.Generator().manual_seed(int(state.key))
        dtype = lowest_dtype(params)
        signs = tree_map(lambda p: (torch.randint(0, 2, p.shape, generator=gen) * 2 - 1).to(dtype), params)
        leaves, treedef = optree.tree_flatten(params)
        hvp = _hvp(obj_fn, params, signs)
        product = [torch.zeros_like(x) if h is None else h.detach() * z
                   for x, h, z in zip(leaves, treedef.flatten_up_to(hvp), treedef.flatten_up_to(signs))]
        return treedef.unflatten(product), HutchinsonState(state.key + 1)

    return GradientTransformation(init, update)


def _hvp(obj_fn: Callable, params: Any, v: Any) -> Any:
    """The Hessian of ``obj_fn`` at ``params`` times ``v``: ``obj_fn.hvp(params, v)`` when it has
    one (a loss whose second derivative another framework computes), else twice torch's autograd."""
    own = getattr(obj_fn, "hvp", None)
    if own is not None:
        return own(params, v)
    leaves, treedef = optree.tree_flatten(params)
    with torch.enable_grad():
        xs = [p.detach().requires_grad_() for p in leaves]
        grads = torch.autograd.grad(obj_fn(treedef.unflatten(xs)), xs, create_graph=True)
        out = torch.autograd.grad(grads, xs, grad_outputs=treedef.flatten_up_to(v), allow_unused=True)
    return treedef.unflatten([torch.zeros_like(x) if h is None else h for x, h in zip(xs, out)])


def scale_by_sophia(b1: float = 0.965, b2: float = 0.99, eps: float = 1e-8, gamma: float = 0.01,
                    clip_threshold: float | None = 1.0, update_interval: int = 10,
                    hessian_diagonal_fn: GradientTransformation | None = None, mu_dtype: Any = None,
                    verbose: bool = False, print_win_rate_every_n_steps: int = 0) -> GradientTransformation:
    r"""Sophia's step (``optax.contrib.scale_by_sophia``): :math:`\mathrm{clip}(\hat m / \max(\gamma h, \epsilon))`,
    ``h`` an EMA of ``hessian_diagonal_fn``'s estimate, refreshed every ``update_interval`` steps."""
    mu_dtype = as_dtype(mu_dtype, "mu_dtype")
    hess = hutchinson_estimator_diag_hessian() if hessian_diagonal_fn is None else hessian_diagonal_fn
    extra = takes_extra_args(hess)

    def init(params):
        return SophiaState(count_zero(), zeros_like(params, mu_dtype), zeros_like(params), hess.init(params))

    def update(updates, state, params=None, **hess_kwargs):
        if params is None:
            raise ValueError("params must be provided to sophia's update function.")
        t = count_inc(state.count)
        c = step_count(t)
        mu = tree_map(lambda g, m: moment(g, m, b1, 1), updates, state.mu)
        out = tree_map(lambda m, h: debias(m, b1, c) / torch.clamp(gamma * h, min=eps), mu, state.nu)
        if clip_threshold is not None:
            if verbose and print_win_rate_every_n_steps and c % print_win_rate_every_n_steps == 0:
                inside = sum(int((u.abs() < clip_threshold).sum()) for u in optree.tree_leaves(out))
                print(f"Sophia optimizer win rate: {inside / max(1, sum(u.numel() for u in optree.tree_leaves(out)))}")
            out = tree_map(lambda u: torch.clamp(u, -clip_threshold, clip_threshold), out)
        hess_state, nu = state.hessian_fn_state, state.nu
        if step_count(state.count) % update_interval == 0:
            diag, hess_state = (update_with(hess, updates, hess_state, params, hess_kwargs) if extra
                                else hess.update(updates, hess_state, params))
            nu = tree_map(lambda d, n: moment(d, n, b2, 1), diag, nu)
        if mu_dtype is not None:
            mu = tree_map(lambda m: m.to(mu_dtype), mu)
        return out, SophiaState(t, mu, nu, hess_state)

    return GradientTransformation(init, update)


@alias
def sophia(learning_rate: ScalarOrSchedule, b1: float = 0.965, b2: float = 0.99, eps: float = 1e-8,
           weight_decay: float = 1e-4, weight_decay_mask: Mask | None = None, gamma: float = 0.01,
           clip_threshold: float | None = 1.0, update_interval: int = 10,
           hessian_diagonal_fn: GradientTransformation | None = None, mu_dtype: Any = None, verbose: bool = False,
           print_win_rate_every_n_steps: int = 0) -> GradientTransformation:
    """Sophia (``optax.contrib.sophia``): ``chain(scale_by_sophia, add_decayed_weights,
    scale_by_learning_rate)``; by default Hutchinson's estimate, which needs ``obj_fn``.

    Reference: Liu et al., Sophia: A Scalable Stochastic Second-order Optimizer for Language
    Model Pre-training, 2023 (arXiv:2305.14342).
    """
    return chain(scale_by_sophia(b1, b2, eps, gamma, clip_threshold, update_interval, hessian_diagonal_fn, mu_dtype,
                                 verbose, print_win_rate_every_n_steps),
                 T.add_decayed_weights(weight_decay, weight_decay_mask), T.scale_by_learning_rate(learning_rate))
