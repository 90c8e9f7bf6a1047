"""Fused in-place kernels for chains that spell a rule torch has one for.

A chain's ``update`` runs its links one after the other: that is the definition of the rule (the
pure maths, compared with Optax by the parity tests). When the links' specs spell a rule torch
has a fused multi-tensor kernel for, `match` gives the in-place step that runs that kernel
instead, one call per (device, dtype, weight decay), updating params and state tensors in place.
It is torch's implementation of the same rule, held to ``torch.optim`` with ``foreach=False`` by
the tests, so the two paths check each other. `zero.functional.fast.chains` wraps it for a chain:
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
implementations instead: torch has no fused kernel for them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from zero.functional import sharding
from zero.functional.base import GradientTransformation, Spec, count_inc

__all__ = ["match", "Lists", "keep_placement"]

KernelStep = Callable[["Lists", tuple], Any]
# torch.optim hides its submodules' names; their functions are torch's multi-tensor implementations
_TORCH_RMSPROP = importlib.import_module("torch.optim.rmsprop")
_TORCH_ADAMAX = importlib.import_module("torch.optim.adamax")
_TORCH_ADADELTA = importlib.import_module("torch.optim.adadelta")
_TORCH_RPROP = importlib.import_module("torch.optim.rprop")
_TORCH_NADAM = importlib.import_module("torch.optim.nadam")
_TORCH_RADAM = importlib.import_module("torch.optim.radam")


def match(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """The kernel step for links with these ``(position, spec)``, or ``None`` if no kernel fits."""
    return (_adam_kernel(specs) or _sgd_kernel(specs) or _adagrad_kernel(specs) or _rmsprop_kernel(specs)
            or _adamax_kernel(specs) or _adadelta_kernel(specs) or _rprop_kernel(specs) or _nadam_radam_kernel(specs))


class Lists:
    """One step's params and grads as lists, in the leaf order of the params' tree (a list, or a
    dict by name: optree orders its keys), with what a kernel needs beside them.

    ``clip`` is the global norm to clip the grads to (a leading ``clip_by_global_norm``), or None.
    A kernel asks `clipped` for its grads only once it has accepted the tensors.
    """

    def __init__(self, params: Any, grads: Any, clip: float | None = None):
        self.params, self.treedef = optree.tree_flatten(params)
        self.grads, self.tree, self.clip = self.treedef.flatten_up_to(grads), grads, clip

    def leaves(self, subtree: Any) -> list:
        """A state field shaped like the params, as a list in the params' order."""
        return self.treedef.flatten_up_to(subtree)

    def decays(self, decay: tuple[float, Any]) -> list[float]:
        """Each leaf's weight decay: the rate where the decay's mask (resolved on the grads, as
        `masked` does) is True, 0 elsewhere."""
        rate, mask = decay
        if mask is None:
            return [rate] * len(self.params)
        flags = optree.tree_broadcast_prefix(mask(self.tree) if callable(mask) else mask, self.tree)
        return [rate if bool(f) else 0.0 for f in self.treedef.flatten_up_to(flags)]

    def clipped(self, grad_scale_ok: bool) -> tuple[list, torch.Tensor | None]:
        """The grads to step with, and the ``grad_scale`` a fused kernel divides them by (or None).

        With a clip the global norm is computed here, once. A kernel that takes ``grad_scale``
        gets ``norm / max_norm`` as one (a float32 in torch's kernels, so float64 grads are scaled
        beforehand instead, as `clip_by_global_norm` scales them: ``g / norm * max_norm``).
        """
        if self.clip is None:
            return self.grads, None
        norm = sharding.global_norm(self.grads)
        if norm < self.clip:
            return self.grads, None
        if grad_scale_ok and all(g.dtype in (torch.float32, torch.bfloat16, torch.float16) for g in self.grads):
            return self.grads, torch.tensor(float(norm) / self.clip, dtype=torch.float32)
        scaled = [g / norm.to(g.dtype) for g in self.grads] if not _same(self.grads) else \
            torch._foreach_div(self.grads, norm.to(self.grads[0].dtype))
        torch._foreach_mul_(scaled, self.clip)
        return scaled, None


def _same(tensors: list) -> bool:
    """Whether one foreach op can take the list (one dtype; a list of one is always fine)."""
    return len({t.dtype for t in tensors}) <= 1


def keep_placement(old: GradientTransformation, new: GradientTransformation) -> None:
    """Give ``new``'s kernel the placement ``old``'s kernel has checked, when both have one.

    A learning-rate scheduler changes a hyperparameter at every step, and `inject_hyperparams`
    then steps with a transformation built for the new values. Its kernel would check every
    tensor's dtype and device again (milliseconds for thousands of tensors); the placement is
    only a record of tensors already checked, so the new kernel may take over the one of the
    kernel that last stepped the same params (`inject_hyperparams` keeps that kernel per param
    list, so param groups that share a transformation at different learning rates keep one each).
    """
    old_kernel, new_kernel = getattr(old.inplace, "kernel", None), getattr(new.inplace, "kernel", None)
    if hasattr(old_kernel, "placement") and hasattr(new_kernel, "placement"):
        new_kernel.placement = old_kernel.placement


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
    """Pop torch's prefix of a rule: ``maximize`` as ``scale(-1)``, then coupled weight decay
    (without a mask: torch's multi-tensor implementations take one decay per call)."""
    maximize = _take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    decay = _take(specs, "add_decayed_weights", _plain_decay)
    return maximize, decay[1].args["weight_decay"] if decay else 0.0


def _take_decay(specs: list[tuple[int, Spec]]) -> tuple[float, Any] | None:
    """Pop a weight decay, maskless or masked (``masked(add_decayed_weights(rate))``, what a
    ``mask=`` builds): ``(rate, mask)``, or None."""
    plain = _take(specs, "add_decayed_weights", _plain_decay)
    if plain is not None:
        return plain[1].args["weight_decay"], None
    inner = lambda a: a["inner"].spec is not None and a["inner"].spec.name == "add_decayed_weights" \
        and not callable(a["inner"].spec.args["weight_decay"])  # noqa: E731
    masked = _take(specs, "masked", inner)
    return (masked[1].args["inner"].spec.args["weight_decay"], masked[1].args["mask"]) if masked else None


def _plain_adam(args: dict) -> bool:
    """``scale_by_adam`` as torch's fused kernel computes it."""
    return not args["eps_root"] and not args["nesterov"] and args["mu_dtype"] is None


def _plain_decay(args: dict) -> bool:
    return args["mask"] is None and not callable(args["weight_decay"])


def _decayed_rule(specs: list[tuple[int, Spec]], take_core: Callable[[list], Any], masks: bool = True):
    """[scale(-1)] [decay] core [decay] scale_by_learning_rate, with at most one of the two decays
    (masked ones only when ``masks``), or None: (maximize, (decay rate, mask), decoupled, the
    core's position and spec, the lr link's position and learning rate)."""
    specs = list(specs)
    maximize = _take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    coupled = _take_decay(specs)
    core = take_core(specs)
    decoupled = _take_decay(specs)
    lr = _take(specs, "scale_by_learning_rate", lambda a: a["flip_sign"])
    if core is None or lr is None or specs or (coupled and decoupled):
        return None
    decay = coupled or decoupled or (0.0, None)
    if decay[1] is not None and not masks:
        return None
    return maximize, decay, decoupled is not None, core[0], core[1], lr[0], lr[1].args["learning_rate"]


def _by_decay(groups: list[list[int]], decays: list[float]) -> list[tuple[list[int], float]]:
    """Each placement group split by weight decay: one kernel call per (device, dtype, decay)."""
    out = []
    for idx in groups:
        by: dict[float, list[int]] = {}
        for i in idx:
            by.setdefault(decays[i], []).append(i)
        out += [(part, rate) for rate, part in by.items()]
    return out


def _named(inplace: Any, kernel: str, decay: tuple[float, Any] | None, grad_scale: bool) -> KernelStep:
    """Mark a kernel step for `zero.functional.explain`: the kernel it calls and how many calls a
    step makes (``decay`` given: one per (device, dtype, decay); else torch's multi-tensor
    implementation, one call), and give it the placement it checks tensors with."""
    inplace.placement = _Placement()  # read at each call: see keep_placement
    inplace.kernel_name, inplace.grad_scale = kernel, grad_scale
    inplace.masked = decay is not None and decay[1] is not None

    def calls(lists: Lists) -> int:
        if decay is None:
            return 1
        return len(_by_decay(_by_device_and_dtype(lists.params), lists.decays(decay)))

    inplace.calls = calls
    return inplace


def _adam_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
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
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        adam, lr_state, params = state[core_at], state[lr_at], lists.params
        mu, nu = lists.leaves(adam.mu), lists.leaves(adam.nu)
        nu_max = lists.leaves(adam.nu_max) if amsgrad else []
        groups = inplace.placement(params, lists.grads, mu, nu, *([nu_max] if amsgrad else []))
        if groups is None:
            return None
        grads, scale = lists.clipped(grad_scale_ok=True)
        count = count_inc(adam.count)
        rate = _rate(learning_rate, lr_state)
        for idx, weight_decay in _by_decay(groups, lists.decays(decay)):
            pick = lambda xs, idx=idx: [xs[i] for i in idx]  # noqa: E731
            device = params[idx[0]].device
            step = torch.tensor(float(count), device=device)
            kernel(pick(params), pick(grads), pick(mu), pick(nu), pick(nu_max) if amsgrad else [],
                   [step] * len(idx), amsgrad=amsgrad, lr=rate, beta1=hyper["b1"], beta2=hyper["b2"],
                   weight_decay=weight_decay, eps=hyper["eps"], maximize=maximize,
                   grad_scale=None if scale is None else scale.to(device))
        new = list(state)
        new[core_at] = adam._replace(count=count)
        new[lr_at] = _advance(learning_rate, lr_state)
        return tuple(new)

    return _named(inplace, kernel.__name__, decay, grad_scale=True)


def _sgd_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] [torch_momentum | trace] scale_by_learning_rate: SGD.

    Optax's ``trace`` is torch's momentum without dampening: its buffer starts at zero, so its
    first step ``g + decay * 0`` is torch's first buffer, the gradient itself.
    """
    specs = list(specs)
    maximize = _take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    decay = _take_decay(specs) or (0.0, None)
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
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        params = lists.params
        buffers = lists.leaves(getattr(state[momentum[0]], field)) if momentum else []
        groups = inplace.placement(params, lists.grads, *([buffers] if momentum else []))
        if groups is None:
            return None
        grads, scale = lists.clipped(grad_scale_ok=True)
        first = field == "momentum_buffer" and int(state[momentum[0]].count) == 0
        lr_state = state[lr_at]
        rate = _rate(learning_rate, lr_state)
        for idx, weight_decay in _by_decay(groups, lists.decays(decay)):
            pick = lambda xs, idx=idx: [xs[i] for i in idx]  # noqa: E731
            torch._fused_sgd_(pick(params), pick(grads), pick(buffers) if momentum else [],
                              weight_decay=weight_decay, momentum=mom["momentum"], lr=rate,
                              dampening=mom["dampening"], nesterov=mom["nesterov"], maximize=maximize,
                              is_first_step=first,
                              grad_scale=None if scale is None else scale.to(params[idx[0]].device))
        new = list(state)
        if field == "momentum_buffer":
            new[momentum[0]] = state[momentum[0]]._replace(count=count_inc(state[momentum[0]].count))
        new[lr_at] = _advance(learning_rate, lr_state)
        return tuple(new)

    return _named(inplace, "_fused_sgd_", decay, grad_scale=True)


def _adagrad_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
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
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        params, sums = lists.params, lists.leaves(state[core_at].sum_of_squares)
        groups = inplace.placement(params, lists.grads, sums)
        if groups is None:
            return None
        grads, scale = lists.clipped(grad_scale_ok=True)
        count = count_inc(state[lr_at].count)  # torch's step t, counted from 1
        for idx in groups:
            pick = lambda xs, idx=idx: [xs[i] for i in idx]  # noqa: E731
            device = params[idx[0]].device
            step = torch.tensor(float(count), device=device)
            torch._fused_adagrad_(pick(params), pick(grads), pick(sums), [step] * len(idx), lr=hyper["lr"],
                                  lr_decay=hyper["lr_decay"], weight_decay=weight_decay, eps=eps, maximize=maximize,
                                  grad_scale=None if scale is None else scale.to(device))
        new = list(state)
        new[lr_at] = state[lr_at]._replace(count=count)
        return tuple(new)

    return _named(inplace, "_fused_adagrad_", (weight_decay, None), grad_scale=True)


def _rmsprop_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
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
                               lr=_rate(learning_rate, state[lr_at]), alpha=hyper["decay"], eps=hyper["eps"],
                               weight_decay=weight_decay, momentum=momentum[1].args["decay"] if momentum else 0.0,
                               centered=centered)
        new = list(state)
        new[lr_at] = _advance(learning_rate, state[lr_at])
        return tuple(new)

    return _named(inplace, "torch.optim.rmsprop.rmsprop(foreach=True)", None, grad_scale=False)


def _adamax_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] scale_by_adamax scale_by_learning_rate: Adamax, torch's
    and Optax's spelling alike, on torch's multi-tensor implementation."""
    rule = _lr_rule(specs, "scale_by_adamax")
    if rule is None:
        return None
    maximize, weight_decay, core_at, hyper, lr_at, learning_rate = rule

    @torch.no_grad()
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        adamax, params = state[core_at], lists.params
        if (moments := _checked_moments(inplace, lists, adamax)) is None:
            return None
        mu, nu = moments
        grads = lists.clipped(grad_scale_ok=False)[0]
        steps = _per_param(adamax.count, len(params), scalar_dtype())  # torch increments each
        _TORCH_ADAMAX.adamax(params, grads, mu, nu, steps, foreach=True, maximize=maximize, eps=hyper["eps"],
                             beta1=hyper["b1"], beta2=hyper["b2"], lr=_rate(learning_rate, state[lr_at]),
                             weight_decay=weight_decay)
        new = list(state)
        new[core_at] = adamax._replace(count=count_inc(adamax.count))
        new[lr_at] = _advance(learning_rate, state[lr_at])
        return tuple(new)

    return _named(inplace, "torch.optim.adamax.adamax(foreach=True)", None, grad_scale=False)


def _adadelta_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] scale_by_adadelta scale_by_learning_rate: Adadelta, on
    torch's multi-tensor implementation."""
    rule = _lr_rule(specs, "scale_by_adadelta")
    if rule is None:
        return None
    maximize, weight_decay, core_at, hyper, lr_at, learning_rate = rule

    @torch.no_grad()
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        adadelta, params = state[core_at], lists.params
        e_g, e_x = lists.leaves(adadelta.e_g), lists.leaves(adadelta.e_x)
        if inplace.placement(params, lists.grads, e_g, e_x) is None:
            return None
        grads = lists.clipped(grad_scale_ok=False)[0]
        steps = [torch.zeros(())] * len(params)  # counted by torch, read by no rule here
        _TORCH_ADADELTA.adadelta(params, grads, e_g, e_x, steps, foreach=True, lr=_rate(learning_rate, state[lr_at]),
                                 rho=hyper["rho"], eps=hyper["eps"], weight_decay=weight_decay, maximize=maximize)
        new = list(state)
        new[lr_at] = _advance(learning_rate, state[lr_at])
        return tuple(new)

    return _named(inplace, "torch.optim.adadelta.adadelta(foreach=True)", None, grad_scale=False)


def _nadam_radam_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] [add_decayed_weights] (torch_nadam | torch_radam) [add_decayed_weights]
    scale_by_learning_rate: `from_torch(NAdam | RAdam)`, on torch's multi-tensor implementations."""
    rule = _decayed_rule(specs, lambda specs: _take(specs, "torch_nadam") or _take(specs, "torch_radam"), masks=False)
    if rule is None:
        return None
    maximize, (decay, _), decoupled, core_at, core_spec, lr_at, learning_rate = rule
    nadam = core_spec.name == "torch_nadam"
    options = dict(beta1=core_spec.args["b1"], beta2=core_spec.args["b2"], eps=core_spec.args["eps"],
                   weight_decay=decay, decoupled_weight_decay=decoupled, maximize=maximize, foreach=True)
    if nadam:
        options["momentum_decay"] = core_spec.args["momentum_decay"]

    @torch.no_grad()
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        core_state, params = state[core_at], lists.params
        if (moments := _checked_moments(inplace, lists, core_state)) is None:
            return None
        mu, nu = moments
        grads = lists.clipped(grad_scale_ok=False)[0]
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

    return _named(inplace, f"torch.optim.{core_spec.name[6:]}.{core_spec.name[6:]}(foreach=True)", None,
                  grad_scale=False)


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


def _rprop_kernel(specs: list[tuple[int, Spec]]) -> KernelStep | None:
    """[scale(-1)] torch_rprop scale(-1): `from_torch(Rprop)`, on torch's multi-tensor implementation."""
    specs = list(specs)
    maximize = _take(specs, "scale", lambda a: a["step_size"] == -1.0) is not None
    core = _take(specs, "torch_rprop")
    descend = _take(specs, "scale", lambda a: a["step_size"] == -1.0)
    if core is None or descend is None or specs:
        return None
    core_at, (eta_minus, eta_plus), (lo, hi) = core[0], core[1].args["etas"], core[1].args["step_sizes"]

    @torch.no_grad()
    def inplace(lists: Lists, state: tuple) -> tuple | None:
        rprop, params = state[core_at], lists.params
        prevs, sizes = lists.leaves(rprop.prev_updates), lists.leaves(rprop.step_sizes)
        if inplace.placement(params, lists.grads, prevs, sizes) is None:
            return None
        grads = lists.clipped(grad_scale_ok=False)[0]
        steps = [torch.zeros(())] * len(params)  # counted by torch, read by no rule here
        _TORCH_RPROP.rprop(params, grads, prevs, sizes, steps, foreach=True, maximize=maximize, step_size_min=lo,
                           step_size_max=hi, etaminus=eta_minus, etaplus=eta_plus)
        return state  # prevs and step sizes were updated in place, as torch keeps them

    return _named(inplace, "torch.optim.rprop.rprop(foreach=True)", None, grad_scale=False)


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
