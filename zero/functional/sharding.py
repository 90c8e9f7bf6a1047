"""Whole-tensor and whole-model quantities when a rank steps only pieces of the model.

Most rules are element-wise and step a piece of a tensor exactly as they would the whole. A
few need quantities over whole tensors or the whole model: `clip_by_global_norm` (the global
norm), `scale_by_trust_ratio` (LAMB, LARS: each tensor's norm), `apply_if_finite` (is every
update finite). They ask this module, never compute those over their leaves themselves:

- with no sharding installed (one process, or a plain optimizer) the answers come from the
  leaves alone;
- a sharded backend installs a `Sharding` around its local step: it says which pieces of which
  whole tensors each leaf holds, and gives a ``reduce`` that sums a tensor over the ranks. Each
  answer is then one partial sum per piece and one small ``reduce``.

Every rank must ask the same questions in the same order, since each is a collective: a
sharded `zero.functional.Optimizer` therefore steps every param group on every step, even one
with no gradients on this rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch

__all__ = ["Pieces", "Sharding", "installed", "every_group", "global_norm", "tensor_norms", "all_finite",
           "whole_tensors"]


@dataclass(frozen=True)
class Pieces:
    """What one leaf holds: consecutive pieces of whole tensors, then padding.

    ``tensors[k]`` is the index (among ``Sharding.dtypes``) of the tensor whose piece of
    ``lengths[k]`` elements comes ``k``-th in the flattened leaf.
    """

    tensors: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def used(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class Sharding:
    """Installed by a sharded backend: the pieces each local param holds, and the ranks' sum.

    ``pieces`` maps ``id(param)`` of every local param to its `Pieces`; the leaves a
    transformation sees follow the params it is stepping, in order. ``dtypes[t]`` is whole
    tensor ``t``'s dtype. ``reduce(t)`` returns ``t`` summed over the ranks (a collective).
    """

    pieces: Mapping[int, Pieces]
    dtypes: tuple[torch.dtype, ...]
    reduce: Callable[[torch.Tensor], torch.Tensor]
    every_group: bool = True  # the ranks' reductions pair up only if each steps every group
    numels: tuple[int, ...] = ()  # whole tensor t's number of elements (for `whole_tensors`)

    @property
    def n_tensors(self) -> int:
        return len(self.dtypes)


_SHARDING: ContextVar[Sharding | None] = ContextVar("zero_sharding", default=None)
_LEAVES: ContextVar[tuple[Pieces, ...] | None] = ContextVar("zero_sharded_leaves", default=None)


@contextlib.contextmanager
def installed(sharding: Sharding) -> Iterator[None]:
    """Make ``sharding`` the answer for the steps taken inside the block."""
    token = _SHARDING.set(sharding)
    try:
        yield
    finally:
        _SHARDING.reset(token)


def every_group() -> bool:
    """Whether a sharded step must step every param group, even one with no gradients here."""
    sharding = _SHARDING.get()
    return sharding is not None and sharding.every_group


@contextlib.contextmanager
def stepping(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside the block, leaf ``k`` of the trees being transformed is a piece of ``params[k]``'s."""
    sharding = _SHARDING.get()
    if sharding is None:
        yield
        return
    try:
        pieces = tuple(sharding.pieces[id(p)] for p in params)
    except KeyError:
        raise ValueError("a sharded step got a param the backend did not register") from None
    token = _LEAVES.set(pieces)
    try:
        yield
    finally:
        _LEAVES.reset(token)


def _sharded(leaves: Sequence[torch.Tensor], what: str) -> tuple[Sharding, tuple[Pieces, ...]] | None:
    sharding, pieces = _SHARDING.get(), _LEAVES.get()
    if sharding is None:
        return None
    if pieces is None or len(pieces) != len(leaves):
        n = "no" if pieces is None else len(pieces)
        raise ValueError(f"{what} under a sharded optimizer got {len(leaves)} leaves for {n} stepped params: "
                         "it can only be computed over the params' own leaves (not inside masked or "
                         "multi_transform), or use a whole-param plan")
    return sharding, pieces


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Sums of squares in at least float32 (bf16 sums lose the small terms), in float64 for float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def global_norm(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all leaves together, over every rank's pieces when sharded.

    As unsharded, it is the norm of the tensors' norms, each rounded to its tensor's dtype.
    """
    found = _sharded(leaves, "a global norm")
    if found is None:
        if not leaves:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(leaves)))
    sharding, pieces = found
    norms = _whole_norms(sharding, pieces, leaves)
    for dt in set(sharding.dtypes):  # tensors outside this step have norm 0 and add nothing
        at = [t for t, d in enumerate(sharding.dtypes) if d == dt]
        norms[at] = norms[at].to(dt).double()
    total = torch.linalg.vector_norm(norms)
    dtype = functools.reduce(torch.promote_types, [leaf.dtype for leaf in leaves], torch.float32)
    return total.to(dtype)


def tensor_norms(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per leaf, the L2 norm of the whole tensor it is (a piece of), broadcastable to the leaf.

    Unsharded: one 0-d norm per leaf. Sharded: a 1-D tensor as long as the leaf, each element
    holding its tensor's norm (padding gets 0).
    """
    found = _sharded(leaves, "per-tensor norms")
    if found is None:
        return [torch.linalg.vector_norm(leaf) for leaf in leaves]
    sharding, pieces = found
    norms = _whole_norms(sharding, pieces, leaves)
    return [_expand(norms, pc, leaf) for leaf, pc in zip(leaves, pieces)]


def _whole_norms(sharding: Sharding, pieces: Sequence[Pieces], leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The norm of every whole tensor (float64, CPU): per-piece sums of squares, one ``reduce``."""
    sums = torch.zeros(sharding.n_tensors, dtype=torch.float64)
    for leaf, pc in zip(leaves, pieces):
        if pc.tensors:
            squares = _wide(leaf.reshape(-1)[:pc.used]).square()
            lengths = torch.tensor(pc.lengths, device=leaf.device)
            partial = torch.segment_reduce(squares, "sum", lengths=lengths).to(device="cpu", dtype=torch.float64)
            sums.index_add_(0, torch.tensor(pc.tensors), partial)
    return sharding.reduce(sums).sqrt()


def _expand(norms: torch.Tensor, pc: Pieces, leaf: torch.Tensor) -> torch.Tensor:
    per_piece = norms[list(pc.tensors)].to(device=leaf.device, dtype=leaf.dtype)
    lengths = torch.tensor(pc.lengths, device=leaf.device)
    out = torch.zeros(leaf.numel(), dtype=leaf.dtype, device=leaf.device)
    out[:pc.used] = torch.repeat_interleave(per_piece, lengths)
    return out.view(leaf.shape)


def whole_tensors(leaves: Sequence[torch.Tensor], what: str) -> None:
    """``ValueError`` unless every leaf is a whole tensor in its own shape: for rules that read a
    tensor's shape or all its elements at once (``centralize``, ``adaptive_grad_clip``...), which a
    rank stepping pieces of tensors (a flat plan) cannot run."""
    sharding, stepped = _SHARDING.get(), _LEAVES.get()
    if sharding is None or (stepped is not None and all(_whole(sharding, pc) for pc in stepped)):
        return  # every param this rank steps is whole, so any leaves of them are (inside masked too)
    sharding, pieces = _sharded(leaves, what)
    for leaf, pc in zip(leaves, pieces):
        if not (_whole(sharding, pc) and pc.lengths[0] == leaf.numel()):
            raise ValueError(f"{what} needs each tensor whole, but this sharded step holds pieces of tensors "
                             "(a flat plan): use a whole-param plan (ZeroRedundancyOptimizer(..., plan=...) "
                             "without flat buckets)")


def _whole(sharding: Sharding, pc: Pieces) -> bool:
    return len(pc.tensors) == 1 and bool(sharding.numels) and pc.lengths[0] == sharding.numels[pc.tensors[0]]


def all_finite(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether every element of every leaf is finite, on every rank when sharded."""
    bad = sum(int((~torch.isfinite(leaf)).sum()) for leaf in leaves)
    found = _sharded(leaves, "a finiteness check")
    if found is not None:
        bad = int(found[0].reduce(torch.tensor(bad, dtype=torch.float64)))
    return bad == 0

