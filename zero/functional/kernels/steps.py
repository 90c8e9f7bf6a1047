"""What every kernel step shares: the step's params and grads as lists (`Lists`), the check of
which tensors a kernel can take together (`Placement`), one kernel call per (device, dtype,
weight decay), and the learning rate of the step."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from zero.functional import sharding
from zero.functional.base import count_inc
from zero.functional.kernels.knobs import now

__all__ = ["KernelStep", "Lists", "Placement", "by_decay", "by_device_and_dtype", "picker",
           "marked", "rate_of", "advanced"]

KernelStep = Callable[["Lists", tuple], Any]


class Lists:
    """One step's params and grads as lists, in the leaf order of the params' tree (a list, or a
    dict by name: optree orders its keys), with what a kernel needs beside them.

    ``clip`` is the global norm to clip the grads to (a leading ``clip_by_global_norm``), or None.
    A kernel asks `clipped` for its grads only once it has accepted the tensors.
    """

    def __init__(self, params: Any, grads: Any, clip: float | None = None):
        self.params, self.treedef = flatten(params)
        self.grads, self.tree, self.clip = self.treedef.flatten_up_to(grads), grads, clip

    def leaves(self, subtree: Any) -> list:
        """A state field shaped like the params, as a list in the params' order."""
        return self.treedef.flatten_up_to(subtree)

    def decays(self, decay: tuple[float, Any]) -> list[float]:
        """Each leaf's weight decay: the rate where the decay's mask (resolved on the grads, as
        `masked` does) is True, 0 elsewhere."""
        rate, mask = now(decay[0]), decay[1]
        if mask is None:
            return [rate] * len(self.params)
        flags = optree.tree_broadcast_prefix(mask(self.tree) if callable(mask) else mask, self.tree)
        return [rate if bool(f) else 0.0 for f in self.treedef.flatten_up_to(flags)]

    def clipped(self, grad_scale_ok: bool) -> tuple[list, torch.Tensor | None]:
        """The grads to step with, and the ``grad_scale`` a fused kernel divides them by (or None).

        With a clip the global norm is computed here, once, and the grads are left clipped, in
        place, as ``torch.nn.utils.clip_grad_norm_`` leaves them (the pure `update` never writes
        its inputs): a kernel that takes ``grad_scale`` gets ``norm / max_norm`` and writes the
        clipped grads back itself (torch's fused kernels do), in the pass it makes anyway. Its
        ``grad_scale`` is a float32, so float64 grads are clipped here instead, as
        `clip_by_global_norm` clips them: ``g / norm * max_norm``. Fresh copies would cost two
        more passes over fresh memory: 2x the step on 8.4M params.
        """
        if self.clip is None:
            return self.grads, None
        norm = sharding.global_norm(self.grads)
        if norm < self.clip:
            return self.grads, None
        if grad_scale_ok and all(g.dtype in (torch.float32, torch.bfloat16, torch.float16) for g in self.grads):
            return self.grads, torch.tensor(float(norm) / self.clip, dtype=torch.float32)
        for group in by_device_and_dtype(self.grads):
            grads = [self.grads[i] for i in group]
            torch._foreach_div_(grads, norm.to(grads[0].dtype))
            torch._foreach_mul_(grads, self.clip)
        return self.grads, None


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_TREEDEFS: dict[int | tuple, optree.PyTreeSpec] = {}


def flatten(tree: Any) -> tuple[list, optree.PyTreeSpec]:
    """``optree.tree_flatten(tree)``. A step's tree is a list of tensors or a dict of them by name,
    the same from step to step: its structure is kept per length (or names), and only its leaves
    are read then (on 200 tensors, flattening costs 37 us a step and reading the leaves 2)."""
    kind = type(tree)
    values = tree if kind is list else tree.values() if kind is dict else None
    if values is None or not set(map(type, values)) <= _PLAIN:
        return optree.tree_flatten(tree)
    key = len(tree) if kind is list else tuple(tree)
    treedef = _TREEDEFS.get(key)
    if treedef is None:
        if len(_TREEDEFS) >= 64:  # names of many param sets: keep the latest only
            _TREEDEFS.clear()
        treedef = _TREEDEFS[key] = optree.tree_structure(tree)
    return treedef.flatten_up_to(tree), treedef


class Placement:
    """Which tensors a kernel can step together: index groups by (device, dtype), or None.

    Checked every step, since a step may get tensors of other dtypes or devices (a state loaded
    elsewhere, grads of another dtype), but cheaply: params and state tensors are the same
    objects from step to step, so only their identities are compared with the last step's, and
    only the params' and grads' dtypes and devices are read again (a param keeps its identity
    through ``param.data = ...``); for 2,000 tensors 0.6 ms instead of 3 ms. The last step's
    params and state are referenced here, so that no other tensor can take one of their
    identities while it is remembered.
    """

    def __init__(self):
        self.held: tuple = ()
        self.kinds: list | None = None
        self.groups: list[list[int]] | None = None

    def __call__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 *state: Sequence[torch.Tensor]) -> list[list[int]] | None:
        lists = (params, *state)
        if not _same_tensors(lists, self.held):
            self.held = tuple(list(xs) for xs in lists)
            self.groups = _groups(lists)
            self.kinds = None if self.groups is None else _kinds(params)
        if self.groups is None or not laid_out_alike(params, grads):
            return None
        if _kinds(params) != self.kinds or _kinds(grads) != self.kinds:  # .data = ... keeps a param's identity
            return _groups((params, grads, *state))
        return self.groups


def _same_tensors(lists: tuple, held: tuple) -> bool:
    """Whether ``lists`` hold the very tensors ``held`` does, position by position."""
    return len(lists) == len(held) and all(
        len(xs) == len(ys) and all(map(operator.is_, xs, ys)) for xs, ys in zip(lists, held))


def laid_out_alike(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    """Whether every param and gradient is contiguous: torch's fused kernels walk a param, its
    gradient and its state in memory order, element i of one beside element i of the others, so a
    transposed param (``nn.Parameter(w.t())``) given a contiguous gradient by hand would be
    stepped with another element's gradient. One flag per tensor, read by C loops."""
    return all(map(_CONTIGUOUS, params)) and all(map(_CONTIGUOUS, grads))


_CONTIGUOUS = torch.Tensor.is_contiguous


def _kinds(tensors: Sequence[torch.Tensor]) -> tuple[list, list]:
    """Each tensor's dtype and device index, read by C loops (a step reads them for every tensor)."""
    return list(map(_DTYPE, tensors)), list(map(torch.Tensor.get_device, tensors))


_DTYPE = operator.attrgetter("dtype")


def _groups(lists: Sequence[Sequence[torch.Tensor]]) -> list[list[int]] | None:
    """What torch's fused kernels take: contiguous real floats on CPU or CUDA, matching dtype and
    device position by position across the lists; index groups by (device, dtype), or None."""
    first = lists[0]
    if not all(t.is_floating_point() and t.device.type in ("cpu", "cuda") and t.is_contiguous() for t in first) or \
            not all(t.is_contiguous() for other in lists[1:] for t in other) or not all(
            a.dtype == b.dtype and a.device == b.device for other in lists[1:] for a, b in zip(first, other)):
        return None
    return by_device_and_dtype(first)


def by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def by_decay(groups: list[list[int]], decays: list[float]) -> list[tuple[list[int], float]]:
    """Each placement group split by weight decay: one kernel call per (device, dtype, decay)."""
    if len(set(decays)) <= 1:  # one decay for all (no mask): the groups as they are
        return [(idx, decays[0] if decays else 0.0) for idx in groups]
    out = []
    for idx in groups:
        by: dict[float, list[int]] = {}
        for i in idx:
            by.setdefault(decays[i], []).append(i)
        out += [(part, rate) for rate, part in by.items()]
    return out


def picker(idx: list[int], n: int) -> Callable[[list], list]:
    """Picks positions ``idx`` out of lists of ``n`` (one kernel call's tensors); all of them, in
    order, is the list itself (the common case: one device, dtype and decay)."""
    if len(idx) == n:
        return lambda xs: xs
    return lambda xs: [xs[i] for i in idx]


def marked(inplace: Any, kernel: str, decay: tuple[float, Any] | None, grad_scale: bool) -> KernelStep:
    """Mark a kernel step for `zero.functional.explain`: the kernel it calls and how many calls a
    step makes (``decay`` given: one per (device, dtype, decay); else torch's multi-tensor
    implementation, one call), and give it the placement it checks tensors with."""
    inplace.placement = Placement()
    inplace.kernel_name, inplace.grad_scale = kernel, grad_scale
    inplace.masked = decay is not None and decay[1] is not None

    def calls(lists: Lists) -> int:
        if decay is None:
            return 1
        return len(by_decay(by_device_and_dtype(lists.params), lists.decays(decay)))

    inplace.calls = calls
    return inplace


def rate_of(learning_rate: Any, lr_state: Any) -> float:
    """The learning rate of this step: the number, or the schedule at the lr link's count."""
    return float(learning_rate(lr_state.count) if callable(learning_rate) else now(learning_rate))


def advanced(learning_rate: Any, lr_state: Any) -> Any:
    """The lr link's state after a step (a schedule counts steps; a constant keeps no state)."""
    return lr_state._replace(count=count_inc(lr_state.count)) if callable(learning_rate) else lr_state
