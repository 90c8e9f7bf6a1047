"""The Adam family of rescalings (``optax.scale_by_adam``, ``scale_by_amsgrad``,
``scale_by_adamax``, ``scale_by_radam``, ``scale_by_belief``), mirrored formula for formula.

``scale_by_adam`` runs torch's fused Adam kernel when the tensors allow (on copies of the
moments, so ``update`` stays pure) and foreach ops otherwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from zero.functional.base import (
    GradientTransformation,
    check_non_negative,
    check_unit,
    count_inc,
    count_zero,
    tree_map,
    zeros_like,
)
from zero.functional.transform import _debias, _moment

__all__ = ["ScaleByAdamState", "ScaleByAmsgradState", "ScaleByBeliefState", "scale_by_adam", "scale_by_amsgrad",
           "scale_by_adamax", "scale_by_radam", "scale_by_belief"]


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleByAmsgradState(NamedTuple):
    count: torch.Tensor
    mu: Any
    nu: Any
    nu_max: Any


class ScaleByBeliefState(NamedTuple):
    count: torch.Tensor
    mu: Any
    nu: Any


def _check_betas(b1, b2, eps):
    check_unit("b1", b1)
    check_unit("b2", b2)
    check_non_negative("eps", eps)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                  mu_dtype: torch.dtype | None = None, *, nesterov: bool = False) -> GradientTransformation:
    """Adam's rescaling ``m_hat / (sqrt(v_hat + eps_root) + eps)`` (``optax.scale_by_adam``)."""
    _check_betas(b1, b2, eps)

    def init(params):
        return ScaleByAdamState(count_zero(), zeros_like(params, mu_dtype), zeros_like(params))

    def update(updates, state, params=None):
        g, treedef = optree.tree_flatten(updates)
        mu, nu = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        count = count_inc(state.count)
        if eps_root == 0 and not nesterov and mu_dtype is None and _fusable(g, mu, nu):
            out, mu, nu = adam_direction(g, mu, nu, int(count), b1, b2, eps)
        else:
            out, mu, nu = _adam_foreach(g, mu, nu, int(count), b1, b2, eps, eps_root, nesterov)
        if mu_dtype is not None:
            mu = [m.to(mu_dtype) for m in mu]
        unflat = lambda leaves: optree.tree_unflatten(treedef, leaves)
        return unflat(out), ScaleByAdamState(count, unflat(mu), unflat(nu))

    return GradientTransformation(init, update)


def _fusable(*lists) -> bool:
    """Torch's fused Adam kernel takes float tensors on CPU/CUDA, each list's dtypes matching."""
    return all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in lists[0]) and all(
        a.dtype == b.dtype and a.device == b.device for other in lists[1:] for a, b in zip(lists[0], other))


@torch.no_grad()
def fused_adam_(params, grads, mu, nu, count: int, b1, b2, eps, lr, weight_decay=0.0) -> None:
    """One in-place step of torch's fused Adam kernel (AdamW's when ``weight_decay``), run per
    (device, dtype) group as the kernel requires."""
    kernel = torch._fused_adamw_ if weight_decay else torch._fused_adam_
    groups: dict = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), idx in groups.items():
        pick = lambda xs, idx=idx: [xs[i] for i in idx]
        step = torch.tensor(float(count), device=device)
        kernel(pick(params), pick(grads), pick(mu), pick(nu), [], [step] * len(idx), amsgrad=False, lr=lr,
               beta1=b1, beta2=b2, weight_decay=weight_decay, eps=eps, maximize=False)


@torch.no_grad()
def adam_direction(g, mu, nu, count: int, b1, b2, eps, lr=-1.0):
    """``(-lr * m_hat / (sqrt(v_hat) + eps), new mu, new nu)`` without touching the inputs.

    Stepping a zero "param" leaves exactly ``-lr`` times the direction in it (no cancellation);
    the kernel runs on copies of the moments, so the caller's state stays as it was.
    """
    mu, nu = torch._foreach_add(mu, 0.0), torch._foreach_add(nu, 0.0)
    out = [torch.zeros_like(x) for x in g]
    fused_adam_(out, g, mu, nu, count, b1, b2, eps, lr)
    return out, mu, nu


def _adam_foreach(g, mu, nu, c, b1, b2, eps, eps_root, nesterov):
    mu = torch._foreach_lerp(mu, g, 1 - b1)
    nu = torch._foreach_mul(nu, b2)
    torch._foreach_addcmul_(nu, g, g, 1 - b2)
    denom = torch._foreach_div(nu, 1 - b2**c)
    if eps_root:
        torch._foreach_add_(denom, eps_root)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    if nesterov:
        num = torch._foreach_mul(mu, b1 / (1 - b1 ** (c + 1)))
        torch._foreach_add_(num, torch._foreach_mul(g, (1 - b1) / (1 - b1**c)))
        out = torch._foreach_div(num, denom)
    else:
        out = torch._foreach_div(mu, denom)
        torch._foreach_mul_(out, 1 / (1 - b1**c))
    return out, mu, nu


def scale_by_amsgrad(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                     mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    """AMSGrad: Adam with the running maximum of ``v_hat`` (``optax.scale_by_amsgrad``)."""
    _check_betas(b1, b2, eps)

    def init(params):
        return ScaleByAmsgradState(count_zero(), zeros_like(params, mu_dtype), zeros_like(params),
                                   zeros_like(params))

    def update(updates, state, params=None):
        mu = tree_map(lambda g, m: _moment(g, m, b1, 1), updates, state.mu)
        nu = tree_map(lambda g, v: _moment(g, v, b2, 2), updates, state.nu)
        count = count_inc(state.count)
        nu_max = tree_map(lambda vm, v: torch.maximum(vm, _debias(v, b2, count)), state.nu_max, nu)
        out = tree_map(lambda m, vm: _debias(m, b1, count) / (torch.sqrt(vm + eps_root) + eps), mu, nu_max)
        return out, ScaleByAmsgradState(count, mu, nu, nu_max)

    return GradientTransformation(init, update)


def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adamax: the infinity-norm variant of Adam (``optax.scale_by_adamax``)."""
    _check_betas(b1, b2, eps)

    def init(params):
        return ScaleByAdamState(count_zero(), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None):
        count = count_inc(state.count)
        mu = tree_map(lambda g, m: _moment(g, m, b1, 1), updates, state.mu)
        nu = tree_map(lambda g, v: torch.maximum(g.abs() + eps, b2 * v), updates, state.nu)
        out = tree_map(lambda m, v: _debias(m, b1, count) / v, mu, nu)
        return out, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


def scale_by_belief(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16, eps_root: float = 1e-16,
                    *, nesterov: bool = False) -> GradientTransformation:
    """AdaBelief: scale by the EMA of the prediction error (``optax.scale_by_belief``)."""
    _check_betas(b1, b2, eps)

    def init(params):
        return ScaleByBeliefState(count_zero(), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None):
        mu = tree_map(lambda g, m: _moment(g, m, b1, 1), updates, state.mu)
        nu = tree_map(lambda g, m, v: _moment(g - m, v, b2, 2) + eps_root, updates, mu, state.nu)
        count = count_inc(state.count)
        mu_hat = _nesterov_hat(mu, updates, b1, count) if nesterov else tree_map(
            lambda m: _debias(m, b1, count), mu)
        out = tree_map(lambda m, v: m / (torch.sqrt(_debias(v, b2, count)) + eps), mu_hat, nu)
        return out, ScaleByBeliefState(count, mu, nu)

    return GradientTransformation(init, update)


def _nesterov_hat(mu, updates, b1, count):
    c = int(count)
    return tree_map(lambda m, g: b1 * (m / (1 - b1 ** (c + 1))) + (1 - b1) * (g / (1 - b1**c)), mu, updates)


def scale_by_radam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                   threshold: float = 5.0, *, nesterov: bool = False) -> GradientTransformation:
    """Rectified Adam (``optax.scale_by_radam``)."""
    _check_betas(b1, b2, eps)
    if threshold < 4:  # the rectifier sqrt((rho-4)(rho-2)...) is undefined for 2 < rho < 4
        raise ValueError(f"threshold must be >= 4 for the rectification to be defined, got {threshold!r}")
    ro_inf = 2.0 / (1.0 - b2) - 1.0

    def init(params):
        return ScaleByAdamState(count_zero(), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None):
        mu = tree_map(lambda g, m: _moment(g, m, b1, 1), updates, state.mu)
        nu = tree_map(lambda g, v: _moment(g, v, b2, 2), updates, state.nu)
        count = count_inc(state.count)
        b2t = b2 ** int(count)
        ro = ro_inf - 2 * int(count) * b2t / (1 - b2t)
        mu_hat = _nesterov_hat(mu, updates, b1, count) if nesterov else tree_map(
            lambda m: _debias(m, b1, count), mu)
        if ro >= threshold:
            r = ((ro - 4) * (ro - 2) * ro_inf / ((ro_inf - 4) * (ro_inf - 2) * ro)) ** 0.5
            out = tree_map(lambda m, v: r * m / (torch.sqrt(_debias(v, b2, count) + eps_root) + eps), mu_hat, nu)
        else:
            out = mu_hat
        return out, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)
