"""`SetStates`: one param group's transformation states, one per set of params stepped together.

A set is a group's params that have gradients (or one DDP bucket). The sets repeat every
iteration, so each state sees the same params every step, and params that never get a gradient
(frozen ones) never get state, as in torch. A param that turns up in two different sets is an
error, not a silent state split, unless the transformation is declared per param (``per_param``,
for torch's rules): then the earlier set's state is split (`split_state`) and each part steps alone.

The states read as torch's per-param entries (`entries`) and load from them (`load`), named as
`zero.functional.adapters.state_names` says.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from itertools import compress, repeat
from typing import Any

import optree
import torch

from zero.functional import sharding
from zero.functional.adapters.closure_args import CLOSURE, with_closure_args
from zero.functional.adapters.group_settings import hyperparams_of, show_scheduled, sync_hyperparams
from zero.functional.adapters.state_names import load_named, named_leaves, names_of
from zero.functional.adapters.state_tree import as_tree, split_state
from zero.functional.adapters.torch_rules import torch_class_of, with_torch_settings
from zero.functional.base import GradientTransformation, inplace_step

__all__ = ["SetStates", "Fill"]

# fill(key, position in the set or None, the leaf as saved) -> the value to load (see `load_named`)
Fill = Callable[[str, int | None, Any], Any]


def _guards(state: Any) -> list[Any]:
    """The ``ApplyIfFiniteState`` nodes of a transformation's state."""
    from zero.functional.transforms.conditionality import ApplyIfFiniteState

    def is_guard(node: Any) -> bool:
        return isinstance(node, ApplyIfFiniteState)

    return [x for x in optree.tree_leaves(state, is_leaf=is_guard, none_is_leaf=True) if is_guard(x)]


def _max_errors(tx: Any) -> int:
    """The ``max_consecutive_errors`` of the first ``apply_if_finite`` in ``tx``'s spec (0 if none seen)."""
    spec = getattr(tx, "spec", None)
    if spec is None:
        return 0
    if spec.name == "apply_if_finite":
        return int(spec.args["max_consecutive_errors"])
    inner = [spec.args.get("inner"), *spec.links]
    return next((m for m in map(_max_errors, inner) if m), 0)


_LISTS = frozenset({"params", "param_names"})  # a group's lists, no setting or hyperparameter read from them
_FIXED = (float, int, bool, str, type(None))


def _frozen(value: Any) -> bool:
    """Whether ``value`` changes only by being replaced: a number, a string, a tuple of them."""
    kind = type(value)
    return kind in _FIXED or (kind is tuple and all(type(x) in _FIXED for x in value))


def _hyperparam_tensors(state: Any) -> tuple:
    """An injected state's hyperparameter tensors' identities and versions (an in-place write
    bumps one), and the tensors (held, so no other tensor takes an identity); empty for other
    states."""
    hyperparams = getattr(state, "hyperparams", None)
    if not isinstance(hyperparams, dict):
        return ()
    tensors = tuple(hyperparams.values())
    return tuple(map(id, tensors)), tuple(map(getattr, tensors, repeat("_version"), repeat(0))), tensors


class SetStates:
    """One group's transformation states, keyed by the tuple of param positions stepped together."""

    def __init__(self, tx: GradientTransformation, per_param: bool = False, index: int = 0):
        self.tx, self.per_param, self.index = tx, per_param, index
        self.names = names_of(tx)
        self.guarded: bool | None = None  # whether the states hold an apply_if_finite's (see guard_reports)
        self.max_errors = _max_errors(tx)
        self.states: dict[tuple[int, ...], Any] = {}
        self._owner: dict[int, tuple[int, ...]] = {}
        self._fresh: set[tuple[int, ...]] = set()  # sets started (to be read or loaded into) but never stepped
        self._seen: tuple = ()  # the group as the last step read it, when nothing in it can change in place
        self._synced: dict[tuple[int, ...], tuple] = {}  # per set: its hyperparameter tensors and versions then
        self._hyper = frozenset(hyperparams_of(tx))  # group keys kept in the state (a rebuild keeps the same)

    def owns(self, i: int) -> bool:
        """Whether the param at position ``i`` has a state."""
        return i in self._owner

    def step(self, idx: tuple[int, ...], params: list, grads: list, group: dict | None = None,
             names: list[str] | None = None, extra_args: dict | None = None) -> None:
        moved = None if group is None else self._moved_keys(group)
        if group is not None and self._settings_moved(moved) and torch_class_of(self.tx) is not None:
            self.tx = with_torch_settings(self.tx, group, self.index)
        if idx in self.states or not any(i in self._owner for i in idx):
            return self._step(idx, params, grads, group, names, extra_args, moved)
        clash = {self._owner[i] for i in idx if i in self._owner}
        if clash <= self._fresh:  # started before any step (state read, or made at construction): the first
            for block in clash:   # step's set decides, as it does for a state not started yet
                self.forget(block)
            return self._step(idx, params, grads, group, names, extra_args, moved)
        if not self.per_param:
            clash = sorted({self._owner[i] for i in idx if i in self._owner})
            raise ValueError(f"params {list(idx)} are stepped together, but some were stepped before with "
                             f"{clash}: the set of params with gradients must repeat every step "
                             "(put params that get gradients at different times in separate param groups)")
        self._split_along(set(idx))
        where = {i: k for k, i in enumerate(idx)}
        blocks = sorted({self._owner[i] for i in idx if i in self._owner})
        fresh = tuple(i for i in idx if i not in self._owner)
        for block in blocks + ([fresh] if fresh else []):
            self._step(block, [params[where[i]] for i in block], [grads[where[i]] for i in block], group, None,
                       extra_args, moved)

    def _split_along(self, stepping: set[int]) -> None:
        """Split every set that is partly stepping into its stepping and its resting params."""
        for block in {self._owner[i] for i in stepping if i in self._owner}:
            inside = [k for k, i in enumerate(block) if i in stepping]
            if len(inside) == len(block):
                continue
            outside = [k for k, i in enumerate(block) if i not in stepping]
            for part, state in zip((inside, outside), split_state(self.states.pop(block), len(block),
                                                                  [inside, outside])):
                key = tuple(block[k] for k in part)
                self.states[key] = state
                self._owner.update(dict.fromkeys(key, key))

    def _step(self, idx: tuple[int, ...], params: list, grads: list, group: dict | None,
              names: list[str] | None, extra_args: dict | None = None, moved: set[str] | None = None) -> None:
        """``moved``: the group's keys whose values moved since the last step (`_moved_keys`)."""
        state = self.states.get(idx)
        if state is None:
            state = self.start(idx, params, names)
        if group is not None and not self._in_sync(idx, state, moved):
            state = sync_hyperparams(state, group)
        # the leaves reach the transformation in the tree's order (a dict's sorted by name)
        tree, grad_tree = as_tree(params, names), as_tree(grads, names)
        if extra_args and CLOSURE in extra_args:  # the loss again at other params, for this set (a line search)
            extra_args = with_closure_args(extra_args, tree, grad_tree)
            grad_tree = extra_args["grad"]  # (a copy: the closure's own zero_grad must not write the step's)
        with sharding.stepping(tree):
            self.states[idx] = inplace_step(self.tx, tree, grad_tree, state, leaves=params, extra_args=extra_args)
        self._fresh.discard(idx)
        if group is not None:
            show_scheduled(self.states[idx], group)
            if moved == set():  # (a group that moves every step, by a scheduler, is synced every step)
                self._synced[idx] = _hyperparam_tensors(self.states[idx])

    def _moved_keys(self, group: dict) -> set[str] | None:
        """The group's keys whose values are not the very objects the last step read, or None
        when every value must be read: the first step, a key added or removed, or a value that can
        change without being replaced (a tensor, a list: anything but numbers, strings and tuples of
        them; the params' lists aside). A scheduler's new ``lr`` is a new float: ``{"lr"}``."""
        keys, values, seen = tuple(group), tuple(group.values()), self._seen
        if seen and seen[0] == keys:
            flags = list(map(operator.is_not, values, seen[1]))
            if not any(flags):
                return set()
            moved = set(compress(keys, flags))
            if all(_frozen(group[k]) for k in moved - _LISTS):
                self._seen = (keys, values)
                return moved
        elif all(_frozen(v) for k, v in group.items() if k not in _LISTS):
            self._seen = (keys, values)
            self._synced.clear()
            return None
        self._seen = ()
        self._synced.clear()
        return None

    def _settings_moved(self, moved: set[str] | None) -> bool:
        """Whether this step's group may hold a setting the rule was not built with: a moved key
        that is neither a hyperparameter kept in the state (synced apart) nor a params' list."""
        return moved is None or bool(moved - self._hyper - _LISTS)

    def _in_sync(self, idx: tuple[int, ...], state: Any, moved: set[str] | None) -> bool:
        """Whether set ``idx``'s hyperparameters are the tensors its last step left, unwritten
        since, under a group none of whose values moved (`_moved_keys`): syncing them with the
        group again would keep their numbers."""
        synced = self._synced.get(idx)
        return moved == set() and bool(synced) and _hyperparam_tensors(state)[:2] == synced[:2]

    def start(self, idx: tuple[int, ...], leaves: list[torch.Tensor], names: list[str] | None) -> Any:
        """The state the params at ``idx`` start from (``leaves``: the tensors the rule steps for
        them), kept as their set's."""
        tree = as_tree(leaves, names)
        with sharding.stepping(tree):  # a rule whose start reads whole tensors (DoG's norms) asks across ranks
            state = self.states[idx] = self.tx.init(tree)
        self._owner.update(dict.fromkeys(idx, idx))
        self._fresh.add(idx)
        return state

    def clear(self) -> None:
        """No state for any param: each starts afresh at its next step."""
        self.states, self._owner, self._fresh = {}, {}, set()

    def adopt(self, idx: tuple[int, ...], state: Any) -> None:
        """``state`` as set ``idx``'s (a state dict's, as it was saved)."""
        self.states[idx] = state
        self._owner.update(dict.fromkeys(idx, idx))

    def forget(self, idx: tuple[int, ...]) -> None:
        """Drop the state of set ``idx``: its params start afresh at their next step."""
        del self.states[idx]
        self._fresh.discard(idx)
        for i in idx:
            del self._owner[i]

    def named(self, idx: tuple[int, ...], names: list[str] | None) -> list[tuple[str, int | None, Any]]:
        """Set ``idx``'s state as named per-param entries (`zero.functional.adapters.state_names`)."""
        return named_leaves(self.states[idx], len(idx), names, self.names)

    def load(self, idx: tuple[int, ...], names: list[str] | None, fill: Fill) -> None:
        """Load set ``idx``'s state leaf by leaf from ``fill`` (see `load_named`)."""
        self.states[idx] = load_named(self.states[idx], len(idx), names, self.names, fill)
        self._fresh.discard(idx)  # (a loaded state is a run's: it must go on as it was)

    def guard_reports(self) -> list[tuple[int, int, int]]:
        """Per ``apply_if_finite`` in the states whose last step met NaN or inf: ``(consecutive,
        total, applied)`` (``applied``: 1 when it gave up skipping and stepped). Empty where the
        transformation has no ``apply_if_finite`` (found once, from the first state)."""
        if self.guarded is None and self.states:
            self.guarded = bool(_guards(next(iter(self.states.values()))))
        if not self.guarded:
            return []
        out = []
        for state in self.states.values():
            for guard in _guards(state):
                if not bool(guard.last_finite):
                    consecutive = int(guard.notfinite_count)
                    out.append((consecutive, int(guard.total_notfinite), int(consecutive > self.max_errors)))
        return out

    def sets(self) -> Iterator[tuple[int, ...]]:
        return iter(list(self.states))
