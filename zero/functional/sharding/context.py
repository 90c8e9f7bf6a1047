"""The sharding a backend installs around its local step (`Sharding`, `installed`), which pieces
of which whole tensors each stepped leaf holds (`Pieces`, `stepping`, `subset`), and how the
other parts of this package read them (`current`, `sharded`, `flat_pieces`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import optree
import torch

__all__ = ["Pieces", "Sharding", "installed", "every_group", "stepping", "subset", "current", "sharded",
           "stepping_whole", "whole_piece", "name_of", "flat_pieces", "whole_hint", "SHARDING", "LEAVES", "DEFERRED"]


@dataclass(frozen=True)
class Pieces:
    """What one leaf holds: consecutive pieces of whole tensors, then padding.

    ``tensors[k]`` is the index (among ``Sharding.dtypes``) of the tensor whose piece of
    ``lengths[k]`` elements comes ``k``-th in the flattened leaf.
    """

    tensors: tuple[int, ...]
    lengths: tuple[int, ...]
    starts: tuple[int, ...] = ()  # where each piece starts in its flattened tensor (for `axis_sums`)
    # The quantization block the plan cut this leaf's buffer at (0: none; see `quantized`)
    block: int = 0

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
    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None  # the ranks' maximum (inf-norms)
    every_group: bool = True  # the ranks' reductions pair up only if each steps every group
    # Every leaf of every rank is a whole tensor in its own shape (a whole-param plan): per-tensor
    # quantities need no collective. A property of the plan, not of one rank's leaves, so that
    # every rank takes the same path (a flat shard may happen to hold exactly one tensor).
    whole_params: bool = False
    names: tuple[str, ...] = ()  # whole tensor t's name (for errors, and `whole_tree`)
    numels: tuple[int, ...] = ()  # whole tensor t's number of elements (for `whole_tensors`)
    shapes: tuple[tuple[int, ...], ...] = ()  # whole tensor t's shape (for `axis_sums`)
    # How a user keeps a param whole under this backend (the way out errors about pieces give)
    whole_hint: str = ("keep it whole (zero.make_plan(..., 'flat', whole=...): a hybrid plan), "
                       "or use a whole-param plan")

    @property
    def n_tensors(self) -> int:
        return len(self.dtypes)


SHARDING: ContextVar[Sharding | None] = ContextVar("zero_sharding", default=None)
LEAVES: ContextVar[tuple[Pieces, ...] | None] = ContextVar("zero_sharded_leaves", default=None)


@contextlib.contextmanager
def installed(sharding: Sharding) -> Iterator[None]:
    """Make ``sharding`` the answer for the steps taken inside the block."""
    token, deferred = SHARDING.set(sharding), DEFERRED.set([])
    _OPEN[0] += 1
    try:
        yield
    finally:
        _OPEN[0] -= 1
        DEFERRED.reset(deferred)
        SHARDING.reset(token)


# Refusals a rank found alone (a label on a piece only it holds), raised on every rank together at
# the step's next whole-tensor check (`whole.refuse_together`), which every rank reaches
DEFERRED: ContextVar[list | None] = ContextVar("zero_deferred_refusals", default=None)


# How many `installed` blocks are open, in a plain list that torch.compile can read: it cannot
# trace a ContextVar, so a compiled update takes the unsharded answers, and refuses when one is open.
_OPEN = [0]


def current(var: ContextVar) -> Any:
    """``var.get()``; under ``torch.compile``, ``None`` (no sharding), or a ``RuntimeError`` when
    a sharding is installed: a sharded step's whole-tensor quantities cannot be compiled."""
    if torch.compiler.is_compiling():
        if _OPEN[0]:
            raise RuntimeError("torch.compile cannot trace a sharded optimizer's step (its global norms and "
                               "whole-tensor checks read the sharding from a ContextVar): step it uncompiled, "
                               "or compile the update of an unsharded transformation")
        return None
    return var.get()


def every_group() -> bool:
    """Whether a sharded step must step every param group, even one with no gradients here."""
    sharding = current(SHARDING)
    return sharding is not None and sharding.every_group


class stepping:  # used as a function; a class, not a generator, since every step enters it
    """Inside the block, leaf ``k`` of the trees being transformed is a piece of leaf ``k`` of the
    tree ``params`` (flattened only when a sharding is installed: unsharded steps pay nothing)."""

    __slots__ = ("pieces", "token")

    def __init__(self, params: Any):
        sharding = current(SHARDING)
        self.pieces = self.token = None
        if sharding is None:
            return
        try:
            self.pieces = tuple(sharding.pieces[id(p)] for p in optree.tree_leaves(params))
        except KeyError:
            raise ValueError("a sharded step got a param the backend did not register") from None

    def __enter__(self) -> None:
        if self.pieces is not None:
            self.token = LEAVES.set(self.pieces)

    def __exit__(self, *exc: Any) -> None:
        if self.token is not None:
            LEAVES.reset(self.token)


@contextlib.contextmanager
def subset(keep: Sequence[bool]) -> Iterator[None]:
    """Inside the block, the trees being transformed hold only the leaves where ``keep`` is True
    (``masked`` and ``partition`` hand their inner transformations the masked-in leaves)."""
    pieces = current(LEAVES)
    if current(SHARDING) is None or pieces is None or len(pieces) != len(keep):
        yield  # unsharded, or not the stepped params' own leaves: the checks below say so if it matters
        return
    token = LEAVES.set(tuple(pc for pc, k in zip(pieces, keep) if k))
    try:
        yield
    finally:
        LEAVES.reset(token)


def sharded(leaves: Sequence[torch.Tensor], what: str) -> tuple[Sharding, tuple[Pieces, ...]] | None:
    sharding, pieces = current(SHARDING), current(LEAVES)
    if sharding is None:
        return None
    if pieces is None or len(pieces) != len(leaves):
        n = "no" if pieces is None else len(pieces)
        raise ValueError(f"{what} under a sharded optimizer got {len(leaves)} leaves for {n} stepped params: "
                         "it can only be computed over the params' own leaves (not inside masked or "
                         "multi_transform), or use a whole-param plan")
    return sharding, pieces


def stepping_whole() -> bool:
    """No sharding, or every rank steps whole tensors only (a whole-param plan)."""
    sharding = current(SHARDING)
    return sharding is None or sharding.whole_params


def whole_piece(sharding: Sharding, pc: Pieces) -> bool:
    return len(pc.tensors) == 1 and bool(sharding.numels) and pc.lengths[0] == sharding.numels[pc.tensors[0]]


def name_of(t: int) -> str:
    """Whole tensor ``t``'s name in errors: its index, and its name when the step knows it."""
    sharding = current(SHARDING)
    return f"{t} ({sharding.names[t]})" if sharding is not None and sharding.names else str(t)


def whole_hint() -> str:
    """How to keep a param whole under the installed backend (`Sharding.whole_hint`)."""
    sharding = current(SHARDING)
    return sharding.whole_hint if sharding is not None else Sharding.whole_hint


def flat_pieces(leaves: Sequence[torch.Tensor], what: str) -> tuple[Sharding, tuple[Pieces, ...]] | None:
    """The pieces of a flat plan's step, or None when every leaf is a whole tensor in its shape
    (no sharding, or a whole-param plan: per-tensor sums need no collective there)."""
    if stepping_whole():
        return None
    sharding, stepped = current(SHARDING), current(LEAVES)
    # (a leaf of padding only, a rank's shard past a small buffer's end, holds no piece to place)
    if not sharding.shapes or any(pc.tensors and not pc.starts for pc in (stepped or ())):
        raise ValueError(f"{what} needs the shapes of the tensors and where each piece starts; this backend's "
                         "sharding does not give them")
    return sharded(leaves, what)
