"""A rule's state as torch shows an optimizer's: each param's state by key, in torch's forms.

``torch.optim`` keeps a dict of state per param (``optimizer.state[p]``) and saves it by position
(``state_dict()["state"][i]``); a `zero.functional` rule keeps one state tree per set of params
stepped together. `named_leaves` reads a set's tree as torch's per-param entries, and `load_named`
writes them back:

- a leaf of one param is named by its path in the tree (``"inner_state.0.mu"``, as
  `state_tree.map_state_leaves` names it); a leaf the set shares (a count, a schedule's state)
  appears under every param of the set, and loads from them only when they all agree;
- the hyperparameters a rule keeps in its state for the param groups (`inject_hyperparams`' ``lr``
  ...) are group settings, kept in ``param_groups`` only, as torch keeps them;
- a rule that mirrors a ``torch.optim`` class (`from_torch`) uses that class's names and forms
  (`TORCH_STATE_NAMES`): its counts are torch's ``step`` (a float tensor, one per param), Adam's
  moments ``exp_avg`` and ``exp_avg_sq``, SGD's buffer ``momentum_buffer``..., so a state dict
  written by the one loads into the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zero.functional.adapters.state_tree import map_state_leaves, state_leaves
from zero.functional.adapters.torch_rules import torch_class_of
from zero.functional.base import GradientTransformation
from zero.functional.kernels.multi_tensor import scalar_dtype

__all__ = ["StateNames", "TORCH_STATE_NAMES", "names_of", "named_leaves", "load_named", "per_param", "STEP",
           "MASTER_KEY"]

STEP = "step"  # torch's key for a count
MASTER_KEY = "master"  # a param's master weights, which a sharded executor keeps beside the rule's state

# Per torch.optim class: the field of `from_torch`'s state (the last part of a leaf's path) -> torch's key.
_ADAM = {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"}
TORCH_STATE_NAMES: dict[str, dict[str, str]] = {
    "SGD": {"momentum_buffer": "momentum_buffer"},
    "Adam": _ADAM,
    "AdamW": _ADAM,
    "Adagrad": {"sum_of_squares": "sum"},
    "Adadelta": {"e_g": "square_avg", "e_x": "acc_delta"},
    "RMSprop": {"mu": "grad_avg", "nu": "square_avg", "trace": "momentum_buffer"},
    "Rprop": {"step_sizes": "step_size", "prev_updates": "prev"},
    "Adamax": {"mu": "exp_avg", "nu": "exp_inf"},
    "NAdam": {"mu": "exp_avg", "nu": "exp_avg_sq", "mu_product": "mu_product"},
    "RAdam": {"mu": "exp_avg", "nu": "exp_avg_sq"},
    "Muon": {"momentum_buffer": "momentum_buffer"},
}
_NO_STEP = {"SGD", "Muon"}  # torch's classes that keep no step (zero saves its count anyway)


@dataclass(frozen=True)
class StateNames:
    """How one rule's state leaves are named: ``torch_class``, the ``torch.optim`` class it
    mirrors (None: zero's paths); ``settings``, whether its top-level ``hyperparams`` are the
    param groups' settings (and so not state)."""

    torch_class: str | None = None
    settings: bool = False

    def key(self, path: str) -> str | None:
        """The key of the leaf at ``path``; None for a group setting (not state)."""
        if self.settings and path.startswith("hyperparams."):
            return None
        if self.torch_class is None:
            return path
        field = path.rsplit(".", 1)[-1]
        if field == "count":
            return STEP
        return TORCH_STATE_NAMES[self.torch_class].get(field, path)

    def assumed(self, key: str) -> Any:
        """The value of ``key`` a state dict may lack, or None: ``step`` where torch's class keeps
        none (SGD, Muon), 1 (torch holds a state only once it has stepped; the count only tells a
        started state from a fresh one there)."""
        return 1 if key == STEP and self.torch_class in _NO_STEP else None

    def shown(self, path: str, leaf: Any) -> Any:
        """``leaf`` as torch keeps it: a count as torch's ``step`` (a 0-d float in torch's scalar
        dtype, as ``torch.optim`` makes it); every other leaf itself (the live tensor)."""
        if self.key(path) == STEP and isinstance(leaf, torch.Tensor):
            return torch.tensor(float(leaf), dtype=scalar_dtype())
        return leaf

    def taken(self, path: str, leaf: Any, value: Any) -> Any:
        """The leaf a loaded ``value`` (in the `shown` form) becomes: a ``step`` back into the
        count's integer dtype and device (a ``ValueError`` for one that is not a whole number)."""
        if self.key(path) != STEP or not isinstance(leaf, torch.Tensor):
            return value
        number = float(value)
        if number != int(number) or number < 0:
            raise ValueError(f"a saved 'step' of {number!r} is not a count of steps")
        return torch.tensor(int(number), dtype=leaf.dtype, device=leaf.device)


def names_of(tx: GradientTransformation) -> StateNames:
    """How the state of ``tx`` (as a `zero.functional.Optimizer` runs it) is named."""
    from zero.functional.adapters.group_settings import hyperparams_of

    spec = getattr(tx, "spec", None)
    return StateNames(torch_class_of(tx), bool(hyperparams_of(tx)) and spec.name == "inject_hyperparams")


def named_leaves(state: Any, n: int, tree_names: list[str] | None, names: StateNames
                 ) -> list[tuple[str, int | None, Any]]:
    """``(key, position, value)`` of each state leaf of a set of ``n`` params (``position``: the
    param's, None for a leaf they share), named and shown as `StateNames` says; a key met twice
    (torch's ``step`` for every count of a rule) is listed once."""
    out, seen = [], set()
    for path, pos, leaf in state_leaves(state, n, tree_names):
        key = names.key(path)
        if key is None or (key, pos) in seen:
            continue
        seen.add((key, pos))
        out.append((key, pos, names.shown(path, leaf)))
    return out


def per_param(named: list[tuple[str, int | None, Any]], idx: tuple[int, ...]
              ) -> Iterator[tuple[int, str, int | None, Any]]:
    """`named_leaves`' entries of the set of params at ``idx``, per param: ``(param, key, position,
    value)``. A shared leaf goes under every param, each its own tensor (torch keeps one ``step``
    per param and steps each: one tensor under several params would count once per param)."""
    for key, pos, value in named:
        if pos is not None:
            yield idx[pos], key, pos, value
            continue
        for j, i in enumerate(idx):
            yield i, key, None, value.clone() if j and isinstance(value, torch.Tensor) else value


def load_named(state: Any, n: int, tree_names: list[str] | None, names: StateNames,
               fill: Callable[[str, int | None, Any], Any]) -> Any:
    """``state`` with each named leaf replaced by ``fill(key, position, shown)`` (``shown``: the
    leaf in its saved form, to check a loaded value against or load into in place), taken back
    into the leaf's own form; group settings left as they are."""
    def one(path: str, pos: int | None, leaf: Any) -> Any:
        key = names.key(path)
        if key is None:
            return leaf
        return names.taken(path, leaf, fill(key, pos, names.shown(path, leaf)))

    return map_state_leaves(state, n, one, tree_names)
