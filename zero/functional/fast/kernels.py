"""Fused in-place kernels for chains that spell a rule torch has one for.

A chain's ``update`` runs its links one after the other: that is the definition of the rule (the
pure maths, compared with Optax by the parity tests). When the links' specs spell a rule torch
has a fused multi-tensor kernel for, `fuse` gives the chain an ``inplace`` step that runs that
kernel instead, one call per (device, dtype), updating params and state tensors in place. It is
torch's implementation of the same rule, held to ``torch.optim`` with ``foreach=False`` by the
tests, so the two paths check each other.

Kernels today: Adam and AdamW, in Optax's spelling (``adam``, ``adamw``) and torch's
(`from_torch`: ``maximize`` as ``scale(-1)`` first, coupled weight decay before the moments,
decoupled after, AMSGrad with torch's running maximum); SGD, Optax's (``sgd``, with or without
``trace`` momentum) and torch's (`from_torch`: momentum with dampening and Nesterov, coupled
decay, ``maximize``); Adagrad, torch's (`from_torch`: ``lr_decay``, coupled decay,
``maximize``). RMSprop (torch's spelling), Adamax, Adadelta and Rprop run torch's multi-tensor
implementations instead: torch has no fused kernel for them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from zero.functional.base import GradientTransformation, Spec, count_inc

__all__ = ["fuse"]

InplaceStep = Callable[[list, list, Any], Any]
# torch.optim hides its submodules' names; their functions are torch's multi-tensor implementations
_TORCH_RMSPROP = importlib.import_module("torch.optim.rmsprop")
_TORCH_ADAMAX = importlib.import_module("torch.optim.adamax")
_TORCH_ADADELTA = importlib.import_module("torch.optim.adadelta")
_TORCH_RPROP = importlib.import_module("torch.optim.rprop")
_TORCH_NADAM = importlib.import_module("torch.optim.nadam")
_TORCH_RADAM = importlib.import_module("torch.optim.radam")


def fuse(links: Sequence[GradientTransformation]) -> InplaceStep | None:
    """The fused in-place step for a chain of ``links``, or ``None`` if no kernel fits them."""
    specs = [(i, tx.spec) for i, tx in enumerate(links) if tx.spec is None or tx.spec.name != "identity"]
    if any(spec is None for _, spec in specs):
        return None
    return (_adam_kernel(specs) or _sgd_kernel(specs) or _adagrad_kernel(specs) or _rmsprop_kernel(specs)
            or _adamax_kernel(specs) or _adadelta_kernel(specs) or _rprop_kernel(specs) or _nadam_radam_kernel(specs))


def keep_placement(old: GradientTransformation, new: GradientTransformation) -> None:
    """Give ``new``'s kernel the placement ``old``'s kernel has checked, when both have one.

    A learning-rate scheduler changes a hyperparameter at every step, and `inject_hyperparams`
    then steps with a transformation built for the new values. Its kernel would check every
    tensor's dtype and device again (milliseconds for thousands of tensors); the placement is
    only a record of tensors already checked, so the new kernel may take over the one of the
    kernel that last stepped the same params (`inject_hyperparams` keeps that kernel per param
    list, so param groups that share a transformation at different learning rates keep one each).
    """
    if hasattr(old.inplace, "placement") and hasattr(new.inplace, "placement"):
        new.inplace.placement = old.inplace.placement


class _Placement:
    """Which tensors a kernel can step together: index groups by (device, dtype), or None.

    Checked every step, since a step may get tensors of other dtypes or devices (a state loaded
    elsewhere, grads of another dtype), but cheaply: params and state tensors are the same
    objects from step to step, so only their identities are compared with the last step's, and
    only the params' and grads' dtypes and devices are read again (a param keeps its identity
    through ``param.data = ...``); for 2,000 tensors 0.6 ms instead of 3 ms. The last step's
    params and state are referenced here, so that no other tensor can take one of their
    identities while it is remembered.
    """

    def __init__(self):
        self.held: tuple = ()
        self.ids: list | None = None
        self.kinds: list | None = None
        self.groups: list[list[int]] | None = None

    def __call__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 *state: Sequence[torch.Tensor]) -> list[list[int]] | None:
        ids = [list(map(id, xs)) for xs in (params, *state)]
        if ids != self.ids:
            self.held = tuple(list(xs) for xs in (params, *state))
            self.ids, self.groups = ids, _groups((params, *state))
            self.kinds = None if self.groups is None else _kinds(params)
        if self.groups is None:
            return None
        if _kinds(params) != self.kinds or _kinds(grads) != self.kinds:  # .data = ... keeps a param's identity
            return _groups((params, grads, *state))
        return self.groups


def _kinds(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    return [(t.dtype, t.get_device()) for t in tensors]


def _groups(lists: Sequence[Sequence[torch.Tensor]]) -> list[list[int]] | None:
    """What torch's fused kernels take: real floats on CPU or CUDA, matching dtype and device
    position by position across the lists; index groups by (device, dtype), or None."""
    first = lists[0]
    if not all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in first) or not all(
            a.dtype == b.dtype and a.device == b.device for other in lists[1:] for a, b in zip(first, other)):
        return None
    return _by_device_and_dtype(first)


def _take(specs: list[tuple[int, Spec]], name: str, accept: Callable[[dict], bool] = lambda a: True):
    """Pop the first spec if it is ``name`` with acceptable arguments."""
    if specs and specs[0][1].name == name and accept(specs[0][1].args):
        return specs.pop(0)
    return None


def _maximize_and_decay(specs: list[tuple[int, Spec]]) -> tuple[bool, float]:
    """Pop torch's prefix of a rule: ``maximize`` as ``scale(-1)``, then coupled weight decay."""
    maximize = _take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    decay = _take(specs, "add_decayed_weights", _plain_decay)
    return maximize, decay[1].args["weight_decay"] if decay else 0.0


def _plain_adam(args: dict) -> bool:
    """``scale_by_adam`` as torch's fused kernel computes it."""
    return not args["eps_root"] and not args["nesterov"] and args["mu_dtype"] is None


def _plain_decay(args: dict) -> bool:
    return args["mask"] is None and not callable(args["weight_decay"])


def _decayed_rule(specs: list[tuple[int, Spec]], take_core: Callable[[list], Any]):
    """[scale(-1)] [add_decayed_weights] core [add_decayed_weights] scale_by_learning_rate, with
    at most one of the two decays, or None: (maximize, weight decay, decoupled, the core's
    position and spec, the lr link's position and learning rate)."""
    specs = list(specs)
    maximize = _take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    coupled = _take(specs, "add_decayed_weights", _plain_decay)
    core = take_core(specs)
    decoupled = _take(specs, "add_decayed_weights", _plain_decay)
    lr = _take(specs, "scale_by_learning_rate", lambda a: a["flip_sign"])
    if core is None or lr is None or specs or (coupled and decoupled):
        return None
    decay = (coupled or decoupled)[1].args["weight_decay"] if (coupled or decoupled) else 0.0
    return maximize, decay, decoupled is not None, core[0], core[1], lr[0], lr[1].args["learning_rate"]


def _adam_kernel(specs: list[tuple[int, Spec]]) -> InplaceStep | None:
    """[scale(-1)] [add_decayed_weights] (scale_by_adam | torch_amsgrad) [add_decayed_weights]
    scale_by_learning_rate, with at most one of the two decays."""
    rule = _decayed_rule(specs, lambda specs: _take(specs, "scale_by_adam", _plain_adam)
                         or _take(specs, "torch_amsgrad"))
    if rule is None:
        return None
    maximize, decay, decoupled, core_at, core_spec, lr_at, learning_rate = rule
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    hyper = {k: core_spec.args[k] for k in ("b1", "b2", "eps")}
    amsgrad = core_spec.name == "torch_amsgrad"

    @torch.no_grad()
    def inplace(params: list, grads: list, state: tuple) -> tuple | None:
        adam, lr_state = state[core_at], state[lr_at]
        treedef = optree.tree_structure(params)
        mu, nu = treedef.flatten_up_to(adam.mu), treedef.flatten_up_to(adam.nu)
        nu_max = treedef.flatten_up_to(adam.nu_max) if amsgrad else []
        groups = inplace.placement(params, grads, mu, nu, *([nu_max] if amsgrad else []))
        if groups is None:
            return None
        count = count_inc(adam.count)
        rate = _rate(learning_rate, lr_state)
        for idx in groups:
            pick = lambda xs, idx=idx: [xs[i] for i in idx]  # noqa: E731
            step = torch.tensor(float(count), device=params[idx[0]].device)
            kernel(pick(params), pick(grads), pick(mu), pick(nu), pick(nu_max) if amsgrad else [],
                   [step] * len(idx), amsgrad=amsgrad, lr=rate, beta1=hyper["b1"], beta2=hyper["b2"],
                   weight_decay=decay, eps=hyper["eps"], maximize=maximize)
        new = list(state)
        new[core_at] = adam._replace(count=count)
        new[lr_at] = _advance(learning_rate, lr_state)
        return tuple(new)

    inplace.placement = _Placement()  # read at each call: see keep_placement
    return inplace


def _sgd_kernel(specs: list[tuple[int, Spec]]) -> InplaceStep | None:
    """[scale(-1)] [add_decayed_weights] [torch_momentum | trace] scale_by_learning_rate: SGD.

    Optax's ``trace`` is torch's momentum without dampening: its buffer starts at zero, so its
    first step ``g + decay * 0`` is torch's first buffer, the gradient itself.
    """
    specs = list(specs)
    maximize, weight_decay = _maximize_and_decay(specs)
    momentum = _take(specs, "torch_momentum") or _take(specs, "trace", lambda a: a["accumulator_dtype"] is None)
    lr = _take(specs, "scale_by_learning_rate", lambda a: a["flip_sign"])
    if lr is None or specs:
        return None
    lr_at, learning_rate = lr[0], lr[1].args["learning_rate"]
    mom = {"momentum": 0.0, "dampening": 0.0, "nesterov": False}
    if momentum:
        args = momentum[1].args
        mom = (dict(args) if momentum[1].name == "torch_momentum" else
               {"momentum": args["decay"], "dampening": 0.0, "nesterov": args["nesterov"]})
    field = "momentum_buffer" if momentum and momentum[1].name == "torch_momentum" else "trace"

    @torch.no_grad()
    def inplace(params: list, grads: list, state: tuple) -> tuple | None:
        buffers = optree.tree_structure(params).flatten_up_to(getattr(state[momentum[0]], field)) if momentum else []
        groups = inplace.placement(params, grads, *([buffers] if momentum else []))
        if groups is None:
            return None
        first = field == "momentum_buffer" and int(state[momentum[0]].count) == 0
        lr_state = state[lr_at]
        rate = _rate(learning_rate, lr_state)
        for idx in groups:
            pick = lambda xs, idx=idx: [xs[i] for i in idx]  # noqa: E731
            torch._fused_sgd_(pick(params), pick(grads), pick(buffers) if momentum else [],
                              weight_decay=weight_decay, momentum=mom["momentum"], lr=rate,
                              dampening=mom["dampening"], nesterov=mom["nesterov"], maximize=maximize,
                              is_first_step=first)
        new = list(state)
        if field == "momentum_buffer":
            new[momentum[0]] = state[momentum[0]]._replace(count=count_inc(state[momentum[0]].count))
        new[lr_at] = _advance(learning_rate, lr_state)
        return tuple(new)

    inplace.placement = _Placement()  # read at each call: see keep_placement
    return inplace


def _adagrad_kernel(specs: list[tuple[int, Spec]]) -> InplaceStep | None:
    """[scale(-1)] [add_decayed_weights] torch_adagrad torch_adagrad_lr: `from_torch(Adagrad)`."""
    specs = list(specs)
    maximize, weight_decay = _maximize_and_decay(specs)
    core = _take(specs, "torch_adagrad")
    lr = _take(specs, "torch_adagrad_lr")
    if core is None or lr is None or specs:
        return None
    core_at, eps = core[0], core[1].args["eps"]
    lr_at, hyper = lr[0], lr[1].args

    @torch.no_grad()
    def inplace(params: list, grads: list, state: tuple) -> tuple | None:
        sums = optree.tree_structure(params).flatten_up_to(state[core_at].sum_of_squares)
        groups = inplace.placement(params, grads, sums)
        if groups is None:
            return None
        count = count_inc(state[lr_at].count)  # torch's step t, counted from 1
        for idx in groups:
            pick = lambda xs, idx=idx: [xs[i] for i in idx]  # noqa: E731
            step = torch.tensor(float(count), device=params[idx[0]].device)
            torch._fused_adagrad_(pick(params), pick(grads), pick(sums), [step] * len(idx), lr=hyper["lr"],
                                  lr_decay=hyper["lr_decay"], weight_decay=weight_decay, eps=eps, maximize=maximize)
        new = list(state)
        new[lr_at] = state[lr_at]._replace(count=count)
        return tuple(new)

    inplace.placement = _Placement()  # read at each call: see keep_placement
    return inplace


def _rmsprop_kernel(specs: list[tuple[int, Spec]]) -> InplaceStep | None:
    """[scale(-1)] [add_decayed_weights] (scale_by_rms | scale_by_stddev) [trace] scale_by_learning_rate
    with torch's eps (outside the root, no bias correction, zero start): RMSprop, on torch's
    multi-tensor (foreach) implementation, since torch has no fused kernel for it."""
    specs = list(specs)
    maximize, weight_decay = _maximize_and_decay(specs)
    torch_like = lambda a: not a["eps_in_sqrt"] and not a["bias_correction"] and a["initial_scale"] == 0  # noqa: E731
    core = _take(specs, "scale_by_rms", torch_like) or _take(specs, "scale_by_stddev", torch_like)
    momentum = _take(specs, "trace", lambda a: not a["nesterov"] and a["accumulator_dtype"] is None)
    lr = _take(specs, "scale_by_learning_rate", lambda a: a["flip_sign"])
    if core is None or lr is None or specs:
        return None
    core_at, centered, hyper = core[0], core[1].name == "scale_by_stddev", core[1].args
    lr_at, learning_rate = lr[0], lr[1].args["learning_rate"]

    @torch.no_grad()
    def inplace(params: list, grads: list, state: tuple) -> tuple | None:
        treedef = optree.tree_structure(params)
        square = treedef.flatten_up_to(state[core_at].nu)
        mean = treedef.flatten_up_to(state[core_at].mu) if centered else []
        buffers = treedef.flatten_up_to(state[momentum[0]].trace) if momentum else []
        states = [square] + ([mean] if centered else []) + ([buffers] if momentum else [])
        if inplace.placement(params, grads, *states) is None:
            return None
        steps = [torch.zeros(())] * len(params)  # counted by torch's implementation, read by no rule here
        _TORCH_RMSPROP.rmsprop(params, grads, square, mean, buffers, steps, foreach=True, maximize=maximize,
                               lr=_rate(learning_rate, state[lr_at]), alpha=hyper["decay"], eps=hyper["eps"],
                               weight_decay=weight_decay, momentum=momentum[1].args["decay"] if momentum else 0.0,
                               centered=centered)
        new = list(state)
        new[lr_at] = _advance(learning_rate, state[lr_at])
        return tuple(new)

    inplace.placement = _Placement()  # read at each call: see keep_placement
    return inplace


def _adamax_kernel(specs: list[tuple[int, Spec]]) -> InplaceStep | None:
    """[scale(-1)] [add_decayed_weights] scale_by_adamax scale_by_learning_rate: Adamax, torch's
    and Optax's spelling alike, on torch's multi-tensor implementation."""
    rule = _lr_rule(specs, "scale_by_adamax")
    if rule is None:
        return None
    maximize, weight_decay, core_at, hyper, lr_at, learning_rate = rule

    @torch.no_grad()
    def inplace(params: list, grads: list, state: tuple) -> tuple | None:
        adamax = state[core_at]
        if (moments := _checked_moments(inplace, params, grads, adamax)) is None:
            return None
        mu, nu = moments
        steps = _per_param(adamax.count, len(params), scalar_dtype())  # torch increments each
        _TORCH_ADAMAX.adamax(params, grads, mu, nu, steps, foreach=True, maximize=maximize, eps=hyper["eps"],
                             beta1=hyper["b1"], beta2=hyper["b2"], lr=_rate(learning_rate, state[lr_at]),
                             weight_decay=weight_decay)
        new = list(state)
        new[core_at] = adamax._replace(count=count_inc(adamax.count))
        new[lr_at] = _advance(learning_rate, state[lr_at])
        return tuple(new)

    inplace.placement = _Placement()  # read at each call: see keep_placement
    return inplace


def _adadelta_kernel(specs: list[tuple[int, Spec]]) -> InplaceStep | None:
    """[scale(-1)] [add_decayed_weights] scale_by_adadelta scale_by_learning_rate: Adadelta, on
    torch's multi-tensor implementation."""
    rule = _lr_rule(specs, "scale_by_adadelta")
    if rule is None:
        return None
    maximize, weight_decay, core_at, hyper, lr_at, learning_rate = rule

    @torch.no_grad()
    def inplace(params: list, grads: list, state: tuple) -> tuple | None:
        treedef, adadelta = optree.tree_structure(params), state[core_at]
        e_g, e_x = treedef.flatten_up_to(adadelta.e_g), treedef.flatten_up_to(adadelta.e_x)
        if inplace.placement(params, grads, e_g, e_x) is None:
            return None
        steps = [torch.zeros(())] * len(params)  # counted by torch, read by no rule here
        _TORCH_ADADELTA.adadelta(params, grads, e_g, e_x, steps, foreach=True, lr=_rate(learning_rate, state[lr_at]),
                                 rho=hyper["rho"], eps=hyper["eps"], weight_decay=weight_decay, maximize=maximize)
        new = list(state)
        new[lr_at] = _advance(learning_rate, state[lr_at])
        return tuple(new)

    inplace.placement = _Placement()  # read at each call: see keep_placement
    return inplace


def _nadam_radam_kernel(specs: list[tuple[int, Spec]]) -> InplaceStep | None:
    """[scale(-1)] [add_decayed_weights] (torch_nadam | torch_radam) [add_decayed_weights]
    scale_by_learning_rate: `from_torch(NAdam | RAdam)`, on torch's multi-tensor implementations."""
    rule = _decayed_rule(specs, lambda specs: _take(specs, "torch_nadam") or _take(specs, "torch_radam"))
    if rule is None:
        return None
    maximize, decay, decoupled, core_at, core_spec, lr_at, learning_rate = rule
    nadam = core_spec.name == "torch_nadam"
    options = dict(beta1=core_spec.args["b1"], beta2=core_spec.args["b2"], eps=core_spec.args["eps"],
                   weight_decay=decay, decoupled_weight_decay=decoupled, maximize=maximize, foreach=True)
    if nadam:
        options["momentum_decay"] = core_spec.args["momentum_decay"]

    @torch.no_grad()
    def inplace(params: list, grads: list, state: tuple) -> tuple | None:
        core_state = state[core_at]
        if (moments := _checked_moments(inplace, params, grads, core_state)) is None:
            return None
        mu, nu = moments
        steps = _per_param(core_state.count, len(params), scalar_dtype())  # torch increments each
        rate = _rate(learning_rate, state[lr_at])
        if nadam:
            products = _per_param(core_state.mu_product, len(params), core_state.mu_product.dtype)
            _TORCH_NADAM.nadam(params, grads, mu, nu, products, steps, lr=rate, **options)
            core_state = core_state._replace(mu_product=products[0].clone())
        else:
            _TORCH_RADAM.radam(params, grads, mu, nu, steps, lr=rate, **options)
        new = list(state)
        new[core_at] = core_state._replace(count=count_inc(core_state.count))
        new[lr_at] = _advance(learning_rate, state[lr_at])
        return tuple(new)

    inplace.placement = _Placement()  # read at each call: see keep_placement
    return inplace


def _checked_moments(inplace: Any, params: list, grads: list, core_state: Any) -> tuple[list, list] | None:
    """The state's ``mu`` and ``nu`` as lists like ``params``, or None when the kernel cannot
    take these tensors (its placement check)."""
    treedef = optree.tree_structure(params)
    mu, nu = treedef.flatten_up_to(core_state.mu), treedef.flatten_up_to(core_state.nu)
    return None if inplace.placement(params, grads, mu, nu) is None else (mu, nu)


def _per_param(value: torch.Tensor, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """``n`` separate 0-d tensors holding ``value``: torch's multi-tensor rules keep a step count
    (and NAdam a momentum product) per param and update each in place."""
    return list(torch.full((n,), float(value), dtype=dtype).unbind(0))


def scalar_dtype() -> torch.dtype:
    """The dtype torch keeps optimizer scalars in (``torch.optim.optimizer._get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _lr_rule(specs: list[tuple[int, Spec]], core_name: str):
    """[scale(-1)] [add_decayed_weights] ``core_name`` scale_by_learning_rate, or None: (maximize,
    weight decay, the core's position and arguments, the lr link's position and learning rate)."""
    specs = list(specs)
    maximize, weight_decay = _maximize_and_decay(specs)
    core = _take(specs, core_name)
    lr = _take(specs, "scale_by_learning_rate", lambda a: a["flip_sign"])
    if core is None or lr is None or specs:
        return None
    return maximize, weight_decay, core[0], core[1].args, lr[0], lr[1].args["learning_rate"]


def _rprop_kernel(specs: list[tuple[int, Spec]]) -> InplaceStep | None:
    """[scale(-1)] torch_rprop scale(-1): `from_torch(Rprop)`, on torch's multi-tensor implementation."""
    specs = list(specs)
    maximize = _take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    core = _take(specs, "torch_rprop")
    descend = _take(specs, "scale", lambda a: a["step_size"] == -1.0)
    if core is None or descend is None or specs:
        return None
    core_at, (eta_minus, eta_plus), (lo, hi) = core[0], core[1].args["etas"], core[1].args["step_sizes"]

    @torch.no_grad()
    def inplace(params: list, grads: list, state: tuple) -> tuple | None:
        treedef, rprop = optree.tree_structure(params), state[core_at]
        prevs, sizes = treedef.flatten_up_to(rprop.prev_updates), treedef.flatten_up_to(rprop.step_sizes)
        if inplace.placement(params, grads, prevs, sizes) is None:
            return None
        steps = [torch.zeros(())] * len(params)  # counted by torch, read by no rule here
        _TORCH_RPROP.rprop(params, grads, prevs, sizes, steps, foreach=True, maximize=maximize, step_size_min=lo,
                           step_size_max=hi, etaminus=eta_minus, etaplus=eta_plus)
        return state  # prevs and step sizes were updated in place, as torch keeps them

    inplace.placement = _Placement()  # read at each call: see keep_placement
    return inplace


def _rate(learning_rate: Any, lr_state: Any) -> float:
    """The learning rate of this step: the number, or the schedule at the lr link's count."""
    return float(learning_rate(lr_state.count) if callable(learning_rate) else learning_rate)


def _advance(learning_rate: Any, lr_state: Any) -> Any:
    """The lr link's state after a step (a schedule counts steps; a constant keeps no state)."""
    return lr_state._replace(count=count_inc(lr_state.count)) if callable(learning_rate) else lr_state


def _by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())
