"""Sums and means over some axes of each whole tensor (``centralize``'s row means,
``clip_by_block_rms``'s mean square, ``adaptive_grad_clip``'s unit norms): one partial sum per
piece and unit, one ``reduce`` of every unit of every tensor."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from zero.functional.sharding.context import Pieces, Sharding, current, flat_pieces
from zero.functional.sharding.norms import expand

__all__ = ["AxesOf", "every_axis", "axis_sums", "axis_means", "reads_axes"]

_PROBE: ContextVar[set[int] | None] = ContextVar("zero_axes_probe", default=None)  # see reads_axes


def reads_axes(tx: Any, params: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """The params (by name) whose sums over axes ``tx`` asks for (``centralize``,
    ``clip_by_block_rms``, ``adaptive_grad_clip``), asked of the rule on meta tensors: a backend
    whose pieces are not runs of a tensor's flattened elements (FSDP2's ``Shard(1)``) steps those
    params whole instead."""
    from zero.functional.sharding.whole import asked_of

    return asked_of(tx, params, _PROBE)


def _record(leaves: Sequence[torch.Tensor], axes_of: AxesOf) -> None:
    probe = current(_PROBE)  # (torch.compile cannot trace a ContextVar: None there)
    if probe is not None:
        probe.update(id(x) for x in leaves if axes_of(tuple(x.shape)) is not None)


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
    _record(leaves, axes_of)
    found = flat_pieces(leaves, "sums over a tensor's axes")
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
    _record(leaves, axes_of)
    found = flat_pieces(leaves, "means over a tensor's axes")
    if found is None:
        axes = [axes_of(tuple(x.shape)) for x in leaves]  # no walrus: torch.compile cannot trace one here
        return [None if a is None else _mean(x, a) for x, a in zip(leaves, axes)]
    sharding, pieces = found
    counts = torch.tensor([math.prod(shape[a] for a in axes) if (axes := axes_of(shape)) is not None else 1
                           for shape in sharding.shapes], dtype=torch.float64)
    # padding has count 0 from expand: clamp it to 1 (its sum is 0 as well)
    return [s / expand(counts, pc, s).clamp(min=1) for s, pc in zip(axis_sums(leaves, axes_of), pieces)]


def _sum(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    return x.sum(dim=axes, keepdim=True) if axes else x.clone()  # torch reads dim=() as every axis


def _mean(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    return x.mean(dim=axes, keepdim=True) if axes else x.clone()


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
