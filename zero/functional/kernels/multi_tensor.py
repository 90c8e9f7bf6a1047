"""Kernel steps on torch's multi-tensor (foreach) implementations, for the rules torch has no
fused kernel for: RMSprop, Adamax, Adadelta, Rprop, NAdam and RAdam (torch's own functions), and
Lion (torch has none: foreach ops in place). Matched from a chain's specs like the fused ones
(`zero.functional.kernels.fused.match` tries these after them)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from zero.functional.base import Spec, count_inc, without_grad
from zero.functional.kernels.knobs import now
from zero.functional.kernels.matching import decayed_rule, lr_rule, maximize_and_decay, take
from zero.functional.kernels.steps import KernelStep, Lists, advanced, by_decay, marked, rate_of

__all__ = ["FOREACH_KERNELS", "scalar_dtype"]

# torch.optim hides its submodules' names; their functions are torch's multi-tensor implementations
_TORCH_RMSPROP = importlib.import_module("torch.optim.rmsprop")
_TORCH_ADAMAX = importlib.import_module("torch.optim.adamax")
_TORCH_ADADELTA = importlib.import_module("torch.optim.adadelta")
_TORCH_RPROP = importlib.import_module("torch.optim.rprop")
_TORCH_NADAM = importlib.import_module("torch.optim.nadam")
_TORCH_RADAM = importlib.import_module("torch.optim.radam")


def _rmsprop_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] (scale_by_rms | scale_by_stddev) [trace] scale_by_learning_rate
    with torch's eps (outside the root, no bias correction, zero start): RMSprop, on torch's
    multi-tensor (foreach) implementation, since torch has no fused kernel for it."""
    specs = list(specs)
    maximize, weight_decay = maximize_and_decay(specs)
    torch_like = lambda a: not a["eps_in_sqrt"] and not a["bias_correction"] and a["initial_scale"] == 0  # noqa: E731
    core = take(specs, "scale_by_rms", torch_like) or take(specs, "scale_by_stddev", torch_like)
    momentum = take(specs, "trace", lambda a: not a["nesterov"] and a["accumulator_dtype"] is None)
    lr = take(specs, "scale_by_learning_rate", lambda a: a["flip_sign"])
    if core is None or lr is None or specs:
        return None
    core_at, centered, hyper = core[0], core[1].name == "scale_by_stddev", core[1].args
    lr_at, learning_rate = lr[0], lr[1].args["learning_rate"]

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        params = lists.params
        square = lists.leaves(state[core_at].nu)
        mean = lists.leaves(state[core_at].mu) if centered else []
        buffers = lists.leaves(state[momentum[0]].trace) if momentum else []
        states = [square] + ([mean] if centered else []) + ([buffers] if momentum else [])
        if inplace.placement(params, lists.grads, *states) is None:
            return None
        grads = lists.clipped(grad_scale_ok=False)[0]
        steps = [torch.zeros(())] * len(params)  # counted by torch's implementation, read by no rule here
        _TORCH_RMSPROP.rmsprop(params, grads, square, mean, buffers, steps, foreach=True, maximize=maximize,
                               lr=rate_of(learning_rate, state[lr_at]), alpha=now(hyper["decay"]),
                               eps=now(hyper["eps"]),
                               weight_decay=now(weight_decay),
                               momentum=now(momentum[1].args["decay"]) if momentum else 0.0,
                               centered=centered)
        new = list(state)
        new[lr_at] = advanced(learning_rate, state[lr_at])
        return tuple(new)

    return marked(inplace, "torch.optim.rmsprop.rmsprop(foreach=True)", None, grad_scale=False)


def _adamax_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] scale_by_adamax scale_by_learning_rate: Adamax, torch's
    and Optax's spelling alike, on torch's multi-tensor implementation."""
    rule = lr_rule(specs, "scale_by_adamax")
    if rule is None:
        return None
    maximize, weight_decay, core_at, hyper, lr_at, learning_rate = rule

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        adamax, params = state[core_at], lists.params
        if (moments := _checked_moments(inplace, lists, adamax)) is None:
            return None
        mu, nu = moments
        grads = lists.clipped(grad_scale_ok=False)[0]
        steps = _per_param(adamax.count, len(params), scalar_dtype())  # torch increments each
        _TORCH_ADAMAX.adamax(params, grads, mu, nu, steps, foreach=True, maximize=maximize, eps=now(hyper["eps"]),
                             beta1=now(hyper["b1"]), beta2=now(hyper["b2"]), lr=rate_of(learning_rate, state[lr_at]),
                             weight_decay=now(weight_decay))
        new = list(state)
        new[core_at] = adamax._replace(count=count_inc(adamax.count))
        new[lr_at] = advanced(learning_rate, state[lr_at])
        return tuple(new)

    return marked(inplace, "torch.optim.adamax.adamax(foreach=True)", None, grad_scale=False)


def _adadelta_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] scale_by_adadelta scale_by_learning_rate: Adadelta, on
    torch's multi-tensor implementation."""
    rule = lr_rule(specs, "scale_by_adadelta")
    if rule is None:
        return None
    maximize, weight_decay, core_at, hyper, lr_at, learning_rate = rule

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        adadelta, params = state[core_at], lists.params
        e_g, e_x = lists.leaves(adadelta.e_g), lists.leaves(adadelta.e_x)
        if inplace.placement(params, lists.grads, e_g, e_x) is None:
            return None
        grads = lists.clipped(grad_scale_ok=False)[0]
        steps = [torch.zeros(())] * len(params)  # counted by torch, read by no rule here
        _TORCH_ADADELTA.adadelta(params, grads, e_g, e_x, steps, foreach=True, lr=rate_of(learning_rate, state[lr_at]),
                                 rho=now(hyper["rho"]), eps=now(hyper["eps"]), weight_decay=now(weight_decay),
                                 maximize=maximize)
        new = list(state)
        new[lr_at] = advanced(learning_rate, state[lr_at])
        return tuple(new)

    return marked(inplace, "torch.optim.adadelta.adadelta(foreach=True)", None, grad_scale=False)


def _nadam_radam_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] (torch_nadam | torch_radam) [add_decayed_weights]
    scale_by_learning_rate: `from_torch(NAdam | RAdam)`, on torch's multi-tensor implementations."""
    rule = decayed_rule(specs, lambda specs: take(specs, "torch_nadam") or take(specs, "torch_radam"), masks=False)
    if rule is None:
        return None
    maximize, (decay, _), decoupled, core_at, core_spec, lr_at, learning_rate = rule
    nadam = core_spec.name == "torch_nadam"
    options = dict(beta1=core_spec.args["b1"], beta2=core_spec.args["b2"], eps=core_spec.args["eps"],
                   weight_decay=decay, decoupled_weight_decay=decoupled, maximize=maximize, foreach=True)
    if nadam:
        options["momentum_decay"] = core_spec.args["momentum_decay"]

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        core_state, params = state[core_at], lists.params
        if (moments := _checked_moments(inplace, lists, core_state)) is None:
            return None
        mu, nu = moments
        grads = lists.clipped(grad_scale_ok=False)[0]
        steps = _per_param(core_state.count, len(params), scalar_dtype())  # torch increments each
        rate = rate_of(learning_rate, state[lr_at])
        if nadam:
            products = _per_param(core_state.mu_product, len(params), core_state.mu_product.dtype)
            _TORCH_NADAM.nadam(params, grads, mu, nu, products, steps, lr=rate, **_read(options))
            core_state = core_state._replace(mu_product=products[0].clone())
        else:
            _TORCH_RADAM.radam(params, grads, mu, nu, steps, lr=rate, **_read(options))
        new = list(state)
        new[core_at] = core_state._replace(count=count_inc(core_state.count))
        new[lr_at] = advanced(learning_rate, state[lr_at])
        return tuple(new)

    return marked(inplace, f"torch.optim.{core_spec.name[6:]}.{core_spec.name[6:]}(foreach=True)", None,
                  grad_scale=False)


def _rprop_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] torch_rprop scale(-1): `from_torch(Rprop)`, on torch's multi-tensor implementation."""
    specs = list(specs)
    maximize = take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    core = take(specs, "torch_rprop")
    descend = take(specs, "scale", lambda a: a["step_size"] == -1.0)
    if core is None or descend is None or specs:
        return None
    core_at, (eta_minus, eta_plus), (lo, hi) = core[0], core[1].args["etas"], core[1].args["step_sizes"]

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        rprop, params = state[core_at], lists.params
        prevs, sizes = lists.leaves(rprop.prev_updates), lists.leaves(rprop.step_sizes)
        if inplace.placement(params, lists.grads, prevs, sizes) is None:
            return None
        grads = lists.clipped(grad_scale_ok=False)[0]
        steps = [torch.zeros(())] * len(params)  # counted by torch, read by no rule here
        _TORCH_RPROP.rprop(params, grads, prevs, sizes, steps, foreach=True, maximize=maximize, step_size_min=now(lo),
                           step_size_max=now(hi), etaminus=now(eta_minus), etaplus=now(eta_plus))
        return state  # prevs and step sizes were updated in place, as torch keeps them

    return marked(inplace, "torch.optim.rprop.rprop(foreach=True)", None, grad_scale=False)


def _lion_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """scale_by_lion [decay] scale_by_learning_rate: Optax's Lion (``lion``), in place on torch's
    foreach ops (torch has no Lion kernel): the sign of the interpolation, the decoupled decay (one
    pass per decay), the param, then the momentum, each a pass over every tensor of a group."""
    hard = lambda a: a["mode"] == "hard" and a["mu_dtype"] is None  # noqa: E731
    rule = decayed_rule(specs, lambda specs: take(specs, "scale_by_lion", hard))
    if rule is None or rule[0] or (rule[1][0] and not rule[2]):  # maximize, or a decay before the sign: pure
        return None
    _, decay, _, core_at, core_spec, lr_at, learning_rate = rule
    lion_b1, lion_b2 = core_spec.args["b1"], core_spec.args["b2"]

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        lion, params = state[core_at], lists.params
        mu = lists.leaves(lion.mu)
        groups = inplace.placement(params, lists.grads, mu)
        if groups is None:
            return None
        grads = lists.clipped(grad_scale_ok=False)[0]
        rate, b1, b2 = rate_of(learning_rate, state[lr_at]), now(lion_b1), now(lion_b2)
        for idx, weight_decay in by_decay(groups, lists.decays(decay)):
            p, g, m = ([xs[i] for i in idx] for xs in (params, grads, mu))
            u = torch._foreach_mul(m, b1)
            torch._foreach_add_(u, g, alpha=1 - b1)
            torch._foreach_sign_(u)
            if weight_decay:
                torch._foreach_add_(u, p, alpha=weight_decay)
            torch._foreach_add_(p, u, alpha=-rate)
            torch._foreach_mul_(m, b2)
            torch._foreach_add_(m, g, alpha=1 - b2)
        new = list(state)
        new[core_at] = lion._replace(count=count_inc(lion.count))
        new[lr_at] = advanced(learning_rate, state[lr_at])
        return tuple(new)

    return marked(inplace, "torch._foreach_* (Lion in place)", decay, grad_scale=False)


def _read(options: dict) -> dict:
    """Keyword arguments for torch's implementation at this call's values (see `knobs.now`)."""
    return {k: now(v) for k, v in options.items()}


def _checked_moments(inplace: Any, lists: Lists, core_state: Any) -> tuple[list, list] | None:
    """The state's ``mu`` and ``nu`` as lists like the params, or None when the kernel cannot
    take these tensors (its placement check)."""
    mu, nu = lists.leaves(core_state.mu), lists.leaves(core_state.nu)
    return None if inplace.placement(lists.params, lists.grads, mu, nu) is None else (mu, nu)


def _per_param(value: torch.Tensor, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """``n`` separate 0-d tensors holding ``value``: torch's multi-tensor rules keep a step count
    (and NAdam a momentum product) per param and update each in place."""
    return list(torch.full((n,), float(value), dtype=dtype).unbind(0))


def scalar_dtype() -> torch.dtype:
    """The dtype torch keeps optimizer scalars in (``torch.optim.optimizer._get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


FOREACH_KERNELS = (_rmsprop_kernel, _adamax_kernel, _adadelta_kernel, _rprop_kernel, _nadam_radam_kernel,
                   _lion_kernel)
