"""What steps a `zero.functional.Optimizer`'s params, and where their state lives.

Plain tensors are stepped here (`LocalExecutor`). A DTensor param of ``fully_shard`` is a rank's
piece of a whole tensor, and stepping it exactly takes collectives: sums over the ranks for norms,
whole tensors on an owner for the rules that need them. Collectives live in ``zero.backends``
(DESIGN.md), so this module names the backend module by its dotted name (`EXECUTORS`) and loads it
only for such params: ``import zero.functional`` still loads no backend, and a plain optimizer
never does. Every executor steps a group through ``step_group`` and lists and loads the state
through ``entries`` and ``load`` (`zero.functional.adapters.face.Executor`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from zero.functional.adapters.face import Entry
from zero.functional.adapters.nonfinite import StepGuard, all_finite
from zero.functional.adapters.state_names import MASTER_KEY, STEP, StateNames, per_param

__all__ = ["EXECUTORS", "GroupExecutor", "LocalExecutor", "storage_kind", "executor_for", "load_sets",
           "same_value"]

# The sharded-storage types zero steps, by qualified name (the names torch 2.x has used), and the
# module whose ``executor(optimizer)`` steps them.
EXECUTORS = {"torch.distributed.tensor.DTensor": "zero.backends.fsdp2",
             "torch.distributed.tensor._api.DTensor": "zero.backends.fsdp2",
             "torch.distributed._tensor.api.DTensor": "zero.backends.fsdp2"}

Run = Callable[[tuple[int, ...], list[torch.Tensor], list[torch.Tensor]], None]


class GroupExecutor(Protocol):
    """Steps one param group: ``step_group(k, idx, params, grads, run)`` calls ``run(keep,
    leaves, grads)`` once, with the plain tensors this rank steps of group ``k``'s params at
    positions ``idx`` (``keep``: their positions), inside the `zero.functional.sharding` answers
    that make the rule's whole-tensor quantities exact, and writes the results back; and lists
    and loads the state (`zero.functional.adapters.face.Executor`)."""

    guard: StepGuard  # the collective half of a step's start (`OptimizerFace.begin_step`)

    def step_group(self, k: int, idx: tuple[int, ...], params: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor], run: Run) -> None: ...

    def entries(self, saving: bool = True) -> Iterator[Entry]: ...

    def load(self, entries: dict[int, dict[str, Any]], groups: list[dict]) -> None: ...


class LocalExecutor:
    """Plain tensors: each group's rule steps them as they are, and their state is the rule's.
    One process: its check-in is its own, and it is its own guard (`StepGuard`)."""

    layout_key = None  # the state is every param's: it loads anywhere

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    @property
    def guard(self) -> LocalExecutor:
        return self

    def local_nonfinite(self) -> bool:
        return not all_finite([p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None])

    def check_in(self, flag: int) -> Callable[[], list[list[int]]]:
        return lambda: [[flag]]

    def flagged_names(self) -> list[str]:
        opt, out = self.optimizer, []
        for t, p in enumerate(opt.all_params()):
            if p.grad is not None and not all_finite([p.grad]):
                out.append(opt.label(t))
        return out

    def where(self, ranks: list[int]) -> str:
        return "in this process's gradients"

    def step_group(self, k: int, idx: tuple[int, ...], params: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor], run: Run) -> None:
        run(idx, list(params), list(grads))

    def entries(self, saving: bool = True) -> Iterator[Entry]:
        opt, first = self.optimizer, 0
        for k, group in enumerate(opt.param_groups):
            opt.ensure_state(k, tuple(i for i, p in enumerate(group["params"]) if p.requires_grad))
            sets = opt.set_states_of(k)
            for idx in sets.sets():
                for i, key, _, value in per_param(sets.named(idx, opt.names_of(k, idx)), idx):
                    yield first + i, key, value
            first += len(group["params"])

    def load(self, entries: dict[int, dict[str, Any]], groups: list[dict]) -> None:
        load_sets(self.optimizer, entries, self.optimizer.ensure_state)


def load_sets(optimizer: Any, entries: dict[int, dict[str, Any]], start: Callable[[int, tuple[int, ...]], Any],
              into: Callable[[int, int, str, Any, Any], Any] | None = None) -> None:
    """Load ``entries`` (by position across the groups) into a `zero.functional.Optimizer`'s sets,
    leaf by leaf. Trainable params with saved entries and no state here start one first
    (``start(k, idx)``, as a step would start it, stepped together); a set of
    which no param has a saved entry starts afresh, as torch's empty state does. ``into(t, pos, key,
    leaf, saved)`` loads one saved value into a leaf (by default: in place for tensors with
    dimensions, checked by shape).
    """
    opt, first = optimizer, 0
    for k, group in enumerate(opt.param_groups):
        n = len(group["params"])
        sets = opt.set_states_of(k)
        saved = [i for i in range(n) if entries.get(first + i) and group["params"][i].requires_grad]
        fresh = tuple(i for i in saved if not sets.owns(i))
        if fresh:
            start(k, fresh)
        for idx in sets.sets():
            got = [entries.get(first + i) or {} for i in idx]
            if not any(got):
                sets.forget(idx)
                continue
            missing = [opt.label(first + i) for i, g in zip(idx, got) if not g]
            if missing:
                raise ValueError(f"the state dict has no state for {missing[:5]}, which this optimizer steps together "
                                 f"with {opt.label(first + idx[0])}: it was saved before they had state, or for "
                                 "other params")
            asked: set[str] = set()
            sets.load(idx, opt.names_of(k, idx), _filler(opt, first, idx, got, into, sets.names, asked))
            _check_all_taken(opt, first, idx, got, asked)
        first += n


def _check_all_taken(opt: Any, first: int, idx: tuple[int, ...], got: list[dict], asked: set[str]) -> None:
    """A saved entry the rule does not keep would be dropped: a ``ValueError`` naming it."""
    for i, saved in zip(idx, got):
        extra = sorted(k for k in saved if k not in asked and k != MASTER_KEY)  # (masters: their executor's)
        if extra:
            raise ValueError(f"the state dict's {extra[:4]} for {opt.label(first + i)}, which "
                             f"{opt.rule_label(first + i)} does not keep: it was saved by another rule or optimizer")


def _filler(opt: Any, first: int, idx: tuple[int, ...], got: list[dict], into: Any, names: StateNames,
            asked: set[str]) -> Any:
    def fill(key: str, pos: int | None, leaf: Any) -> Any:
        asked.add(key)
        at = range(len(idx)) if pos is None else (pos,)
        if isinstance(leaf, torch.Tensor) and leaf.dim() and not leaf.numel() and key not in got[at[0]]:
            return leaf  # no element of it here (a rank's empty part of a param): nothing to load or save
        if all(key not in got[j] for j in at) and names.assumed(key) is not None:
            return names.assumed(key)
        for j in at:
            if key not in got[j]:
                raise ValueError(f"the state dict has no {key!r} for {opt.label(first + idx[j])} (it has "
                                 f"{sorted(got[j])}): it was saved by another rule or optimizer "
                                 f"than {opt.rule_label(first + idx[j])}")
        value = got[at[0]][key]
        for j in at[1:]:
            if not same_value(got[j][key], value):
                raise ValueError(f"the state dict's {key!r} is {_shown(value)} for {opt.label(first + idx[at[0]])} and "
                                 f"{_shown(got[j][key])} for {opt.label(first + idx[j])}, which this rule keeps as one "
                                 f"(their set's{' step count' if key == STEP else ''}): step them in separate "
                                 "param groups to keep them apart")
        t = first + idx[at[0]]
        return into(t, pos, key, leaf, value) if into is not None else load_leaf(leaf, value, opt.label(t), key)
    return fill


def load_leaf(leaf: Any, value: Any, label: str, key: str) -> Any:
    """``value`` loaded into ``leaf``: copied in (unless it is that memory) for a tensor with
    dimensions, whose shape must match; a 0-d or other value taken as it is, on the leaf's device."""
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
        if not isinstance(value, torch.Tensor) or value.shape != leaf.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"the state dict's {key!r} of {label} has shape {got}, the state here "
                             f"{tuple(leaf.shape)}")
        if value.data_ptr() != leaf.data_ptr() or value.stride() != leaf.stride():
            leaf.copy_(value)
        return leaf
    if isinstance(leaf, torch.Tensor) and isinstance(value, (torch.Tensor, int, float)):
        return torch.as_tensor(value).to(dtype=leaf.dtype, device=leaf.device, copy=True)
    return value


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and bool(torch.equal(a.to(b.device, b.dtype), b))
    return a == b


def _shown(value: Any) -> str:
    return repr(value.item()) if isinstance(value, torch.Tensor) and value.numel() == 1 else type(value).__name__


def storage_kind(param: torch.Tensor) -> str | None:
    """The `EXECUTORS` key ``param``'s type is (or derives from), None for a plain tensor."""
    for cls in type(param).__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in EXECUTORS:
            return name
    return None


def executor_for(optimizer: Any) -> GroupExecutor:
    """The executor of ``optimizer``'s params (a `zero.functional.Optimizer`): `LocalExecutor`
    for plain tensors. Plain and sharded params in one optimizer are a ``ValueError`` naming one of
    each: a plain param on every rank would count once per rank in a whole-model norm."""
    kinds: dict[str | None, str] = {}
    for k, group in enumerate(optimizer.param_groups):
        names = group.get("param_names") or [f"param_groups[{k}]['params'][{i}]" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"]):
            kinds.setdefault(storage_kind(p), name)
    if not kinds or (None in kinds and len(kinds) == 1):  # (no params: a rank's local optimizer may hold none)
        return LocalExecutor(optimizer)
    if None in kinds:
        sharded = next(n for kind, n in kinds.items() if kind is not None)
        raise ValueError(f"zero.functional.Optimizer got plain param {kinds[None]!r} beside sharded param {sharded!r} "
                         "(a DTensor): shard every param the optimizer steps (fully_shard the root module too), or "
                         "step the plain ones with another optimizer")
    modules = {EXECUTORS[kind] for kind in kinds}
    if len(modules) > 1:
        raise ValueError(f"zero.functional.Optimizer got params of several sharded kinds: {sorted(kinds)}")
    return importlib.import_module(modules.pop()).executor(optimizer, **optimizer.executor_options())
