"""Fused in-place kernels for chains that spell a rule torch has one for.

A chain's ``update`` runs its links one after the other: that is the definition of the rule (the
pure maths, compared with Optax by the parity tests). When the links' specs spell a rule torch
has a fused multi-tensor kernel for, `match` gives the in-place step that runs that kernel
instead, one call per (device, dtype, weight decay), updating params and state tensors in place.
It is torch's implementation of the same rule, held to ``torch.optim`` with ``foreach=False`` by
the tests, so the two paths check each other. `zero.functional.kernels.chains` wraps it for a chain:
nested chains, a leading ``clip_by_global_norm`` (the kernels' ``grad_scale``) and trees by name.

A kernel step takes the step's `Lists` and the chain's link states, flat, and returns the new
link states, or ``None`` when it cannot take these tensors (checked before anything is computed,
so that the clip's norm, a collective when sharded, is asked exactly once on either path).
Weight decay may carry a mask (``adamw(mask=...)``): the fused kernels then run once per decay.

Kernels today: Adam and AdamW, in Optax's spelling (``adam``, ``adamw``) and torch's
(`from_torch`: ``maximize`` as ``scale(-1)`` first, coupled weight decay before the moments,
decoupled after, AMSGrad with torch's running maximum); SGD, Optax's (``sgd``, with or without
``trace`` momentum) and torch's (`from_torch`: momentum with dampening and Nesterov, coupled
decay, ``maximize``); Adagrad, torch's (`from_torch`: ``lr_decay``, coupled decay,
``maximize``). RMSprop (torch's spelling), Adamax, Adadelta and Rprop run torch's multi-tensor
implementations instead: torch has no fused kernel for them. Lion, which torch does not have,
runs in place on torch's foreach ops. The low-bit Adam chains (`zero.functional.contrib.adamw_8bit`)
step param by param in place (`zero.functional.kernels.lowbit`).
"""

from __future__ import annotations

import torch

from zero.functional.base import Spec, count_inc, without_grad
from zero.functional.kernels.knobs import now
from zero.functional.kernels.lowbit import LOWBIT_KERNELS
from zero.functional.kernels.matching import decayed_rule, maximize_and_decay, plain_adam, take, take_decay
from zero.functional.kernels.multi_tensor import FOREACH_KERNELS
from zero.functional.kernels.steps import KernelStep, Lists, advanced, by_decay, marked, picker, rate_of
from zero.functional.scalars import step_tensor, value_of

__all__ = ["match"]


def match(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """The kernel step for links with these ``(position, spec)``, or ``None`` if no kernel fits."""
    for kernel in (_adam_kernel, _sgd_kernel, _adagrad_kernel, *FOREACH_KERNELS, *LOWBIT_KERNELS):
        if (step := kernel(specs)) is not None:
            return step
    return None


def _adam_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] (scale_by_adam | torch_amsgrad) [add_decayed_weights]
    scale_by_learning_rate, with at most one of the two decays."""
    rule = decayed_rule(specs, lambda specs: take(specs, "scale_by_adam", plain_adam)
                         or take(specs, "torch_amsgrad"))
    if rule is None:
        return None
    maximize, decay, decoupled, core_at, core_spec, lr_at, learning_rate = rule
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    hyper = {k: core_spec.args[k] for k in ("b1", "b2", "eps")}
    amsgrad = core_spec.name == "torch_amsgrad"

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        adam, lr_state, params = state[core_at], state[lr_at], lists.params
        mu, nu = lists.leaves(adam.mu), lists.leaves(adam.nu)
        nu_max = lists.leaves(adam.nu_max) if amsgrad else []
        groups = inplace.placement(params, lists.grads, mu, nu, *([nu_max] if amsgrad else []))
        if groups is None:
            return None
        grads, scale = lists.clipped(grad_scale_ok=True)
        count = count_inc(adam.count)
        rate = rate_of(learning_rate, lr_state)
        for idx, weight_decay in by_decay(groups, lists.decays(decay)):
            pick = picker(idx, len(params))
            device = params[idx[0]].device
            step = step_tensor(value_of(count), device)
            kernel(pick(params), pick(grads), pick(mu), pick(nu), pick(nu_max) if amsgrad else [],
                   [step] * len(idx), amsgrad=amsgrad, lr=rate, beta1=now(hyper["b1"]), beta2=now(hyper["b2"]),
                   weight_decay=weight_decay, eps=now(hyper["eps"]), maximize=maximize,
                   grad_scale=None if scale is None else scale.to(device))
        new = list(state)
        new[core_at] = adam._replace(count=count)
        new[lr_at] = advanced(learning_rate, lr_state)
        return tuple(new)

    return marked(inplace, kernel.__name__, decay, grad_scale=True)


def _sgd_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] [torch_momentum | trace] scale_by_learning_rate: SGD.

    Optax's ``trace`` is torch's momentum without dampening: its buffer starts at zero, so its
    first step ``g + decay * 0`` is torch's first buffer, the gradient itself.
    """
    specs = list(specs)
    maximize = take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    decay = take_decay(specs) or (0.0, None)
    momentum = take(specs, "torch_momentum") or take(specs, "trace", lambda a: a["accumulator_dtype"] is None)
    lr = take(specs, "scale_by_learning_rate", lambda a: a["flip_sign"])
    if lr is None or specs:
        return None
    lr_at, learning_rate = lr[0], lr[1].args["learning_rate"]
    mom = {"momentum": 0.0, "dampening": 0.0, "nesterov": False}
    if momentum:
        args = momentum[1].args
        mom = (dict(args) if momentum[1].name == "torch_momentum" else
               {"momentum": args["decay"], "dampening": 0.0, "nesterov": args["nesterov"]})
    field = "momentum_buffer" if momentum and momentum[1].name == "torch_momentum" else "trace"

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        params = lists.params
        buffers = lists.leaves(getattr(state[momentum[0]], field)) if momentum else []
        groups = inplace.placement(params, lists.grads, *([buffers] if momentum else []))
        if groups is None:
            return None
        grads, scale = lists.clipped(grad_scale_ok=True)
        first = field == "momentum_buffer" and value_of(state[momentum[0]].count) == 0
        lr_state = state[lr_at]
        rate = rate_of(learning_rate, lr_state)
        for idx, weight_decay in by_decay(groups, lists.decays(decay)):
            pick = picker(idx, len(params))
            torch._fused_sgd_(pick(params), pick(grads), pick(buffers) if momentum else [],
                              weight_decay=weight_decay, momentum=now(mom["momentum"]), lr=rate,
                              dampening=now(mom["dampening"]), nesterov=mom["nesterov"], maximize=maximize,
                              is_first_step=first,
                              grad_scale=None if scale is None else scale.to(params[idx[0]].device))
        new = list(state)
        if field == "momentum_buffer":
            new[momentum[0]] = state[momentum[0]]._replace(count=count_inc(state[momentum[0]].count))
        new[lr_at] = advanced(learning_rate, lr_state)
        return tuple(new)

    return marked(inplace, "_fused_sgd_", decay, grad_scale=True)


def _adagrad_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] torch_adagrad torch_adagrad_lr: `from_torch(Adagrad)`."""
    specs = list(specs)
    maximize, weight_decay = maximize_and_decay(specs)
    core = take(specs, "torch_adagrad")
    lr = take(specs, "torch_adagrad_lr")
    if core is None or lr is None or specs:
        return None
    core_at, eps = core[0], core[1].args["eps"]
    lr_at, hyper = lr[0], lr[1].args

    @without_grad
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        params, sums = lists.params, lists.leaves(state[core_at].sum_of_squares)
        groups = inplace.placement(params, lists.grads, sums)
        if groups is None:
            return None
        grads, scale = lists.clipped(grad_scale_ok=True)
        count = count_inc(state[lr_at].count)  # torch's step t, counted from 1
        for idx in groups:
            pick = picker(idx, len(params))
            device = params[idx[0]].device
            step = step_tensor(value_of(count), device)
            torch._fused_adagrad_(pick(params), pick(grads), pick(sums), [step] * len(idx), lr=now(hyper["lr"]),
                                  lr_decay=now(hyper["lr_decay"]), weight_decay=now(weight_decay), eps=now(eps),
                                  maximize=maximize,
                                  grad_scale=None if scale is None else scale.to(device))
        new = list(state)
        new[lr_at] = state[lr_at]._replace(count=count)
        return tuple(new)

    return marked(inplace, "_fused_adagrad_", (weight_decay, None), grad_scale=True)
