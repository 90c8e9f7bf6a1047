"""Optax's gradient transformations on torch tensors: same names, defaults and state fields.

Each factory validates its hyperparameters once and returns a `GradientTransformation`; each
mirrors the Optax function of the same name (``optax.<name>``) formula for formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import sharding
from zero.functional.base import (
    NO_PARAMS_MSG,
    EmptyState,
    GradientTransformation,
    Spec,
    as_dtype,
    check_non_negative,
    check_positive,
    check_unit,
    count_inc,
    count_zero,
    full_like,
    identity,
    tree_map,
    zeros_like,
)
from zero.functional.elementwise import (
    moment,
    moments,
    plus_scaled,
    same_dtypes,
    times,
    times_inv_root,
)
from zero.functional.packing import elementwise_map, foreach_map

__all__ = [
    "ScaleByScheduleState", "ScaleByRmsState",
    "ScaleByRmsWithCountState", "ScaleByRStdDevState", "ScaleByRStdDevWithCountState",
    "ScaleByRssState", "ScaleByLionState", "ScaleByRpropState",
    "ScaleByAdaDeltaState", "TraceState", "EmaState", "AddNoiseState", "WeightDecaySchedule",
    "scale", "scale_by_learning_rate", "scale_by_schedule",
    "scale_by_rms", "scale_by_stddev", "scale_by_rss",
    "scale_by_lion", "scale_by_trust_ratio", "scale_by_rprop",
    "scale_by_adadelta", "trace", "ema", "add_decayed_weights", "add_noise",
]


class ScaleByScheduleState(NamedTuple):
    """State of ``scale_by_schedule`` (``optax.ScaleByScheduleState``).

    Fields:
        count: steps taken, a 0-d int32 tensor (the schedule's argument).
    """

    count: torch.Tensor


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


class ScaleByLionState(NamedTuple):
    """State of ``scale_by_lion`` (``optax.ScaleByLionState``).

    Fields:
        count: steps taken, 0-d int32.
        mu: momentum, a pytree like the params (in ``mu_dtype`` if given).
    """

    count: torch.Tensor
    mu: Any


class ScaleByRpropState(NamedTuple):
    """State of ``scale_by_rprop`` (``optax.ScaleByRpropState``).

    Fields:
        step_sizes: each element's current step size, a pytree like the params.
        prev_updates: the previous step's signed updates, a pytree like the params.
    """

    step_sizes: Any
    prev_updates: Any


class ScaleByAdaDeltaState(NamedTuple):
    """State of ``scale_by_adadelta`` (``optax.ScaleByAdaDeltaState``).

    Fields:
        e_g: running average of squared gradients, a pytree like the params.
        e_x: running average of squared steps, a pytree like the params.
    """

    e_g: Any
    e_x: Any


class TraceState(NamedTuple):
    """State of ``trace`` (momentum; ``optax.TraceState``).

    Fields:
        trace: the momentum buffer, a pytree like the params (in ``accumulator_dtype`` if given).
    """

    trace: Any


class EmaState(NamedTuple):
    """State of ``ema`` (``optax.EmaState``).

    Fields:
        count: steps taken, 0-d int32.
        ema: the moving average, a pytree like the params.
    """

    count: torch.Tensor
    ema: Any


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


def scale(step_size: float) -> GradientTransformation:
    """Multiply updates by ``step_size`` (``optax.scale``)."""
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, p=None: (_scaled(u, step_size), s),
                                  spec=Spec("scale", {"step_size": step_size}))


def _scaled(tree, factor):
    if not optree.tree_leaves(tree):
        return tree
    return foreach_map(lambda us: torch._foreach_mul(us, factor), tree)


def scale_by_schedule(step_size_fn: Callable[[Any], float]) -> GradientTransformation:
    """Multiply updates by ``step_size_fn(count)`` (``optax.scale_by_schedule``)."""
    if not callable(step_size_fn):
        raise TypeError(f"step_size_fn must be callable, got {type(step_size_fn).__name__}")

    def update(updates, state, params=None):
        step = step_size_fn(state.count)
        return _scaled(updates, step), ScaleByScheduleState(count_inc(state.count))

    return GradientTransformation(lambda params: ScaleByScheduleState(count_zero()), update)


def scale_by_learning_rate(learning_rate: float | Callable[[Any], float] | None, *,
                           flip_sign: bool = True) -> GradientTransformation:
    """Multiply by ``-learning_rate`` (a float or a schedule); ``optax.scale_by_learning_rate``."""
    if learning_rate is None:
        return identity()
    if not (callable(learning_rate) or isinstance(learning_rate, (int, float, torch.Tensor))):
        raise TypeError(f"learning_rate must be a number or a schedule, got {type(learning_rate).__name__}")
    m = -1 if flip_sign else 1
    if callable(learning_rate):
        tx = scale_by_schedule(lambda count: m * learning_rate(count))
    else:
        tx = scale(m * learning_rate)
    return tx._replace(spec=Spec("scale_by_learning_rate", {"learning_rate": learning_rate, "flip_sign": flip_sign}))


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
                nu_hat = torch._foreach_div(nu, 1 - decay ** int(count)) if bias_correction else nu
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
                bc = 1 - decay ** int(count) if bias_correction else 1.0
                mu_hat = torch._foreach_div(mu, bc) if bias_correction else mu
                var = torch._foreach_div(nu, bc) if bias_correction else torch._foreach_mul(nu, 1.0)
                if same_dtypes(var, mu_hat):
                    torch._foreach_addcmul_(var, mu_hat, mu_hat, -1)
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
        sos = torch._foreach_addcmul(ts, gs, [g.conj() for g in gs]) if same_dtypes(gs, ts) else \
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


_LION_SIGNS = {
    "hard": lambda x, beta: torch.sign(x),
    "smooth": lambda x, beta: torch.tanh(beta * x),
    "refined": lambda x, beta: torch.where(x.abs() < 1.0, x, torch.sign(x)),
}


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None,
                  mode: str = "hard", smooth_beta: float = 1.0) -> GradientTransformation:
    """Lion: the sign of an interpolation of momentum and update (``optax.scale_by_lion``).

    ``mode`` picks the sign: ``"hard"`` (``sign``), ``"smooth"`` (``tanh(smooth_beta x)``) or
    ``"refined"`` (``x`` where ``|x| < 1``, else its sign). An unknown mode is a ``ValueError``
    here, where Optax raises it at the first update.
    """
    mu_dtype = as_dtype(mu_dtype, "mu_dtype")
    check_unit("b1", b1, closed=True)
    check_unit("b2", b2, closed=True)
    if mode not in _LION_SIGNS:
        raise ValueError(f"scale_by_lion mode must be one of {sorted(_LION_SIGNS)}, got {mode!r}")
    sign = _LION_SIGNS[mode]

    def init(params):
        return ScaleByLionState(count_zero(), zeros_like(params, mu_dtype))

    def update(updates, state, params=None):
        out = elementwise_map(lambda g, m: sign((1 - b1) * g + b1 * m, smooth_beta), updates, state.mu)
        # Accumulate in the wider dtype (mu_dtype=float32 with bf16 updates stays float32-exact).
        mu = elementwise_map(lambda g, m: moment(g.to(torch.promote_types(g.dtype, m.dtype)), m, b2, 1).to(m.dtype),
                      updates, state.mu)
        return out, ScaleByLionState(count_inc(state.count), mu)

    return GradientTransformation(init, update)


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


def scale_by_rprop(learning_rate: float, eta_minus: float = 0.5, eta_plus: float = 1.2,
                   min_step_size: float = 1e-6, max_step_size: float = 50.0) -> GradientTransformation:
    """Rprop's sign-based step sizes (``optax.scale_by_rprop``, including its update rule)."""
    check_positive("learning_rate", learning_rate)

    def update(updates, state, params=None):
        sign = elementwise_map(lambda g, prev: g * prev, updates, state.prev_updates)
        steps = elementwise_map(lambda s, st: torch.where(
            s == 0, st, torch.clamp(torch.where(s > 0, st * eta_plus, st * eta_minus), min_step_size, max_step_size)),
            sign, state.step_sizes)
        prev = elementwise_map(lambda s, g, st: torch.where(s < 0, torch.zeros_like(g), st * torch.sign(g)),
                        sign, updates, steps)
        out = elementwise_map(lambda s, old: torch.where(s < 0, torch.zeros_like(old), old), sign, state.prev_updates)
        return out, ScaleByRpropState(steps, prev)

    return GradientTransformation(
        lambda p: ScaleByRpropState(full_like(p, learning_rate), zeros_like(p)), update)


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


def trace(decay: float, nesterov: bool = False, accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Momentum: ``t = g + decay * t`` (``optax.trace``)."""
    accumulator_dtype = as_dtype(accumulator_dtype, "accumulator_dtype")
    check_non_negative("decay", decay)

    def scaled(factor=1.0):
        def rule(gs, ts):
            new = plus_scaled(gs, ts, decay)
            out = times(plus_scaled(gs, new, decay), factor, own=True) if nesterov else times(new, factor, own=False)
            return out, (new if accumulator_dtype is None else [t.to(accumulator_dtype) for t in new])

        def update(updates, state, params=None):
            out, new = foreach_map(rule, updates, state.trace, outputs=2)
            return out, TraceState(new)

        return update

    spec = Spec("trace", {"decay": decay, "nesterov": nesterov, "accumulator_dtype": accumulator_dtype})
    init = lambda p: TraceState(zeros_like(p, accumulator_dtype))  # noqa: E731
    return GradientTransformation(init, scaled(), spec=spec, scaled=scaled)


def ema(decay: float, debias: bool = True, accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Exponential moving average of updates (``optax.ema``)."""
    accumulator_dtype = as_dtype(accumulator_dtype, "accumulator_dtype")
    check_unit("decay", decay, closed=True)

    def update(updates, state, params=None):
        count = count_inc(state.count)

        def rule(gs, es):
            new = moments(gs, es, decay, 1)
            out = torch._foreach_div(new, 1 - decay ** int(count)) if debias else new
            return out, (new if accumulator_dtype is None else [e.to(accumulator_dtype) for e in new])

        out, new = foreach_map(rule, updates, state.ema, outputs=2)
        return out, EmaState(count, new)

    return GradientTransformation(lambda p: EmaState(count_zero(), zeros_like(p, accumulator_dtype)), update)


def add_decayed_weights(weight_decay: float | Callable[[Any], float] = 0.0,
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
            if not scheduled and weight_decay == 0.0:
                return _scaled(updates, factor) if factor != 1.0 else updates, new_state
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
        from zero.functional.wrappers import masked

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
