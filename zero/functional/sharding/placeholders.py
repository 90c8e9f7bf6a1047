"""State leaves that hold nothing (`placeholder`): the 1-element zeros Optax keeps in a field a
param does not use (Adafactor's ``v_row``/``v_col`` of a vector, its ``v`` of a factored matrix).
Marked, so that a sharded checkpoint saves them as they are (the same on every rank that holds a
piece of the param) instead of refusing them as a statistic of a whole param it holds only part of."""

from __future__ import annotations

import torch

__all__ = ["placeholder", "is_placeholder"]

_MARK = "_zero_placeholder"


def placeholder(like: torch.Tensor, numel: int = 1) -> torch.Tensor:
    """Zeros of ``numel`` elements in ``like``'s dtype and device, marked as a placeholder."""
    out = torch.zeros(numel, dtype=like.dtype, device=like.device)
    setattr(out, _MARK, True)
    return out


def is_placeholder(t: object) -> bool:
    """Whether ``t`` is a state leaf made by `placeholder` (or loaded into one, in place)."""
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)
