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

import inspect
import operator
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch

from zero.functional import sharding
from zero.functional.base import GradientTransformation, inplace_step, tree_map
from zero.functional.combine import chain
from zero.functional.inject import inject_hyperparams
from zero.functional.kernels.chains import Path, explain

__all__ = ["Optimizer", "FunctionalOptimizer", "hyperparams_of", "with_group_hyperparams", "from_factory",
           "rule_name", "check_not_optax", "split_state", "map_state_leaves", "state_leaves"]


def rule_name(tx: GradientTransformation) -> str:
    """What ``tx`` is, named as its factory is called (``zero.functional.adamw``,
    ``zero.functional.contrib.muon``; an injected alias by the alias; others by their spec)."""
    spec = getattr(tx, "spec", None)
    if spec is None:
        return "a zero.functional transformation built by hand"
    source = spec.args.get("source") if spec.name == "inject_hyperparams" else None
    factory = source[0] if source else spec.factory
    if factory is None:
        return f"zero.functional.{spec.name}"
    module = getattr(factory, "__module__", "") or ""
    where = "zero.functional.contrib" if ".contrib" in module else "zero.functional"
    return f"{where}.{factory.__name__}" if module.startswith("zero.functional") else factory.__name__


def hyperparams_of(tx: GradientTransformation) -> dict[str, float]:
    """The torch-group view (``lr`` ...) of the hyperparameters ``tx`` keeps in its state
    (those of `inject_hyperparams`, read from its spec; none for other transformations)."""
    spec = getattr(tx, "spec", None)
    if spec is None or spec.name not in ("inject_hyperparams", "from_optax"):
        return {}
    return {_group_key(k): v for k, v in spec.args["hyperparams"].items()}


def with_group_hyperparams(tx: Any, who: str = "tx") -> GradientTransformation:
    """``tx`` in the form whose hyperparameters param groups and lr schedulers can set.

    An alias (``zero.functional.sgd(0.1)`` ...) is rebuilt under `inject_hyperparams` with the
    same arguments, so it steps the same; a transformation that already keeps its hyperparameters
    in its state is returned as it is, and so is one that has none to offer. An Optax object is a
    ``TypeError`` saying to wrap it with `from_optax`.
    """
    check_not_optax(tx, who)
    if not hasattr(tx, "init") or not hasattr(tx, "update"):
        raise TypeError(f"{who} must be a zero.functional GradientTransformation, got {type(tx).__name__}")
    spec = getattr(tx, "spec", None)
    if spec is not None and spec.factory is not None:
        return _injected(spec.factory, spec.args)
    if spec is not None and spec.name == "chain":
        return _chain_with_group_hyperparams(tx, who)
    return tx


def _injected(factory: Any, args: dict) -> GradientTransformation:
    """``factory(**args)`` with its numeric arguments kept in the state, in float64 (which holds a
    Python float exactly: torch keeps group settings as Python numbers, and a float kept in the
    params' dtype would round: bf16 makes ``b2=0.999`` 1.0). A mask (or Muon's dimension numbers)
    is a function of the params, not a schedule of the step, and a block size shapes the state:
    they stay fixed."""
    fixed = [k for k in args if "mask" in k or "dimension_numbers" in k or k == "block_size"]
    return inject_hyperparams(factory, static_args=fixed, hyperparam_dtype=torch.float64)(**args)


def from_factory(factory: Any, kwargs: dict, who: str = "optimizer_class") -> GradientTransformation:
    """``factory(**kwargs)`` in the form whose hyperparameters param groups set: the same
    transformation, by the same route, as `with_group_hyperparams` makes of the built
    ``factory(**kwargs)`` (a `zero.functional` alias is built, then rebuilt from its spec); a
    factory of your own is injected with the same settings. So ``ZeroRedundancyOptimizer(params,
    F.adamw, learning_rate=...)`` and ``ZeroRedundancyOptimizer(params, F.adamw(...))`` step alike."""
    check_not_optax(factory, who)
    signature = inspect.signature(factory)
    try:
        bound = signature.bind(**kwargs)
    except TypeError as e:
        raise TypeError(f"{who} {getattr(factory, '__name__', factory)!r}: {e}") from None
    tx = factory(**kwargs)
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"{who} {factory!r} returned {type(tx).__name__}, not a GradientTransformation")
    if tx.spec is not None and tx.spec.factory is not None:
        return with_group_hyperparams(tx, who)
    bound.apply_defaults()
    return _injected(factory, dict(bound.arguments))


_RATES = ("learning_rate", "lr")


def _chain_with_group_hyperparams(tx: GradientTransformation, who: str) -> GradientTransformation:
    """A chain whose one link has a learning rate (an alias, `from_torch`, `inject_hyperparams`,
    in nested chains too) rebuilt so that link's hyperparameters are the group's (``lr`` ...), as
    ``inject_hyperparams(lambda learning_rate: chain(..., adamw(learning_rate), ...))`` would:
    torch's lr schedulers then drive it. Several such links: a ``ValueError`` saying how to choose."""
    rated = _rated_links(tx.spec.links, ())
    if not rated:
        return tx
    if len(rated) > 1:
        names = ", ".join(f"link {'.'.join(map(str, path))} ({name})" for path, name, _, _ in rated)
        raise ValueError(f"{who} is a chain with a learning rate in more than one link ({names}), so a param "
                         "group's lr cannot say which it sets; name the one a scheduler drives yourself: inject_"
                         "hyperparams(lambda learning_rate: chain(..., adamw(learning_rate), ...))(learning_rate=...)")
    path, _, factory, args = rated[0]

    def rebuilt(**hyperparams: Any) -> GradientTransformation:
        return _with_link(tx, path, factory(**hyperparams))

    rebuilt.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in args])
    rebuilt.__name__ = f"chain around {factory.__name__}"
    return _injected(rebuilt, args)


def _rated_links(links: tuple, at: tuple[int, ...]) -> list[tuple[tuple[int, ...], str, Any, dict]]:
    """``(path, name, factory, args)`` of each link that can be rebuilt with a learning rate."""
    out = []
    for i, link in enumerate(links):
        spec = getattr(link, "spec", None)
        if spec is None:
            continue
        source = (spec.factory, spec.args) if spec.factory is not None else spec.args.get("source")
        if source is not None and any(k in source[1] for k in _RATES):
            name = spec.name if spec.factory is not None else f"inject_hyperparams({source[0].__name__})"
            out.append((at + (i,), name, *source))
        elif spec.name == "chain":
            out += _rated_links(spec.links, at + (i,))
    return out


def _with_link(tx: GradientTransformation, path: tuple[int, ...], link: Any) -> GradientTransformation:
    """The chain ``tx`` with the link at ``path`` (through nested chains) replaced by ``link``."""
    links = list(tx.spec.links)
    links[path[0]] = link if len(path) == 1 else _with_link(links[path[0]], path[1:], link)
    return chain(*links)


def check_not_optax(obj: Any, who: str) -> None:
    """``TypeError`` for an Optax transformation or factory where a zero.functional one is needed."""
    module = getattr(obj, "__module__", "") or ""
    if module.split(".")[0] != "optax" and type(obj).__module__.split(".")[0] != "optax":
        return
    if hasattr(obj, "init") and hasattr(obj, "update"):
        raise TypeError(f"{who} is an Optax transformation ({type(obj).__name__}), which steps JAX arrays: "
                        f"wrap it as zero.functional.from_optax({who}) to run it on torch tensors")
    name = getattr(obj, "__name__", "factory")
    raise TypeError(f"{who} is Optax's {name}, which builds transformations of JAX arrays: pass "
                    f"zero.functional.from_optax(optax.{name}(...)), or zero.functional's own {name} if it has one")


def _group_key(name: str) -> str:
    return "lr" if name == "learning_rate" else name


def _check_group_settings(group: dict, known: dict, index: int) -> None:
    """A group setting that looks like a hyperparameter the transformation does not keep would be
    ignored: that is an error, naming it (other keys, e.g. a group's name, are left alone)."""
    ignored = sorted(k for k, v in group.items() if k not in ("params", "tx") and k not in known
                     and _looks_like_hyperparameter(v))
    if ignored:
        offer = f"its hyperparameters are {sorted(known)}" if known else "it keeps none in its state"
        raise ValueError(f"param group {index} sets {ignored}, which its transformation would ignore: {offer}. "
                         "Build it with zero.functional.inject_hyperparams(factory)(...) (or an alias, or "
                         "optax.inject_hyperparams inside from_optax) to make a setting per group")


def _looks_like_hyperparameter(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_looks_like_hyperparameter(v) for v in value)
    return isinstance(value, (bool, int, float, torch.Tensor))


def _sync_hyperparams(state: Any, group: dict) -> Any:
    """Copy the group's values (set by the user or an lr scheduler) into an injected state:
    ours (floats) or Optax's through `from_optax` (0-d tensors, kept in their dtype)."""
    hyperparams = getattr(state, "hyperparams", None)
    if not isinstance(hyperparams, dict) or not hasattr(state, "_replace"):
        return state
    for k in getattr(state, "hyperparams_states", None) or {}:  # each step's value comes from its schedule
        key = _group_key(k)
        if key in group and float(group[key]) != float(hyperparams[k]):
            raise ValueError(f"the param group's {key!r} was set to {group[key]!r}, but {k} follows the "
                             f"transformation's own schedule (now {float(hyperparams[k])!r}), which would ignore "
                             f"it: give {k} as a number to let torch's lr schedulers (or you) set it, or drop them")
    hp = {k: _like(v, group.get(_group_key(k), v)) for k, v in hyperparams.items()}
    return state._replace(hyperparams=hp)


def _show_scheduled(state: Any, group: dict) -> None:
    """After a step, a scheduled hyperparameter's value in its group (``lr`` as it is now)."""
    for k in getattr(state, "hyperparams_states", None) or {}:
        if _group_key(k) in group:
            group[_group_key(k)] = float(state.hyperparams[k])


def _like(old: Any, value: Any) -> Any:
    if isinstance(old, torch.Tensor):
        return torch.as_tensor(value, dtype=old.dtype, device=old.device)
    return float(value)


def split_state(state: Any, n: int, parts: list[list[int]]) -> list[Any]:
    """Cut the state of a transformation initialised on ``n`` params into one state per part.

    Per-param entries are the lists of length ``n`` (a state mirrors the params list it was made
    for); everything else (step counts, hyperparameters) is copied into every part, tensors cloned
    so that the parts step independently. Meaningful only for rules that treat params alone.
    """
    def cut(node: Any, part: list[int]) -> Any:
        if isinstance(node, list) and len(node) == n:
            return [node[i] for i in part]
        if isinstance(node, tuple):
            items = [cut(x, part) for x in node]
            return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
        if isinstance(node, dict):
            return {k: cut(v, part) for k, v in node.items()}
        return node.clone() if isinstance(node, torch.Tensor) else node
    return [cut(state, part) for part in parts]


def map_state_leaves(state: Any, n: int, fn: Any, names: list[str] | None = None) -> Any:
    """``state`` (of a transformation initialised on ``n`` params) with each leaf replaced by
    ``fn(key, position, leaf)``: ``key`` is the leaf's path, dotted (NamedTuple fields by name);
    ``position`` the index of the param a per-param leaf belongs to (the lists of length ``n``,
    as `split_state` reads them, or with ``names`` the dicts by those names), None for leaves the
    params share (counts, hyperparameters)."""
    def walk(node: Any, path: tuple[str, ...], pos: int | None) -> Any:
        if isinstance(node, list) and len(node) == n and pos is None:
            return [walk(x, path, i) for i, x in enumerate(node)]
        if names is not None and isinstance(node, dict) and pos is None and set(node) == set(names):
            return {k: walk(x, path, names.index(k)) for k, x in node.items()}
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*[walk(x, path + (f,), pos) for f, x in zip(node._fields, node)])
        if isinstance(node, (tuple, list)):
            return type(node)(walk(x, path + (str(i),), pos) for i, x in enumerate(node))
        if isinstance(node, dict):
            return {k: walk(x, path + (str(k),), pos) for k, x in node.items()}
        return fn(".".join(path) or "state", pos, node)
    return walk(state, (), None)


def state_leaves(state: Any, n: int, names: list[str] | None = None) -> list[tuple[str, int | None, Any]]:
    """``(key, position, leaf)`` of every leaf of ``state``, as `map_state_leaves` names them."""
    out: list[tuple[str, int | None, Any]] = []
    map_state_leaves(state, n, lambda key, pos, leaf: out.append((key, pos, leaf)), names)
    return out


def as_tree(params: list, names: list[str] | None) -> Any:
    """The tree a transformation steps: the list of params, or a dict by name when named."""
    return params if names is None else dict(zip(names, params))


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
            state = _sync_hyperparams(state, group)
        # the leaves reach the transformation in the tree's order (a dict's sorted by name)
        tree = as_tree(params, names)
        with sharding.stepping(tree):
            self.states[idx] = inplace_step(self.tx, tree, as_tree(grads, names), state, leaves=params)
        if group is not None:
            _show_scheduled(self.states[idx], group)

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
        if isinstance(params, torch.nn.Module):  # torch keeps the names of (name, param) pairs
            params = list(params.named_parameters())
        super().__init__(params, hyperparams_of(self._default_tx))

    def add_param_group(self, param_group: dict) -> None:
        param_group = dict(param_group)
        tx = with_group_hyperparams(param_group.pop("tx", self._default_tx), "a param group's 'tx'")
        known = hyperparams_of(tx)
        _check_group_settings(param_group, known, len(self.param_groups))
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
        for k, (group, states) in enumerate(zip(self.param_groups, self._states)):
            every = [p.grad for p in group["params"]]
            idx = tuple(i for i, g in enumerate(every) if g is not None)
            if idx or sharding.every_group():  # sharded rules make collectives: every rank steps every group
                params = [group["params"][i] for i in idx]
                grads = [every[i] for i in idx]
                if any(map(_SPARSE, grads)):
                    raise ValueError("zero.functional.Optimizer does not support sparse gradients")
                states.step(idx, params, grads, group, self.names_of(k, idx))
        self._steps += 1
        self._report_guards()
        return loss

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

    def ensure_state(self, k: int, idx: tuple[int, ...]) -> None:
        """Give group ``k``'s params at positions ``idx`` the state they start from, stepped
        together, unless they have state (a checkpoint then loads into it in place)."""
        states = self._states[k]
        if idx and not any(i in states._owner for i in idx):
            params = [self.param_groups[k]["params"][i] for i in idx]
            states.states[idx] = states.tx.init(as_tree(params, self.names_of(k, idx)))
            states._owner.update(dict.fromkeys(idx, idx))

    def set_states(self, k: int) -> dict[tuple[int, ...], Any]:
        """Group ``k``'s states, by the positions of the params stepped together (writable)."""
        return self._states[k].states

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["tx_states"] = [dict(s.states) for s in self._states]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "tx_states" not in state_dict or len(state_dict["tx_states"]) != len(self.param_groups):
            raise ValueError("state_dict was not saved by a zero.functional.Optimizer with "
                             f"{len(self.param_groups)} param groups")
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
