"""`from_torch`: transformations with `torch.optim` semantics, expressed as chain order.

Coupled L2 ``weight_decay`` is ``add_decayed_weights`` *before* the moments (``torch.optim.Adam``);
decoupled decay comes *after* them (``AdamW``); ``maximize`` negates the gradient first. Where
torch's rule differs from Optax's (SGD dampening, AMSGrad, Adagrad, Rprop, NAdam, RAdam) a
``_torch_*`` transformation here mirrors the torch class named in its docstring.
The hyperparameters live in the state under torch's group keys (``lr``, ``weight_decay`` ...),
so `zero.functional.Optimizer` and torch's lr schedulers can change them between steps.
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, NamedTuple

import optree
import torch

from zero.functional import transforms as T
from zero.functional.base import (
    GradientTransformation,
    Spec,
    check_non_negative,
    check_unit,
    count_inc,
    count_zero,
    full_like,
    identity,
    tree_leaves,
    tree_map,
    zeros_like,
)
from zero.functional.combine import chain
from zero.functional.foreach import elementwise_map
from zero.functional.inject import inject_hyperparams
from zero.functional.kernels.multi_tensor import scalar_dtype as _scalar_dtype

__all__ = ["from_torch", "TORCH_CLASSES", "torch_class_of", "torch_settings", "with_torch_settings"]

_IMPLEMENTATION_ONLY = {"foreach", "fused"}  # change how torch computes, not what
_MUST_BE_FALSE = {"capturable", "differentiable"}


def _negate(maximize: bool) -> GradientTransformation:
    return T.scale(-1.0) if maximize else identity()


class TorchMomentumState(NamedTuple):
    """State of ``torch.optim.SGD``'s momentum as `from_torch` runs it.

    Fields:
        count: steps taken, 0-d int32 (0: the buffer is not yet set).
        momentum_buffer: torch's ``momentum_buffer``, a pytree like the params.
    """

    count: torch.Tensor
    momentum_buffer: Any


def _torch_momentum(momentum: float, dampening: float, nesterov: bool) -> GradientTransformation:
    """``torch.optim.SGD``'s momentum: the buffer starts as the first gradient, then
    ``b = momentum b + (1 - dampening) g``."""

    def update(updates, state, params=None):
        if int(state.count) == 0:
            buf = elementwise_map(torch.clone, updates)
        else:
            buf = elementwise_map(lambda g, b: momentum * b + (1 - dampening) * g, updates, state.momentum_buffer)
        out = elementwise_map(lambda g, b: g + momentum * b, updates, buf) if nesterov else buf
        return out, TorchMomentumState(count_inc(state.count), buf)

    spec = Spec("torch_momentum", {"momentum": momentum, "dampening": dampening, "nesterov": nesterov})
    return GradientTransformation(lambda p: TorchMomentumState(count_zero(), zeros_like(p)), update, spec=spec)


def _torch_amsgrad(b1: float, b2: float, eps: float) -> GradientTransformation:
    """``torch.optim.Adam(amsgrad=True)``: the running max of the *raw* second moment."""

    def init(params):
        return T.ScaleByAmsgradState(count_zero(), zeros_like(params), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None):
        mu = elementwise_map(lambda g, m: torch.lerp(m, g, 1 - b1), updates, state.mu)
        nu = elementwise_map(lambda g, v: b2 * v + (1 - b2) * g * g, updates, state.nu)
        nu_max = elementwise_map(torch.maximum, state.nu_max, nu)
        c = int(count_inc(state.count))
        bc1, bc2 = 1 - b1**c, 1 - b2**c
        out = elementwise_map(lambda m, vm: (m / bc1) / (vm.sqrt() / math.sqrt(bc2) + eps), mu, nu_max)
        return out, T.ScaleByAmsgradState(count_inc(state.count), mu, nu, nu_max)

    return GradientTransformation(init, update, spec=Spec("torch_amsgrad", {"b1": b1, "b2": b2, "eps": eps}))


def _torch_adagrad(initial_accumulator_value: float, eps: float) -> GradientTransformation:
    """``torch.optim.Adagrad``'s rescaling: ``g / (sqrt(sum g^2) + eps)``."""

    def update(updates, state, params=None):
        sos = elementwise_map(lambda g, s: s + g * g, updates, state.sum_of_squares)
        return elementwise_map(lambda g, s: g / (s.sqrt() + eps), updates, sos), T.ScaleByRssState(sos)

    return GradientTransformation(lambda p: T.ScaleByRssState(full_like(p, initial_accumulator_value)), update,
                                  spec=Spec("torch_adagrad", {"eps": eps}))


def _torch_adagrad_lr(lr: float, lr_decay: float) -> GradientTransformation:
    """``torch.optim.Adagrad``'s step size: ``-lr / (1 + (t - 1) lr_decay)`` at step ``t``."""
    tx = T.scale_by_schedule(lambda count: -lr / (1 + int(count) * lr_decay))
    return tx._replace(spec=Spec("torch_adagrad_lr", {"lr": lr, "lr_decay": lr_decay}))


def _torch_rprop(lr: float, etas: tuple[float, float], step_sizes: tuple[float, float]) -> GradientTransformation:
    """``torch.optim.Rprop``: returns ``sign(g) * step_size`` (the chain negates it)."""
    eta_minus, eta_plus = etas
    lo, hi = step_sizes

    def update(updates, state, params=None):
        prod = elementwise_map(lambda g, prev: g * prev, updates, state.prev_updates)
        factor = elementwise_map(lambda s: torch.where(s > 0, torch.full_like(s, eta_plus),
                                                torch.where(s < 0, torch.full_like(s, eta_minus), torch.ones_like(s))),
                          prod)
        steps = elementwise_map(lambda st, f: (st * f).clamp(lo, hi), state.step_sizes, factor)
        grads = elementwise_map(lambda g, s: torch.where(s < 0, torch.zeros_like(g), g), updates, prod)
        return elementwise_map(lambda g, st: g.sign() * st, grads, steps), T.ScaleByRpropState(steps, grads)

    spec = Spec("torch_rprop", {"etas": etas, "step_sizes": step_sizes})
    return GradientTransformation(lambda p: T.ScaleByRpropState(full_like(p, lr), zeros_like(p)), update, spec=spec)


class TorchNAdamState(NamedTuple):
    """State of ``torch.optim.NAdam``'s rescaling as `from_torch` runs it.

    Fields:
        count: steps taken, 0-d int32.
        mu_product: product of the momentum schedule so far, a 0-d tensor in torch's scalar dtype.
        mu: first moment (torch's ``exp_avg``), a pytree like the params.
        nu: second moment (torch's ``exp_avg_sq``), a pytree like the params.
    """

    count: torch.Tensor
    mu_product: torch.Tensor
    mu: Any
    nu: Any


def _torch_nadam(b1: float, b2: float, eps: float, momentum_decay: float) -> GradientTransformation:
    """``torch.optim.NAdam``'s rescaling (Dozat's momentum schedule, without the ``-lr``)."""

    def init(params):
        return TorchNAdamState(count_zero(), torch.ones((), dtype=_scalar_dtype()), zeros_like(params),
                               zeros_like(params))

    def update(updates, state, params=None):
        c = int(count_inc(state.count))
        mu_t = b1 * (1.0 - 0.5 * 0.96 ** (c * momentum_decay))
        mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((c + 1) * momentum_decay))
        mu_product = state.mu_product * mu_t  # kept in torch's scalar dtype, as torch does
        prod = float(mu_product)
        m = elementwise_map(lambda g, m: torch.lerp(m, g, 1 - b1), updates, state.mu)
        v = elementwise_map(lambda g, v: b2 * v + (1 - b2) * g * g, updates, state.nu)
        denom = elementwise_map(lambda v: (v / (1 - b2**c)).sqrt() + eps, v)
        out = elementwise_map(lambda g, m, d: g * ((1 - mu_t) / (1 - prod)) / d
                              + m * (mu_next / (1 - prod * mu_next)) / d, updates, m, denom)
        return out, TorchNAdamState(count_inc(state.count), mu_product, m, v)

    spec = Spec("torch_nadam", {"b1": b1, "b2": b2, "eps": eps, "momentum_decay": momentum_decay})
    return GradientTransformation(init, update, spec=spec)


def _torch_radam(b1: float, b2: float, eps: float) -> GradientTransformation:
    """``torch.optim.RAdam``'s rescaling: rectified once ``rho_t > 5``, else momentum SGD."""
    rho_inf = 2 / (1 - b2) - 1

    def init(params):
        return T.ScaleByAdamState(count_zero(), zeros_like(params), zeros_like(params))

    def update(updates, state, params=None):
        c = int(count_inc(state.count))
        bc1, bc2 = 1 - b1**c, 1 - b2**c
        m = elementwise_map(lambda g, m: torch.lerp(m, g, 1 - b1), updates, state.mu)
        v = elementwise_map(lambda g, v: b2 * v + (1 - b2) * g * g, updates, state.nu)
        rho_t = rho_inf - 2 * c * (b2**c) / bc2
        if rho_t > 5.0:
            rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            out = elementwise_map(lambda m, v: (m / bc1) * (rect * math.sqrt(bc2) / (v.sqrt() + eps)), m, v)
        else:
            out = elementwise_map(lambda m: m / bc1, m)
        return out, T.ScaleByAdamState(count_inc(state.count), m, v)

    return GradientTransformation(init, update, spec=Spec("torch_radam", {"b1": b1, "b2": b2, "eps": eps}))


def _decays(weight_decay: float, decoupled: bool):
    """(before the moments, after them): torch's coupled L2 or decoupled decay."""
    decay = T.add_decayed_weights(weight_decay) if weight_decay else identity()
    return (identity(), decay) if decoupled else (decay, identity())


def _sgd(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")
    mom = _torch_momentum(momentum, dampening, nesterov) if momentum else identity()
    return chain(_negate(maximize), _decays(weight_decay, False)[0], mom, T.scale_by_learning_rate(lr))


def _adam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
          decoupled_weight_decay=False):
    b1, b2 = betas
    check_unit("betas[0]", b1)
    check_unit("betas[1]", b2)
    before, after = _decays(weight_decay, decoupled_weight_decay)
    core = _torch_amsgrad(b1, b2, eps) if amsgrad else T.scale_by_adam(b1, b2, eps)
    return chain(_negate(maximize), before, core, after, T.scale_by_learning_rate(lr))


def _adamw(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False):
    return _adam(lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay=True)


def _adagrad(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10, maximize=False):
    check_non_negative("lr_decay", lr_decay)
    return chain(_negate(maximize), _decays(weight_decay, False)[0],
                 _torch_adagrad(initial_accumulator_value, eps), _torch_adagrad_lr(lr, lr_decay))


def _adadelta(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, maximize=False):
    return chain(_negate(maximize), _decays(weight_decay, False)[0], T.scale_by_adadelta(rho, eps),
                 T.scale_by_learning_rate(lr))


def _rmsprop(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, maximize=False):
    scaler = (T.scale_by_stddev if centered else T.scale_by_rms)(alpha, eps, eps_in_sqrt=False)
    return chain(_negate(maximize), _decays(weight_decay, False)[0], scaler,
                 T.trace(momentum) if momentum else identity(), T.scale_by_learning_rate(lr))


def _rprop(lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50.0), maximize=False):
    if not 0 < etas[0] < 1 < etas[1]:
        raise ValueError(f"etas must satisfy 0 < eta_minus < 1 < eta_plus, got {etas!r}")
    return chain(_negate(maximize), _torch_rprop(lr, etas, step_sizes), T.scale(-1.0))


def _adamax(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False):
    return chain(_negate(maximize), _decays(weight_decay, False)[0], T.scale_by_adamax(*betas, eps),
                 T.scale_by_learning_rate(lr))


def _nadam(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
           decoupled_weight_decay=False, maximize=False):
    before, after = _decays(weight_decay, decoupled_weight_decay)
    return chain(_negate(maximize), before, _torch_nadam(*betas, eps, momentum_decay), after,
                 T.scale_by_learning_rate(lr))


def _radam(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
           maximize=False):
    before, after = _decays(weight_decay, decoupled_weight_decay)
    return chain(_negate(maximize), before, _torch_radam(*betas, eps), after, T.scale_by_learning_rate(lr))


class TorchMuonState(NamedTuple):
    """State of ``torch.optim.Muon`` as `from_torch` runs it.

    Fields:
        momentum_buffer: torch's ``momentum_buffer``, a pytree like the params.
    """

    momentum_buffer: Any


def _torch_muon(momentum: float, nesterov: bool, ns_coefficients: tuple, eps: float, ns_steps: int,
                adjust_lr_fn: str | None) -> GradientTransformation:
    """``torch.optim.Muon``'s direction: ``b = lerp(b, g, 1 - momentum)``, orthogonalised in
    bfloat16 (of ``lerp(g, b, momentum)`` with ``nesterov``), times its shape's learning-rate ratio."""
    from zero.functional.contrib.newton_schulz import torch_newton_schulz

    def ratio(shape):
        rows, cols = shape[:2]
        if adjust_lr_fn == "match_rms_adamw":
            return 0.2 * math.sqrt(max(rows, cols))
        return math.sqrt(max(1, rows / cols))

    def init(params):
        for p in tree_leaves(params):
            if p.ndim != 2:
                raise ValueError(f"torch.optim.Muon steps matrices only, got a param of shape {tuple(p.shape)}: "
                                 "give the others to another rule (zero.functional.contrib.muon does so itself)")
        return TorchMuonState(zeros_like(params))

    def update(updates, state, params=None):
        m = float(momentum)
        buf = elementwise_map(lambda g, b: b.lerp(g, 1 - m), updates, state.momentum_buffer)
        look = elementwise_map(lambda g, b: g.lerp(b, m), updates, buf) if nesterov else buf
        # tree_map, not elementwise_map: the orthogonalisation reads each matrix whole (never a packed buffer)
        out = tree_map(lambda x: ratio(x.shape) * torch_newton_schulz(x, ns_coefficients, int(ns_steps),
                                                                      float(eps)).to(x.dtype), look)
        return out, TorchMuonState(buf)

    return GradientTransformation(init, update, spec=Spec("torch_muon", {"momentum": momentum, "nesterov": nesterov}))


def _muon(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.7750, 2.0315),
          eps=1e-7, ns_steps=5, adjust_lr_fn=None):
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be three numbers, got {ns_coefficients!r}")
    check_non_negative("momentum", momentum)
    return chain(_torch_muon(momentum, nesterov, tuple(ns_coefficients), eps, ns_steps, adjust_lr_fn),
                 _decays(weight_decay, True)[1], T.scale_by_learning_rate(lr))


TORCH_CLASSES = {"SGD": _sgd, "Adam": _adam, "AdamW": _adamw, "Adagrad": _adagrad, "Adadelta": _adadelta,
                 "RMSprop": _rmsprop, "Rprop": _rprop, "Adamax": _adamax, "NAdam": _nadam, "RAdam": _radam,
                 "Muon": _muon}


def from_torch(optimizer_class: type | str, **defaults: Any) -> GradientTransformation:
    """A transformation that steps exactly as ``optimizer_class(params, **defaults)`` would.

    ``optimizer_class`` is one of ``TORCH_CLASSES`` (the class or its name). ``foreach`` and
    ``fused`` are accepted and ignored (they change how torch computes, not the result);
    ``capturable`` and ``differentiable`` must be False; anything else torch's class does not
    take raises a ``TypeError``.
    """
    name = optimizer_class if isinstance(optimizer_class, str) else getattr(optimizer_class, "__name__", "")
    if name not in TORCH_CLASSES:
        raise ValueError(f"from_torch supports {sorted(TORCH_CLASSES)}, not {optimizer_class!r}")
    factory = TORCH_CLASSES[name]
    for key in _MUST_BE_FALSE & defaults.keys():
        if defaults.pop(key):
            raise ValueError(f"from_torch({name}): {key}=True is not supported")
    for key in _IMPLEMENTATION_ONLY & defaults.keys():
        defaults.pop(key)
    unknown = defaults.keys() - inspect.signature(factory).parameters.keys()
    if unknown:
        raise TypeError(f"from_torch({name}) got unsupported options {sorted(unknown)}")
    for key in ("lr", "eps", "weight_decay"):
        if key in defaults:
            check_non_negative(key, defaults[key])
    factory(**defaults)  # validate now, not at the first init
    return inject_hyperparams(factory, hyperparam_dtype=torch.float64)(**defaults)  # tuples (betas, etas) stay static


_CLASS_OF = {factory: name for name, factory in TORCH_CLASSES.items()}
_TORCH_ONLY = {"foreach", "fused", "capturable", "differentiable"}  # how torch computes, never what


def torch_class_of(tx: Any) -> str | None:
    """The ``torch.optim`` class ``tx`` mirrors (``"AdamW"``) when `from_torch` built it, else None."""
    spec = getattr(tx, "spec", None)
    source = spec.args.get("source") if spec is not None and spec.name == "inject_hyperparams" else None
    return _CLASS_OF.get(source[0]) if source else None


def torch_settings(tx: Any) -> dict[str, Any]:
    """The group settings torch's class keeps for the rule `from_torch` built as ``tx``, each with
    the rule's value: its numbers (also in the state), its fixed settings (``betas``, ``amsgrad``
    ...) and torch's implementation keys (``foreach``, ``fused`` ...: torch's defaults). Read off
    the class itself, built once over a stand-in param, so a dict saved under them loads into torch's."""
    name = torch_class_of(tx)
    if name is None:
        return {}
    args = tx.spec.args["source"][1]
    probe = getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(2, 2))], **args)
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


def with_torch_settings(tx: GradientTransformation, group: dict, index: int) -> GradientTransformation:
    """``tx`` (a `from_torch` rule) as ``group``'s fixed settings now say: rebuilt when one was
    changed (``betas`` by a scheduler), as torch's class reads its group at every step. A change
    that would change the state's layout (``amsgrad``, SGD's ``momentum`` from 0) is a
    ``ValueError`` naming it; torch's implementation keys are taken as they come (``capturable`` and
    ``differentiable`` must stay False)."""
    source = tx.spec.args["source"]
    name, args = _CLASS_OF[source[0]], source[1]
    for key in ("capturable", "differentiable"):
        if group.get(key):
            raise ValueError(f"param group {index} sets {key}=True, which zero.functional.from_torch({name}) "
                             "does not support (it steps as torch does with it False)")
    hyper = tx.spec.args["hyperparams"]  # kept in the state, synced apart: skipped first (the most of a group)
    changed = {k: group[k] for k, v in args.items() if k not in hyper and k in group and not _same_setting(group[k], v)}
    if not changed:
        return tx
    # the rule keeps a copy: a list it shared with the group (``betas``) would follow the group's
    # later writes in place, and the next step would compare the list with itself and miss them
    changed = copy.deepcopy(changed)
    rebuilt = from_torch(name, **{**args, **changed})
    meta = [torch.empty(2, 2, device="meta")]
    if optree.tree_structure(rebuilt.init(meta), none_is_leaf=True) != \
            optree.tree_structure(tx.init(meta), none_is_leaf=True):
        key = next(iter(changed))
        raise ValueError(f"param group {index}'s {key!r} changed from {args[key]!r} to {group[key]!r}, which "
                         f"changes what torch.optim.{name}'s state holds: build a new optimizer for it")
    return rebuilt


def _same_setting(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b))
    return a == b
