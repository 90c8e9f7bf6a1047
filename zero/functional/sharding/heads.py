"""Rules that need whole *heads* rather than whole tensors (per-head Muon): a weight whose first
axis is cut into ``H`` heads of ``d`` rows is ``H`` matrices, so a rank holding some whole heads
of it (FSDP2's rows when they fall on head edges, a run cut at head edges over HSDP's replicas)
can step them where they lie, with no exchange (`whole_heads`); and the probe that asks a rule
which params it reads by heads (`head_counts`, on meta tensors), from which a plan cuts them at
head edges where it can."""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import torch

from zero.functional.sharding.context import LEAVES, SHARDING, Pieces, Sharding, current, sharded
from zero.functional.sharding.whole import PROBE, _asked, cut_tensors, refuse_together

__all__ = ["whole_heads", "reads_heads", "head_counts", "whole_shapes"]

_HEADS: ContextVar[dict[int, int] | None] = ContextVar("zero_head_probe", default=None)  # see head_counts
_COST_HEADS: ContextVar[dict[int, int] | None] = ContextVar("zero_cost_head_probe", default=None)  # the same


def reads_heads(leaves: Sequence[torch.Tensor], heads: Sequence[int | None]) -> None:
    """Say that a rule keeps each leaf's state and work per head along its first axis
    (``heads[j]``; per-head SOAP's factors, Shampoo's blocks) though it needs the tensor whole:
    what `head_counts` (``costs=True``) records for a plan's costs. No effect in a step."""
    _record(_COST_HEADS, leaves, heads)


def _record(var: ContextVar, leaves: Sequence[torch.Tensor], heads: Sequence[int | None]) -> None:
    """Each leaf's heads into the probe ``var`` holds, when one is asking."""
    probe = current(var)
    if probe is not None:
        probe.update({id(leaf): h for leaf, h in zip(leaves, heads) if h and h > 1})


def whole_heads(leaves: Sequence[torch.Tensor], what: str, heads: Sequence[int | None]
                ) -> list[tuple[int, tuple[int, ...]]]:
    """Per leaf, ``(k, shape)``: the heads it holds and the shape to read it in (the whole
    tensor's, with ``k * d`` rows). ``heads[j]`` is leaf ``j``'s whole tensor's heads along its
    first axis (None or 1: it has none, and must be whole).

    A whole leaf holds all its heads, in its own shape. A piece of one tensor (FSDP2's rows, a run
    of them) is stepped where it lies when it is whole heads: it starts and ends at head edges of
    the flattened tensor. Any other piece is a ``ValueError`` on every rank (as `whole_tensors`),
    naming the param. Asked by `head_counts` or `needs_whole` on whole meta tensors, it records."""
    _record(_HEADS, leaves, heads)
    reads_heads(leaves, heads)
    needs = current(PROBE)
    if needs is not None:  # a plan keeps them whole unless it cuts them at head edges (it asks head_counts too)
        needs.update(id(leaf) for leaf in leaves)
    found = cut_tensors(leaves, what)
    if found is None:
        return [(h or 1, tuple(leaf.shape)) for leaf, h in zip(leaves, heads)]
    (sharding, pieces), out, bad = sharded(leaves, what), [], set()
    for leaf, h, ts, pc in zip(leaves, heads, found, pieces):
        held = (h or 1, tuple(leaf.shape)) if not ts else _in_piece(sharding, pc, leaf, h)
        if held is None:
            bad.update(ts)
        out.append(held or (1, tuple(leaf.shape)))
    refuse_together(sharding, bad, f"{what} needs each tensor whole, or whole heads of it")
    return out


def _in_piece(sharding: Sharding, pc: Pieces, leaf: torch.Tensor, h: int | None) -> tuple[int, tuple[int, ...]] | None:
    """The heads a piece holds and its shape, when it is whole heads of one tensor; else None."""
    if not h or h < 2 or len(pc.tensors) != 1 or not pc.starts or not sharding.shapes:
        return None
    shape = tuple(sharding.shapes[pc.tensors[0]])
    per = math.prod(shape) // h
    if pc.used != leaf.numel() or pc.starts[0] % per or pc.lengths[0] % per:
        return None
    k = pc.lengths[0] // per
    return k, (k * shape[0] // h, *shape[1:])


def head_counts(tx: Any, params: dict[str, tuple[tuple[int, ...], torch.dtype]], costs: bool = False
                ) -> dict[str, int]:
    """The params (by name) ``tx`` reads by heads along their first axis, each with its heads,
    asked of the rule itself: one ``init`` and ``update`` on ``meta`` tensors, recording what
    its `whole_heads` checks say. A plan may cut these at head edges instead of keeping them whole.
    ``costs``: also those whose state and work are per head but that are stepped whole
    (`reads_heads`: per-head SOAP and Shampoo), for a plan's costs."""
    tree = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in params.items()}
    found: dict[str, int] = {}
    _asked(tx, tree, _COST_HEADS if costs else _HEADS, found)
    return {name: found[name] for name in params if name in found}


def whole_shapes(leaves: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """Per leaf, the shape of the whole tensor it is, or holds a piece of (its own shape when it
    holds pieces of several, or no sharding says): for per-tensor constants such as a matrix's
    fans, which a piece shares with its whole. No collective."""
    sharding, pieces = current(SHARDING), current(LEAVES)
    if sharding is None or not sharding.shapes or pieces is None or len(pieces) != len(leaves):
        return [tuple(leaf.shape) for leaf in leaves]
    return [tuple(sharding.shapes[pc.tensors[0]]) if len(pc.tensors) == 1 else tuple(leaf.shape)
            for leaf, pc in zip(leaves, pieces)]
