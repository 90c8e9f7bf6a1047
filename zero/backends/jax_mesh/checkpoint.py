"""Orbax checkpoints of a mesh's optimizer state, restored under any plan and mesh size.

`save` writes the state as it is placed: every buffer leaf is a sharded array, so Orbax writes
each device's slice from that device (one chunk a device), and the plan goes beside it. `restore`
reads for each device of the new placement only the pieces of params that fall in its slice,
wherever they sat in the saved buffers (another mesh size, another strategy), so no device ever
holds more than its own slice.

The format on disk is `zero.backends.orbax_format`'s (the converter writes and reads it too).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from zero.backends.jax_mesh.buffers import Buffer
from zero.backends.jax_mesh.executor import Placed
from zero.backends.jax_mesh.hybrid import HybridState, WholeParams, masked
from zero.backends.jax_mesh.rules import is_per_param
from zero.backends.orbax_format import (
    FORMAT,
    Source,
    check,
    checkpointer,
    checksums,
    dotted,
    ocp_args,
    read_meta,
    write_replacing,
)
from zero.plans.plan import Plan

__all__ = ["save", "restore"]

def _per_buffer(buffers: tuple[Buffer, ...]) -> Callable[[Any], bool]:
    view_def = jax.tree.structure(tuple(range(len(buffers))))
    shapes = [(b.length,) for b in buffers]
    return lambda node: is_per_param(node, view_def, shapes)


def save(path: str | os.PathLike, state: Any, plan: Plan, mesh: Mesh, axis: str = "data", *,
         params: Any = None, tx: optax.GradientTransformation | None = None) -> None:
    """Write ``state`` (from `init` or a step under ``plan``) with Orbax, each device its own
    slice, with ``params`` (replicated, optional) and the plan beside it. A hybrid plan's state
    needs ``params`` and ``tx`` too: its rows hold each rank's ``tx.init`` of its own params,
    laid out by them.

    Saving over a checkpoint replaces it whole or not at all: the new one is written beside it
    and renamed into place once Orbax has finished it."""
    placed = Placed(plan, mesh, axis)
    names = [m.name for m in plan.metas]
    if plan.hybrid and (tx is None or params is None or not isinstance(state, HybridState)):
        raise ValueError("a hybrid plan's state (a HybridState, from jax_mesh.init under the plan) is saved with the "
                         "rule and the params that lay out its rows: save(path, state, plan, mesh, params=params, "
                         "tx=tx)")
    items, nodes = _flat_items(state.flat if plan.hybrid else state, placed)
    meta = {"format": FORMAT, "layout": "buffers", "names": names, "shapes": [list(m.shape) for m in plan.metas],
            "dtypes": [m.dtype for m in plan.metas], "plan": plan.to_json(), "nodes": nodes,
            "has_params": params is not None}
    if plan.hybrid:
        meta["whole"] = _whole_items(state.whole, placed.whole_params(tx, params), params, items, nodes)
    saved_params = dict(zip(names, jax.tree.leaves(params))) if params is not None else {}
    meta["checksums"] = {**checksums("state", items), **checksums("params", saved_params)}
    composite = {"state": ocp_args().PyTreeSave(items), "zero": ocp_args().JsonSave(meta)}
    if params is not None:
        composite["params"] = ocp_args().PyTreeSave(saved_params)
    write_replacing(path, lambda tmp: checkpointer().save(tmp, ocp_args().Composite(**composite)))


def _flat_items(state: Any, placed: Placed) -> tuple[dict, list[dict]]:
    """The arrays and node descriptions of a state over the plan's buffers."""
    per_buffer = _per_buffer(placed.buffers)
    items, nodes = {}, []
    for j, (key_path, node) in enumerate(jax.tree_util.tree_flatten_with_path(state, is_leaf=per_buffer)[0]):
        if per_buffer(node):
            items.update({f"n{j}.b{k}": b for k, b in enumerate(node)})
            nodes.append({"path": dotted(key_path), "per_param": True, "flat": True,
                          "dtype": np.dtype(node[0].dtype).name})
        else:
            items[f"s{j}"] = node
            nodes.append({"path": dotted(key_path), "per_param": False})
    return items, nodes


def _whole_items(rows: tuple, whole: WholeParams, params: Any, items: dict, nodes: list[dict]) -> dict:
    """A hybrid state's rows into ``items`` (as placed: each device writes its own), the nodes only
    they hold into ``nodes``; returns where each rank's leaves sit in them."""
    if tuple(r.shape for r in rows) != tuple(s.shape for s in whole.state.shapes()):
        raise ValueError(f"the state's rows have shapes {[r.shape for r in rows]}, not those of this rule's state "
                         f"under the plan {[s.shape for s in whole.state.shapes()]}: pass the tx it was made with")
    known = {n["path"] for n in nodes}
    slots = []
    for r, roles in enumerate(whole_roles(whole, params)):
        mine = []
        for (path, i), (d, start, size), like in zip(roles, whole.state.slots[r], whole.state_like[r]):
            mine.append([path, i, d, start, size, list(like.shape)])
            if path not in known:
                known.add(path)
                nodes.append({"path": path, "per_param": i is not None, "flat": False,
                              **({"dtype": whole.state.dtypes[d]} if i is not None else {})})
        slots.append(mine)
    items.update({f"w{d}": row for d, row in enumerate(rows)})
    return {"dtypes": list(whole.state.dtypes), "width": list(whole.state.width), "slots": slots}


def _holds_params(node: Any, treedef: Any, shapes: list) -> bool:
    return is_per_param(node, treedef, shapes)


def whole_roles(whole: WholeParams, params: Any) -> list[list[tuple[str, int | None]]]:
    """For each rank, each leaf of its state: ``(node path, param)`` for a per-param leaf (Muon's
    momentum of one matrix), ``(leaf path, None)`` for a leaf its params share (counts)."""
    leaves, out = jax.tree.leaves(params), []
    for r, mine in enumerate(whole.owned):
        treedef = jax.tree.structure(masked(params, mine))
        shapes = [tuple(np.shape(leaves[i])) for i in mine]
        per_param = functools.partial(_holds_params, treedef=treedef, shapes=shapes)
        state = whole.state_defs[r].unflatten(whole.state_like[r])
        roles: list[tuple[str, int | None]] = []
        for key_path, node in jax.tree_util.tree_flatten_with_path(state, is_leaf=per_param)[0]:
            roles += [(dotted(key_path), i) for i in mine] if per_param(node) else [(dotted(key_path), None)]
        out.append(roles)
    return out


def restore(path: str | os.PathLike, tx: optax.GradientTransformation, params: Any, plan: Plan, mesh: Mesh,
            axis: str = "data", *, reads: dict[int, int] | None = None) -> tuple[Any, Any]:
    """``(params, state)`` of a checkpoint `save` (or ``zero checkpoint convert``) wrote, the state
    placed by ``plan`` along ``axis`` of ``mesh`` as `init` places it, to continue with
    `update(tx, plan, mesh)`. ``plan`` may differ from the saved one (another mesh size, another
    strategy; a hybrid plan's whole params another owner): each device reads only the pieces of
    its own slice, or its own whole params' state. ``params`` gives the tree (and the values, when
    the checkpoint holds none); the saved ones come back replicated.

    A ``ValueError`` names what does not fit: a piece whose bytes changed since the save (every
    piece carries a checksum, checked first: `verify`), a param missing or reshaped, a state node
    ``tx`` needs that the checkpoint lacks, another dtype. ``reads``, a dict, receives the bytes of
    per-param state each position along ``axis`` read."""
    placed = Placed(plan, mesh, axis)
    placed.check(tx, params)
    meta = read_meta(path)
    check(path, meta)
    source = Source(path, meta)
    mapping = _match_params(source.meta, plan)
    reads = {} if reads is None else reads
    per_buffer = _per_buffer(placed.buffers)
    found, upper = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, placed.view_of(params)),
                                                        is_leaf=per_buffer)
    out = []
    for key_path, node in found:
        p = dotted(key_path)
        source.require(p)
        if per_buffer(node):
            out.append(tuple(_buffer(source, p, b, leaf, placed, mapping, reads)
                             for b, leaf in zip(placed.buffers, node)))
        else:
            value = _shared(source, p, node)
            out.append(jax.device_put(value, placed.replicated))
    state = upper.unflatten(out)
    whole = placed.whole_params(tx, params)
    if whole is not None:
        state = HybridState(state, _rows(source, whole, whole_roles(whole, params), placed, mapping, reads))
    return _params(source, params, mapping, placed), state


def _rows(source: Source, whole: WholeParams, roles: list, placed: Placed, mapping: list[int],
          reads: dict[int, int]) -> tuple[jax.Array, ...]:
    """A hybrid plan's state rows, each device's built from its own params' saved state alone."""
    built: dict[int, tuple[np.ndarray, ...]] = {}

    def rank_rows(r: int) -> tuple[np.ndarray, ...]:
        if r not in built:
            before, leaves = source.read_bytes, []
            for (path, i), like in zip(roles[r], whole.state_like[r]):
                numel = int(np.prod(like.shape))
                value = _shared(source, path, like) if i is None else source.piece(path, mapping[i], 0, numel)
                _check_dtype(path, value.dtype, like.dtype)
                leaves.append(value.reshape(like.shape))
            built[r] = whole.state.pack(r, leaves, np)
            reads[r] = reads.get(r, 0) + source.read_bytes - before
        return built[r]

    def row(d: int, width: int) -> jax.Array:
        return jax.make_array_from_callback((placed.plan.world_size * width,), placed.sharded,
                                            lambda index: rank_rows((index[0].start or 0) // width)[d])

    return tuple(row(d, w) for d, w in enumerate(whole.state.width))


def _match_params(meta: dict, plan: Plan) -> list[int]:
    """For each of the plan's params, its index in the checkpoint (by name, same shape)."""
    index = {n: i for i, n in enumerate(meta["names"])}
    out = []
    for m in plan.metas:
        if m.name not in index:
            raise ValueError(f"the checkpoint has no param {m.name!r}; it holds {meta['names'][:8]}"
                             f"{' ...' if len(meta['names']) > 8 else ''}")
        i = index[m.name]
        if tuple(meta["shapes"][i]) != tuple(m.shape):
            raise ValueError(f"param {m.name!r} has shape {tuple(m.shape)} here but {tuple(meta['shapes'][i])} in the "
                             "checkpoint")
        out.append(i)
    extra = sorted(set(meta["names"]) - {m.name for m in plan.metas})
    if extra:
        raise ValueError(f"the checkpoint holds params these do not have: {extra[:8]}")
    return out


def _shared(source: Source, path: str, like: Any) -> np.ndarray:
    """A shared leaf (a count, a hyperparameter) as ``like`` has it: a float of another width is
    cast (torch keeps injected hyperparameters in float64, Optax in float32), another kind is not."""
    value = source.shared(path)
    if np.dtype(value.dtype).kind == np.dtype(like.dtype).kind and value.dtype != like.dtype:
        value = value.astype(like.dtype)
    _check_dtype(path, value.dtype, like.dtype)
    return value.reshape(like.shape)


def _check_dtype(what: str, saved: Any, here: Any) -> None:
    if np.dtype(saved) != np.dtype(here):
        raise ValueError(f"state {what!r} is {np.dtype(saved).name} in the checkpoint but {np.dtype(here).name} "
                         "here: restore with params and a rule of the saved dtypes")


def _buffer(source: Source, node: str, buf: Buffer, like: Any, placed: Placed, mapping: list[int],
            reads: dict[int, int]) -> jax.Array:
    """One buffer leaf of the new placement, each device's slice read from its pieces alone."""
    dtype = np.dtype(like.dtype)

    def slice_of(index: tuple[slice, ...]) -> np.ndarray:
        lo, hi, _ = index[0].indices(buf.length)
        out, before = np.zeros(hi - lo, dtype), source.read_bytes
        for i, start, size in zip(buf.params, buf.starts, buf.sizes):
            a, b = max(start, lo), min(start + size, hi)
            if a < b:
                piece = source.piece(node, mapping[i], a - start, b - start)
                _check_dtype(node, piece.dtype, dtype)
                out[a - lo:b - lo] = piece
        rank = lo // (buf.length // placed.plan.world_size)
        reads[rank] = reads.get(rank, 0) + source.read_bytes - before
        return out

    return jax.make_array_from_callback((buf.length,), placed.sharded, slice_of)


def _params(source: Source, params: Any, mapping: list[int], placed: Placed) -> Any:
    leaves, treedef = jax.tree.flatten(params)
    saved = [source.param(i) for i in mapping]
    if any(s is None for s in saved):
        return jax.device_put(params, placed.replicated)
    for s, x in zip(saved, leaves):
        _check_dtype("params", s.dtype, x.dtype)
    return jax.device_put(treedef.unflatten([s.reshape(np.shape(x)) for s, x in zip(saved, leaves)]),
                          placed.replicated)
