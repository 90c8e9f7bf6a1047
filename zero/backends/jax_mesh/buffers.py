"""Where each param's elements sit in the buffers a mesh steps, read from a `zero.Plan`.

A mesh shards an array in equal slices along one axis, so every layout here is a set of 1-D
buffers whose length is a multiple of the mesh size: device ``r`` holds elements
``r * length / W`` onwards. A flat plan's buffers are the torch backend's flat buffers, element
for element. A whole-param plan's are rows, one per rank and dtype, each holding its owner's
params back to back: the buffer is the rows laid end to end, each padded to the longest, so
that device ``r``'s slice is exactly rank ``r``'s params (JAX shards evenly; the shorter rows
carry padding, which `Buffer.owned` leaves out).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zero.plans.layout import bucket_views
from zero.plans.plan import Plan

__all__ = ["Buffer", "packing", "pack", "pack_slices", "unpack"]


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


def pack(leaves: Sequence[jax.Array], buffers: Sequence[Buffer], xp: Any = jnp) -> tuple[jax.Array, ...]:
    """Each buffer filled from ``leaves`` (flattened, in plan order), zeros between and after;
    ``xp=numpy`` packs on the host."""
    return _slices(leaves, buffers, rank=0, world=1, xp=xp)  # one rank's slice of one rank is the whole


def pack_slices(leaves: Sequence[jax.Array], buffers: Sequence[Buffer], mesh: Any, axis: str) -> tuple[jax.Array, ...]:
    """`pack`, sharded along ``axis`` of ``mesh``, with each device copying only the pieces of
    its own slice out of the (replicated) ``leaves``: packing whole buffers first would copy every
    param on every device."""
    world = mesh.shape[axis]
    branches = [functools.partial(_slices, buffers=buffers, rank=r, world=world) for r in range(world)]

    def local(leaves):
        return jax.lax.switch(jax.lax.axis_index(axis), branches, leaves)

    specs = tuple(PartitionSpec(axis) for _ in buffers)
    return jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(), out_specs=specs, check_vma=False)(list(leaves))


def _slices(leaves, buffers: Sequence[Buffer], rank: int, world: int, xp: Any = jnp) -> tuple[jax.Array, ...]:
    """Rank ``rank``'s slice of every buffer (of ``world`` equal ones), from the pieces of params
    that fall in it, zeros between and after."""
    out = []
    for buf in buffers:
        width, dtype = buf.length // world, leaves[buf.params[0]].dtype if buf.params else xp.float32
        lo, hi, parts = rank * width, (rank + 1) * width, []
        pos = lo
        for i, start, size in sorted(zip(buf.params, buf.starts, buf.sizes), key=lambda e: e[1]):
            a, b = max(start, lo), min(start + size, hi)
            if a >= b:
                continue
            if a > pos:
                parts.append(xp.zeros(a - pos, dtype))
            parts.append(xp.ravel(leaves[i])[a - start:b - start].astype(dtype))
            pos = b
        parts.append(xp.zeros(hi - pos, dtype))
        out.append(xp.concatenate(parts))
    return tuple(out)


def unpack(view: Sequence[jax.Array], buffers: Sequence[Buffer], like: Sequence[jax.Array]) -> list[jax.Array]:
    """The leaves ``like`` with every packed param read back out of ``view`` (others kept)."""
    out = list(like)
    for buf, flat in zip(buffers, view):
        for i, start, size in zip(buf.params, buf.starts, buf.sizes):
            out[i] = flat[start:start + size].reshape(like[i].shape)
    return out
