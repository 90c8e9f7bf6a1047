"""Chains on a kernel, and which path a transformation takes (`explain`).

`fuse` gives a chain the in-place step of the kernel its links spell (`fused.match`), over the
links of nested chains and aliases (``chain(clip_by_global_norm(1.0), adamw(...))`` is one list
of links), with a leading ``clip_by_global_norm`` folded in: one norm, then the kernels'
``grad_scale``. Like ``torch.nn.utils.clip_grad_norm_``, a clipped in-place step leaves the
grads clipped (see `Lists.clipped`); the pure ``update`` never writes its inputs. A chain of a
clip and one link that has an in-place step of its own (an `inject_hyperparams`,
`apply_if_finite`, `masked` ...) clips the grads in place once and runs that step.
The combinators' in-place steps live beside their updates; each in-place step carries a
``describe(params) -> Path`` that `explain` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zero.functional.base import GradientTransformation, Spec, add_updates, step_in_place, without_grad
from zero.functional.kernels.fused import match
from zero.functional.kernels.knobs import matching, now
from zero.functional.kernels.steps import Lists, laid_out_alike

__all__ = ["Path", "fuse", "explain", "described"]


@dataclass(frozen=True)
class Path:
    """What one step of a transformation runs on given params.

    ``kernel`` names torch's kernel (or multi-tensor implementation) the step calls, ``None`` on
    the pure path (the links' ``update`` in turn, fresh tensors, then an in-place add);
    ``calls`` is how many kernel calls a step makes; ``why`` says what was folded into the
    kernel, or which link keeps the chain on the pure path and why. ``parts`` holds the paths
    of the transformations a combinator routes leaves to (``partition``), by label.
    """

    kernel: str | None
    calls: int
    why: str
    parts: tuple[tuple[str, Path], ...] = ()

    def after(self, note: str) -> Path:
        """This path reached through a combinator that does ``note`` first (a check, a mask ...)."""
        return Path(self.kernel, self.calls, f"{note}; {self.why}", self.parts)

    @property
    def fused(self) -> bool:
        return self.kernel is not None and all(p.fused for _, p in self.parts)

    def __str__(self) -> str:
        head = (f"fused: {self.kernel}, {self.calls} call{'s' if self.calls != 1 else ''} per step"
                if self.kernel is not None else "pure path")
        lines = [f"{head} ({self.why})"] + [f"  {label}: {part}" for label, part in self.parts]
        return "\n".join(lines)


def explain(tx: GradientTransformation, params: Any) -> Path:
    """The path one step of ``tx`` takes on ``params`` (a tree, as ``tx.init`` takes it) when an
    optimizer steps it in place: `zero.functional.Optimizer`, `ZeroRedundancyOptimizer`. A step
    whose params or gradients are not contiguous takes the pure path (the kernels pair elements
    by memory order), whatever this says of contiguous ones.

    >>> import torch, zero.functional as F
    >>> params = {"w": torch.zeros(3, 3), "b": torch.zeros(3)}
    >>> tx = F.chain(F.clip_by_global_norm(1.0), F.adamw(1e-3, mask=lambda t: {n: n != "b" for n in t}))
    >>> print(F.explain(tx, params))  # doctest: +NORMALIZE_WHITESPACE
    fused: _fused_adamw_, 2 calls per step (clip_by_global_norm folded: one global norm, then the
    kernel's grad_scale; a weight-decay mask: one call per decay)
    """
    describe = getattr(tx.inplace, "describe", None)
    if describe is not None:
        return describe(params)
    return Path(None, 0, why_pure(tx))


def described(inplace: Any, describe: Any) -> Any:
    """``inplace`` with its ``describe(params) -> Path`` attached (for `explain`)."""
    inplace.describe = describe
    return inplace


def fuse(links: Sequence[GradientTransformation], given_up: Any = None) -> Any:
    """The in-place step of a chain of ``links``, or ``None`` if it has none (see the module).
    ``given_up``: the chain's update that writes its links' new states into their old tensors
    (its ``owned(1.0)``, see `GradientTransformation`), the step when no kernel or in-place link
    takes the chain."""
    flat = _flat_links(links, ())
    step = _kernel_or_link_step(flat)
    if step is None and given_up is not None:
        return _owned_step(given_up, [tx for _, tx in flat])
    return step


def _kernel_or_link_step(flat: list[tuple[tuple[int, ...], Any]]) -> Any:
    specs = [(i, tx.spec) for i, (_, tx) in enumerate(flat) if tx.spec is None or tx.spec.name != "identity"]
    if any(spec is None for _, spec in specs):
        return None
    clip = None
    if specs and specs[0][1].name == "clip_by_global_norm":
        clip = specs.pop(0)[1].args["max_norm"]  # read at each call: a knob may move it
    with matching():
        kernel = match(specs)
    if kernel is not None:
        return _kernel_step(kernel, [path for path, _ in flat], clip)
    if len(specs) == 1 and flat[specs[0][0]][1].inplace is not None:
        return _link_step(*flat[specs[0][0]], clip)
    return None


def _flat_links(links: Sequence[GradientTransformation], at: tuple[int, ...]) -> list[tuple[tuple[int, ...], Any]]:
    """``(path, link)`` of every link, nested chains and aliases opened: ``path`` indexes the
    nested state tuples."""
    out = []
    for i, tx in enumerate(links):
        spec = tx.spec
        out += _flat_links(spec.links, at + (i,)) if spec is not None and spec.links else [(at + (i,), tx)]
    return out


def _at(state: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        state = state[i]
    return state


def _replaced(state: tuple, path: tuple[int, ...], value: Any) -> tuple:
    new = list(state)
    new[path[0]] = value if len(path) == 1 else _replaced(state[path[0]], path[1:], value)
    return tuple(new)


def _kernel_step(kernel: Any, paths: list[tuple[int, ...]], clip: float | None) -> Any:
    @without_grad
    def inplace(params: Any, grads: Any, state: tuple) -> tuple | None:
        links = tuple([_at(state, path) for path in paths])
        new = kernel(Lists(params, grads, None if clip is None else float(now(clip))), links)
        if new is None:
            return None
        for path, old, value in zip(paths, links, new):
            if value is not old:
                state = _replaced(state, path, value)
        return state

    def describe(params: Any) -> Path:
        lists = Lists(params, params, clip)
        if not laid_out_alike(lists.params, ()):
            k = next(i for i, p in enumerate(lists.params) if not p.is_contiguous())
            return Path(None, 0, f"leaf {k} is not contiguous (strides {lists.params[k].stride()}): "
                                 f"{kernel.kernel_name} walks memory in order, so the step takes the pure path")
        notes = ["clip_by_global_norm folded: one global norm, then "
                 + ("the kernel's grad_scale" if kernel.grad_scale else "the grads clipped in place")] \
            if clip is not None else []
        if kernel.masked:
            notes.append("a weight-decay mask: one call per decay")
        return Path(kernel.kernel_name, kernel.calls(lists), "; ".join(notes) or "the chain spells the kernel's rule")

    inplace.kernel = kernel  # marks a kernel step: its numbers are read through knobs.now
    return described(inplace, describe)


def _link_step(path: tuple[int, ...], tx: GradientTransformation, clip: float | None) -> Any:
    """A chain whose one real link (beside identities and a leading clip) steps in place."""
    @without_grad
    def inplace(params: Any, grads: Any, state: tuple) -> tuple:
        lists = Lists(params, grads, None if clip is None else float(now(clip)))
        clipped = lists.treedef.unflatten(lists.clipped(grad_scale_ok=False)[0])
        return _replaced(state, path, step_in_place(tx, params, clipped, _at(state, path)))

    def describe(params: Any) -> Path:
        inner = explain(tx, params)
        if clip is None:
            return inner
        return inner.after("clip_by_global_norm: one global norm, the grads clipped in place")

    return described(inplace, describe)


def _owned_step(given_up: Any, links: list[GradientTransformation]) -> Any:
    """A chain's links in turn, those that can write their new state into the old one's tensors
    doing so (the optimizer owns the state and drops the old one), then the updates added."""
    @without_grad
    def inplace(params: Any, grads: Any, state: tuple) -> tuple:
        updates, new = given_up(grads, state, params)
        add_updates(params, updates)
        return new

    def describe(params: Any) -> Path:
        names = ", ".join(tx.spec.name if tx.spec is not None else _name(tx) for tx in links if tx.owned is not None)
        return Path(None, 0, f"{_why_chain(links)}; {names} writes its new state into the old one's tensors")

    return described(inplace, describe)


def why_pure(tx: GradientTransformation) -> str:
    """Why ``tx`` has no in-place step: the link or setting that keeps it on the pure path."""
    spec = tx.spec
    if spec is None:
        return "a transformation built by hand, or one zero cannot see into: no spec to match a kernel"
    if spec.name == "from_optax":
        return "from_optax runs Optax's own update (JAX) through DLPack"
    if spec.links:
        return _why_chain(spec.links)
    inner = spec.args.get("inner")
    if isinstance(inner, GradientTransformation):
        return f"{spec.name} around a transformation on the pure path: {why_pure(inner)}"
    return f"{spec.name} has no in-place step: its update writes fresh tensors"


def _why_chain(links: Sequence[GradientTransformation]) -> str:
    flat = [tx for _, tx in _flat_links(links, ())]
    for tx in flat:
        if tx.spec is None:
            return f"a link without a spec ({_name(tx)}) cannot be matched to a kernel"
    names = [tx.spec.name for tx in flat if tx.spec.name != "identity"]
    for tx in flat:
        hint = _hint(tx.spec, first=tx is flat[0])
        if hint:
            return hint
    return f"no kernel takes the links {' -> '.join(names)}"


def _hint(spec: Spec, first: bool) -> str | None:
    """A setting that rules out every kernel, named."""
    args = spec.args
    if spec.name == "scale_by_adam":
        off = [k for k in ("eps_root", "nesterov", "mu_dtype") if args.get(k)]
        if off:
            return f"scale_by_adam({', '.join(f'{k}={args[k]!r}' for k in off)}): torch's Adam kernels have no {off[0]}"
    if spec.name == "add_decayed_weights" and callable(args.get("weight_decay")):
        return "a scheduled weight decay: the kernels take one decay per call"
    if spec.name == "clip_by_global_norm" and not first:
        return "clip_by_global_norm is folded into a kernel only as the chain's first link"
    if spec.name == "masked":
        inner = args["inner"].spec
        if inner is None or inner.name != "add_decayed_weights":
            return "a masked link other than a weight decay inside a chain (wrap the whole chain in masked instead)"
    return None


def _name(tx: Any) -> str:
    fn = getattr(tx.update, "__qualname__", "") or ""
    return fn.split(".<locals>")[0] or type(tx).__name__
