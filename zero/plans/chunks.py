"""Where each rank's piece of a parameter's state sits, as chunks of the parameter's own shape.

A sharded checkpoint (`torch.distributed.checkpoint`) stores every tensor as rectangular chunks
of its global shape, each with offsets: that is how it reshards on load, between any two
chunkings. A whole-param plan gives each param's state to one rank: one chunk, the whole shape.
A flat plan gives a rank a range of the param's flattened elements, which is a rectangle only
when it starts and ends on whole rows; `range_boxes` cuts any range into the few rectangles,
each contiguous in row-major order, that cover it exactly. So the saved tensors keep the params'
shapes (FSDP2 and a plain ``torch.save`` of the same model read them as theirs) and each box is
a view into the rank's 1-D state, copied neither on save nor on load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from zero.plans.layout import FlatLayout
from zero.plans.partition import Partition

__all__ = ["Box", "Held", "range_boxes", "param_chunks"]


@dataclass(frozen=True)
class Box:
    """A rectangle ``offsets``/``sizes`` of a param's shape; its elements are contiguous in
    row-major order and the first is element ``start`` of the flattened param."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return prod(self.sizes)


@dataclass(frozen=True)
class Held:
    """Elements ``start:end`` of param ``param`` (flattened) are at ``offset`` of local tensor ``local``
    (the rank's local optimizer's ``local``-th param: an owned param, or a flat shard; see
    `zero.plans.holdings`)."""

    param: int
    local: int
    offset: int
    start: int
    end: int


def range_boxes(shape: Sequence[int], start: int, end: int) -> tuple[Box, ...]:
    """The boxes, in element order, that cover flattened elements ``start:end`` of a row-major
    tensor of ``shape``: at most two per dimension (a partial row at each end, whole rows between)."""
    shape = tuple(int(d) for d in shape)
    numel = prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"range {start}:{end} is not inside a tensor of shape {shape} ({numel} elements)")
    if start == end:
        return ()
    return tuple(_boxes(shape, 0, (), start, end, 0))


def _boxes(shape: tuple[int, ...], dim: int, lead: tuple[int, ...], lo: int, hi: int, base: int) -> list[Box]:
    """Boxes for elements ``lo:hi`` of the sub-tensor at index ``lead`` (dims before ``dim``)."""
    if dim == len(shape):  # a scalar: the one element
        return [Box(lead, (), base)]
    inner = prod(shape[dim + 1:])
    rest = shape[dim + 1:]
    if lo % inner == 0 and hi % inner == 0:
        return [Box(lead + (lo // inner,) + (0,) * len(rest), ((1,) * len(lead)) + ((hi - lo) // inner,) + rest,
                    base + lo)]
    out: list[Box] = []
    first = lo // inner
    if lo % inner:  # a partial first row
        row_hi = min(hi, (first + 1) * inner)
        out += _boxes(shape, dim + 1, lead + (first,), lo - first * inner, row_hi - first * inner, base + first * inner)
        lo = row_hi
    if lo < hi and hi // inner > lo // inner:  # whole rows
        out += _boxes(shape, dim, lead, lo, hi // inner * inner, base)
        lo = hi // inner * inner
    if lo < hi:  # a partial last row
        last = lo // inner
        out += _boxes(shape, dim + 1, lead + (last,), 0, hi - last * inner, base + last * inner)
    return out


def param_chunks(index: int, numel: int, partition: Partition | None,
                 flat: FlatLayout | None) -> tuple[tuple[int, int, int], ...]:
    """Every rank's ``(rank, start, end)`` range of param ``index``'s elements: the owner's whole
    range under a whole-param plan, the flat layout's segments under a flat one; under a hybrid
    (both given), the owner's for the params it keeps whole (owner >= 0), else the segments."""
    if partition is not None and (flat is None or partition.owner[index] >= 0):
        return ((partition.owner[index], 0, numel),) if numel else ()
    assert flat is not None
    return tuple((s.rank, s.start, s.end) for s in flat.segments(index) if s.end > s.start)

