"""Microbatching (mirrors ``optax.microbatch`` and ``optax.microbatching``'s ``AccumulationType``
and ``Accumulator``): a function of a batch evaluated one microbatch at a time, its results
summed, averaged or concatenated, so a batch too large for memory at once gives the same answer.
A torch function here: a loss, a ``torch.func`` gradient, a closure running backward.

Microbatch ``i`` of ``n`` takes rows ``i, i + n, i + 2n ...`` of each batch argument, as Optax's
column-major reshape does, so a ``CONCAT`` result comes back in the batch's order."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

__all__ = ["AccumulationType", "Accumulator", "microbatch"]


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """How microbatch results combine (``optax.microbatching.Accumulator``): ``init(value)`` a carry
    from the first result's shape, ``update(carry, value, index)``, ``finalize(carry)``."""

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, int], Any]
    finalize: Callable[[Any], Any]
    aggregate: Callable[[Any], Any] = lambda values: values


class AccumulationType(enum.Enum):
    """The built-in accumulators (``optax.microbatching.AccumulationType``)."""

    MEAN = enum.auto()
    SUM = enum.auto()
    RUNNING_MEAN = enum.auto()
    CONCAT = enum.auto()


def _floating(x: torch.Tensor) -> torch.Tensor:
    if not (x.is_floating_point() or x.is_complex()):
        raise ValueError("MEAN and RUNNING_MEAN Accumulators require floating-point values.")
    return torch.zeros_like(x)


def _built_in(kind: AccumulationType, n: int) -> Accumulator:
    """An `AccumulationType`'s accumulator (Optax's enum of the same names is taken too)."""
    kind = AccumulationType[kind.name] if isinstance(kind, enum.Enum) and kind.name in AccumulationType.__members__ \
        else kind
    if kind in (AccumulationType.MEAN, AccumulationType.CONCAT) and n <= 0:
        raise ValueError(f"num_microbatches={n} must be positive.")
    if kind is AccumulationType.SUM:
        return Accumulator(torch.zeros_like, lambda c, v, _: c + v, lambda c: c)
    if kind is AccumulationType.MEAN:
        return Accumulator(_floating, lambda c, v, _: c + v, lambda c: c / n)
    if kind is AccumulationType.RUNNING_MEAN:
        return Accumulator(_floating, lambda c, v, i: c * (i / (i + 1)) + v * (1 - i / (i + 1)), lambda c: c)
    if kind is AccumulationType.CONCAT:
        def update(carry, value, index):
            carry[index::n] = value  # row j of microbatch i is row i + j n of the batch
            return carry
        return Accumulator(lambda v: torch.zeros((v.shape[0] * n,) + v.shape[1:], dtype=v.dtype, device=v.device),
                           update, lambda c: c)
    raise ValueError(f"Unknown accumulator: {kind}")


def _per_leaf(accumulator: Any, n: int, out: Any) -> Any:
    """The accumulator tree (a prefix of the output's) as one accumulator per output leaf."""
    def one(acc):
        return acc if isinstance(acc, Accumulator) else _built_in(acc, n)
    is_acc = lambda x: isinstance(x, (Accumulator, enum.Enum))  # noqa: E731
    accs = optree.tree_map(one, accumulator, is_leaf=is_acc)
    return optree.tree_broadcast_prefix(accs, out, is_leaf=is_acc)


def microbatch(fun: Callable[..., Any], argnums: int | Sequence[int], microbatch_size: int | None,
               accumulator: Any = AccumulationType.SUM, *, argnames: str | Sequence[str] = (),
               in_axes: int | Sequence[int] = 0, num_real_microbatches: int | None = None) -> Callable[..., Any]:
    """``fun`` evaluated microbatch by microbatch over the batch axes (``in_axes``) of the arguments
    at ``argnums`` and ``argnames``, its results combined by ``accumulator`` (an `AccumulationType`,
    an `Accumulator`, or a tree of them, a prefix of ``fun``'s output) (``optax.microbatch``).
    ``num_real_microbatches`` stops after that many; ``microbatch_size=None`` returns ``fun``."""
    if microbatch_size is None:
        return fun
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    argnames = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    axes = (in_axes,) * (len(argnums) + len(argnames)) if isinstance(in_axes, int) else tuple(in_axes)

    def run(*args, **kwargs):
        batched = [(args, i, ax) for i, ax in zip(argnums, axes)] + \
                  [(kwargs, k, ax) for k, ax in zip(argnames, axes[len(argnums):])]
        sizes = {x.shape[ax] for holder, key, ax in batched for x in optree.tree_leaves(holder[key])}
        if len(sizes) > 1:
            raise ValueError(f"Batch Arguments must have equal-size batch axes, found {sorted(sizes)}.")
        size = sizes.pop()
        if size % microbatch_size:
            raise ValueError(f"batch_size={size} must be divisible by microbatch_size={microbatch_size}.")
        n = size // microbatch_size
        carry, accs = None, None
        for i in range(n if num_real_microbatches is None else int(num_real_microbatches)):
            a, kw = list(args), dict(kwargs)
            for (holder, key, ax) in batched:
                target = a if holder is args else kw
                rows = torch.arange(i, size, n)
                target[key] = optree.tree_map(lambda x, ax=ax, r=rows: x.index_select(ax, r.to(x.device)), holder[key])
            out = fun(*a, **kw)
            if accs is None:
                accs = _per_leaf(accumulator, n, out)
                carry = optree.tree_map(lambda acc, v: acc.init(v), accs, out)
            carry = optree.tree_map(lambda acc, c, v, i=i: acc.update(c, v, i), accs, carry, out)
        return optree.tree_map(lambda acc, c: acc.finalize(c), accs, carry)

    return run
