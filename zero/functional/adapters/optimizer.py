"""Running a transformation as a stateful torch optimizer.

`Optimizer` is a real ``torch.optim.Optimizer`` (param groups, closures, ``zero_grad``, state
dicts, lr schedulers); `FunctionalOptimizer` is the ``step(gradients)`` form that DDP comm hooks
call one bucket at a time, like torch's private ``_FunctionalAdam`` family but for any
transformation.

A param group built from named params (``model.named_parameters()``, as torch takes them) gives
the transformation its params as a dict by name, so masks and labels can be written by name, as
on the pure path: ``masked(tx, lambda tree: {n: not n.endswith("bias") for n in tree})``.

Both keep one transformation state per *set of parameters stepped together*
(`zero.functional.adapters.rule_states.SetStates`). `Optimizer` keeps torch's optimizer contract
(``state``, ``state_dict``, ``load_state_dict``, hooks) through
`zero.functional.adapters.face.OptimizerFace`, whatever steps its params (`executor_for`).
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable, Iterable
from itertools import compress, repeat
from typing import Any

import optree
import torch

from zero.functional import sharding
from zero.functional.adapters.closure_args import CLOSURE
from zero.functional.adapters.eval_mode import EvalMode
from zero.functional.adapters.executor import GroupExecutor, LocalExecutor, executor_for
from zero.functional.adapters.face import OptimizerFace
from zero.functional.adapters.group_settings import (
    check_group_settings,
    hyperparams_of,
    rule_name,
    settings_of,
    with_group_hyperparams,
)
from zero.functional.adapters.nonfinite import NonFinite
from zero.functional.adapters.rule_states import SetStates
from zero.functional.adapters.state_tree import as_tree
from zero.functional.base import GradientTransformation, tree_map, without_grad
from zero.functional.kernels.chains import Path, explain

__all__ = ["Optimizer", "FunctionalOptimizer"]


def _check_names(group: dict, index: int) -> None:
    names = group.get("param_names")
    if names is not None and len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"param group {index} names {twice} more than once: a transformation steps a group's "
                         "params as a dict by name, so each name must be unique in its group")


def eager_under_compile(method: Callable) -> Callable:
    """``torch.compiler.disable(method)`` for a call that is traced, and ``method`` itself for one
    that is not: the disabled wrapper costs about 1.5 us a call (torch 2.13, CPU) even when no
    compiler runs. Traced, the flag reads True, and the compiler meets the disabled wrapper: a
    graph break, the step run eagerly."""
    disabled = torch.compiler.disable(method)

    @functools.wraps(method)
    def step(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return method(*args, **kwargs)

    return step


class Optimizer(EvalMode, OptimizerFace):
    """A ``torch.optim.Optimizer`` that steps params with a `GradientTransformation`.

    ``params`` are tensors, ``(name, tensor)`` pairs, param-group dicts (a group may carry its own
    ``"tx"``) or an ``nn.Module`` (its named params, one group). When a
    transformation keeps hyperparameters in its state (`inject_hyperparams`, `from_torch`), they
    appear as group keys (``learning_rate`` as ``lr``) and changes to the group, e.g. by a
    ``torch.optim.lr_scheduler``, take effect at the next step; a rule that mirrors a
    ``torch.optim`` class (`from_torch`) keeps every group key that class keeps.

    torch's contract holds (`zero.functional.adapters.face`): ``state[p]`` is ``p``'s state,
    ``state_dict()`` and ``load_state_dict`` are torch's form, under torch's names for `from_torch`
    rules. Over FSDP2's DTensor params (`executor`: `zero.backends.fsdp2`) the state is each rank's
    pieces, as DTensors in the params' placements, started when the optimizer is built.

    ``nonfinite``: what a step does with gradients that hold NaN or inf (``"warn"``, ``"skip"``,
    ``"raise"``: `zero.functional.adapters.nonfinite`). By default ``"warn"`` over sharded params,
    whose step starts with the ranks' check-in anyway (each rank's flag rides in it; it also
    compares the ranks' settings, naming a rank whose ``lr`` differs), and unchecked over plain
    params, as in ``torch.optim`` (a check there would cost a pass over the gradients and a sync).

    ``train()`` / ``eval()`` (`zero.functional.adapters.eval_mode`): schedule-free rules'
    evaluation params swapped into the params and back, as ``schedulefree``'s optimizers do.
    """

    def __init__(self, params: Iterable, tx: GradientTransformation, *, per_param: bool = False,
                 nonfinite: str | None = None):
        self._default_tx = with_group_hyperparams(tx)
        self._steps = 0  # step() calls
        self.skipped_steps = 0  # steps an apply_if_finite in the transformation skipped
        self._states: list[SetStates] = []
        self._per_param = per_param  # see FunctionalOptimizer: params may step in changing sets
        self.executor: GroupExecutor | None = None  # made once the groups are in (by the params' kind)
        if isinstance(params, torch.nn.Module):  # torch keeps the names of (name, param) pairs
            params = list(params.named_parameters())
        super().__init__(params, settings_of(self._default_tx))
        self.executor = executor_for(self)
        sharded = not isinstance(self.executor, LocalExecutor)
        self.nonfinite = NonFinite(nonfinite if nonfinite is not None else "warn") \
            if nonfinite is not None or sharded else None

    def executor_options(self) -> dict[str, Any]:
        """What a sharded executor is built with (`executor_for`): none here; an optimizer that
        steps more itself says so (`zero.backends.fsdp2.ReplicaShardedOptimizer`: over HSDP's
        replicas too, with master weights)."""
        return {}

    def add_param_group(self, param_group: dict) -> None:
        if self.executor is not None and not isinstance(self.executor, LocalExecutor):
            raise ValueError("add_param_group on an optimizer of sharded params (FSDP2's): their plan, made when "
                             "the optimizer was built, places every group's params; build it with every group")
        param_group = dict(param_group)
        tx = with_group_hyperparams(param_group.pop("tx", self._default_tx), "a param group's 'tx'")
        known = settings_of(tx)
        check_group_settings(param_group, known, len(self.param_groups))
        for key, value in known.items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)  # torch reads names off (name, param) pairs
        _check_names(self.param_groups[-1], len(self.param_groups) - 1)
        self._states.append(SetStates(tx, self._per_param, len(self._states)))
        self.state_changed()

    # torch.compile(opt.step) runs the step eagerly (its kernels are torch's fused ones): traced,
    # its Python bookkeeping breaks the graph, and dynamo then mistakes the state's 0-d
    # hyperparameter tensors for data-dependent scalars. Compile `tx.update` for a compiled step.
    @eager_under_compile
    @without_grad
    def step(self, closure=None, **extra_args):
        """One step of every group's rule (torch's ``step(closure)``). ``extra_args`` reach rules
        that take them (Optax's ``update(..., value=loss)``: MoMo, a line search); a closure's loss
        is passed as ``value`` unless one is given, and a line search gets ``grad`` and ``value_fn``
        from it (its trials rerun the closure at other params, as ``torch.optim.LBFGS``'s do)."""
        self.check_training()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if loss is not None:
                extra_args.setdefault("value", loss.detach() if isinstance(loss, torch.Tensor) else loss)
                extra_args.setdefault(CLOSURE, closure)  # a line search's trials (`closure_args`)
        executor = self.executor
        skip, after = self.begin_step(executor.guard, self._steps + 1)
        if skip:
            self.skipped_steps += 1
            return loss
        for k, (group, states) in enumerate(zip(self.param_groups, self._states)):
            params = group["params"]
            grads = [p.grad for p in params]
            idx = tuple(compress(range(len(grads)), map(operator.is_not, grads, repeat(None))))
            if idx or sharding.every_group():  # sharded rules make collectives: every rank steps every group
                if len(idx) < len(grads):  # (else the group's own list: the executors read it, never keep it)
                    params, grads = [params[i] for i in idx], [grads[i] for i in idx]
                if any(map(_SPARSE, grads)):
                    raise ValueError("zero.functional.Optimizer does not support sparse gradients")
                executor.step_group(k, idx, params, grads, lambda keep, leaves, gs, k=k, group=group, states=states:
                                    states.step(keep, leaves, gs, group, self.names_of(k, keep), extra_args))
        self._steps += 1
        self.state_changed()
        after()
        self._report_guards()
        return loss

    @property
    def steps(self) -> int:
        """The steps taken (a step every rank skipped for NaN or inf is not one)."""
        return self._steps

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

    def label(self, t: int) -> str:
        """Param ``t`` (its position across the groups) as messages name it."""
        for g in self.param_groups:
            if t < len(g["params"]):
                names = g.get("param_names")
                return f"param {t} ({names[t]!r})" if names else f"param {t}"
            t -= len(g["params"])
        return f"param {t}"

    def rule_label(self, t: int) -> str:
        """The rule param ``t``'s group steps with, named as it was built."""
        for k, g in enumerate(self.param_groups):
            if t < len(g["params"]):
                return rule_name(self.rule(k))
            t -= len(g["params"])
        return "its rule"

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
        if idx and not any(states.owns(i) for i in idx):
            params = leaves if leaves is not None else [self.param_groups[k]["params"][i] for i in idx]
            states.start(idx, params, self.names_of(k, idx))
            self.state_changed()

    def set_states(self, k: int) -> dict[tuple[int, ...], Any]:
        """Group ``k``'s states, by the positions of the params stepped together (writable)."""
        return self._states[k].states

    def set_states_of(self, k: int) -> SetStates:
        """Group ``k``'s `SetStates` (its rule, its states by set)."""
        return self._states[k]

    def state_nbytes(self) -> int:
        """Bytes of the rule's state tensors on this rank, its 0-d counts and scalars left out:
        what a plan's ``state_bytes`` counts for a `zero.functional` rule (`zero.plans.costs`)."""
        return sum(t.nbytes for s in self._states for state in s.states.values() for t in optree.tree_leaves(state)
                   if isinstance(t, torch.Tensor) and t.ndim)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's form (`zero.functional.adapters.face.OptimizerFace.load_state_dict`); a dict of
        the earlier form (``tx_states``, the states as they were) loads onto plain params only."""
        if "tx_states" not in state_dict:
            return super().load_state_dict(state_dict)
        if not isinstance(self.executor, LocalExecutor) or len(state_dict["tx_states"]) != len(self.param_groups):
            raise ValueError("this state_dict is of the earlier zero.functional.Optimizer form (tx_states), which "
                             f"loads into an optimizer of plain params with {len(state_dict['tx_states'])} groups")
        for group, saved_group, states, saved in zip(self.param_groups, state_dict["param_groups"], self._states,
                                                     state_dict["tx_states"]):
            group.update({k: v for k, v in saved_group.items() if k not in ("params", "param_names")})
            states.clear()
            for idx, state in saved.items():
                device = group["params"][idx[0]].device
                states.adopt(idx, tree_map(lambda x, d=device: _to_device(x, d), state))
        self.state_changed()


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
        self._states = SetStates(tx, per_param)

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

