"""0-d hyperparameter and count tensors that remember the number they were made from.

An injected state keeps its hyperparameters and step counts as 0-d tensors (Optax's layout), while
an in-place step reads them as Python numbers, and a param group's numbers are written into them
before each step. Made and read back every step, that was thirteen dispatched ops of
`from_torch(SGD)`'s step, each dearer inside the ``record_function`` scope torch's
``Optimizer.step`` opens. A tensor made here keeps its number beside it, with its version counter
at the time; the number is read back from there while the version is unchanged (any in-place
write bumps it: a checkpoint loaded into it, ``copy_``, ``fill_``), else from the tensor itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zero.functional.foreach import traced

__all__ = ["scalar", "counter", "step_tensor", "value_of", "same_number"]

_KEPT = "_zero_number"  # the attribute a made tensor keeps (version, number) in


def scalar(value: float, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """``torch.as_tensor(value, dtype=dtype, device=device)``, remembering ``value`` when the
    tensor holds it exactly (a float64 tensor does; a float32 one may round it)."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if dtype == torch.float64 and type(value) in (float, int) and abs(value) < 2**53:
        setattr(t, _KEPT, (t._version, float(value)))
    return t


def counter(n: int) -> torch.Tensor:
    """A step counter, a 0-d int32 tensor (``torch.tensor(n, dtype=torch.int32)``), remembering ``n``.
    Eager, it is made by ``scalar_tensor`` at half the cost; traced, or under a dispatch mode (a
    simulation's fake tensors), by ``torch.tensor``, whose fake tensor keeps its value."""
    t = _maker()(n, dtype=torch.int32)
    setattr(t, _KEPT, (t._version, n))
    return t


def step_tensor(n: int, device: torch.device) -> torch.Tensor:
    """The step tensor torch's fused kernels take, ``torch.tensor(float(n), device=device)`` (a 0-d
    tensor of the default dtype), made as `counter` makes its own: by ``scalar_tensor`` when eager."""
    return _maker()(float(n), device=device)


def _maker() -> Any:
    """``torch.scalar_tensor`` when eager (half ``torch.tensor``'s cost), else ``torch.tensor``:
    traced, or under a dispatch mode (a simulation's fake tensors), whose fake tensor keeps its
    value. (``traced`` first: dynamo cannot read the dispatch stack.)"""
    return torch.scalar_tensor if not traced() and not torch._C._len_torch_dispatch_stack() else torch.tensor


def _kept(t: torch.Tensor) -> Any:
    """The number ``t`` was made from, if nothing wrote into it since; else None."""
    kept = t.__dict__.get(_KEPT)
    return kept[1] if kept is not None and kept[0] == t._version else None


def value_of(t: torch.Tensor) -> Any:
    """``t.item()``, from the number ``t`` was made from when nothing wrote into it since."""
    kept = _kept(t)
    return t.item() if kept is None else kept


def same_number(t: torch.Tensor, value: Any) -> bool:
    """Whether ``t`` was made from ``value`` (a number, its sign of zero too) and is unchanged
    since: a tensor made from ``value`` now would hold the same."""
    kept = _kept(t) if type(value) in (float, int) else None
    return kept is not None and kept == value and math.copysign(1.0, kept) == math.copysign(1.0, value)
