"""Reduce the updates' scale when the loss stops improving (mirrors
``optax.contrib.reduce_on_plateau`` and ``ReduceLROnPlateauState``), fed the loss as torch's
``ReduceLROnPlateau`` is: ``update(..., value=loss)``, or ``Optimizer.step(closure)`` (the closure's
loss) or ``Optimizer.step(value=loss)``. The loss is a number every rank must agree on: under a
data-parallel optimizer, the loss averaged over the ranks."""

from __future__ import annotations

from typing import NamedTuple

import torch

from zero.functional.base import GradientTransformation, highest_dtype, lowest_dtype, tree_map

__all__ = ["ReduceLROnPlateauState", "reduce_on_plateau"]


class ReduceLROnPlateauState(NamedTuple):
    """State of ``reduce_on_plateau`` (``optax.contrib.ReduceLROnPlateauState``).

    Fields:
        scale: the factor on the updates (params' lowest dtype); best_value: the best averaged loss;
        plateau_count, cooldown_count: steps without improvement, and of cooldown left (0-d int32);
        count: losses accumulated since the last check; avg_value: their average.
    """

    scale: torch.Tensor
    best_value: torch.Tensor
    plateau_count: torch.Tensor
    cooldown_count: torch.Tensor
    count: torch.Tensor
    avg_value: torch.Tensor



def _check(factor: float, rtol: float, atol: float) -> None:
    if not 0.0 < factor < 1.0:
        raise ValueError(f"Factor must be in the range (0, 1), got factor = {factor}.")
    if rtol < 0.0 or atol < 0.0:
        raise ValueError(f"Both rtol and atol must be non-negative, got rtol = {rtol} and atol = {atol}.")
    if rtol == 0.0 and atol == 0.0:
        raise ValueError(f"At least one of rtol or atol must be positive, got rtol = {rtol} and atol = {atol}.")
    if rtol > 1.0:
        raise ValueError(f"rtol must be less than or equal to 1.0, got rtol = {rtol}.")


def reduce_on_plateau(factor: float = 0.1, patience: int = 10, rtol: float = 1e-4, atol: float = 0.0,
                      cooldown: int = 0, accumulation_size: int = 1, min_scale: float = 0.0) -> GradientTransformation:
    """Multiply the updates by a scale that drops by ``factor`` once the loss, averaged over
    ``accumulation_size`` steps, has not improved (by ``rtol`` relative, ``atol`` absolute) for
    ``patience`` checks, then waits ``cooldown`` checks (``optax.contrib.reduce_on_plateau``).

    Example:
        >>> import torch, zero.functional as F
        >>> tx = F.chain(F.sgd(0.1), F.contrib.reduce_on_plateau(factor=0.5, patience=1))
        >>> p = torch.tensor([1.0])
        >>> state = tx.init(p)
        >>> for loss in (1.0, 1.0, 1.0):  # no improvement after the first: halved at the second
        ...     u, state = tx.update(torch.tensor([1.0]), state, p, value=loss)
        >>> float(state[1].scale)
        0.25
    """
    _check(factor, rtol, atol)

    def init(params):
        high = highest_dtype(params)
        zero = torch.zeros((), dtype=torch.int32)
        return ReduceLROnPlateauState(torch.tensor(1.0, dtype=lowest_dtype(params)),
                                      torch.tensor(float("inf"), dtype=high), zero, zero.clone(), zero.clone(),
                                      torch.tensor(0.0, dtype=high))

    def check(state: ReduceLROnPlateauState) -> ReduceLROnPlateauState:
        improved = bool(state.avg_value < (1 - rtol) * state.best_value - atol)
        best = state.avg_value.to(state.best_value.dtype) if improved else state.best_value
        plateau = 0 if improved else int(state.plateau_count) + 1
        if int(state.cooldown_count) > 0:
            plateau, scale, cool = 0, state.scale, int(state.cooldown_count) - 1
        else:
            hit = plateau == patience
            scale = torch.clamp(state.scale * factor if hit else state.scale, min=min_scale)
            plateau, cool = (0 if hit else plateau), (cooldown if hit else 0)
        i32 = torch.int32
        return ReduceLROnPlateauState(scale, best, torch.tensor(plateau, dtype=i32), torch.tensor(cool, dtype=i32),
                                      torch.tensor(0, dtype=i32), torch.zeros((), dtype=state.avg_value.dtype))

    def update(updates, state, params=None, *, value=None, **extra_args):
        if value is None:
            raise ValueError("reduce_on_plateau needs the loss: update(updates, state, params, value=loss), "
                             "optimizer.step(closure) with a closure returning it, or optimizer.step(value=loss)")
        count = int(state.count) + 1
        avg = ((count - 1) * state.avg_value + torch.as_tensor(value, dtype=state.avg_value.dtype).detach()) / count
        state = state._replace(avg_value=avg.to(state.avg_value.dtype), count=torch.tensor(count, dtype=torch.int32))
        if count == accumulation_size:
            state = check(state)
        return tree_map(lambda g: state.scale.to(g.dtype) * g, updates), state

    return GradientTransformation(init, update)
