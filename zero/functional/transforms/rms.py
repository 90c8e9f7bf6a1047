"""Rescaling by accumulated squares: RMSprop's and Adagrad's second moments and AdaDelta
(``optax.scale_by_rms``, ``scale_by_stddev``, ``scale_by_rss``, ``scale_by_adadelta``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional.base import (
    GradientTransformation,
    Spec,
    check_non_negative,
    check_unit,
    count_inc,
    count_zero,
    full_like,
    step_count,
    zeros_like,
)
from zero.functional.elementwise import moments, same_dtypes, times, times_inv_root
from zero.functional.foreach import foreach_map, ops

__all__ = ["ScaleByRmsState", "ScaleByRmsWithCountState", "ScaleByRStdDevState", "ScaleByRStdDevWithCountState",
           "ScaleByRssState", "ScaleByAdaDeltaState", "scale_by_rms", "scale_by_stddev", "scale_by_rss",
           "scale_by_adadelta"]


class ScaleByRmsState(NamedTuple):
    """State of ``scale_by_rms`` (``optax.ScaleByRmsState``).

    Fields:
        nu: running average of squared updates, a pytree like the params.
    """

    nu: Any


class ScaleByRmsWithCountState(NamedTuple):
    """State of ``scale_by_rms(bias_correction=True)``.

    Fields:
        count: steps taken, 0-d int32.
        nu: running average of squared updates, a pytree like the params.
    """

    count: torch.Tensor
    nu: Any


class ScaleByRStdDevState(NamedTuple):
    """State of ``scale_by_stddev`` (centred RMSProp).

    Fields:
        mu: running mean of updates, a pytree like the params.
        nu: running mean of squared updates, a pytree like the params.
    """

    mu: Any
    nu: Any


class ScaleByRStdDevWithCountState(NamedTuple):
    """State of ``scale_by_stddev(bias_correction=True)``.

    Fields:
        count: steps taken, 0-d int32.
        mu: running mean of updates, a pytree like the params.
        nu: running mean of squared updates, a pytree like the params.
    """

    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleByRssState(NamedTuple):
    """State of ``scale_by_rss`` (Adagrad; ``optax.ScaleByRssState``).

    Fields:
        sum_of_squares: sum of all squared updates so far, a pytree like the params.
    """

    sum_of_squares: Any


class ScaleByAdaDeltaState(NamedTuple):
    """State of ``scale_by_adadelta`` (``optax.ScaleByAdaDeltaState``).

    Fields:
        e_g: running average of squared gradients, a pytree like the params.
        e_x: running average of squared steps, a pytree like the params.
    """

    e_g: Any
    e_x: Any


def scale_by_rms(decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
                 eps_in_sqrt: bool = True, bias_correction: bool = False) -> GradientTransformation:
    """Divide by the root of an EMA of squared updates (``optax.scale_by_rms``)."""
    check_unit("decay", decay, closed=True)
    check_non_negative("eps", eps)

    def init(params):
        nu = full_like(params, initial_scale)
        return ScaleByRmsWithCountState(count_zero(), nu) if bias_correction else ScaleByRmsState(nu)

    def scaled(factor=1.0):
        def update(updates, state, params=None):
            count = count_inc(state.count) if bias_correction else None

            def rule(gs, vs):
                nu = moments(gs, vs, decay, 2)
                nu_hat = ops.div(nu, 1 - decay ** step_count(count)) if bias_correction else nu
                return times(times_inv_root(gs, nu_hat, eps, eps_in_sqrt), factor, own=True), nu

            out, nu = foreach_map(rule, updates, state.nu, outputs=2)
            return out, (ScaleByRmsWithCountState(count, nu) if bias_correction else ScaleByRmsState(nu))

        return update

    spec = Spec("scale_by_rms", _rms_args(decay, eps, initial_scale, eps_in_sqrt, bias_correction))
    return GradientTransformation(init, scaled(), spec=spec, scaled=scaled)


def _rms_args(decay, eps, initial_scale, eps_in_sqrt, bias_correction) -> dict:
    return {"decay": decay, "eps": eps, "initial_scale": initial_scale, "eps_in_sqrt": eps_in_sqrt,
            "bias_correction": bias_correction}


def scale_by_stddev(decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
                    eps_in_sqrt: bool = True, bias_correction: bool = False) -> GradientTransformation:
    """Divide by the running standard deviation (centred RMSProp; ``optax.scale_by_stddev``)."""
    check_unit("decay", decay, closed=True)
    check_non_negative("eps", eps)

    def init(params):
        mu, nu = zeros_like(params), full_like(params, initial_scale)
        return ScaleByRStdDevWithCountState(count_zero(), mu, nu) if bias_correction else ScaleByRStdDevState(mu, nu)

    def scaled(factor=1.0):
        def update(updates, state, params=None):
            count = count_inc(state.count) if bias_correction else None

            def rule(gs, ms, vs):
                mu, nu = moments(gs, ms, decay, 1), moments(gs, vs, decay, 2)
                bc = 1 - decay ** step_count(count) if bias_correction else 1.0
                mu_hat = ops.div(mu, bc) if bias_correction else mu
                var = ops.div(nu, bc) if bias_correction else ops.mul(nu, 1.0)
                if same_dtypes(var, mu_hat):
                    ops.addcmul_(var, mu_hat, mu_hat, -1)
                else:
                    var = [v - m * m for v, m in zip(var, mu_hat)]
                return times(times_inv_root(gs, var, eps, eps_in_sqrt), factor, own=True), mu, nu

            out, mu, nu = foreach_map(rule, updates, state.mu, state.nu, outputs=3)
            new = ScaleByRStdDevWithCountState(count, mu, nu) if bias_correction else ScaleByRStdDevState(mu, nu)
            return out, new

        return update

    spec = Spec("scale_by_stddev", _rms_args(decay, eps, initial_scale, eps_in_sqrt, bias_correction))
    return GradientTransformation(init, scaled(), spec=spec, scaled=scaled)


def scale_by_rss(initial_accumulator_value: float = 0.1, eps: float = 1e-7) -> GradientTransformation:
    """Divide by the root of the sum of squared updates (Adagrad; ``optax.scale_by_rss``)."""
    check_non_negative("initial_accumulator_value", initial_accumulator_value)

    def rule(gs, ts):
        sos = ops.addcmul(ts, gs, [g.conj() for g in gs]) if same_dtypes(gs, ts) else \
            [g * g.conj() + t for g, t in zip(gs, ts)]
        if eps > 0 and not any(t.is_complex() for t in sos):
            # Optax's where(sos > 0, rsqrt(sos + eps), 0) g: sos = 0 only where g = 0, and then
            # rsqrt(eps) g is that same (signed) zero, so the where pass is not needed.
            return times_inv_root(gs, sos, eps, True), sos
        return [torch.where(t.real > 0, torch.rsqrt(t + eps), 0.0) * g for g, t in zip(gs, sos)], sos

    def scaled(factor=1.0):
        def update(updates, state, params=None):
            def scaled_rule(gs, ts):
                out, sos = rule(gs, ts)
                return times(out, factor, own=True), sos

            out, sos = foreach_map(scaled_rule, updates, state.sum_of_squares, outputs=2)
            return out, ScaleByRssState(sos)

        return update

    init = lambda p: ScaleByRssState(full_like(p, initial_accumulator_value))  # noqa: E731
    return GradientTransformation(init, scaled(), scaled=scaled)


def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    """Adadelta's unit-correcting rescaling (``optax.scale_by_adadelta``)."""
    check_unit("rho", rho, closed=True)

    def rule(gs, egs, exs):
        e_g = moments(gs, egs, rho, 2)
        out = [torch.sqrt(ex + eps) / torch.sqrt(eg + eps) * g for g, eg, ex in zip(gs, e_g, exs)]
        return out, e_g, moments(out, exs, rho, 2)

    def update(updates, state, params=None):
        out, e_g, e_x = foreach_map(rule, updates, state.e_g, state.e_x, outputs=3)
        return out, ScaleByAdaDeltaState(e_g, e_x)

    return GradientTransformation(lambda p: ScaleByAdaDeltaState(zeros_like(p), zeros_like(p)), update,
                                  spec=Spec("scale_by_adadelta", {"rho": rho, "eps": eps}))
