"""Where each param's elements sit in the 1-D buffers a JAX mesh steps, read from a `zero.Plan`
(`packing`; `zero.backends.jax_mesh.buffers` packs and unpacks them, and the Orbax format reads
saved pieces by them).

A mesh shards an array in equal slices along one axis, so every layout here is a set of 1-D
buffers whose length is a multiple of the mesh size: device ``r`` holds elements
``r * length / W`` onwards. A flat plan's buffers are the torch backend's flat buffers, element
for element. A whole-param plan's are rows, one per rank and dtype, each holding its owner's
params back to back: the buffer is the rows laid end to end, each padded to the longest, so
that device ``r``'s slice is exactly rank ``r``'s params (JAX shards evenly; the shorter rows
carry padding, which `Buffer.owned` leaves out).
"""

from __future__ import annotations

from dataclasses import dataclass

from zero.plans.layout import bucket_views
from zero.plans.plan import Plan

__all__ = ["Buffer", "packing"]


@dataclass(frozen=True)
class Buffer:
    """``params[k]`` (indices into the plan's metas) occupies ``starts[k]:starts[k] + sizes[k]``;
    ``owned[r]`` is how many of rank ``r``'s ``length / W`` elements are params, not padding."""

    dtype: str
    length: int
    params: tuple[int, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    owned: tuple[int, ...]


def packing(plan: Plan) -> tuple[Buffer, ...]:
    """The buffers that execute ``plan``: its flat buffers, or one row buffer per dtype."""
    if plan.flat is not None:
        return tuple(_flat_buffer(b, plan.world_size) for b in plan.flat.buffers)
    layout = bucket_views(plan.metas, plan.partition, align_bytes=1)  # back to back: no kernel needs alignment
    return tuple(_row_buffer(layout.at(key), plan.metas) for key in layout.keys())


def _flat_buffer(buf, world_size: int) -> Buffer:
    owned = [0] * world_size
    for segs in buf.segments:
        for s in segs:
            owned[s.rank] += s.end - s.start
    sizes = tuple(sum(s.end - s.start for s in segs) for segs in buf.segments)
    return Buffer(buf.dtype, buf.padded_numel, buf.params, buf.offsets, sizes, tuple(owned))


def _row_buffer(rows, metas) -> Buffer:
    width = max(1, max(b.numel for b in rows))  # a rank that owns nothing of this dtype still has a row
    params, starts, sizes = [], [], []
    for rank, row in enumerate(rows):
        params += row.params
        starts += [rank * width + off for off in row.offsets]
        sizes += [metas[i].numel for i in row.params]
    return Buffer(rows[0].dtype, width * len(rows), tuple(params), tuple(starts), tuple(sizes),
                  tuple(b.numel for b in rows))
