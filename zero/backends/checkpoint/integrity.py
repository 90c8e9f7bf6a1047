"""Checksums for DCP checkpoints: every stored piece hashed as it is written, verified before a load.

DCP writes each tensor piece (a chunk of a tensor, or a rank's whole tensor) as a range of bytes
in a ``.distcp`` file and keeps no checksum: a changed byte loads. `ChecksumWriter` (the writer
`zero.backends.checkpoint.save` uses) hashes each range once it is written and the coordinator
writes the hashes beside DCP's ``.metadata``, in ``.zero-checksums.json`` (written last, with the
hash of ``.metadata`` itself), so the checkpoint stays DCP's own: FSDP2 and ``dcp.load`` read it
as they read any.

`verify` checks a checkpoint without loading it: ``.metadata`` readable and unchanged, every data
file there and long enough, every piece's bytes as hashed. `zero.backends.checkpoint.load` runs it
first, each rank hashing its share of the pieces, and every rank raises the same ``ValueError``
(naming the file, the tensor and the piece) before anything is copied into the model or the
optimizer. A checkpoint without checksums (an older zero's, FSDP2's) still loads, with a warning
that its bytes cannot be verified. The hash: `zero.backends.checksums`.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from zero.backends.checksums import ALGORITHM, Digest, UnverifiedCheckpointWarning, digest
from zero.backends.checksums import warn_unverified as _warn

__all__ = ["SIDECAR", "ALGORITHM", "ChecksumWriter", "digest", "read_metadata", "verify", "pieces", "Piece",
           "has_checksums", "UnverifiedCheckpointWarning", "tensor_digest", "STATE_DICT_KEY", "state_dict_checksums",
           "verify_state_dict"]

SIDECAR = ".zero-checksums.json"
_CHUNK = 64 << 20  # bytes hashed per read


STATE_DICT_KEY = "zero_checksums"  # in torch's consolidated state dict (plain optimizers ignore it)


def _file_digest(path: str, offset: int, length: int) -> str:
    """The hash of ``length`` bytes of ``path`` from ``offset``; a short file hashes what is there
    (its size is checked apart). Hashed where the file is mapped: from the page cache, with no copy
    into fresh memory (9x faster than reading it in chunks here: a fresh buffer's pages cost more
    than the hash), so a verified load reads each byte from memory twice, not from disk twice."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return digest(view[offset:offset + length])
            finally:
                view.release()
    except (ValueError, OSError):  # an empty file, or a file system without mmap: read it
        return _read_digest(path, offset, length)


def _read_digest(path: str, offset: int, length: int) -> str:
    h = Digest()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            block = f.read(min(left, _CHUNK))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


@dataclass(frozen=True)
class _Hashed:
    """A piece's storage info (DCP's own object) with the hash of its bytes, from a rank's writer
    to the coordinator; the coordinator gives DCP the storage info back before writing ``.metadata``."""

    info: Any
    hash: str


class ChecksumWriter(FileSystemWriter):
    """DCP's file writer, which also hashes every piece it wrote (each rank its own) and, on the
    coordinator, writes the hashes beside ``.metadata`` (see the module)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        results = written.wait()
        for r in results:
            info = r.storage_data
            path = os.path.join(os.fspath(self.path), info.relative_path)
            object.__setattr__(r, "storage_data", _Hashed(info, _file_digest(path, info.offset, info.length)))
        return written

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        hashed = []
        for rank_results in results:
            for r in rank_results:
                if isinstance(r.storage_data, _Hashed):
                    hashed.append((r.index, r.storage_data))
                    object.__setattr__(r, "storage_data", r.storage_data.info)
        super().finish(metadata, results)
        root = os.fspath(self.path)
        entries = [{"file": h.info.relative_path, "offset": h.info.offset, "length": h.info.length,
                    "fqn": index.fqn, "piece": list(index.offset) if index.offset is not None else None,
                    "hash": h.hash} for index, h in hashed]
        with open(os.path.join(root, ".metadata"), "rb") as f:
            meta_hash = digest(f.read())
        tmp = os.path.join(root, SIDECAR + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": "zero-checksums/1", "algorithm": ALGORITHM, "metadata": meta_hash,
                       "pieces": entries}, f)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, SIDECAR))


def has_checksums(path: str | os.PathLike) -> bool:
    return os.path.exists(os.path.join(os.fspath(path), SIDECAR))


def _sidecar(path: str) -> dict | None:
    """The checksums beside a checkpoint, or None where it has none."""
    where = os.path.join(path, SIDECAR)
    if not os.path.exists(where):
        return None
    try:
        with open(where) as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"the checkpoint's checksums at {where!r} cannot be read ({type(e).__name__}: {e}): the "
                         "file is damaged") from None
    if out.get("algorithm") != ALGORITHM or not isinstance(out.get("pieces"), list):
        raise ValueError(f"the checkpoint's checksums at {where!r} are not zero's ({ALGORITHM}): the file is "
                         "damaged or of another tool")
    return out


def read_metadata(path: str | os.PathLike) -> Any:
    """DCP's ``.metadata`` of the checkpoint at ``path``, checked against its hash when there is
    one; a truncated or unreadable file is a ``ValueError`` naming it."""
    path = os.fspath(path)
    where = os.path.join(path, ".metadata")
    with open(where, "rb") as f:
        data = f.read()
    sums = _sidecar(path)
    if sums is not None and digest(data) != sums.get("metadata"):
        raise ValueError(f"the checkpoint's {where!r} does not match its checksum: it was changed or damaged "
                         "after it was saved")
    try:
        metadata = pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - any unpickling failure: a damaged file
        raise ValueError(f"the checkpoint's {where!r} cannot be read ({type(e).__name__}: {e}): it is truncated "
                         f"or damaged ({len(data)} bytes)") from None
    if not hasattr(metadata, "state_dict_metadata") or getattr(metadata, "storage_data", None) is None:
        raise ValueError(f"the checkpoint's {where!r} is not DCP's metadata (it holds {type(metadata).__name__})")
    return metadata


@dataclass(frozen=True)
class Piece:
    """One stored piece: where its bytes are, which tensor and chunk they hold, their hash (or None)."""

    file: str
    offset: int
    length: int
    fqn: str
    chunk: tuple[int, ...] | None
    hash: str | None

    def describe(self) -> str:
        where = f" at offsets {list(self.chunk)}" if self.chunk else ""
        return f"{self.fqn!r}{where} (bytes {self.offset}..{self.offset + self.length} of {self.file})"


def pieces(path: str | os.PathLike, metadata: Any) -> list[Piece]:
    """Every stored piece of the checkpoint, with its hash where the checkpoint has checksums."""
    sums = _sidecar(os.fspath(path))
    hashes = {} if sums is None else {(p["file"], p["offset"], p["length"]): p["hash"] for p in sums["pieces"]}
    out = []
    for index, info in (metadata.storage_data or {}).items():
        key = (info.relative_path, info.offset, info.length)
        out.append(Piece(info.relative_path, info.offset, info.length, index.fqn,
                         tuple(index.offset) if index.offset is not None else None, hashes.get(key)))
    if sums is not None and len(hashes) != len(out):
        raise ValueError(f"the checkpoint's checksums list {len(hashes)} pieces but its .metadata {len(out)}: one of "
                         "the two files was changed after the save")
    return sorted(out, key=lambda p: (p.file, p.offset))


def verify(path: str | os.PathLike, metadata: Any, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with the checkpoint's data (empty: nothing), checking the pieces in this
    ``share`` (``(rank, world)``: every ``world``-th file from ``rank``): each data file there and
    long enough (every file, by every share: cheap), each piece's bytes as hashed."""
    path = os.fspath(path)
    errors, everything = [], pieces(path, metadata)
    ends: dict[str, int] = {}
    for p in everything:
        ends[p.file] = max(ends.get(p.file, 0), p.offset + p.length)
    for name, end in sorted(ends.items()):
        where = os.path.join(path, name)
        size = os.path.getsize(where) if os.path.exists(where) else None
        if size is None:
            errors.append(f"the data file {where!r} is missing")
        elif size < end:
            errors.append(f"the data file {where!r} is short: {size} bytes where its pieces need {end}")
    broken = {e.split("'")[1] for e in errors}
    rank, world = share
    mine = sorted(ends)[rank::world]
    for p in _pieces_of(everything, mine):
        where = os.path.join(path, p.file)
        if p.hash is not None and where not in broken and _file_digest(where, p.offset, p.length) != p.hash:
            errors.append(f"the checkpoint's {p.describe()} does not match its checksum: the file was changed or "
                          "damaged after it was saved")
    return errors


def _pieces_of(everything: list[Piece], files: list[str]) -> Iterator[Piece]:
    wanted = set(files)
    return (p for p in everything if p.file in wanted)


def warn_unverified(path: str | os.PathLike) -> None:
    _warn(path, "saved by DCP or FSDP2 directly, or by an older zero")


def tensor_digest(t: Any) -> str | None:
    """The hash of a plain tensor's bytes (None for a tensor subclass, whose bytes are its own)."""
    import torch

    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    flat = t.detach().cpu().contiguous().reshape(-1)
    return digest(flat.view(torch.uint8).numpy() if flat.numel() else b"")


def state_dict_checksums(state: dict) -> dict[str, dict[str, str]]:
    """Per param index and key, the hash of each plain tensor of a torch state dict's ``state``."""
    import torch

    out: dict[str, dict[str, str]] = {}
    for index, st in state.items():
        hashes = {k: tensor_digest(v) for k, v in (st or {}).items() if isinstance(v, torch.Tensor)}
        out[str(index)] = {k: h for k, h in hashes.items() if h is not None}
    return out


def verify_state_dict(saved: dict, names: Any = None) -> None:
    """``ValueError`` naming every tensor of a consolidated state dict whose bytes differ from
    their hash (``names(i)``: param ``i``'s name), before anything is loaded; a dict without
    checksums (torch's own) is left alone."""
    sums = saved.get(STATE_DICT_KEY)
    if sums is None:
        return
    got = state_dict_checksums(saved["state"])
    bad = [(i, k) for i, per in sums.items() for k, h in per.items() if got.get(i, {}).get(k) != h]
    if bad:
        def label(i: str) -> str:
            name = names(int(i)) if names else i
            return f"param {i}" if name == i else f"param {i} ({name})"

        shown = ", ".join(f"{label(i)}'s {k!r}" for i, k in bad[:6])
        raise ValueError(f"the state dict's {shown} do not match their checksums ({len(bad)} tensors): it was "
                         "changed or damaged after state_dict() made it (torch.load does not check its files), "
                         "so nothing was loaded")
