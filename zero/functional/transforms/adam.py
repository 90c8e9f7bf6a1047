"""The Adam family of rescalings (``optax.scale_by_adam``, ``scale_by_amsgrad``,
``scale_by_adamax``, ``scale_by_radam``, ``scale_by_belief``, ``scale_by_yogi``, ``scale_by_adan``),
mirrored formula for formula.

``update`` is the maths, in foreach ops over the pytree's leaves; a chain of ``scale_by_adam``
and ``scale_by_learning_rate`` also steps in place with torch's fused kernel
(`zero.functional.kernels.fused`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional.base import (
    GradientTransformation,
    Spec,
    as_dtype,
    check_non_negative,
    check_unit,
    count_inc,
    count_zero,
    full_like,
    step_count,
    zeros_like,
)
from zero.functional.elementwise import abs_sq, debias, max_real, moment, moments, nonzero, same_dtypes, sqrt, times
from zero.functional.foreach import elementwise_map, foreach_map, ops

__all__ = ["ScaleByAdamState", "ScaleByAmsgradState", "ScaleByBeliefState", "scale_by_adam", "scale_by_amsgrad",
           "scale_by_adamax", "scale_by_belief", "scale_by_radam", "scale_by_yogi", "ScaleByAdanState",
           "scale_by_adan"]


class ScaleByAdamState(NamedTuple):
    """State of ``scale_by_adam``, ``scale_by_adamax`` and ``scale_by_radam`` (``optax.ScaleByAdamState``).

    Fields:
        count: steps taken, a 0-d int32 tensor.
        mu: first moment, a pytree like the params (in ``mu_dtype`` if given).
        nu: second moment (``scale_by_adamax``: the infinity norm), a pytree like the params.
    """

    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleByAmsgradState(NamedTuple):
    """State of ``scale_by_amsgrad`` (``optax.ScaleByAmsgradState``).

    Fields:
        count: steps taken, 0-d int32.
        mu: first moment, a pytree like the params.
        nu: second moment, a pytree like the params.
        nu_max: running maximum of the (debiased) second moment, a pytree like the params.
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    nu_max: Any


class ScaleByBeliefState(NamedTuple):
    """State of ``scale_by_belief`` (AdaBelief; ``optax.ScaleByBeliefState``).

    Fields:
        count: steps taken, 0-d int32.
        mu: first moment, a pytree like the params.
        nu: running average of the squared prediction error ``(g - mu)^2``, a pytree like the params.
    """

    count: torch.Tensor
    mu: Any
    nu: Any


def _check_betas(b1, b2, eps):
    check_unit("b1", b1)
    check_unit("b2", b2)
    check_non_negative("eps", eps)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                  mu_dtype: torch.dtype | None = None, *, nesterov: bool = False) -> GradientTransformation:
    r"""Adam's rescaling (mirrors ``optax.scale_by_adam``).

    .. math::
        m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \quad v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2,
        \quad u_t = \hat m_t / (\sqrt{\hat v_t + \epsilon_{root}} + \epsilon),

    with ``x_hat = x / (1 - beta^t)``; with ``nesterov``, ``m_hat`` looks one step ahead:
    ``b1 m_t / (1 - b1^(t+1)) + (1 - b1) g_t / (1 - b1^t)``.

    Args:
        b1, b2: decay rates of the first and second moments, in [0, 1).
        eps: added to the root of the second moment (outside the root).
        eps_root: added inside the root (for differentiating through the update).
        mu_dtype: dtype the first moment is stored in (``None``: the updates' dtype).
        nesterov: use the Nesterov look-ahead (NAdam in Optax's form).

    Returns:
        A transformation with state `ScaleByAdamState`. In a chain followed by
        ``scale_by_learning_rate`` (``adam``, ``adamw``, ``from_torch(torch.optim.Adam)``) the
        in-place step runs torch's fused Adam kernel (`zero.functional.kernels.fused`).
    """
    mu_dtype = as_dtype(mu_dtype, "mu_dtype")
    _check_betas(b1, b2, eps)

    def init(params):
        return ScaleByAdamState(count_zero(), zeros_like(params, mu_dtype), zeros_like(params))

    def scaled(factor=1.0):
        def update(updates, state, params=None):
            count = count_inc(state.count)
            c = step_count(count)

            def rule(g, mu, nu):
                out, mu, nu = _adam_foreach(g, mu, nu, c, b1, b2, eps, eps_root, nesterov, factor)
                return out, (mu if mu_dtype is None else [m.to(mu_dtype) for m in mu]), nu

            out, mu, nu = foreach_map(rule, updates, state.mu, state.nu, outputs=3)
            return out, ScaleByAdamState(count, mu, nu)

        return update

    spec = Spec("scale_by_adam", {"b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root, "mu_dtype": mu_dtype,
                                  "nesterov": nesterov})
    return GradientTransformation(init, scaled(), spec=spec, scaled=scaled)


def _floating(*lists):
    """Integer tensors in the default float dtype (Optax's moments of integer params become float)."""
    return [[t if t.is_floating_point() or t.is_complex() else t.to(torch.get_default_dtype()) for t in ts]
            for ts in lists]


def _adam_foreach(g, mu, nu, c, b1, b2, eps, eps_root, nesterov, factor=1.0):
    """Adam's update times ``factor`` (nonzero: it folds into the scalars), and the new moments."""
    g, mu, nu = _adam_moments(g, mu, nu, b1, b2)
    return _adam_direction(g, mu, nu, c, b1, b2, eps, eps_root, nesterov, factor), mu, nu


def _adam_moments(g, mu, nu, b1, b2):
    """The updates (as floats) and Adam's new moments, fresh, over lists."""
    if not all(x.is_floating_point() or x.is_complex() for x in g):
        g, mu, nu = _floating(g, mu, nu)
    # The first moment in the wider of its and the update's dtypes (mu_dtype=float32 with bf16
    # updates accumulates in float32), as Optax's type promotion does.
    wide = [torch.promote_types(m.dtype, x.dtype) for m, x in zip(mu, g)]
    mu = ops.lerp([m.to(d) for m, d in zip(mu, wide)], [x.to(d) for x, d in zip(g, wide)], 1 - b1)
    return g, mu, moments(g, nu, b2, 2)  # |g|^2 for complex updates


def _adam_direction(g, mu, nu, c, b1, b2, eps, eps_root, nesterov, factor):
    """``factor m_hat / (sqrt(v_hat + eps_root) + eps)`` at step ``c`` over lists (``m_hat``
    Nesterov's look-ahead with ``nesterov``)."""
    bc1, bc2 = 1 - b1**c, 1 - b2**c
    # sqrt(v / bc2 + eps_root) = sqrt(v + eps_root bc2) / sqrt(bc2): the corrections fold into
    # scalars on the denominator, two passes over the moments fewer than applying them to tensors.
    denom = sqrt(ops.add(nu, eps_root * bc2) if nonzero(eps_root) else nu)
    if nesterov:
        ops.mul_(denom, bc2 ** -0.5)
        ops.add_(denom, eps)
        return ops.div(_nesterov_hat(g, mu, b1, c, factor), denom)
    # c m_hat / (sqrt(v_hat) + eps) = m / ((bc1 sqrt(v) / sqrt(bc2) + bc1 eps) / c)
    ops.mul_(denom, bc1 * bc2 ** -0.5 / factor)
    ops.add_(denom, bc1 * eps / factor)
    return ops.div(mu, denom)


def _nesterov_hat(g, mu, b1, c, factor=1.0):
    """``factor (b1 m / (1 - b1^(c+1)) + (1 - b1) g / (1 - b1^c))`` over lists, fresh."""
    num = ops.mul(mu, factor * b1 / (1 - b1 ** (c + 1)))
    ops.add_(num, g, alpha=factor * (1 - b1) / (1 - b1**c))
    return num


def scale_by_amsgrad(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                     mu_dtype: torch.dtype | None = None, bias_correction_mu: bool = True,
                     bias_correction_nu: bool = True) -> GradientTransformation:
    """AMSGrad: Adam with the running maximum of ``v_hat`` (``optax.scale_by_amsgrad``); each
    moment is debiased unless its ``bias_correction_*`` is False."""
    mu_dtype = as_dtype(mu_dtype, "mu_dtype")
    _check_betas(b1, b2, eps)

    def init(params):
        return ScaleByAmsgradState(count_zero(), zeros_like(params, mu_dtype), zeros_like(params),
                                   zeros_like(params))

    def scaled(factor=1.0):
        def update(updates, state, params=None):
            count = count_inc(state.count)
            c = step_count(count)
            bc1 = 1 - b1**c if bias_correction_mu else 1.0
            bc2 = 1 - b2**c if bias_correction_nu else 1.0

            def rule(g, m, v, vm):
                if not _real_alike(g, m, v, vm):  # complex or mixed dtypes: Optax's formulas leaf by leaf
                    mu, nu = [moment(*x, b1, 1) for x in zip(g, m)], [moment(*x, b2, 2) for x in zip(g, v)]
                    nu_max = [max_real(a, b / bc2) for a, b in zip(vm, nu)]
                    return ([factor * (a / bc1) / (torch.sqrt(b + eps_root) + eps) for a, b in zip(mu, nu_max)],
                            mu, nu, nu_max)
                mu, nu = moments(g, m, b1, 1), moments(g, v, b2, 2)
                nu_max = ops.maximum(vm, ops.div(nu, bc2) if bias_correction_nu else nu)
                denom = sqrt(ops.add(nu_max, eps_root) if nonzero(eps_root) else nu_max)
                ops.add_(denom, eps)
                out = ops.div(mu, denom)
                return times(out, factor / bc1, own=True), mu, nu, nu_max

            out, mu, nu, nu_max = foreach_map(rule, updates, state.mu, state.nu, state.nu_max, outputs=4)
            return out, ScaleByAmsgradState(count, mu, nu, nu_max)

        return update

    return GradientTransformation(init, scaled(), scaled=scaled)


def _real_alike(*lists) -> bool:
    """Whether the lists hold real floating tensors of one dtype position by position (the fused
    passes' case; anything else runs Optax's formulas tensor by tensor)."""
    return same_dtypes(*lists) and all(t.is_floating_point() for t in lists[0])


def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adamax: the infinity-norm variant of Adam (``optax.scale_by_adamax``)."""
    _check_betas(b1, b2, eps)

    def init(params):
        return ScaleByAdamState(count_zero(), zeros_like(params), zeros_like(params))

    def scaled(factor=1.0):
        def update(updates, state, params=None):
            count = count_inc(state.count)
            bc1 = 1 - b1 ** step_count(count)

            def rule(g, m, v):
                if not _real_alike(g, m, v):  # complex or mixed dtypes: Optax's formulas leaf by leaf
                    mu = [moment(a, b, b1, 1) for a, b in zip(g, m)]
                    nu = [max_real(a.abs() + eps, b2 * b) for a, b in zip(g, v)]
                    return [factor * (a / bc1) / b for a, b in zip(mu, nu)], mu, nu
                mu, size = moments(g, m, b1, 1), ops.abs(g)
                ops.add_(size, eps)
                nu = ops.mul(v, b2)
                ops.maximum_(nu, size)  # max(|g| + eps, b2 v): the infinity norm
                return times(ops.div(mu, nu), factor / bc1, own=True), mu, nu

            out, mu, nu = foreach_map(rule, updates, state.mu, state.nu, outputs=3)
            return out, ScaleByAdamState(count, mu, nu)

        return update

    spec = Spec("scale_by_adamax", {"b1": b1, "b2": b2, "eps": eps})
    return GradientTransformation(init, scaled(), spec=spec, scaled=scaled)


def scale_by_belief(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16, eps_root: float = 1e-16,
                    *, nesterov: bool = False) -> GradientTransformation:
    """AdaBelief: scale by the EMA of the prediction error (``optax.scale_by_belief``)."""
    _check_betas(b1, b2, eps)

    def init(params):
        return ScaleByBeliefState(count_zero(), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None):
        mu = elementwise_map(lambda g, m: moment(g, m, b1, 1), updates, state.mu)
        nu = elementwise_map(lambda g, m, v: moment(g - m, v, b2, 2) + eps_root, updates, mu, state.nu)
        count = count_inc(state.count)
        c = step_count(count)
        if nesterov:
            mu_hat = foreach_map(lambda gs, ms: _nesterov_hat(gs, ms, b1, c), updates, mu)
        else:
            mu_hat = elementwise_map(lambda m: debias(m, b1, c), mu)
        out = elementwise_map(lambda m, v: m / (torch.sqrt(debias(v, b2, c)) + eps), mu_hat, nu)
        return out, ScaleByBeliefState(count, mu, nu)

    return GradientTransformation(init, update)


def scale_by_radam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                   threshold: float = 5.0, *, nesterov: bool = False) -> GradientTransformation:
    """Rectified Adam (``optax.scale_by_radam``)."""
    _check_betas(b1, b2, eps)
    if threshold < 4:  # the rectifier sqrt((rho-4)(rho-2)...) is undefined for 2 < rho < 4
        raise ValueError(f"threshold must be >= 4 for the rectification to be defined, got {threshold!r}")
    ro_inf = 2.0 / (1.0 - b2) - 1.0

    def init(params):
        return ScaleByAdamState(count_zero(), zeros_like(params), zeros_like(params))

    def scaled(factor=1.0):
        def update(updates, state, params=None):
            count = count_inc(state.count)
            c = step_count(count)
            ro = ro_inf - 2 * c * b2**c / (1 - b2**c)

            def rectified(g, mu, nu, r):  # Adam's direction, rectified
                return _adam_direction(g, mu, nu, c, b1, b2, eps, eps_root, nesterov, factor * r ** 0.5)

            def plain(g, mu):
                return _nesterov_hat(g, mu, b1, c, factor) if nesterov else ops.mul(mu, factor / (1 - b1**c))

            def rule(g, mu, nu):
                g, mu, nu = _adam_moments(g, mu, nu, b1, b2)
                r = (ro - 4) * (ro - 2) * ro_inf / ((ro_inf - 4) * (ro_inf - 2) * ro)
                if not isinstance(ro, torch.Tensor):
                    return (rectified(g, mu, nu, r) if ro >= threshold else plain(g, mu)), mu, nu
                # traced (ro a tensor): both branches, selected per step; the rectifier's root taken
                # of 1 where unused, so its gradient stays finite (JAX's gives NaN there)
                ok = ro >= threshold
                out = zip(rectified(g, mu, nu, torch.where(ok, r, 1.0)), plain(g, mu))
                return [torch.where(ok, a, b) for a, b in out], mu, nu

            out, mu, nu = foreach_map(rule, updates, state.mu, state.nu, outputs=3)
            return out, ScaleByAdamState(count, mu, nu)

        return update

    return GradientTransformation(init, scaled(), scaled=scaled)


def scale_by_yogi(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-3, eps_root: float = 0.0,
                  initial_accumulator_value: float = 1e-6) -> GradientTransformation:
    """Yogi: Adam whose second moment moves by ``sign(v - g^2) g^2`` (``optax.scale_by_yogi``)."""
    _check_betas(b1, b2, eps)

    def init(params):
        return ScaleByAdamState(count_zero(), full_like(params, initial_accumulator_value),
                                  full_like(params, initial_accumulator_value))

    def update(updates, state, params=None):
        mu = elementwise_map(lambda g, m: moment(g, m, b1, 1), updates, state.mu)
        nu = elementwise_map(lambda g, v: v - (1 - b2) * torch.sgn(v - abs_sq(g)) * abs_sq(g), updates, state.nu)
        count = count_inc(state.count)
        c = step_count(count)
        out = elementwise_map(lambda m, v: debias(m, b1, c) / (torch.sqrt(debias(v, b2, c) + eps_root) + eps), mu, nu)
        return out, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


class ScaleByAdanState(NamedTuple):
    """State of ``scale_by_adan`` (``optax.ScaleByAdanState``).

    Fields:
        m: moment of the gradients; v: moment of their differences; n: moment of the squared
        Nesterov term; g: the last gradients (pytrees like the params); t: steps taken, 0-d int32.
    """

    m: Any
    v: Any
    n: Any
    g: Any
    t: torch.Tensor


def scale_by_adan(b1: float = 0.98, b2: float = 0.92, b3: float = 0.99, eps: float = 1e-8,
                  eps_root: float = 0.0) -> GradientTransformation:
    """Adan: Adam-like moments of the gradients, of their differences and of the squared
    Nesterov term ``g + (1 - b2) (g - g_prev)`` (``optax.scale_by_adan``)."""

    def init(params):
        return ScaleByAdanState(zeros_like(params), zeros_like(params), zeros_like(params), zeros_like(params),
                                count_zero())

    def update(updates, state, params=None):
        first = state.t == 0  # a tensor: the same graph at every step (torch.compile)
        diff = elementwise_map(lambda g, prev: torch.where(first, 0, g - prev), updates, state.g)
        m = elementwise_map(lambda g, m: moment(g, m, b1, 1), updates, state.m)
        v = elementwise_map(lambda d, v: moment(d, v, b2, 1), diff, state.v)
        n = elementwise_map(lambda g, d, n: moment(g + (1 - b2) * d, n, b3, 2), updates, diff, state.n)
        t = count_inc(state.t)
        c = step_count(t)
        out = elementwise_map(lambda m, v, n: (debias(m, b1, c) + (1 - b2) * debias(v, b2, c))
                       / (torch.sqrt(debias(n, b3, c) + eps_root) + eps), m, v, n)
        return out, ScaleByAdanState(m, v, n, updates, t)

    return GradientTransformation(init, update)
