"""The on-disk format of zero's Orbax checkpoints, owned here: `zero.backends.jax_mesh` writes and
reads it (`save`, `restore`), `zero.backends.checkpoint.convert` writes it from DCP and reads it
back to DCP. Nothing else spells it.

A checkpoint is an Orbax directory (``ocp.CompositeCheckpointHandler``) with the items

- ``zero``: JSON (`read_meta`): the format (`FORMAT`), the params' names, shapes and dtypes, the
  saved plan, the state's nodes by their dotted path in Optax's state (``"0.mu"``, `dotted`),
  each per-param (one leaf per param, as Adam's ``mu``) or shared by the params (counts), and
  the checksums of every piece written (`checksums`, `verify`, `check`);
- ``state``: the arrays, ``n{j}.b{k}`` for per-param node ``j`` over buffer ``k`` (the plan's
  buffers, `zero.backends.jax_mesh.packing`), ``w{d}`` for a hybrid plan's rows of dtype ``d``,
  ``s{j}`` for a shared leaf;
- ``params`` (when given): the params by name, replicated.

The converter lays the state out per param instead (``"layout": "params"``: one Orbax item
``p{i}`` per param, with its node leaves shaped like it), so that a torch checkpoint streams
tensor by tensor. `Source` reads pieces of either layout with tensorstore. A checkpoint is
written beside its path and swapped in (`write_replacing`): never half-written.
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

from zero.backends.checksums import digest, warn_unverified
from zero.plans.mesh_buffers import packing
from zero.plans.plan import Plan

__all__ = ["FORMAT", "dotted", "checksums", "verify", "check", "ocp_args", "checkpointer", "write_replacing",
           "read_meta", "Source"]

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


def checksums(item: str, arrays: dict) -> dict[str, list[list]]:
    """Per array of Orbax item ``item`` (``"item/key"``), the hash of each piece as written: each
    device's slice of a sharded buffer, the whole of anything else, as ``[start, stop, hash]`` over
    its flattened elements (`zero.backends.checksums`)."""
    out = {}
    for key, arr in arrays.items():
        pieces: dict[tuple[int, int], str] = {}
        sharded = isinstance(arr, jax.Array) and np.ndim(arr) == 1 and not arr.sharding.is_fully_replicated
        for shard in arr.addressable_shards if sharded else ():
            part = shard.index[0]
            span = (part.start or 0, arr.shape[0] if part.stop is None else part.stop)
            if span not in pieces:  # a slice held by several devices is written once
                pieces[span] = digest(np.ascontiguousarray(np.asarray(shard.data)))
        if not pieces:
            data = np.ascontiguousarray(np.asarray(arr))
            pieces[0, int(data.size)] = digest(data)
        out[f"{item}/{key}"] = [[start, stop, h] for (start, stop), h in sorted(pieces.items())]
    return out


def verify(path: str | os.PathLike, meta: dict | None = None) -> list[str]:
    """What is wrong with an Orbax checkpoint of zero's (empty: nothing): every piece `checksums`
    hashed read back and hashed again; an array that cannot be read, named. ``[]`` for a checkpoint
    without checksums (see `restore`)."""
    meta = read_meta(path) if meta is None else meta
    source, errors = Source(path, meta), []
    for name, pieces in (meta.get("checksums") or {}).items():
        item, key = name.split("/", 1)
        try:
            arr = source.array(item, key)
            for start, stop, want in pieces:
                whole = arr.rank == 0 or (start == 0 and stop == int(np.prod(arr.shape, dtype=np.int64)))
                data = np.asarray((arr if whole else arr[start:stop]).read().result())
                if digest(np.ascontiguousarray(data)) != want:
                    errors.append(f"the checkpoint's {item} array {key!r}, elements {start}..{stop}, does not match "
                                  "its checksum: it was changed or damaged after it was saved")
        except Exception as e:  # noqa: BLE001 - whatever tensorstore says of a damaged store, named
            errors.append(f"the checkpoint's {item} array {key!r} cannot be read ({type(e).__name__}: {e})")
    return errors


def check(path: str | os.PathLike, meta: dict) -> None:
    """``ValueError`` naming what `verify` finds, before anything is restored; a warning for a
    checkpoint without checksums (an older zero's)."""
    errors = verify(path, meta)
    if errors:
        more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
        raise ValueError(f"the checkpoint at {os.fspath(path)!r} is damaged, so nothing was restored: "
                         + "; ".join(errors[:4]) + more)
    if "checksums" not in meta:
        warn_unverified(path, "saved by an older zero")


def ocp_args():
    import orbax.checkpoint as ocp

    return ocp.args


def checkpointer():
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
    try:
        with open(where) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the checkpoint at {root!r} has a damaged zero/metadata ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"the checkpoint at {root!r} is in format {meta.get('format')!r}, not {FORMAT!r}")
    return meta


class Source:
    """Reads pieces of a saved checkpoint's per-param state, and its shared leaves, with
    tensorstore: only the chunks a piece falls in are read. ``read_bytes`` counts what was asked.

    Each ``(node path, param)`` sits in a saved flat buffer (``n{j}.b{k}``), a hybrid plan's row
    (``w{d}``), or a per-param item (``p{i}``, the converter's layout)."""

    def __init__(self, path: str | os.PathLike, meta: dict):
        import tensorstore as ts

        self._ts, self.root, self.meta = ts, os.path.abspath(os.fspath(path)), meta
        self._open: dict[tuple[str, str], Any] = {}
        self.read_bytes = 0
        self.at: dict[tuple[str, int], tuple] = {}  # (node path, param) -> where
        self.shared_at: dict[str, tuple] = {}  # leaf path -> where

        flat = packing(Plan.from_json(meta["plan"])) if meta["layout"] == "buffers" else ()
        for j, node in enumerate(meta["nodes"]):
            path = node["path"]
            if not node["per_param"]:
                item = "state" if meta["layout"] == "buffers" else "shared"
                self.shared_at.setdefault(path, ("array", item, f"s{j}"))
            elif meta["layout"] == "params":
                held = node.get("params", range(len(meta["names"])))  # the params it holds
                self.at.update({(path, i): ("param", f"p{i}", f"n{j}") for i in held})
            elif node.get("flat", True):
                for k, b in enumerate(flat):
                    self.at.update({(path, i): ("range", f"n{j}.b{k}", start) for i, start in zip(b.params, b.starts)})
        whole = meta.get("whole")
        for r, slots in enumerate(whole["slots"] if whole else ()):
            for path, i, d, start, size, shape in slots:
                offset = r * whole["width"][d] + start
                if i is None:
                    self.shared_at.setdefault(path, ("row", f"w{d}", offset, size, tuple(shape)))
                else:
                    self.at[path, i] = ("range", f"w{d}", offset)

    def array(self, item: str, key: str) -> Any:
        if (item, key) not in self._open:
            kvstore = {"driver": "ocdbt", "base": f"file://{self.root}/{item}/", "path": key}
            try:  # Orbax writes zarr v2 arrays in an OCDBT store by default; zarr v3 when asked to
                opened = self._ts.open({"driver": "zarr", "kvstore": kvstore}, open=True, read=True).result()
            except ValueError:
                opened = self._ts.open({"driver": "zarr3", "kvstore": kvstore}, open=True, read=True).result()
            self._open[item, key] = opened
        return self._open[item, key]

    def require(self, path: str) -> None:
        """``ValueError`` when the checkpoint has no state node ``path`` at all (another rule)."""
        held = sorted(n["path"] for n in self.meta["nodes"])
        if path not in held:
            raise ValueError(f"this transformation's state has {path!r}, which the checkpoint at {self.root!r} lacks "
                             f"(it holds {held}): restore with the rule it was saved with")

    def has(self, path: str, param: int) -> bool:
        return (path, param) in self.at

    def piece(self, path: str, param: int, lo: int, hi: int) -> np.ndarray:
        """Elements ``lo:hi`` of saved param ``param``'s leaf of per-param node ``path`` (flattened)."""
        if (path, param) not in self.at:
            raise ValueError(f"the checkpoint at {self.root!r} has no state {path!r} for param "
                             f"{self.meta['names'][param]!r}: restore with the rule and plan kind it was saved with")
        where = self.at[path, param]
        if where[0] == "range":
            _, key, start = where
            out = np.asarray(self.array("state", key)[start + lo:start + hi].read().result())
        else:
            arr, shape = self.array(where[1], where[2]), tuple(self.meta["shapes"][param])
            row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            if len(shape) == 0:
                out = np.asarray(arr.read().result()).reshape(-1)[lo:hi]
            else:  # the rows the range falls in, then the range within them
                first, last = lo // row, -(-hi // row)
                out = np.asarray(arr[first:last].read().result()).reshape(-1)[lo - first * row:hi - first * row]
        self.read_bytes += out.nbytes
        return out

    def shared(self, path: str) -> np.ndarray:
        """A leaf the params share (a count), whole."""
        self.require(path)
        if path not in self.shared_at:
            raise ValueError(f"state {path!r} is per param in the checkpoint at {self.root!r} but shared here")
        where = self.shared_at[path]
        if where[0] == "array":
            return np.asarray(self.array(where[1], where[2]).read().result())
        _, key, offset, size, shape = where
        return np.asarray(self.array("state", key)[offset:offset + size].read().result()).reshape(shape)

    def param(self, param: int) -> np.ndarray | None:
        """A saved param whole (None when the checkpoint has no params)."""
        if not self.meta.get("has_params"):
            return None
        if self.meta["layout"] == "buffers":
            return np.asarray(self.array("params", self.meta["names"][param]).read().result())
        return np.asarray(self.array(f"p{param}", "param").read().result())
