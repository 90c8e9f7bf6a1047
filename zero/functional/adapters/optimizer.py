"""Running a transformation as a stateful torch optimizer.

`Optimizer` is a real ``torch.optim.Optimizer`` (param groups, closures, ``zero_grad``, state
dicts, lr schedulers); `FunctionalOptimizer` is the ``step(gradients)`` form that DDP comm hooks
call one bucket at a time, like torch's private ``_FunctionalAdam`` family but for any
transformation.

A param group built from named params (``model.named_parameters()``, as torch takes them) gives
the transformation its params as a dict by name, so masks and labels can be written by name, as
on the pure path: ``masked(tx, lambda tree: {n: not n.endswith("bias") for n in tree})``.

Both keep one transformation state per *set of parameters stepped together*: a group's params
that have gradients, or one DDP bucket. The sets repeat every iteration, so each state sees the
same params every step, and params that never get a gradient (frozen ones) never get state, as
in torch. A param that turns up in two different sets is an error, not a silent state split,
unless the transformation is declared per param (``FunctionalOptimizer(per_param=True)``, for
torch's rules): then the earlier set's state is split (`split_state`) and each part steps alone.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch

from zero.functional import sharding
from zero.functional.adapters.group_settings import (
    check_group_settings,
    hyperparams_of,
    show_scheduled,
    sync_hyperparams,
    with_group_hyperparams,
)
from zero.functional.adapters.sharded_storage import executor_for
from zero.functional.adapters.state_tree import as_tree, split_state
from zero.functional.base import GradientTransformation, inplace_step, tree_map
from zero.functional.kernels.chains import Path, explain

__all__ = ["Optimizer", "FunctionalOptimizer"]


def _check_names(group: dict, index: int) -> None:
    names = group.get("param_names")
    if names is not None and len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"param group {index} names {twice} more than once: a transformation steps a group's "
                         "params as a dict by name, so each name must be unique in its group")


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


class _StatesBySet:
    """Transformation states keyed by the tuple of param indices stepped together."""

    def __init__(self, tx: GradientTransformation, per_param: bool = False):
        self.tx, self.per_param = tx, per_param
        self.guarded: bool | None = None  # whether the states hold an apply_if_finite's (see guard_reports)
        self.max_errors = _max_errors(tx)
        self.states: dict[tuple[int, ...], Any] = {}
        self._owner: dict[int, tuple[int, ...]] = {}

    def step(self, idx: tuple[int, ...], params: list, grads: list, group: dict | None = None,
             names: list[str] | None = None) -> None:
        if idx in self.states or not any(i in self._owner for i in idx):
            return self._step(idx, params, grads, group, names)
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
            self._step(block, [params[where[i]] for i in block], [grads[where[i]] for i in block], group, None)

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
              names: list[str] | None) -> None:
        state = self.states.get(idx)
        if state is None:
            state = self.tx.init(as_tree(params, names))
            self._owner.update(dict.fromkeys(idx, idx))
        if group is not None:
            state = sync_hyperparams(state, group)
        # the leaves reach the transformation in the tree's order (a dict's sorted by name)
        tree = as_tree(params, names)
        with sharding.stepping(tree):
            self.states[idx] = inplace_step(self.tx, tree, as_tree(grads, names), state, leaves=params)
        if group is not None:
            show_scheduled(self.states[idx], group)

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


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that steps params with a `GradientTransformation`.

    ``params`` are tensors, ``(name, tensor)`` pairs, param-group dicts (a group may carry its own
    ``"tx"``) or an ``nn.Module`` (its named params, one group). When a
    transformation keeps hyperparameters in its state (`inject_hyperparams`, `from_torch`), they
    appear as group keys (``learning_rate`` as ``lr``) and changes to the group, e.g. by a
    ``torch.optim.lr_scheduler``, take effect at the next step.
    """

    def __init__(self, params: Iterable, tx: GradientTransformation, *, per_param: bool = False):
        self._default_tx = with_group_hyperparams(tx)
        self._steps = 0  # step() calls
        self.skipped_steps = 0  # steps an apply_if_finite in the transformation skipped
        self._states: list[_StatesBySet] = []
        self._per_param = per_param  # see FunctionalOptimizer: params may step in changing sets
        self._executor: Any = None  # what steps sharded params (FSDP2's DTensors), found at the first step
        if isinstance(params, torch.nn.Module):  # torch keeps the names of (name, param) pairs
            params = list(params.named_parameters())
        super().__init__(params, hyperparams_of(self._default_tx))

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_executor", None):
            raise ValueError("add_param_group after the first step of sharded params (FSDP2's): their plan, made at "
                             "the first step, places every group's params; build the optimizer with every group")
        param_group = dict(param_group)
        tx = with_group_hyperparams(param_group.pop("tx", self._default_tx), "a param group's 'tx'")
        known = hyperparams_of(tx)
        check_group_settings(param_group, known, len(self.param_groups))
        for key, value in known.items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)  # torch reads names off (name, param) pairs
        _check_names(self.param_groups[-1], len(self.param_groups) - 1)
        self._states.append(_StatesBySet(tx, self._per_param))

    # torch.compile(opt.step) runs the step eagerly (its kernels are torch's fused ones): traced,
    # its Python bookkeeping breaks the graph, and dynamo then mistakes the state's 0-d
    # hyperparameter tensors for data-dependent scalars. Compile `tx.update` for a compiled step.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        executor = self.executor
        for k, (group, states) in enumerate(zip(self.param_groups, self._states)):
            every = [p.grad for p in group["params"]]
            idx = tuple(i for i, g in enumerate(every) if g is not None)
            if idx or sharding.every_group():  # sharded rules make collectives: every rank steps every group
                params = [group["params"][i] for i in idx]
                grads = [every[i] for i in idx]
                if any(map(_SPARSE, grads)):
                    raise ValueError("zero.functional.Optimizer does not support sparse gradients")
                if executor is None:
                    states.step(idx, params, grads, group, self.names_of(k, idx))
                else:
                    executor.step_group(k, idx, params, grads, lambda keep, leaves, gs, k=k, group=group, states=states:
                                        states.step(keep, leaves, gs, group, self.names_of(k, keep)))
        self._steps += 1
        self._report_guards()
        return loss

    @property
    def executor(self) -> Any:
        """What steps this optimizer's params when they are sharded storage (FSDP2's DTensors:
        `zero.functional.adapters.sharded_storage`), None for plain tensors. Found at the first
        step, after every ``add_param_group``."""
        if self._executor is None and self._steps == 0:
            self._executor = executor_for(self) or False
        return self._executor or None

    def _report_guards(self) -> None:
        """An ``apply_if_finite`` that met NaN or inf in this step says so: a warning, and
        `skipped_steps` counts the steps it skipped."""
        reports = [r for states in self._states for r in states.guard_reports()]
        if not reports:
            return
        consecutive, total, applied = max(reports)
        if applied:
            what = (f"stepped anyway: {consecutive} steps in a row held them, more than its max_consecutive_errors "
                    "allows")
        else:
            self.skipped_steps += 1
            what = f"skipped it ({consecutive} in a row, {total} in all; optimizer.skipped_steps counts them)"
        warnings.warn(f"step {self._steps}: apply_if_finite found NaN or inf in the updates and {what}",
                      RuntimeWarning, stacklevel=2)

    def rule(self, k: int) -> GradientTransformation:
        """The transformation group ``k`` steps with (as it runs: its hyperparameters injected)."""
        return self._states[k].tx

    def names_of(self, k: int, idx: tuple[int, ...]) -> list[str] | None:
        """The names group ``k``'s params at ``idx`` have in the tree the transformation steps,
        or None (a list): names come from named params, and not under ``per_param``, whose
        states split by position."""
        names = self.param_groups[k].get("param_names")
        return None if names is None or self._per_param else [names[i] for i in idx]

    @property
    def path(self) -> list[Path]:
        """Per param group, what its step runs (`zero.functional.explain`): the kernel and its
        calls, or the link that keeps the transformation on the pure path."""
        trainable = [p.requires_grad for g in self.param_groups for p in g["params"]]
        return self.explain_groups(trainable.__getitem__)

    def explain_groups(self, trainable: Callable[[int], bool]) -> list[Path]:
        """`path` for the params ``trainable(position)`` says step (positions across the groups):
        a sharded optimizer's local tensors, its shards and masters, need no ``requires_grad``."""
        out, at = [], 0
        for k, (group, states) in enumerate(zip(self.param_groups, self._states)):
            idx = tuple(i for i in range(len(group["params"])) if trainable(at + i))
            at += len(group["params"])
            out.append(explain(states.tx, as_tree([group["params"][i] for i in idx], self.names_of(k, idx))))
        return out

    def ensure_state(self, k: int, idx: tuple[int, ...], leaves: list[torch.Tensor] | None = None) -> None:
        """Give group ``k``'s params at positions ``idx`` the state they start from, stepped
        together, unless they have state (a checkpoint then loads into it in place). ``leaves``:
        the tensors a step hands the rule for them (sharded params': this rank's pieces and the
        whole tensors it owns), by default the params."""
        states = self._states[k]
        if idx and not any(i in states._owner for i in idx):
            params = leaves if leaves is not None else [self.param_groups[k]["params"][i] for i in idx]
            states.states[idx] = states.tx.init(as_tree(params, self.names_of(k, idx)))
            states._owner.update(dict.fromkeys(idx, idx))

    def set_states(self, k: int) -> dict[tuple[int, ...], Any]:
        """Group ``k``'s states, by the positions of the params stepped together (writable)."""
        return self._states[k].states

    def state_nbytes(self) -> int:
        """Bytes of the rule's state tensors on this rank, its 0-d counts and scalars left out:
        what a plan's ``state_bytes`` counts for a `zero.functional` rule (`zero.plans.costs`)."""
        return sum(t.nbytes for s in self._states for state in s.states.values() for t in optree.tree_leaves(state)
                   if isinstance(t, torch.Tensor) and t.ndim)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["tx_states"] = [dict(s.states) for s in self._states]
        if self.executor is not None:  # sharded params: the states are this rank's pieces, by its plan
            sd["sharded_layout"] = self.executor.layout_key
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "tx_states" not in state_dict or len(state_dict["tx_states"]) != len(self.param_groups):
            raise ValueError("state_dict was not saved by a zero.functional.Optimizer with "
                             f"{len(self.param_groups)} param groups")
        self._check_layout(state_dict.get("sharded_layout"))
        for k, (states, saved) in enumerate(zip(self._states, state_dict["tx_states"])):
            injected = bool(hyperparams_of(states.tx))
            if any(injected != isinstance(getattr(s, "hyperparams", None), dict) for s in saved.values()):
                raise ValueError(f"param group {k}'s saved transformation state does not fit its transformation "
                                 f"({'with' if injected else 'without'} injected hyperparameters): it was saved "
                                 "with another transformation, or by a zero older than the per-group settings")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "tx_states"})
        for group, states, saved in zip(self.param_groups, self._states, state_dict["tx_states"]):
            states.states, states._owner = {}, {}
            for idx, state in saved.items():
                device = group["params"][idx[0]].device
                states.states[idx] = tree_map(lambda x, d=device: _to_device(x, d), state)
                states._owner.update(dict.fromkeys(idx, idx))


    def _check_layout(self, saved: Any) -> None:
        """A state of sharded params loads only into the same rank of the same plan: its tensors
        are that rank's pieces (and the whole tensors it owned)."""
        here = None if self.executor is None else self.executor.layout_key
        if saved != here:
            raise ValueError(f"this state_dict holds the optimizer state of {saved or 'plain params'}, and this "
                             f"optimizer steps {here or 'plain params'}: a sharded optimizer's state_dict loads only "
                             "into the same rank of the same layout (the same model, mesh and rules)")


_SPARSE = operator.attrgetter("is_sparse")


def _to_device(x: Any, device: torch.device) -> Any:
    """Per-param state follows its param's device; 0-d counters stay on the CPU, as created."""
    if not isinstance(x, torch.Tensor):
        return x
    return x.to(device, copy=True) if x.dim() else x.clone()


class FunctionalOptimizer:
    """``step(gradients)`` over a fixed list of params: a ``None`` gradient skips that param.

    The form DDP comm hooks use: each bucket's step passes gradients for its params only.
    ``per_param=True`` declares that ``tx`` treats each param alone (as every ``torch.optim``
    rule and `from_torch` does): params may then miss a gradient on any step, as in torch, and
    their state does not advance while they do. Otherwise the set with gradients must repeat.
    """

    def __init__(self, params: list[torch.Tensor], tx: GradientTransformation, _allow_empty_param_list: bool = False,
                 *, per_param: bool = False):
        params = list(params)
        if not params and not _allow_empty_param_list:
            raise ValueError("FunctionalOptimizer got an empty parameter list")
        tx = with_group_hyperparams(tx)
        self.params = params
        self.param_group = {"params": params, **hyperparams_of(tx)}
        self._states = _StatesBySet(tx, per_param)

    @property
    def param_groups(self) -> list[dict]:
        return [self.param_group]

    @torch.no_grad()
    def step(self, gradients: list[torch.Tensor | None]) -> None:
        if len(gradients) != len(self.params):
            raise ValueError(f"step got {len(gradients)} gradients for {len(self.params)} params")
        idx = tuple(i for i, g in enumerate(gradients) if g is not None)
        if idx:
            self._states.step(idx, [self.params[i] for i in idx], [gradients[i] for i in idx], self.param_group)
