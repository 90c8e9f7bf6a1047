"""Gradient clipping when the optimizer, not DDP, averages the gradients.

With ``reduce_scatter_grads=True`` a rank holds only its shards' averaged gradients (and the
whole params it owns); the params hold no ``.grad``. `clip_grad_norm_` clips those: every
reduction of the iteration is waited for, the total norm is one all-reduce of per-tensor
partial sums over the shards (`zero.functional.sharding.total_norm`), and the result equals
DDP + ``torch.nn.utils.clip_grad_norm_``. Where the params' ``.grad`` hold DDP's averaged
gradients it is torch's own call.

torch's own ``clip_grad_norm_`` and ``clip_grad_value_`` would read no ``.grad`` on such params
and return 0 with nothing clipped. So once a mode that keeps the gradients exists (`register`),
``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` (and their ``torch.nn.utils.clip_grad``
names) are wrapped: given exactly one optimizer's trainable params (``model.parameters()``) they
clip as above, the same result as with DDP; given part of them, or them and other params with
gradients, a ``ValueError``; any other call is torch's, unchanged. A name bound before ``zero``
was imported (``from torch.nn.utils import clip_grad_norm_``) is not wrapped: call the
optimizer's method there.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.utils import clip_grad

from zero.functional import sharding

__all__ = ["clip_grad_norm_", "clip_grad_value_", "register"]

# id(param) -> the mode that keeps its gradient; a mode holds its params, so their ids stay theirs.
_KEEPER: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_KEPT: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()
_TORCH: dict[str, Callable] = {}  # torch's own functions, by name, once wrapped


def register(mode: Any, params: Iterable[torch.Tensor]) -> None:
    """``mode`` keeps these params' gradients (`zero.backends.modes.Mode.held_grads`): torch's
    clipping functions called on them clip what the mode holds, or refuse."""
    params = list(params)
    for p in params:
        _KEEPER[id(p)] = mode
    _KEPT[mode] = frozenset(id(p) for p in params)
    if not _TORCH:
        for name, ours in (("clip_grad_norm_", clip_grad_norm_), ("clip_grad_value_", clip_grad_value_)):
            _TORCH[name] = getattr(clip_grad, name)
            wrapped = _wrap(_TORCH[name], ours)
            setattr(clip_grad, name, wrapped)
            setattr(torch.nn.utils, name, wrapped)


@torch.no_grad()
def clip_grad_norm_(mode: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the gradients ``mode`` steps: scale them by
    ``max_norm / (total_norm + 1e-6)`` where that is below 1; returns the total norm. Every rank
    must call it (the norm is a collective under ``reduce_scatter_grads``)."""
    held = mode.held_grads()
    if held is None:  # the params' .grad are DDP's averaged gradients, whole on every rank
        return _torch("clip_grad_norm_")(_trainable(mode), max_norm, norm_type, error_if_nonfinite, foreach)
    tensors, grads = [t for t, _ in held], [g for _, g in held]
    with sharding.installed(mode.sharding), sharding.stepping(tensors):
        total = sharding.total_norm(grads, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {float(total)}, so they cannot "
                           "be clipped; pass error_if_nonfinite=False to scale them by it anyway")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total.to(grads[0].device if grads else total.device)


@torch.no_grad()
def clip_grad_value_(mode: Any, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_`` over the gradients ``mode`` steps: clamp each to
    ``[-clip_value, clip_value]`` (the averaged gradients, as DDP + torch's clamps)."""
    held = mode.held_grads()
    if held is None:
        return _torch("clip_grad_value_")(_trainable(mode), clip_value, foreach)
    value = float(clip_value)
    for _, g in held:
        g.clamp_(-value, value)
    return None


def _wrap(original: Callable, ours: Callable) -> Callable:
    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        mode = _keeper_of(params, original.__name__)
        return original(params, *args, **kwargs) if mode is None else ours(mode, *args, **kwargs)

    return clip


def _keeper_of(params: list[torch.Tensor], name: str) -> Any:
    """The one mode keeping every one of ``params``' gradients, None when none keeps any."""
    keepers = {id(m): m for p in params if (m := _KEEPER.get(id(p))) is not None}
    if not keepers:
        return None
    if len(keepers) > 1:
        raise ValueError(f"torch.nn.utils.{name} over the params of {len(keepers)} sharded optimizers at once: "
                         "each keeps its own gradients; call each optimizer's clip_grad_norm_")
    (mode,) = keepers.values()
    given = {id(p) for p in params}
    missing = [i for i, p in enumerate(mode.params) if id(p) in _KEPT[mode] and id(p) not in given]
    others = sum(1 for p in params if id(p) not in _KEPT[mode] and p.grad is not None)
    if missing or others:
        first = mode.plan.metas[missing[0]].name if missing else ""
        what = (f"misses {len(missing)} of its trainable params (first: param {first})" if missing
                else f"adds {others} params with gradients it does not step")
        raise ValueError(f"torch.nn.utils.{name} over part of a sharded optimizer's params (the call {what}): "
                         "the optimizer holds its params' gradients (reduce_scatter_grads=True), and clips over all "
                         "of them at once; pass all of them (model.parameters()) or call opt.clip_grad_norm_")
    return mode


def _torch(name: str) -> Callable:
    return _TORCH.get(name) or getattr(clip_grad, name)


def _trainable(mode: Any) -> list[torch.Tensor]:
    return [p for p in mode.params if p.requires_grad]

