"""Packing a mesh's arrays into the 1-D buffers that execute a `zero.Plan`, and back.

Where each param's elements sit in those buffers (`Buffer`, `packing`) is the plan layer's
(`zero.plans.mesh_buffers`); this moves JAX arrays in and out of them (`pack`, `pack_slices`, `unpack`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zero.plans.mesh_buffers import Buffer, packing

__all__ = ["Buffer", "packing", "pack", "pack_slices", "unpack"]


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
