"""The transformation algebra of Optax, over pytrees of torch tensors.

A `GradientTransformation` is a pair of pure functions: ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``. Pytrees are handled by optree
(dicts, lists, tuples, NamedTuples, None as an empty subtree), so trees read as in JAX.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zero.functional.foreach import traced
from zero.functional.scalars import counter, value_of

__all__ = ["GradientTransformation", "Spec", "EmptyState", "identity", "stateless_tx", "set_to_zero", "stateless",
           "stateless_with_tree_map", "unscaled", "inplace_step", "step_in_place", "add_updates", "tree_map",
           "takes_extra_args",
           "update_with", "with_extra_args_support", "as_dtype", "step_count", "select",
           "flatten_like", "check_structure", "tree_leaves", "zeros_like", "full_like", "count_zero", "count_inc",
           "NO_PARAMS_MSG", "check_positive", "check_unit", "check_non_negative", "Schedule", "ScalarOrSchedule"]

# A schedule: step count (an int or a 0-d tensor; a tensor of counts, elementwise) -> hyperparameter value.
Schedule = Callable[[Any], Any]
ScalarOrSchedule = float | Schedule

NO_PARAMS_MSG = "this transformation needs the current params: call update(updates, state, params)"
_INT32_MAX = 2**31 - 1


class Spec(NamedTuple):
    """What a transformation is, as data: the factory that built it and the arguments it got.

    Combinators read specs instead of closures: `chain` looks for a fused kernel for its links
    (`zero.functional.kernels.fused`); `zero.functional.Optimizer` reads the hyperparameters of
    `inject_hyperparams` from its spec to show them as param-group keys, and rebuilds an alias
    (whose spec has its ``factory``) under `inject_hyperparams` so param groups can set them.
    """

    name: str
    args: dict[str, Any]
    factory: Callable[..., Any] | None = None  # rebuilds it: ``factory(**args)`` (the aliases)
    links: tuple = ()  # the transformations it runs in turn: a chain's, an alias's chain's


class _Fields(NamedTuple):
    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    inplace: Callable[[list, list, Any], Any] | None = None
    spec: Spec | None = None
    scaled: Callable[[float], Callable[..., tuple[Any, Any]]] | None = None
    owned: Callable[[float], Callable[..., tuple[Any, Any]]] | None = None


class GradientTransformation(_Fields):
    """``init(params) -> state`` and ``update(updates, state, params=None) -> (updates, state)``.

    ``update`` is pure and defines the rule. ``inplace``, when set, is a faster way to take the
    same step: ``inplace(params, grads, state)`` (trees like ``init``'s params) updates params and
    state tensors in place and returns the new state, or returns ``None`` when it cannot take these
    tensors (the caller then runs ``update``; see `inplace_step`). ``spec`` describes the
    transformation (see `Spec`); ``None`` for one built by hand. ``scaled``, when set, maps a
    nonzero number ``c`` to an ``update`` whose updates come out multiplied by ``c``: `chain`
    runs a link followed by ``scale(c)`` (or a constant learning rate) as that one update, which
    saves a pass over the updates. ``owned``, when set, maps ``c`` to ``scaled(c)``'s update
    (``c = 1``: ``update``'s; see `unscaled`) for a caller that gives up the state it passes: it
    may write the new state into the old one's tensors (the same numbers, bit for bit, without
    fresh memory for each). `chain` runs it inside its in-place step, which an optimizer takes
    only with the state it owns; a combinator that keeps an inner state it passed on (to restore
    after a skipped step ...) never calls its inner's ``owned``.

    ``inplace``, ``spec``, ``scaled`` and ``owned`` describe ``init`` and ``update``, so ``_replace`` of
    either of those drops them unless it sets them too: ``sgd(0.1)._replace(update=f)`` steps
    through ``f`` (a transformation built by hand), never through the fused SGD its spec names.
    """

    __slots__ = ()

    def _replace(self, **changes: Any) -> GradientTransformation:
        if "init" in changes or "update" in changes:
            for derived in ("inplace", "spec", "scaled", "owned"):
                changes.setdefault(derived, None)
        return super()._replace(**changes)


def unscaled(update: Callable[..., tuple[Any, Any]]) -> Callable[[float], Callable[..., tuple[Any, Any]]]:
    """The ``owned`` of a transformation without ``scaled``: `chain` folds no scale into it, so
    it is only ever asked for ``c = 1``."""
    def owned(factor: float = 1.0) -> Callable[..., tuple[Any, Any]]:
        if factor != 1.0:
            raise ValueError(f"this transformation has no scaled update, so it cannot fold a scale of {factor}")
        return update
    return owned


def takes_extra_args(tx: GradientTransformation) -> bool:
    """Whether ``tx.update`` accepts extra keyword arguments (Optax's ``GradientTransformationExtraArgs``:
    ``update(updates, state, params, **extra_args)``, e.g. ``value=`` for a line search)."""
    return _has_var_keyword(tx.update)


@functools.lru_cache(maxsize=1024)
def _has_var_keyword(fn: Callable) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def update_with(tx: GradientTransformation, updates: Any, state: Any, params: Any, extra_args: dict) -> tuple:
    """``tx.update`` given the extra args when it takes them (combinators forward them this way, so a
    link that ignores them never sees them, as Optax's ``with_extra_args_support``)."""
    if extra_args and takes_extra_args(tx):
        return tx.update(updates, state, params, **extra_args)
    return tx.update(updates, state, params)


def with_extra_args_support(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` with an ``update`` that accepts and ignores extra args (``optax.with_extra_args_support``)."""
    if takes_extra_args(tx):
        return tx

    def update(updates, state, params=None, **extra_args):
        return tx.update(updates, state, params)

    # the same rule: every field that describes it kept
    return tx._replace(update=update, inplace=tx.inplace, spec=tx.spec, scaled=tx.scaled, owned=tx.owned)


def as_dtype(value: Any, name: str = "dtype") -> torch.dtype | None:
    """A dtype argument as torch takes it: ``None``, a ``torch.dtype``, or its name as NumPy and
    Optax spell it (``"bfloat16"``, ``"float32"``)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype or a dtype name such as 'bfloat16', got {value!r}")
    return dtype


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


def tree_map(fn: Callable, tree: Any, *rest: Any) -> Any:
    """``optree.tree_map``; a structure mismatch names the missing and unexpected leaves."""
    try:
        return optree.tree_map(fn, tree, *rest)
    except ValueError:
        for other in rest:
            check_structure(tree, other, "the state")
        raise


def flatten_like(tree: Any, reference: Any, what: str = "the state") -> tuple[list, Any]:
    """The leaves of ``tree`` and of ``reference`` cut to ``tree``'s structure (``reference`` may
    have subtrees where ``tree`` has leaves); a mismatch names the leaves that differ."""
    leaves, treedef = optree.tree_flatten(tree)
    try:
        return leaves, treedef.flatten_up_to(reference)
    except ValueError:
        check_structure(tree, reference, what)
        raise


def check_structure(updates: Any, reference: Any, what: str = "the params") -> None:
    """``ValueError`` naming the leaves ``updates`` lacks, or has extra, compared with ``reference``."""
    if optree.tree_structure(updates) == optree.tree_structure(reference):
        return
    mine, theirs = set(_paths(updates)), set(_paths(reference))
    missing, extra = sorted(theirs - mine, key=str)[:5], sorted(mine - theirs, key=str)[:5]
    if not missing and not extra:  # the same paths: a leaf is None on one side (a param without a gradient)
        pairs = zip(_paths(updates), optree.tree_leaves(updates, none_is_leaf=True),
                    optree.tree_leaves(reference, none_is_leaf=True))
        nones = [path for path, u, r in pairs if (u is None) != (r is None)][:5]
        raise ValueError(f"the updates (gradients) do not have the structure of {what}: None where the other "
                         f"holds a tensor at {', '.join(nones) or 'a node of another type'} (a param without a "
                         "gradient: give it one, or leave it out of the params)")
    raise ValueError(f"the updates (gradients) do not have the structure of {what}: missing "
                     f"{', '.join(missing) or 'nothing'}; unexpected {', '.join(extra) or 'nothing'} "
                     "(leaf paths; the state was made by init from the params)")


def _paths(tree: Any) -> list[str]:
    return ["".join(f"[{k!r}]" for k in path) or "<root>" for path in optree.tree_paths(tree, none_is_leaf=True)]


def tree_leaves(tree: Any) -> list:
    return optree.tree_leaves(tree)


def lowest_dtype(tree: Any) -> torch.dtype:
    """The leaves' least precise floating dtype (Optax's ``tree.dtype(params, 'lowest')``): the
    dtype a rule keeps its 0-d scalars in (a float32 step size for bf16 and float32 params is bf16)."""
    floats = [p.dtype for p in tree_leaves(tree) if p.is_floating_point()]
    return min(floats, key=lambda d: torch.finfo(d).bits, default=torch.get_default_dtype())


def highest_dtype(tree: Any) -> torch.dtype:
    """The leaves' most precise floating dtype (Optax's ``tree.dtype(params, 'highest')``)."""
    floats = [p.dtype for p in tree_leaves(tree) if p.is_floating_point()]
    return max(floats, key=lambda d: torch.finfo(d).bits, default=torch.get_default_dtype())


def zeros_like(tree: Any, dtype: torch.dtype | str | None = None) -> Any:
    dtype = as_dtype(dtype)
    return tree_map(lambda p: torch.zeros_like(p, dtype=dtype), tree)


def full_like(tree: Any, value: float | torch.Tensor) -> Any:
    """Each leaf's shape filled with ``value``; a 0-d tensor ``value`` stays in the graph (a
    hyperparameter being differentiated or swept)."""
    if isinstance(value, torch.Tensor):
        return tree_map(lambda p: torch.zeros_like(p) + value, tree)
    return tree_map(lambda p: torch.full_like(p, value), tree)


def count_zero() -> torch.Tensor:
    """A step counter as Optax keeps it: a 0-d int32 tensor (made from a number, so that under
    ``FakeTensorMode``, as a simulation steps, it keeps its value: fake tensors made so do)."""
    return counter(0)


def count_inc(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``, saturating at the int32 maximum (Optax's ``safe_increment``). Tensor maths
    throughout, so a compiled update does not specialize on the count (or recompile each step)."""
    if type(count) is torch.Tensor and count.is_cpu and not traced():  # eager: one small tensor
        return counter(min(int(value_of(count)) + 1, _INT32_MAX))
    count = torch.as_tensor(count)
    return torch.where(count < _INT32_MAX, count + 1, count).to(torch.int32)


def step_count(count: Any) -> int | torch.Tensor:
    """A step count as the rules' maths reads it: a Python int when eager (the bias corrections
    then fold into foreach ops' scalars), a 0-d float64 tensor when traced (`traced`): ``int()``
    would stop the compiler, or make it recompile at every step, and under ``vmap`` an ensemble's
    counts are batched. The scalars computed from it (``1 - b^t``) are then float64 as Python's
    are, and are cast to each tensor's dtype where they meet it, as a Python number would be
    (`zero.functional.foreach.ops`, `zero.functional.elementwise.debias`)."""
    if not traced():
        return int(count)
    return torch.as_tensor(count).to(torch.float64)


def first_or(count: Any, at_first: float, later: float) -> Any:
    """``at_first`` at the first step (``count``, a `step_count`, is 0), else ``later``: a number
    when eager, a float64 0-d tensor when traced (one graph for every step)."""
    if isinstance(count, int):
        return at_first if count == 0 else later
    f64 = torch.float64
    return torch.where(count == 0, torch.tensor(at_first, dtype=f64), torch.tensor(later, dtype=f64))


def select(pred: torch.Tensor, if_true: Any, if_false: Any) -> Any:
    """``torch.where(pred, a, b)`` leaf by leaf over two trees of one structure: how a traced
    update (`traced`) takes one of two outcomes held in one graph, as Optax's ``lax.cond``."""
    return tree_map(lambda a, b: torch.where(pred, a, b), if_true, if_false)


def identity() -> GradientTransformation:
    """Leaves updates unchanged (``optax.identity``)."""
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, p=None: (u, s), spec=Spec("identity", {}))


def stateless_tx(update: Callable) -> GradientTransformation:
    """A transformation with no state around ``update(updates, state, params=None)``."""
    return GradientTransformation(lambda params: EmptyState(), update)


def set_to_zero() -> GradientTransformation:
    """Zero updates (``optax.set_to_zero``); e.g. freezes the params it is routed to."""
    return stateless_tx(lambda u, s, p=None: (zeros_like(u), s))


def stateless(f: Callable[[Any, Any], Any]) -> GradientTransformation:
    """A transformation from ``f(updates, params) -> updates`` (``optax.stateless``)."""
    return stateless_tx(lambda u, s, p=None: (f(u, p), EmptyState()))


def stateless_with_tree_map(f: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> GradientTransformation:
    """``f(update, param)`` leaf by leaf (``param`` is None without params); ``optax.stateless_with_tree_map``."""
    def update(updates, state, params=None):
        if params is None:
            return tree_map(lambda u: f(u, None), updates), EmptyState()
        return tree_map(f, updates, params), EmptyState()

    return stateless_tx(update)


def without_grad(fn: Callable) -> Callable:
    """``@torch.no_grad()``, entered only when grad mode is on: an in-place step nests several
    such functions (the optimizer's step, the transformation's, the chain's, the kernel's), and
    each ``no_grad`` entered costs about 1.5 us. Grad mode is switched by function calls, not by
    ``no_grad``'s decorator, whose context objects are five more Python calls a step."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        torch.set_grad_enabled(False)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_grad_enabled(True)

    return call


@without_grad
def inplace_step(tx: GradientTransformation, params: Any, grads: Any, state: Any,
                 leaves: list[torch.Tensor] | None = None, extra_args: dict | None = None) -> Any:
    """One step of ``tx`` on a tree of params (a list, a dict by name ...), updating them in
    place; returns the new state. The outermost call: combinators step their inner
    transformations with `step_in_place`, and autograd is told once, here (``leaves``: the
    params' leaves in any order, when the caller holds them: the tree is then not flattened).

    torch's fused kernels write params without telling autograd; a for-loop step does. Telling
    it makes a backward that saved a param before this step raise, as with torch.optim's default
    step (e.g. several RPC trainers), instead of mixing values.

    ``extra_args`` (the loss as ``value=`` ...) reach a transformation that takes them, through its
    ``update`` (an in-place kernel takes none).
    """
    if extra_args and takes_extra_args(tx):
        updates, new_state = tx.update(grads, state, params, **extra_args)
        add_updates(params, updates)
    else:
        new_state = step_in_place(tx, params, grads, state)
    torch.autograd.graph.increment_version(tree_leaves(params) if leaves is None else leaves)
    return new_state


def step_in_place(tx: GradientTransformation, params: Any, grads: Any, state: Any) -> Any:
    """`inplace_step` inside another in-place step (a combinator's inner transformation): uses
    ``tx.inplace`` when the transformation has one that takes these tensors, else ``tx.update``
    then an in-place add; returns the new state."""
    if tx.inplace is not None:
        new_state = tx.inplace(params, grads, state)
        if new_state is not None:
            return new_state
    updates, state = tx.update(grads, state, params)
    add_updates(params, updates)
    return state


def add_updates(params: Any, updates: Any) -> None:
    """``params += updates`` in place, leaf by leaf, each update cast to its param's dtype."""
    leaves, theirs = flatten_like(params, updates, "the params")
    if leaves:
        torch._foreach_add_(leaves, [u.to(p.dtype) for p, u in zip(leaves, theirs)])


def check_number(name: str, value: Any) -> None:
    """A hyperparameter is a real number or a tensor (a schedule, a callable, is checked by its
    caller): ``"1e-3"`` is a ``TypeError`` naming it, never Python's bare comparison error."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")


def _unknown(value: Any) -> bool:
    """Whether a hyperparameter's value cannot be read now: a schedule, or a tensor that
    ``torch.func`` or ``torch.compile`` is tracing (reading it would stop the trace, and under
    ``vmap`` it holds one value per sweep entry). Its range is then not checked here."""
    return callable(value) or (isinstance(value, torch.Tensor) and traced())


def check_positive(name: str, value: Any) -> None:
    if not callable(value):
        check_number(name, value)
    if not _unknown(value) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def check_non_negative(name: str, value: Any) -> None:
    if not callable(value):
        check_number(name, value)
    if not _unknown(value) and not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def check_unit(name: str, value: Any, closed: bool = False) -> None:
    """``value`` in [0, 1) (or [0, 1] when ``closed``)."""
    check_number(name, value)
    if _unknown(value):
        return
    ok = 0 <= value <= 1 if closed else 0 <= value < 1
    if not ok:
        raise ValueError(f"{name} must be in [0, {'1]' if closed else '1)'}, got {value!r}")
