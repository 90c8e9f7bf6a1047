"""Lookahead (mirrors ``optax.lookahead``, ``LookaheadState`` and ``LookaheadParams``): a fast
rule steps ``fast`` params, and every ``sync_period`` steps the ``slow`` params move part of the
way to them and the fast ones restart from there. Element-wise around its fast rule.

As in Optax, the params are a `LookaheadParams` pair (the pure form: ``update(grads, state,
LookaheadParams(fast, slow))``, gradients of the fast params, evaluating at ``slow``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zero.functional.base import GradientTransformation, select, tree_map

__all__ = ["LookaheadState", "LookaheadParams", "lookahead"]


class LookaheadState(NamedTuple):
    """State of ``lookahead`` (``optax.LookaheadState``).

    Fields:
        fast_state: the fast rule's state; steps_since_sync: 0-d int32.
    """

    fast_state: Any
    steps_since_sync: torch.Tensor


class LookaheadParams(NamedTuple):
    """The params ``lookahead`` steps (``optax.LookaheadParams``): the fast ones and the slow ones."""

    fast: Any
    slow: Any

    @classmethod
    def init_synced(cls, params: Any) -> LookaheadParams:
        """Both from ``params`` (copies: the steps write them apart)."""
        return cls(fast=params, slow=tree_map(lambda p: p.detach().clone(), params))


def lookahead(fast_optimizer: GradientTransformation, sync_period: int, slow_step_size: float,
              reset_state: bool = False) -> GradientTransformation:
    """Lookahead around ``fast_optimizer`` (``optax.lookahead``): updates are a `LookaheadParams`
    of updates to ``fast`` and ``slow``.

    Reference: Zhang et al., Lookahead Optimizer: k steps forward, 1 step back, 2019
    (arXiv:1907.08610).
    """
    if sync_period < 1:
        raise ValueError("Synchronization period must be >= 1.")

    def init(params):
        fast = getattr(params, "fast", params)  # Optax too takes the fast params alone
        return LookaheadState(fast_optimizer.init(fast), torch.zeros((), dtype=torch.int32))

    def update(updates, state, params=None):
        if not isinstance(params, LookaheadParams):
            raise TypeError(f"lookahead steps LookaheadParams(fast, slow), got {type(params).__name__}: start them "
                            "with zero.functional.LookaheadParams.init_synced(params), as Optax's lookahead does")
        fast_updates, fast_state = fast_optimizer.update(updates, state.fast_state, params.fast)
        sync = int(state.steps_since_sync) == sync_period - 1
        diff = tree_map(lambda f, u, s: f + u - s, params.fast, fast_updates, params.slow)
        slow_out = tree_map(lambda d: slow_step_size * sync * d, diff)
        fast_out = tree_map(lambda u, d: u - sync * (1 - slow_step_size) * d, fast_updates, diff)
        if reset_state and sync:
            fast_state = select(torch.tensor(True), fast_optimizer.init(params.fast), fast_state)
        steps = torch.tensor((int(state.steps_since_sync) + 1) % sync_period, dtype=torch.int32)
        return LookaheadParams(fast=fast_out, slow=slow_out), LookaheadState(fast_state, steps)

    return GradientTransformation(init, update)
