"""``train()`` / ``eval()`` on a `zero.functional.Optimizer`: for rules whose params to evaluate
differ from the params they step at (schedule-free learning: its average ``x`` against the
gradient point ``y``), the swap ``schedulefree``'s torch optimizers make, through the executor that
steps the params (plain tensors, FSDP2's pieces and whole params by owner, masters), so each rank
swaps what it steps and the executor writes it back as after a step.

A rule with nothing to swap makes both calls no-ops, so a training loop may call them whatever
the rule. A step in eval mode is a ``ValueError``: it would step from the average, not from ``y``.
A state dict saved in eval mode says so, and loading it puts the optimizer back in eval mode (the
model's params saved with it hold ``x``), so ``train()`` after a resume swaps ``y`` back in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zero.functional.adapters.state_tree import as_tree
from zero.functional.base import tree_leaves
from zero.functional.contrib._schedule_free import schedule_free_states, swap_eval, swap_train

__all__ = ["EvalMode"]

Swap = Callable[[Any, list[torch.Tensor]], None]


class EvalMode:
    """Mixed into `zero.functional.Optimizer`: ``train()``, ``eval()`` and ``training``, and
    ``measurements()`` (what ``monitor``, ``snapshot`` and ``measure_with_ema`` keep)."""

    def measurements(self, group: int | None = None) -> dict[str, Any]:
        """The last step's measurements of every ``monitor`` and ``snapshot`` in the rule, by name
        (``group``: of that param group only). A name measured in two places (two groups, two sets
        of params) is a ``ValueError`` saying which: ask per group. Under a sharded optimizer a
        measure sees this rank's pieces (see `zero.functional.transforms.monitoring`)."""
        from zero.functional.transforms.monitoring import measurements_in

        found: dict[str, Any] = {}
        groups = range(len(self.param_groups)) if group is None else [group]
        for k in groups:
            for state in self.set_states_of(k).states.values():
                for name, value in measurements_in(state):
                    if name in found:
                        raise ValueError(f"measurement {name!r} is taken in more than one place (param groups, "
                                         "or sets of params stepped apart): ask optimizer.measurements(group=k)")
                    found[name] = value
        return found

    _evaluating = False  # whether eval() swapped evaluation params in (until train())

    @property
    def training(self) -> bool:
        """False between ``eval()`` and ``train()`` when the rule has params to swap."""
        return not self._evaluating

    def eval(self) -> None:
        """Write the params to evaluate at into the params, in place (schedule-free: ``x``); a
        no-op for rules without them, and when already in eval mode. Every rank calls it."""
        if not self._evaluating and self.has_swap():
            self._swap(swap_eval)
            self._evaluating = True

    def train(self, mode: bool = True) -> None:
        """Back to the params the rule steps at (schedule-free: ``y``); ``train(False)`` is ``eval()``."""
        if not mode:
            return self.eval()
        if self._evaluating:
            self._swap(swap_train)
            self._evaluating = False

    def mark_evaluating(self, evaluating: bool) -> None:
        """A state dict saved in eval mode was loaded (the model's saved params are ``x``): the next
        ``train()`` swaps them to ``y``, and a step before it is refused, as before the save."""
        self._evaluating = evaluating and self.has_swap()

    def check_training(self) -> None:
        if self._evaluating:
            raise ValueError("step() between optimizer.eval() and optimizer.train(): the params hold the schedule-free "
                             "average x, and a step must start from the gradient point y. Call optimizer.train() "
                             "before the training steps (as with schedulefree's optimizers)")

    def has_swap(self) -> bool:
        """Whether some group's rule keeps evaluation params, read off the rule (the state of no
        params), not off this rank's states: every rank must agree, as the swap's exchanges pair up."""
        return any(_swaps(self.set_states_of(k).tx) for k in range(len(self.param_groups)))

    @torch.no_grad()
    def _swap(self, swap: Swap) -> None:
        for k, group in enumerate(self.param_groups):
            sets = self.set_states_of(k)
            # trainable params (alike on every rank: the exchanges pair up) and any with state (a
            # ZeRO rank's flat shards, which are not leaves that require grad)
            idx = tuple(i for i, p in enumerate(group["params"]) if p.requires_grad or sets.owns(i))
            params = [group["params"][i] for i in idx]
            run = self._swapper(k, sets, swap)
            self.executor.step_group(k, idx, params, [torch.zeros_like(p) for p in params], run)

    def _swapper(self, k: int, sets: Any, swap: Swap) -> Callable[..., None]:
        """The executor's ``run``: each set's state swaps the leaves it steps, in its tree's order."""
        def run(keep: tuple[int, ...], leaves: list[torch.Tensor], _grads: Any) -> None:
            where = {i: j for j, i in enumerate(keep)}
            for key, state in sets.states.items():
                if all(i in where for i in key):
                    tree = as_tree([leaves[where[i]] for i in key], self.names_of(k, key))
                    swap(state, tree_leaves(tree))
        return run


def _swaps(tx: Any) -> bool:
    try:
        empty = tx.init({})
    except Exception:  # a rule that cannot start on no params (it reads shapes): none of schedule-free's
        return False
    return bool(schedule_free_states(empty))
