"""`OptimizerFace`: torch's optimizer contract, written once, over whatever executes the step.

Every zero optimizer (`zero.functional.Optimizer` over plain or FSDP2's params,
`zero.ZeroRedundancyOptimizer` in each of its modes) is one of these, so code written against
``torch.optim.Optimizer`` works on all of them alike:

- ``optimizer.state`` is a live mapping from each trainable param to a dict of its state: the
  tensors the step uses (no copies), in the param's placement (a DTensor over FSDP2's params, a
  ``ShardedTensor`` of the elements a flat ZeRO plan gives this rank), named as torch names them
  where the rule mirrors a ``torch.optim`` class (`zero.functional.adapters.state_names`). A
  trainable param whose state another rank holds maps to ``{}``; so ``len(optimizer.state)`` is the
  number of trainable params on every rank, and torch's ``get_state_dict`` (which steps an
  optimizer whose ``state`` is empty) never steps one of these. Reading it starts a state that
  does not exist yet, as the first step would (zeros, count 0), and never steps.
- ``state_dict()`` is torch's form: ``state`` by position, ``param_groups`` with each group's
  settings, ``params`` (positions) and ``param_names`` (from named params). Its tensors are the
  live state, as torch's are; ``load_state_dict`` takes that form back, keyed by position or by
  the FQNs torch's ``set_state_dict`` passes, and the groups' settings with it.
- torch's hooks (step, ``state_dict``, ``load_state_dict``) run as on any torch optimizer.

What differs per executor is only where the state lives: ``executor.entries()`` lists this rank's
entries, ``executor.load(entries, groups)`` loads them (`Executor`). The start of a step is shared
too (`OptimizerFace.begin_step`): the ranks' check-in (steps, settings such as ``lr`` and the plan
compared, the rank and setting that differ named) and the policy on NaN and inf in the gradients
(``nonfinite``: `zero.functional.adapters.nonfinite`), the executor answering the collective half
(its ``guard``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from typing import Any, Protocol

import torch

from zero.functional.adapters.nonfinite import NonFinite, StepGuard

__all__ = ["OptimizerFace", "StateView", "Executor", "Entry", "LAYOUT_KEY"]

Entry = tuple[int, str, Any]  # (param position across the groups, state key, value)
LAYOUT_KEY = "sharded_layout"  # in a state_dict of one rank's pieces: whose (torch's loaders ignore it)
EVAL_KEY = "schedule_free_eval"  # in a state_dict saved in eval mode: the params saved with it hold the average x


class Executor(Protocol):
    """Where an `OptimizerFace`'s state lives: what it lists and how it loads. ``layout_key``
    names the rank and plan whose pieces its entries are (None: every param's whole state)."""

    layout_key: str | None

    def entries(self, saving: bool = True) -> Iterator[Entry]:
        """Every state entry this rank holds, params without state started first. ``saving``: for
        ``state_dict()`` (a piece no DTensor placement describes, a flat ZeRO range or a run over
        HSDP's replicas, as a ``ShardedTensor`` of the param's shape, which DCP reshards); else for
        ``optimizer.state``, whose values torch's tools read as tensors (such a piece is then this
        rank's elements themselves)."""
        ...

    def load(self, entries: dict[int, dict[str, Any]], groups: list[dict]) -> None:
        """Load ``entries`` (by param position; each trainable param this rank holds present) and
        take ``groups`` (the saved groups' settings, one dict per group, without params)."""
        ...


class StateView(Mapping):
    """``optimizer.state`` of an `OptimizerFace` (see the module): read through its executor,
    built when first read after a step or a load, never during a step."""

    def __init__(self, face: OptimizerFace):
        self._face = face
        self._table: dict[int, dict[str, Any]] = {}
        self._version = -1

    def table(self) -> dict[int, dict[str, Any]]:
        """Param position -> its entries, for every trainable param (``{}``: held elsewhere)."""
        face = self._face
        if self._version != face.state_key():
            self._table, self._version = face.entries_table(saving=False), face.state_key()
        return self._table

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        at = self._face.position(param)
        return self.table().get(at, {}) if at is not None else {}  # torch's defaultdict answers {} too

    def __contains__(self, param: object) -> bool:
        return self._face.position(param) is not None and bool(getattr(param, "requires_grad", False))

    def __iter__(self) -> Iterator[torch.Tensor]:
        params = self._face.all_params()
        return iter([params[i] for i in self._face.trainable_positions()])

    def __len__(self) -> int:
        return len(self._face.trainable_positions())

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        raise TypeError(f"{type(self._face).__name__}.state is a view of the rule's state: write into its tensors "
                        "(state[p]['exp_avg'].copy_(...)) or use load_state_dict")

    def __repr__(self) -> str:
        return f"StateView({len(self)} params)"


class OptimizerFace(torch.optim.Optimizer):
    """torch's optimizer contract over ``self.executor`` (see the module). A subclass sets
    ``executor`` and calls ``state_changed()`` whenever a step or a load changes the state;
    ``nonfinite`` is its policy on NaN and inf in the gradients (None: not checked)."""

    executor: Executor
    nonfinite: NonFinite | None = None

    def __init__(self, params: Any, defaults: dict[str, Any]):
        self.state_version = 0
        super().__init__(params, defaults)

    @property
    def state(self) -> StateView:  # type: ignore[override]
        view = self.__dict__.get("_state_view")
        if view is None:
            view = self.__dict__["_state_view"] = StateView(self)
        return view

    @state.setter
    def state(self, value: Any) -> None:
        if value:  # torch's __init__ sets an empty dict; the state lives in the executor
            raise TypeError(f"{type(self).__name__}.state cannot be replaced: use load_state_dict")

    def state_changed(self) -> None:
        """Say that the state changed (a step, a load): the next read of ``state`` rebuilds it."""
        self.state_version += 1

    def state_key(self) -> Any:
        """What ``state``'s cached view is of: it is built again when this changes."""
        return self.state_version

    def begin_step(self, guard: StepGuard, step: int, scaled: bool = False) -> tuple[bool, Callable[[], None]]:
        """The start of step ``step`` on every rank, whatever executes it: the ranks' check-in
        (``guard``'s: steps, settings and plan compared) carrying this rank's flag for NaN or inf in
        its gradients, and ``nonfinite`` on them. Returns ``(skip, after)``: whether every rank skips
        this step, and what runs after the local step (``"warn"`` verifies there, its latency hidden
        behind the step; ``"skip"`` and ``"raise"`` decide before anything is stepped). A step a loss
        scaler drives (``scaled``) is the scaler's to skip."""
        policy = self.nonfinite
        flag = 0 if policy is None or scaled else int(guard.local_nonfinite())
        verify = guard.check_in(flag)
        if policy is None:
            return False, lambda: _discard(verify())
        if policy.policy == "warn":
            return False, lambda: _discard(policy.settle(verify(), guard, step))
        return policy.settle(verify(), guard, step), _discard

    def entries_table(self, saving: bool) -> dict[int, dict[str, Any]]:
        """Param position -> its entries (`Executor.entries`), every trainable param present."""
        table: dict[int, dict[str, Any]] = {i: {} for i in self.trainable_positions()}
        for i, key, value in self.executor.entries(saving):
            table.setdefault(i, {})[key] = value
        return table

    # -- positions ---------------------------------------------------------------------------

    def all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def position(self, param: object) -> int | None:
        """``param``'s position across the groups, None when it is not one of this optimizer's."""
        sizes = tuple(len(g["params"]) for g in self.param_groups)
        cached = self.__dict__.get("_positions")
        if cached is None or cached[0] != sizes:
            cached = self.__dict__["_positions"] = (sizes, {id(p): i for i, p in reversed(
                list(enumerate(self.all_params())))})
        return cached[1].get(id(param))

    def trainable_positions(self) -> list[int]:
        return [i for i, p in enumerate(self.all_params()) if p.requires_grad]

    # -- torch's state dict ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's form (see the module): this rank's state by param position, every trainable
        param present (``{}`` where another rank holds its state), and the groups' settings; with
        the layout it holds the pieces of (``"sharded_layout"``) when the state is sharded."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = self.torch_state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def torch_state_dict(self) -> dict[str, Any]:
        """`state_dict` without torch's hooks."""
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        sd: dict[str, Any] = {"state": self.entries_table(saving=True), "param_groups": groups}
        if self.executor.layout_key is not None:
            sd[LAYOUT_KEY] = self.executor.layout_key
        if not getattr(self, "training", True):  # saved between eval() and train(): the params hold x, not y
            sd[EVAL_KEY] = True
        return sd

    def mark_evaluating(self, evaluating: bool) -> None:
        """What a loaded state dict says of eval mode (`EVAL_KEY`): an optimizer without one ignores it."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's form (`state_dict`'s, or torch's own optimizer's of the same rule): state
        keyed by position, or by the FQNs the groups' ``params`` list (torch's ``set_state_dict``),
        mapped onto this optimizer's params by order, as torch maps them; then the groups' settings."""
        state_dict = state_dict.copy()
        self.mark_evaluating(bool(state_dict.pop(EVAL_KEY, False)))  # the next train() swaps the saved x back to y
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.load_torch_state_dict(state_dict)
        self.state_changed()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def load_torch_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`load_state_dict` without torch's hooks."""
        saved_groups = _checked_groups(state_dict, self.param_groups)
        _check_layout(state_dict.get(LAYOUT_KEY), self.executor.layout_key)
        ids = dict(zip(chain.from_iterable(g["params"] for g in saved_groups), range(len(self.all_params()))))
        unknown = [k for k in state_dict["state"] if k not in ids]
        if unknown:
            raise ValueError(f"the state dict has state for {unknown[:5]}, which its param_groups do not list: it "
                             "does not describe these params")
        entries = {ids[k]: dict(v) for k, v in state_dict["state"].items()}
        settings = [{k: copy.deepcopy(v) for k, v in g.items() if k not in ("params", "param_names")}
                    for g in saved_groups]
        self.check_settings(settings)
        self.executor.load(entries, settings)
        for group, saved in zip(self.param_groups, settings):
            group.update(saved)  # the params, and their names, stay this optimizer's

    def check_settings(self, saved: list[dict]) -> None:
        """A saved group setting this optimizer's group does not have would be ignored: a
        ``ValueError`` naming it (a state dict of another optimizer, whose state may be empty)."""
        _check_settings(saved, self.param_groups)

    def __getstate__(self) -> dict[str, Any]:
        if self.executor.layout_key is not None:
            raise TypeError(f"a {type(self).__name__} over sharded state holds process groups and cannot be copied or "
                            "pickled: save its state (state_dict(), or torch.distributed.checkpoint) and build another")
        return {k: v for k, v in self.__dict__.items() if k not in ("_positions", "_state_view")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _discard(*_: Any) -> None:
    return None


def _check_layout(saved: str | None, here: str | None) -> None:
    """A state dict of one rank's pieces loads only into that rank of that plan (through torch's
    ``get_state_dict`` and DCP, whose tensors place themselves, it loads anywhere)."""
    if saved is not None and saved != here:
        raise ValueError(f"this state_dict holds the optimizer state of {saved}, and this optimizer steps "
                         f"{here or 'plain params'}: one rank's state_dict() loads only into the same rank of the same "
                         "layout; to reshard, save and load through torch.distributed.checkpoint (torch's "
                         "get_state_dict / set_state_dict, or zero.backends.checkpoint)")


_KEPT = ("initial_lr",)  # what torch's lr schedulers add to a group: kept, whatever the rule


def _check_settings(saved: list[dict], groups: list[dict]) -> None:
    """A saved group setting this optimizer's group does not have would be ignored: a
    ``ValueError`` naming it (a state dict of another optimizer, whose state may be empty)."""
    from zero.functional.adapters.group_settings import looks_like_hyperparameter

    for k, (settings, group) in enumerate(zip(saved, groups)):
        foreign = sorted(key for key, value in settings.items()
                         if key not in group and key not in _KEPT and looks_like_hyperparameter(value))
        if foreign:
            raise ValueError(f"the state dict's param group {k} sets {foreign}, which this optimizer's group does not "
                             f"have (its settings: {sorted(k for k in group if k not in ('params', 'param_names'))}): "
                             "it was saved by another optimizer, whose settings would be ignored here")


def _checked_groups(state_dict: Any, groups: list[dict]) -> list[dict]:
    """The saved param groups, checked against ``groups`` as torch checks them."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        keys = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else "-"
        raise ValueError("state_dict must be an optimizer state dict with 'state' and 'param_groups', got "
                         f"{type(state_dict).__name__} with keys {keys}")
    saved = state_dict["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(f"the state dict has {len(saved)} param groups and this optimizer {len(groups)}")
    sizes = [len(g["params"]) for g in saved]
    if sizes != [len(g["params"]) for g in groups]:
        raise ValueError(f"the state dict's param groups hold {sizes} params and this optimizer's "
                         f"{[len(g['params']) for g in groups]}: it was saved for other params")
    return saved
