"""Orbax checkpoints of a mesh's optimizer state, restored under any plan and mesh size.

`save` writes the state as it is placed: every buffer leaf is a sharded array, so Orbax writes
each device's slice from that device (one chunk a device), and the plan goes beside it. `restore`
reads for each device of the new placement only the pieces of params that fall in its slice,
wherever they sat in the saved buffers (another mesh size, another strategy), so no device ever
holds more than its own slice.

A checkpoint is an Orbax directory (``ocp.CompositeCheckpointHandler``) with the items

- ``zero``: JSON: the format, the params' names, shapes and dtypes, the saved plan, and the
  state's nodes by their dotted path in Optax's state (``"0.mu"``, ``"0.count"``), each either
  per-param (one leaf per param, as Adam's ``mu``) or a leaf shared by the params (counts);
- ``state``: the arrays, ``n{j}.b{k}`` for per-param node ``j`` over buffer ``k``, ``s{j}`` for a
  shared leaf;
- ``params`` (when given): the params by name, replicated.

`zero.tools.convert` writes the same JSON over a checkpoint laid out per param instead
(``"layout": "params"``: one Orbax item ``p{i}`` per param, with its node leaves shaped like
it), so that a converted torch checkpoint streams tensor by tensor; `restore` reads both.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from zero.backends.jax_mesh.buffers import Buffer, packing
from zero.backends.jax_mesh.executor import _Placed
from zero.backends.jax_mesh.rules import is_per_param
from zero.plans.plan import Plan

__all__ = ["FORMAT", "save", "restore", "read_meta", "dotted", "Source"]

FORMAT = "zero.jax_mesh/1"


def dotted(path: tuple) -> str:
    """A JAX key path as `zero.functional`'s state keys spell it: ``(SequenceKey(0), GetAttrKey('mu'))``
    is ``"0.mu"`` (the keys DCP checkpoints of `zero.functional` rules use)."""
    parts = []
    for k in path:
        for attr in ("idx", "name", "key"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return ".".join(parts) or "state"


def _per_buffer(buffers: tuple[Buffer, ...]) -> Callable[[Any], bool]:
    view_def = jax.tree.structure(tuple(range(len(buffers))))
    shapes = [(b.length,) for b in buffers]
    return lambda node: is_per_param(node, view_def, shapes)


def save(path: str | os.PathLike, state: Any, plan: Plan, mesh: Mesh, axis: str = "data", *,
         params: Any = None) -> None:
    """Write ``state`` (from `init` or a step under ``plan``) with Orbax, each device its own
    slice, with ``params`` (replicated, optional) and the plan beside it.

    Saving over a checkpoint replaces it whole or not at all: the new one is written beside it
    and renamed into place once Orbax has finished it."""
    placed = _Placed(plan, mesh, axis)
    placed.refuse_hybrid("jax_mesh.save")
    names = [m.name for m in plan.metas]
    per_buffer = _per_buffer(placed.buffers)
    items, nodes = {}, []
    for j, (key_path, node) in enumerate(jax.tree_util.tree_flatten_with_path(state, is_leaf=per_buffer)[0]):
        if per_buffer(node):
            items.update({f"n{j}.b{k}": b for k, b in enumerate(node)})
            nodes.append({"path": dotted(key_path), "per_param": True, "dtype": np.dtype(node[0].dtype).name})
        else:
            items[f"s{j}"] = node
            nodes.append({"path": dotted(key_path), "per_param": False})
    meta = {"format": FORMAT, "layout": "buffers", "names": names, "shapes": [list(m.shape) for m in plan.metas],
            "dtypes": [m.dtype for m in plan.metas], "plan": plan.to_json(), "nodes": nodes,
            "has_params": params is not None}
    composite = {"state": ocp_args().PyTreeSave(items), "zero": ocp_args().JsonSave(meta)}
    if params is not None:
        composite["params"] = ocp_args().PyTreeSave(dict(zip(names, jax.tree.leaves(params))))
    write_replacing(path, lambda tmp: _checkpointer().save(tmp, ocp_args().Composite(**composite)))


def ocp_args():
    import orbax.checkpoint as ocp

    return ocp.args


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def write_replacing(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write`` a checkpoint into a sibling directory, then swap it into ``path``: a save that
    dies leaves the previous checkpoint whole."""
    final = os.path.abspath(os.fspath(path))
    tmp = f"{final}.saving-{uuid.uuid4().hex[:12]}"
    write(tmp)
    if os.path.exists(final):
        aside = f"{final}.replaced-{uuid.uuid4().hex[:12]}"
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside)
    else:
        os.rename(tmp, final)


def read_meta(path: str | os.PathLike) -> dict:
    """The ``zero`` item of a checkpoint; a ``ValueError`` when there is none or it is unfinished."""
    root = os.fspath(path)
    where = os.path.join(root, "zero", "metadata")
    if not os.path.exists(where):
        raise ValueError(f"no zero Orbax checkpoint at {root!r}: it has no zero/metadata (written by "
                         "jax_mesh.save or zero checkpoint convert; an unfinished save leaves none)")
    with open(where) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"the checkpoint at {root!r} is in format {meta.get('format')!r}, not {FORMAT!r}")
    return meta


class Source:
    """Reads pieces of a saved checkpoint's per-param state, and its shared leaves, with
    tensorstore: only the chunks a piece falls in are read. ``read_bytes`` counts what was asked."""

    def __init__(self, path: str | os.PathLike, meta: dict):
        import tensorstore as ts

        self._ts, self.root, self.meta = ts, os.path.abspath(os.fspath(path)), meta
        self.index = {n: i for i, n in enumerate(meta["names"])}
        self._open: dict[tuple[str, str], Any] = {}
        self.read_bytes = 0
        if meta["layout"] == "buffers":
            saved = Plan.from_json(meta["plan"])
            self._where = {}
            for k, b in enumerate(packing(saved)):
                for i, start in zip(b.params, b.starts):
                    self._where[i] = (k, start)

    def array(self, item: str, key: str) -> Any:
        if (item, key) not in self._open:
            spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{self.root}/{item}/",
                                                  "path": key}}
            self._open[item, key] = self._ts.open(spec, open=True, read=True).result()
        return self._open[item, key]

    def piece(self, node: int, param: int, lo: int, hi: int) -> np.ndarray:
        """Elements ``lo:hi`` of saved param ``param``'s leaf of per-param node ``node`` (flattened)."""
        if self.meta["layout"] == "buffers":
            k, start = self._where[param]
            out = self.array("state", f"n{node}.b{k}")[start + lo:start + hi].read().result()
        else:
            arr = self.array(f"p{param}", f"n{node}")
            shape = tuple(self.meta["shapes"][param])
            row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            if len(shape) == 0:
                out = np.asarray(arr.read().result()).reshape(-1)[lo:hi]
            else:  # the rows the range falls in, then the range within them
                first, last = lo // row, -(-hi // row)
                out = np.asarray(arr[first:last].read().result()).reshape(-1)[lo - first * row:hi - first * row]
        self.read_bytes += out.nbytes
        return np.asarray(out)

    def shared(self, node: int) -> np.ndarray:
        item = "state" if self.meta["layout"] == "buffers" else "shared"
        return np.asarray(self.array(item, f"s{node}").read().result())

    def param(self, param: int) -> np.ndarray | None:
        """A saved param whole (None when the checkpoint has no params)."""
        if self.meta["layout"] == "buffers":
            if not os.path.isdir(os.path.join(self.root, "params")):
                return None
            return np.asarray(self.array("params", self.meta["names"][param]).read().result())
        if not self.meta.get("has_params"):
            return None
        return np.asarray(self.array(f"p{param}", "param").read().result())


def restore(path: str | os.PathLike, tx: optax.GradientTransformation, params: Any, plan: Plan, mesh: Mesh,
            axis: str = "data", *, reads: dict[int, int] | None = None) -> tuple[Any, Any]:
    """``(params, state)`` of a checkpoint `save` (or ``zero checkpoint convert``) wrote, the state
    placed by ``plan`` along ``axis`` of ``mesh`` as `init` places it, to continue with
    `update(tx, plan, mesh)`. ``plan`` may differ from the saved one (another mesh size, another
    strategy): each device reads only the pieces of its own slice. ``params`` gives the tree (and
    the values, when the checkpoint holds none); the saved ones come back replicated.

    A ``ValueError`` names what does not fit: a param missing or reshaped, a state node ``tx``
    needs that the checkpoint lacks, another dtype. ``reads``, a dict, receives the bytes of
    per-param state each position along ``axis`` read."""
    placed = _Placed(plan, mesh, axis)
    placed.refuse_hybrid("jax_mesh.restore")
    placed.check(tx, params)
    meta = read_meta(path)
    source = Source(path, meta)
    mapping = _match_params(meta, plan)
    view = placed.view_of(params)
    per_buffer = _per_buffer(placed.buffers)
    found, upper = jax.tree_util.tree_flatten(jax.eval_shape(tx.init, view), is_leaf=per_buffer)
    paths = [dotted(p) for p, _ in jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, view),
                                                                         is_leaf=per_buffer)[0]]
    saved = {n["path"]: (j, n) for j, n in enumerate(meta["nodes"])}
    out = []
    for p, node in zip(paths, found):
        if p not in saved:
            raise ValueError(f"this transformation's state has {p!r}, which the checkpoint at {os.fspath(path)!r} "
                             f"lacks (it holds {sorted(saved)}): restore with the rule it was saved with")
        j, info = saved[p]
        if per_buffer(node):
            if not info["per_param"]:
                raise ValueError(f"state {p!r} is per param here but shared in the checkpoint")
            out.append(tuple(_buffer(source, j, b, leaf, placed, mapping, reads)
                             for b, leaf in zip(placed.buffers, node)))
        else:
            value = source.shared(j)
            _check_dtype(p, value.dtype, node.dtype)
            out.append(jax.device_put(value.reshape(node.shape), placed.replicated))
    state = upper.unflatten(out)
    return _params(source, params, mapping, placed), state


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


def _check_dtype(what: str, saved: Any, here: Any) -> None:
    if np.dtype(saved) != np.dtype(here):
        raise ValueError(f"state {what!r} is {np.dtype(saved).name} in the checkpoint but {np.dtype(here).name} "
                         "here: restore with params and a rule of the saved dtypes")


def _buffer(source: Source, node: int, buf: Buffer, like: Any, placed: _Placed, mapping: list[int],
            reads: dict[int, int] | None) -> jax.Array:
    """One buffer leaf of the new placement, each device's slice read from its pieces alone."""
    dtype = np.dtype(like.dtype)
    _check_dtype(source.meta["nodes"][node]["path"], source.meta["nodes"][node]["dtype"], dtype)

    def slice_of(index: tuple[slice, ...]) -> np.ndarray:
        lo, hi, _ = index[0].indices(buf.length)
        out, before = np.zeros(hi - lo, dtype), source.read_bytes
        for i, start, size in zip(buf.params, buf.starts, buf.sizes):
            a, b = max(start, lo), min(start + size, hi)
            if a < b:
                out[a - lo:b - lo] = source.piece(node, mapping[i], a - start, b - start)
        if reads is not None:
            rank = lo // (buf.length // placed.plan.world_size)
            reads[rank] = reads.get(rank, 0) + source.read_bytes - before
        return out

    return jax.make_array_from_callback((buf.length,), placed.sharded, slice_of)


def _params(source: Source, params: Any, mapping: list[int], placed: _Placed) -> Any:
    leaves, treedef = jax.tree.flatten(params)
    saved = [source.param(i) for i in mapping]
    if any(s is None for s in saved):
        return jax.device_put(params, placed.replicated)
    for s, x in zip(saved, leaves):
        _check_dtype("params", s.dtype, x.dtype)
    return jax.device_put(treedef.unflatten([s.reshape(np.shape(x)) for s, x in zip(saved, leaves)]),
                          placed.replicated)
