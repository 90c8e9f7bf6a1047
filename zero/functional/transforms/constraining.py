"""Constraints on the params a step leaves (``optax.keep_params_nonnegative``). Element-wise."""

from __future__ import annotations

import torch

from zero.functional.base import NO_PARAMS_MSG, EmptyState, GradientTransformation
from zero.functional.foreach import elementwise_map

__all__ = ["NonNegativeParamsState", "keep_params_nonnegative"]


NonNegativeParamsState = EmptyState  # as Optax's: its state is the empty one

def keep_params_nonnegative() -> GradientTransformation:
    """Updates that would take a param below zero take it to zero instead (``-p``)
    (``optax.keep_params_nonnegative``); params must start non-negative."""

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(NO_PARAMS_MSG)
        return elementwise_map(lambda u, p: torch.where(p + u < 0.0, -p, u), updates, params), state

    return GradientTransformation(lambda params: NonNegativeParamsState(), update)
