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

Sums over some axes of each tensor (`axis_sums`, `axis_means`: ``centralize``'s row means,
``clip_by_block_rms``'s mean square, ``adaptive_grad_clip``'s unit norms) are answered the same
way: one partial sum per piece and unit, one ``reduce`` of every unit of every tensor.

Every rank must ask the same questions in the same order, since each is a collective: a
sharded `zero.functional.Optimizer` therefore steps every param group on every step, even one
with no gradients on this rank.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import optree
import torch

from zero.functional.foreach import ops, traced

__all__ = ["Pieces", "Sharding", "installed", "every_group", "stepping", "subset", "global_norm", "total_norm",
           "tensor_norms", "all_finite", "whole_tensors", "needs_whole", "axis_sums", "axis_means", "every_axis",
           "quantized", "block_sizes"]


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

    @property
    def n_tensors(self) -> int:
        return len(self.dtypes)


_SHARDING: ContextVar[Sharding | None] = ContextVar("zero_sharding", default=None)
_LEAVES: ContextVar[tuple[Pieces, ...] | None] = ContextVar("zero_sharded_leaves", default=None)
_PROBE: ContextVar[set[int] | None] = ContextVar("zero_whole_probe", default=None)  # see needs_whole
_BLOCKS: ContextVar[dict[int, tuple[int, int]] | None] = ContextVar("zero_block_probe", default=None)  # see block_sizes


@contextlib.contextmanager
def installed(sharding: Sharding) -> Iterator[None]:
    """Make ``sharding`` the answer for the steps taken inside the block."""
    token = _SHARDING.set(sharding)
    _OPEN[0] += 1
    try:
        yield
    finally:
        _OPEN[0] -= 1
        _SHARDING.reset(token)


# How many `installed` blocks are open, in a plain list that torch.compile can read: it cannot
# trace a ContextVar, so a compiled update takes the unsharded answers, and refuses when one is open.
_OPEN = [0]


def _current(var: ContextVar) -> Any:
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
    sharding = _current(_SHARDING)
    return sharding is not None and sharding.every_group


@contextlib.contextmanager
def stepping(params: Any) -> Iterator[None]:
    """Inside the block, leaf ``k`` of the trees being transformed is a piece of leaf ``k`` of the
    tree ``params`` (flattened only when a sharding is installed: unsharded steps pay nothing)."""
    sharding = _current(_SHARDING)
    if sharding is None:
        yield
        return
    try:
        pieces = tuple(sharding.pieces[id(p)] for p in optree.tree_leaves(params))
    except KeyError:
        raise ValueError("a sharded step got a param the backend did not register") from None
    token = _LEAVES.set(pieces)
    try:
        yield
    finally:
        _LEAVES.reset(token)


@contextlib.contextmanager
def subset(keep: Sequence[bool]) -> Iterator[None]:
    """Inside the block, the trees being transformed hold only the leaves where ``keep`` is True
    (``masked`` and ``partition`` hand their inner transformations the masked-in leaves)."""
    pieces = _current(_LEAVES)
    if _current(_SHARDING) is None or pieces is None or len(pieces) != len(keep):
        yield  # unsharded, or not the stepped params' own leaves: the checks below say so if it matters
        return
    token = _LEAVES.set(tuple(pc for pc, k in zip(pieces, keep) if k))
    try:
        yield
    finally:
        _LEAVES.reset(token)


def _sharded(leaves: Sequence[torch.Tensor], what: str) -> tuple[Sharding, tuple[Pieces, ...]] | None:
    sharding, pieces = _current(_SHARDING), _current(_LEAVES)
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
        return torch.linalg.vector_norm(torch.stack(ops.norm(leaves)))
    sharding, pieces = found
    norms = _whole_norms(sharding, pieces, leaves, ops.norm)
    for dt in set(sharding.dtypes):  # tensors outside this step have norm 0 and add nothing
        at = [t for t, d in enumerate(sharding.dtypes) if d == dt]
        norms[at] = norms[at].to(dt).double()
    total = torch.linalg.vector_norm(norms)
    dtype = functools.reduce(torch.promote_types, [leaf.dtype for leaf in leaves], torch.float32)
    return total.to(dtype)


def total_norm(leaves: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm(leaves, norm_type)``: the ``norm_type``-norm of the whole
    tensors' norms (``inf``: the largest magnitude), over every rank's pieces when sharded.

    Sharded, per-tensor norms and the total are computed in float64 from one ``reduce`` (for
    ``inf`` one ``reduce_max``), so every rank gets the same number, returned in at least float32.
    """
    p = float(norm_type)
    if not p >= 0:
        raise ValueError(f"norm_type={norm_type!r}: a total norm needs a norm_type >= 0 (or inf)")
    found = _sharded(leaves, "a total norm")
    if found is None:
        if not leaves:
            return torch.zeros(())
        norms = [torch.linalg.vector_norm(leaf, p) for leaf in leaves]
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), p)
    sharding, pieces = found
    if math.isinf(p) and sharding.reduce_max is None:
        raise ValueError("an inf-norm under this sharding needs the ranks' maximum, which its backend does not give")
    partial = torch.zeros(sharding.n_tensors, dtype=torch.float64)
    for leaf, pc in zip(leaves, pieces):
        if pc.tensors:
            x = leaf.reshape(-1)[:pc.used].abs().double()
            x = x if math.isinf(p) else (x != 0).double() if p == 0 else x.pow(p)
            lengths = torch.tensor(pc.lengths, device=leaf.device)
            per = torch.segment_reduce(x, "max" if math.isinf(p) else "sum", lengths=lengths, initial=0)
            at = torch.tensor(pc.tensors)
            if math.isinf(p):
                partial.scatter_reduce_(0, at, per.cpu(), "amax")
            else:
                partial.index_add_(0, at, per.cpu())
    if math.isinf(p):
        total = sharding.reduce_max(partial).max()
    else:
        norms = sharding.reduce(partial) if p == 0 else sharding.reduce(partial).pow(1 / p)
        total = torch.linalg.vector_norm(norms, p)
    return total.to(functools.reduce(torch.promote_types, sharding.dtypes, torch.float32))


def tensor_norms(leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per leaf, the L2 norm of the whole tensor it is (a piece of), broadcastable to the leaf.

    Unsharded: one 0-d norm per leaf. Sharded: a 1-D tensor as long as the leaf, each element
    holding its tensor's norm (padding gets 0).
    """
    found = _sharded(leaves, "per-tensor norms")
    if found is None or found[0].whole_params:  # whole tensors here: nothing to ask the other ranks
        return [torch.linalg.vector_norm(leaf) for leaf in leaves]
    sharding, pieces = found
    norms = _whole_norms(sharding, pieces, leaves)
    return [_expand(norms, pc, leaf) for leaf, pc in zip(leaves, pieces)]


def _whole_norms(sharding: Sharding, pieces: Sequence[Pieces], leaves: Sequence[torch.Tensor],
                 norms_of: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> torch.Tensor:
    """The norm of every whole tensor (float64, CPU), one ``reduce``: per-piece sums of squares;
    under a whole-param plan (every leaf a whole tensor) the leaves' own norms by ``norms_of``,
    the unsharded step's function, so that the plan's step is the unsharded step bit for bit."""
    if sharding.whole_params and norms_of is not None:
        local = torch.zeros(sharding.n_tensors, dtype=torch.float64)
        held = [(leaf, pc.tensors[0]) for leaf, pc in zip(leaves, pieces) if pc.tensors]
        if held:
            norms = norms_of([leaf for leaf, _ in held])
            local[torch.tensor([t for _, t in held])] = torch.stack([n.to("cpu", torch.float64) for n in norms])
        return sharding.reduce(local)  # each tensor's norm from its owner, zeros elsewhere: exact
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


def whole_tensors(leaves: Sequence[torch.Tensor], what: str,
                  needs: Callable[[tuple[int, ...]], bool] | None = None) -> None:
    """``ValueError`` unless every leaf is a whole tensor in its own shape: for rules that read a
    tensor's shape or all its elements at once (Newton-Schulz, factored moments, per-tensor
    state), which a rank stepping pieces of tensors (a flat plan) cannot run.

    ``needs(shape)``: only tensors of such shapes must be whole; the rule treats the others
    element by element, so their pieces in a 1-D shard step as they would whole (Adafactor's
    vectors, beside the matrices it factors; a hybrid plan keeps those whole).
    """
    probe = _current(_PROBE)
    if probe is not None:  # needs_whole is asking, on whole meta tensors: record, do not check
        probe.update(id(leaf) for leaf in leaves if needs is None or needs(tuple(leaf.shape)))
        return
    shapes = _current(_SHARDING).shapes if _current(_SHARDING) is not None else ()
    for pieces_of in cut_tensors(leaves, what) or ():  # None: every rank steps whole tensors, or no step
        cut = [t for t in pieces_of if needs is None or not shapes or needs(shapes[t])]
        if cut:
            shape = f" of shape {shapes[cut[0]]}" if shapes else ""
            raise ValueError(f"{what} needs each tensor whole, but this sharded step holds pieces of param "
                             f"{name_of(cut[0])}{shape} (a flat plan): keep it whole (zero.make_plan(..., 'flat', "
                             "whole=...): a hybrid plan), or use a whole-param plan")


def needs_whole(tx: Any, params: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """The params (by name) ``tx`` needs whole, asked of the rule itself: one ``init`` and
    ``update`` on ``meta`` tensors of these shapes and dtypes, recording what its
    `whole_tensors` checks ask for (Muon's matrices, Adafactor's factored ones, SM3's, NovoGrad's
    every tensor) instead of checking: what a flat plan must keep whole to run it (a hybrid plan).

    A chain that cannot run on meta tensors (a link reads data: ``clip_by_global_norm`` compares
    its norm) is asked link by link; a link that cannot is taken to step element by element, and
    the step still checks it (a ``ValueError`` naming the param it was given in pieces)."""
    tree = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in params.items()}
    asked = _asked(tx, tree)
    return [name for name in params if name in asked]


def _asked(tx: Any, tree: dict[str, torch.Tensor]) -> set[str]:
    grads = {name: torch.empty_like(t) for name, t in tree.items()}
    index = {id(t): name for pair in (tree, grads) for name, t in pair.items()}
    asked: set[int] = set()
    token = _PROBE.set(asked)
    try:
        tx.update(grads, tx.init(tree), tree)
        return {index[i] for i in asked if i in index}
    except Exception:  # noqa: BLE001 - a link that reads data: ask its links, or take it as element-wise
        links = getattr(getattr(tx, "spec", None), "links", ())
        return set().union(*(_asked(link, tree) for link in links)) if links else set()
    finally:
        _PROBE.reset(token)


def cut_tensors(leaves: Sequence[torch.Tensor], what: str = "which tensors a leaf holds pieces of"
                ) -> list[tuple[int, ...]] | None:
    """Per leaf, the whole tensors it holds pieces of (empty for a whole tensor in its own
    shape); None when every rank steps whole tensors, or outside a step (a transformation's
    init: the step checks). ``what`` names the asker in errors."""
    if _stepping_whole() or _current(_LEAVES) is None:
        return None
    sharding, pieces = _sharded(leaves, what)
    return [() if _whole(sharding, pc) and pc.lengths[0] == leaf.numel() and _own_shape(sharding, pc, leaf)
            else pc.tensors for leaf, pc in zip(leaves, pieces)]


def whole_tree() -> tuple[dict[str, torch.Tensor], list[int]]:
    """The step's whole tensors as a dict by name, each an empty ``meta`` tensor of its shape and
    dtype (for a rule's function of the params' tree, asked about the whole tensors), and which
    tensor each of the dict's leaves is, in ``tree_leaves`` order."""
    sharding = _current(_SHARDING)
    names = sharding.names if sharding is not None else ()
    if not names or len(set(names)) != len(names) or not sharding.shapes:
        raise ValueError("this sharded step does not know its tensors' names and shapes (or two share a name)")
    meta = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in zip(sharding.shapes, sharding.dtypes)]
    tree = dict(zip(names, meta))
    at = {id(x): t for t, x in enumerate(meta)}
    return tree, [at[id(x)] for x in optree.tree_leaves(tree)]


def name_of(t: int) -> str:
    """Whole tensor ``t``'s name in errors: its index, and its name when the step knows it."""
    sharding = _current(_SHARDING)
    return f"{t} ({sharding.names[t]})" if sharding is not None and sharding.names else str(t)


def _own_shape(sharding: Sharding, pc: Pieces, leaf: torch.Tensor) -> bool:
    return not sharding.shapes or tuple(leaf.shape) == tuple(sharding.shapes[pc.tensors[0]])


AxesOf = Callable[[tuple[int, ...]], tuple[int, ...] | None]


def every_axis(shape: tuple[int, ...]) -> tuple[int, ...]:
    """An `AxesOf` for sums over the whole tensor (its mean square: ``clip_by_block_rms``)."""
    return tuple(range(len(shape)))


def axis_sums(leaves: Sequence[torch.Tensor], axes_of: AxesOf) -> list[torch.Tensor | None]:
    """Per leaf, its whole tensor's sums over ``axes_of(shape)`` (keeping those axes as size 1),
    or None for a tensor ``axes_of`` leaves alone (returns None).

    Unsharded, or when this rank steps whole tensors: ``leaf.sum(axes, keepdim=True)``. Over a
    flat plan's pieces: a leaf-shaped tensor whose every element holds the sum of its unit
    (its tensor's elements that share its coordinates on the other axes), 0 for the elements of
    tensors left alone and for padding.
    """
    found = _pieces_of(leaves, "sums over a tensor's axes")
    if found is None:
        axes = [axes_of(tuple(x.shape)) for x in leaves]  # no walrus: torch.compile cannot trace one here
        return [None if a is None else _sum(x, a) for x, a in zip(leaves, axes)]
    sharding, pieces = found
    units, where = _units(sharding, axes_of)
    sums = torch.zeros(units, dtype=torch.float64)
    ids = [_unit_ids(sharding, pc, where, leaf.device) for pc, leaf in zip(pieces, leaves)]
    for leaf, (index, used) in zip(leaves, ids):
        if leaf.is_complex():
            raise ValueError("sums over a tensor's axes of complex pieces are not supported: use a whole-param plan")
        keep = index >= 0
        sums.index_add_(0, index[keep].cpu(), leaf.reshape(-1)[:used][keep].to(device="cpu", dtype=torch.float64))
    total = sharding.reduce(sums)
    return [_spread(total, index, used, leaf) for leaf, (index, used) in zip(leaves, ids)]


def axis_means(leaves: Sequence[torch.Tensor], axes_of: AxesOf) -> list[torch.Tensor | None]:
    """`axis_sums` divided by the number of elements each sum is over: ``leaf.mean(axes,
    keepdim=True)`` unsharded."""
    found = _pieces_of(leaves, "means over a tensor's axes")
    if found is None:
        axes = [axes_of(tuple(x.shape)) for x in leaves]  # no walrus: torch.compile cannot trace one here
        return [None if a is None else _mean(x, a) for x, a in zip(leaves, axes)]
    sharding, pieces = found
    counts = torch.tensor([math.prod(shape[a] for a in axes) if (axes := axes_of(shape)) is not None else 1
                           for shape in sharding.shapes], dtype=torch.float64)
    # padding has count 0 from _expand: clamp it to 1 (its sum is 0 as well)
    return [s / _expand(counts, pc, s).clamp(min=1) for s, pc in zip(axis_sums(leaves, axes_of), pieces)]


def _sum(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    return x.sum(dim=axes, keepdim=True) if axes else x.clone()  # torch reads dim=() as every axis


def _mean(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    return x.mean(dim=axes, keepdim=True) if axes else x.clone()


def _pieces_of(leaves: Sequence[torch.Tensor], what: str) -> tuple[Sharding, tuple[Pieces, ...]] | None:
    """The pieces of a flat plan's step, or None when every leaf is a whole tensor in its shape
    (no sharding, or a whole-param plan: per-tensor sums need no collective there)."""
    if _stepping_whole():
        return None
    sharding, stepped = _current(_SHARDING), _current(_LEAVES)
    if not sharding.shapes or any(not pc.starts for pc in (stepped or ())):
        raise ValueError(f"{what} needs the shapes of the tensors and where each piece starts; this backend's "
                         "sharding does not give them")
    return _sharded(leaves, what)


def _units(sharding: Sharding, axes_of: AxesOf) -> tuple[int, list]:
    """How many units all tensors have, and per tensor (first unit, strides of its kept axes as
    (stride in the tensor, size, stride among units)) or None when ``axes_of`` leaves it alone."""
    where, first = [], 0
    for shape in sharding.shapes:
        axes = axes_of(shape)
        if axes is None:
            where.append(None)
            continue
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        kept = [d for d in range(len(shape)) if d not in axes]
        unit_strides = [math.prod(shape[e] for e in kept[k + 1:]) for k in range(len(kept))]
        where.append((first, [(strides[d], shape[d], u) for d, u in zip(kept, unit_strides)]))
        first += math.prod(shape[d] for d in kept)
    return first, where


def _unit_ids(sharding: Sharding, pc: Pieces, where: list, device) -> tuple[torch.Tensor, int]:
    """The unit of each used element of a leaf (-1 where its tensor is left alone), and how many
    elements are used (the rest is padding)."""
    parts = []
    for t, start, length in zip(pc.tensors, pc.starts, pc.lengths):
        if where[t] is None:
            parts.append(torch.full((length,), -1, dtype=torch.int64, device=device))
            continue
        first, kept = where[t]
        idx = torch.arange(start, start + length, device=device)
        unit = torch.full_like(idx, first)
        for stride, size, unit_stride in kept:
            unit += (idx // stride) % size * unit_stride
        parts.append(unit)
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    return index, pc.used


def _spread(total: torch.Tensor, index: torch.Tensor, used: int, leaf: torch.Tensor) -> torch.Tensor:
    """Each used element of ``leaf`` gets its unit's sum (0 where left alone or padding)."""
    out = torch.zeros(leaf.numel(), dtype=leaf.dtype, device=leaf.device)
    if used:
        values = total.to(device=leaf.device, dtype=leaf.dtype)[index.clamp(min=0)]
        out[:used] = torch.where(index >= 0, values, torch.zeros((), dtype=leaf.dtype, device=leaf.device))
    return out.view(leaf.shape)


def _stepping_whole() -> bool:
    """No sharding, or every rank steps whole tensors only (a whole-param plan)."""
    sharding = _current(_SHARDING)
    return sharding is None or sharding.whole_params


def _whole(sharding: Sharding, pc: Pieces) -> bool:
    return len(pc.tensors) == 1 and bool(sharding.numels) and pc.lengths[0] == sharding.numels[pc.tensors[0]]


def all_finite(leaves: Sequence[torch.Tensor]) -> bool | torch.Tensor:
    """Whether every element of every leaf is finite, on every rank when sharded: a bool, or a
    0-d bool tensor when traced (`zero.functional.foreach.traced`), for a rule to select with."""
    bad = torch.stack([(~torch.isfinite(leaf)).sum() for leaf in leaves]).sum() if leaves else torch.zeros(())
    found = _sharded(leaves, "a finiteness check")
    if found is not None:
        bad = found[0].reduce(bad.to(torch.float64))
    return bad == 0 if traced() else int(bad) == 0


def quantized(leaves: Sequence[torch.Tensor], block: int, quantizes: Callable[[int], bool], what: str,
              bits: int = 8) -> list[bool]:
    """Per leaf, whether a rule that keeps state quantized in blocks of ``block`` elements (in
    each whole tensor's own element order) quantizes that leaf's: ``quantizes(numel)`` of the
    *whole* tensor it is, or holds pieces of, so that no plan changes which state a param gets.

    A leaf holding pieces (a flat plan's shard) can be quantized only if the plan cut its buffer
    at block edges (`Pieces.block`, from ``zero.make_plan(..., optimizer="adamw8bit")``): each
    block then lies whole in one leaf, and the leaf's blocks are its tensors' blocks. A shard
    that holds pieces of a param to quantize in a buffer cut otherwise is a ``ValueError`` naming
    the param. Asked on whole tensors by `block_sizes`, it records ``(bits, block)`` as well."""
    probe = _BLOCKS.get()
    if probe is not None:
        probe.update({id(leaf): (bits, block) for leaf in leaves if quantizes(leaf.numel())})
    sharding = _current(_SHARDING)
    if sharding is None or sharding.whole_params:
        return [quantizes(leaf.numel()) for leaf in leaves]
    return [_quantized_leaf(sharding, leaf, block, quantizes, what) for leaf in leaves]


def _quantized_leaf(sharding: Sharding, leaf: torch.Tensor, block: int, quantizes: Callable[[int], bool],
                    what: str) -> bool:
    pc = sharding.pieces.get(id(leaf))
    if pc is None:
        raise ValueError(f"{what} under a sharded optimizer got a tensor the backend did not register")
    if len(pc.tensors) == 1 and sharding.numels[pc.tensors[0]] == leaf.numel() == pc.used:
        return quantizes(leaf.numel())  # a whole param (a hybrid plan's): its own blocks
    wanted = [t for t in pc.tensors if quantizes(sharding.numels[t])]
    if pc.block != block and wanted:
        raise ValueError(f"{what} keeps param {name_of(wanted[0])}'s state in blocks of {block} elements, but this "
                         f"flat plan cuts its buffer {'at ' + str(pc.block) if pc.block else 'anywhere'}, so a block "
                         "could be split between ranks and its numbers change with the plan: make the plan with "
                         "zero.make_plan(..., optimizer='adamw8bit') (or '4bit', '/BLOCK'), or let "
                         "ZeroRedundancyOptimizer(..., strategy='flat') make it")
    others = [t for t in pc.tensors if t not in wanted]
    if pc.block == block and others:
        raise ValueError(f"{what}: this flat plan put param {name_of(others[0])}, whose state keeps full precision, "
                         "in a buffer cut for quantized state: it was made for another block size or threshold")
    return pc.block == block


def block_sizes(tx: Any, params: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, tuple[int, int]]:
    """The params (by name) whose state ``tx`` keeps quantized, each with its (bits, block size), asked
    of the rule itself: its ``init`` on whole ``meta`` tensors of these shapes and dtypes,
    recording what it asks `quantized`. What a flat plan must cut at block edges."""
    tree = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in params.items()}
    index = {id(t): name for name, t in tree.items()}
    found: dict[int, tuple[int, int]] = {}
    token = _BLOCKS.set(found)
    try:
        tx.init(tree)
    except Exception:  # noqa: BLE001 - a rule that cannot start on meta tensors keeps no quantized state we can see
        return {}
    finally:
        _BLOCKS.reset(token)
    return {index[i]: b for i, b in found.items() if i in index}
