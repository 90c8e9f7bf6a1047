"""`torch_optimizer`: a zero rule where torch code expects an optimizer class.

Trainers build optimizers as ``cls(params_or_groups, **kwargs)`` with torch's keyword names:
torchtitan's ``OptimizersContainer`` calls its factory with param groups that carry ``params``,
``param_names``, ``lr``, ``betas``, ``eps``, ``weight_decay`` and its ``fused``/``foreach`` keys.
``torch_optimizer(rule)`` is such a constructor for a `zero.functional` rule, building a
`zero.functional.Optimizer` (torch's optimizer contract: `zero.functional.adapters.face`):

- a ``torch.optim`` class is mirrored by `from_torch`: torch's names, group keys and state, so a
  checkpoint of torch's class continues in zero's and the reverse;
- a `zero.functional` factory (``zero.functional.adamw``, ``contrib.muon``, ``contrib.adamw_8bit``,
  ``contrib.soap`` ...) gets torch's names in its own: ``lr`` is its ``learning_rate``, ``betas``
  its ``(b1, b2)`` (Muon's ``(adam_b1, adam_b2)``, for the params it steps with Adam), ``momentum``
  its ``beta`` where it has no ``momentum`` (Muon's); any other key is its own argument's name.
  A key it has no place for is a ``TypeError`` naming it, never dropped.

``fused`` and ``foreach`` say how torch computes, not what: zero's step runs its own fused and
multi-tensor kernels whatever they say (``optimizer.path`` shows which), so they are taken (None,
True or False) and left out of the groups, as `from_torch` takes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zero.functional.adapters.torch_rules import TORCH_CLASSES, from_torch

__all__ = ["torch_optimizer", "rule_settings"]

_IMPLEMENTATION = ("fused", "foreach")
_NOT_SETTINGS = ("params", "param_names")


def torch_optimizer(rule: Any, **fixed: Any) -> Callable[..., Any]:
    """``make(params_or_groups, **torch_kwargs) -> zero.functional.Optimizer`` stepping ``rule``
    (a ``torch.optim`` class `from_torch` mirrors, or a `zero.functional` factory) with torch's
    keyword names (see the module); ``fixed``: the rule's own arguments, the same for every group
    (``block_size=``, ``weight_dimension_numbers=`` ...). Each group's settings are its own."""
    from zero.functional.adapters.optimizer import Optimizer

    def make(params: Iterable, **kwargs: Any) -> Any:
        groups = _groups(params)
        first = {k: v for k, v in groups[0].items() if k not in _NOT_SETTINGS} if groups else {}
        defaults = rule_settings(rule, {**kwargs, **first})  # (torch's defaults, then the first group's own)
        tx = from_torch(rule, **defaults) if _is_torch_class(rule) else rule(**_built_with(rule, fixed, defaults))
        return Optimizer([_group(rule, g) for g in groups], tx)

    make.__name__ = make.__qualname__ = f"torch_optimizer({getattr(rule, '__name__', rule)})"
    return make


def rule_settings(rule: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch's keywords ``kwargs`` as ``rule``'s settings (the group keys a `zero.functional`
    optimizer of it keeps: ``lr``, ``b1`` ...): see the module. ``fused``/``foreach`` are taken
    and left out; a key ``rule`` has no place for is a ``TypeError`` naming it."""
    if _is_torch_class(rule):
        return {k: v for k, v in kwargs.items() if not _implementation(k, v)}
    accepted = inspect.signature(rule).parameters
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in _NOT_SETTINGS or _implementation(key, value):
            continue
        for name, part in _placed(key, value, accepted, rule):
            out["lr" if name == "learning_rate" else name] = part
    return out


def _placed(key: str, value: Any, accepted: Any, rule: Any) -> list[tuple[str, Any]]:
    """Where torch's ``key`` goes in ``rule``'s arguments: ``[(name, value), ...]``."""
    if key in accepted:
        return [(key, value)]
    if key == "lr" and "learning_rate" in accepted:
        return [("learning_rate", value)]
    if key == "betas":
        for b1, b2 in (("b1", "b2"), ("adam_b1", "adam_b2")):
            if b1 in accepted and b2 in accepted:
                first, second = value
                return [(b1, first), (b2, second)]
    if key == "momentum" and "beta" in accepted:
        return [("beta", value)]
    raise TypeError(f"{getattr(rule, '__name__', rule)} has no setting for torch's {key!r}={value!r} (its settings "
                    f"are {sorted(accepted)}; lr is learning_rate, betas (b1, b2)): drop it, or name the rule's own")


def _implementation(key: str, value: Any) -> bool:
    """Whether ``key`` is torch's ``fused`` or ``foreach`` (taken: see the module)."""
    if key not in _IMPLEMENTATION:
        return False
    if value not in (None, True, False):
        raise TypeError(f"{key} must be None, True or False, got {value!r}")
    return True


def _built_with(rule: Any, fixed: dict, defaults: dict) -> dict:
    """The arguments ``rule`` is built with: ``fixed``, and the defaults with the first group's
    settings (each group then sets its own through its keys)."""
    return {**fixed, **{("learning_rate" if k == "lr" else k): v for k, v in defaults.items()}}


def _group(rule: Any, group: dict) -> dict:
    params = group["params"]
    out = {"params": params, **({"param_names": group["param_names"]} if "param_names" in group else {})}
    out.update(rule_settings(rule, {k: v for k, v in group.items() if k not in _NOT_SETTINGS}))
    return out


def _groups(params: Any) -> list[dict]:
    if isinstance(params, torch.nn.Module):
        return [{"params": list(params.parameters())}]
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g) for g in params]
    return [{"params": params}]


def _is_torch_class(rule: Any) -> bool:
    return isinstance(rule, type) and issubclass(rule, torch.optim.Optimizer) and rule.__name__ in TORCH_CLASSES
