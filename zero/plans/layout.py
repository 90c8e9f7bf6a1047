"""How parameters pack into flat buffers: bucket views of a partition, and element-level shards.

Both layouts hold trainable parameters only (frozen ones never change, so never travel) and key
their buffers by (device, dtype), since one flat tensor has one of each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zero.plans.checks import check_int
from zero.plans.meta import ParamMeta, itemsize
from zero.plans.partition import Partition, check_metas, check_rank, check_world_size

__all__ = ["ALIGN_BYTES", "Bucket", "BucketLayout", "bucket_views", "split_bucket", "Piece", "row_chunks",
           "row_padding", "SyncRows", "sync_rows", "param_sync_rows", "DIRECT_NUMEL", "PAD_LIMIT",
           "IN_FLIGHT_BUCKETS", "reduction_units", "Segment", "ShardPiece", "FlatBuffer", "FLAT_BUCKET_NUMEL",
           "DDP_BUCKET_CAP_MB", "default_bucket_numel",
           "FlatLayout", "flat_layout"]


ALIGN_BYTES = 64  # what torch's allocators give a tensor; see bucket_views
DIRECT_NUMEL = 1 << 18  # 1 MiB of float32: from here one broadcast beats a pack and an unpack (`param_sync_rows`)
PAD_LIMIT = 1 / 16  # the default packs every param while rows pad by at most this fraction (`param_sync_rows`)
IN_FLIGHT_BUCKETS = 2  # reductions in flight at once under ZeRO-2 (reduction_units); one more waits for the oldest


@dataclass(frozen=True)
class Bucket:
    """One rank's flat bucket for one (device, dtype): ``params[k]`` holds ``sizes[k]`` elements
    from ``offsets[k]``; ``numel`` is the bucket's length, alignment gaps included."""

    device: str
    dtype: str
    rank: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    """The buckets that ``parameters_as_bucket_view=True`` allocates: per key, one per rank."""

    world_size: int
    buckets: tuple[Bucket, ...]

    def of(self, rank: int) -> tuple[Bucket, ...]:
        check_rank(rank, self.world_size)
        return tuple(b for b in self.buckets if b.rank == rank)

    def keys(self) -> tuple[tuple[str, str], ...]:
        """The (device, dtype) pairs, in order of first appearance."""
        return tuple(dict.fromkeys((b.device, b.dtype) for b in self.buckets))

    def at(self, key: tuple[str, str]) -> tuple[Bucket, ...]:
        """The buckets of one (device, dtype), one per rank, in rank order."""
        return tuple(b for b in self.buckets if (b.device, b.dtype) == tuple(key))


def split_bucket(bucket: Bucket, direct_numel: int) -> tuple[Bucket, tuple[int, ...]]:
    """Separate the params of at least ``direct_numel`` elements from the ones worth packing.

    Large params can travel on their own, straight from and into their storage; packing only
    pays for small ones (per-collective latency). Returns the bucket of the small params (offsets
    recomputed, order kept) and the indices of the large ones.
    """
    check_int("direct_numel", direct_numel, 1)
    small = [(i, n) for i, n in zip(bucket.params, bucket.sizes) if n < direct_numel]
    large = tuple(i for i, n in zip(bucket.params, bucket.sizes) if n >= direct_numel)
    return _bucket(bucket.device, bucket.dtype, bucket.rank, [i for i, _ in small], [n for _, n in small]), large


def _bucket(device: str, dtype: str, rank: int, params: list[int], sizes: list[int],
            align_bytes: int = ALIGN_BYTES) -> Bucket:
    """Params packed in order, each from an offset of ``align_bytes``, as a fresh tensor would be."""
    quantum = max(1, align_bytes // itemsize(dtype))
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // quantum) * quantum
    return Bucket(device, dtype, rank, tuple(params), tuple(offsets), tuple(sizes), end)


@dataclass(frozen=True)
class Piece:
    """Elements ``start:end`` of parameter ``param`` (flattened) sit at ``row_start`` of a chunk."""

    param: int
    start: int
    end: int
    row_start: int


def row_chunks(bucket: Bucket, chunk_numel: int, row_numel: int) -> tuple[tuple[Piece, ...], ...]:
    """Cut a bucket's padded row of ``row_numel`` elements into all-gather chunks.

    Chunk ``c`` covers row elements ``c * chunk_numel`` onwards; its pieces say which slice of
    which parameter each part of the chunk carries. Every rank cuts its row the same way, so one
    all-gather per chunk moves every rank's pieces (rows shorter than ``row_numel`` are padding).
    """
    check_int("chunk_numel", chunk_numel, 1)
    if row_numel < bucket.numel:
        raise ValueError(f"row_numel {row_numel} is smaller than the bucket ({bucket.numel} elements)")
    n_chunks = max(1, math.ceil(row_numel / chunk_numel))
    chunks: list[list[Piece]] = [[] for _ in range(n_chunks)]
    for param, lo, n in zip(bucket.params, bucket.offsets, bucket.sizes):
        pos, hi = lo, lo + n
        while pos < hi:
            c, within = divmod(pos, chunk_numel)
            take = min(hi - pos, chunk_numel - within)
            chunks[c].append(Piece(param, pos - lo, pos - lo + take, within))
            pos += take
    return tuple(tuple(c) for c in chunks)


def bucket_views(metas: Sequence[ParamMeta], part: Partition, align_bytes: int = ALIGN_BYTES) -> BucketLayout:
    """Offsets of each trainable parameter inside its owner's bucket, per (device, dtype).

    Parameters appear in the order the owner's local optimizer receives them
    (``part.params_of(rank)``), as torch lays out its buckets. Each starts ``ALIGN_BYTES`` from
    the bucket's start, as a tensor of its own would: CPU kernels pick their vector paths by
    alignment, so a param viewed at an odd offset computes its forward with other roundings.
    ``align_bytes=1`` packs params back to back (a JAX mesh's rows, where no kernel sees them).
    """
    metas = check_metas(metas)
    check_int("align_bytes", align_bytes, 1)
    if len(part.owner) != len(metas):
        raise ValueError(f"partition covers {len(part.owner)} params but metas has {len(metas)}")
    keys = list(dict.fromkeys(_key(m) for m in metas if m.requires_grad))
    buckets = []
    for device, dtype in keys:
        for rank in range(part.world_size):
            idx = [i for i in part.params_of(rank)
                   if metas[i].requires_grad and _key(metas[i]) == (device, dtype)]
            buckets.append(_bucket(device, dtype, rank, idx, [metas[i].numel for i in idx], align_bytes))
    return BucketLayout(part.world_size, tuple(buckets))


@dataclass(frozen=True)
class SyncRows:
    """How one (device, dtype) of a `BucketLayout` travels after a step.

    Packed params sit in per-rank rows ``chunk`` elements wide and move one chunk at a time:
    ``pieces[r][c]`` is what rank ``r``'s row carries in chunk ``c``. Each ``(owner, param)`` in
    ``direct`` is sent on its own, straight from its storage.
    """

    device: str
    dtype: str
    chunk: int
    pieces: tuple[tuple[tuple[Piece, ...], ...], ...]
    direct: tuple[tuple[int, int], ...]

    @property
    def collectives(self) -> int:
        return (len(self.pieces[0]) if self.chunk else 0) + len(self.direct)


def sync_rows(layout: BucketLayout, direct_numel: int | None = None,
              chunk_bytes: int | None = None, pad_limit: float | None = None) -> tuple[SyncRows, ...]:
    """Per (device, dtype): which params are packed into rows, in which chunks, and which go alone.

    ``direct_numel=None`` packs everything (bucket views: the rows are the params' storage);
    otherwise params of ``direct_numel`` elements or more go alone. ``pad_limit``: only where
    packing every param would pad the rows (each as wide as the widest) by more than
    ``pad_limit`` times the elements they carry; rows that are nearly even are cheaper as one
    collective than as one per large param. ``chunk_bytes=None`` sends each row whole, else the
    ``world_size`` rows of one chunk together stay within ``chunk_bytes``.
    """
    out = []
    for key in layout.keys():
        buckets, direct = layout.at(key), ()
        if direct_numel is not None and (pad_limit is None or row_padding(buckets) > pad_limit * _numel(buckets)):
            split = [split_bucket(b, direct_numel) for b in buckets]
            buckets = tuple(packed for packed, _ in split)
            direct = tuple((b.rank, i) for b, (_, large) in zip(layout.at(key), split) for i in large)
        row = max(b.numel for b in buckets)
        chunk = row if chunk_bytes is None else min(row, max(1, chunk_bytes // (itemsize(key[1]) * len(buckets))))
        pieces = tuple(row_chunks(b, chunk, row) for b in buckets) if chunk else ()
        out.append(SyncRows(key[0], key[1], chunk, pieces, direct))
    return tuple(out)


def param_sync_rows(layout: BucketLayout, bucket_view: bool | None, chunk_bytes: int,
                    direct_numel: int = DIRECT_NUMEL, pad_limit: float = PAD_LIMIT) -> tuple[SyncRows, ...]:
    """`sync_rows` as a whole-param sync with ``parameters_as_bucket_view=bucket_view`` moves the
    params: ``None`` packs every param into rows it views while they pad by at most ``pad_limit``
    (else params of ``direct_numel`` elements or more go alone), ``True`` packs every param, and
    ``False`` keeps the params' own storage, copying small ones through rows of ``chunk_bytes``."""
    views = bucket_view is not False
    return sync_rows(layout, None if bucket_view else direct_numel, None if views else chunk_bytes,
                     pad_limit if bucket_view is None else None)


def row_padding(buckets: Sequence[Bucket]) -> int:
    """Elements of padding when each of ``buckets`` (one key's, one per rank) fills a row as
    wide as the widest."""
    return len(buckets) * max(b.numel for b in buckets) - _numel(buckets)


def _numel(buckets: Sequence[Bucket]) -> int:
    return sum(b.numel for b in buckets)


@dataclass(frozen=True)
class Segment:
    """Elements ``start:end`` of a parameter (flattened) belong to ``rank``'s shard."""

    rank: int
    start: int
    end: int


@dataclass(frozen=True)
class FlatBuffer:
    """All trainable params of one param group and (device, dtype), packed and padded into
    equal shards.

    ``params[k]`` occupies ``offsets[k]:offsets[k] + numel`` of the buffer; rank ``r`` owns
    ``r * shard_numel:(r + 1) * shard_numel``; ``segments[k]`` says which ranks hold which
    elements of ``params[k]``. One buffer per group, because a rank steps its shard of a buffer
    as one tensor, with one group's settings.
    """

    device: str
    dtype: str
    group: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    padded_numel: int
    shard_numel: int
    segments: tuple[tuple[Segment, ...], ...]
    # The quantization block every shard edge respects (0: none): each param's element range
    # is cut only at multiples of it, so each block of a low-bit moment lies on one rank.
    block: int = 0
    # The elements of one head of its params (0: none): a *head buffer* holds params a rule steps
    # head by head (per-head Muon), each cut only at its own head edges, so every rank holds whole
    # heads of them, stepped where they lie (each param's piece a local tensor of its own rows).
    head: int = 0

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """The pieces of params in ``rank``'s shard, in shard order (padding, if any, follows them)."""
        out = []
        for i, off, segs in zip(self.params, self.offsets, self.segments):
            for s in segs:
                if s.rank == rank:
                    out.append(ShardPiece(i, s.start, s.end, off + s.start - rank * self.shard_numel))
        return tuple(out)


@dataclass(frozen=True)
class ShardPiece:
    """Elements ``start:end`` of parameter ``param`` (flattened) sit at ``offset`` of a rank's shard."""

    param: int
    start: int
    end: int
    offset: int


FLAT_BUCKET_NUMEL = 1 << 22  # 16 MiB of float32 per flat buffer: DDP's 25 MiB buckets, rounded
DDP_BUCKET_CAP_MB = 25.0  # DDP's bucket_cap_mb default


def default_bucket_numel(metas: Sequence[ParamMeta], world_size: int = 2, cap_mb: float = DDP_BUCKET_CAP_MB) -> int:
    """The flat buffers' size `ZeroRedundancyOptimizer` gives a model (``strategy="flat"``): at most
    ``cap_mb`` MiB of its widest trainable dtype (DDP's cap, ``bucket_cap_mb``), and small enough
    that ZeRO-2's buckets filling and in flight (``IN_FLIGHT_BUCKETS + 1``) hold at most half of
    the gradient it does not keep (``(W - 1) / W`` of it): then its shards and buckets stay under
    ZeRO-1's whole gradients. With big buckets on a small model ZeRO-2 held more than ZeRO-1."""
    if not isinstance(cap_mb, (int, float)) or isinstance(cap_mb, bool) or not cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {cap_mb!r}")
    trainable = [m for m in metas if m.requires_grad] or list(metas)
    widest = max((itemsize(m.dtype) for m in trainable), default=4)
    total, w = sum(m.numel for m in trainable), max(world_size, 2)
    share = -(-total * (w - 1) // (2 * w * (IN_FLIGHT_BUCKETS + 1)))
    return max(1, min(int(cap_mb * 2**20) // widest, share))


@dataclass(frozen=True)
class FlatLayout:
    """Element-level shards (DeepSpeed ZeRO-1/2): every rank owns an equal slice of each buffer.

    Buffers hold one (param group, device, dtype) each, and at most ``bucket_numel`` elements
    (unless one param alone is larger) when that is set, so that gradients can be reduced buffer
    by buffer while backward runs. They come in the order a backward pass completes them: the
    buffer of the last-registered params first.
    """

    world_size: int
    alignment: int
    buffers: tuple[FlatBuffer, ...]
    bucket_numel: int | None = None

    def segments(self, index: int) -> tuple[Segment, ...]:
        """Where parameter ``metas[index]`` lives; empty for frozen or empty parameters."""
        for buf in self.buffers:
            if index in buf.params:
                return buf.segments[buf.params.index(index)]
        return ()

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns, summed over buffers (equal on every rank)."""
        return sum(b.shard_numel for b in self.buffers)


def flat_layout(metas: Sequence[ParamMeta], world_size: int, alignment: int = 1,
                bucket_numel: int | None = None, block_of: Callable[[ParamMeta], int] | None = None,
                head_of: Callable[[ParamMeta], int] | None = None) -> FlatLayout:
    """Pack trainable params per (group, device, dtype) into buffers padded to ``world_size * alignment``.

    ``alignment`` (elements) makes every shard boundary a multiple of it, e.g. 128 bytes / itemsize
    for aligned NCCL transfers. ``bucket_numel`` caps a buffer's elements (a larger param gets
    a buffer of its own): gradients reduce-scatter per buffer, so smaller buffers start sooner.

    ``block_of(meta)``: the quantization block of a param's optimizer state, 0 for none
    (`zero.plans.costs.RuleCost.block_for`). Params with a block get buffers of their
    own (one per block size), whose shards are a multiple of the block: each param's numel is one
    too, so every param starts at a block edge of its buffer and is cut only at its own block
    edges, whatever the world size. The padding this costs is in ``padding``.

    ``head_of(meta)``: the elements of one head of a param a rule steps head by head along its
    first axis (`zero.plans.costs.RuleCost.head_block`), 0 for none. Such params get *head
    buffers* of their own (one per head size) in the same way, their shards a multiple of the
    head: every rank holds whole heads of them (`FlatBuffer.head`).
    """
    metas = check_metas(metas)
    check_world_size(world_size)
    check_int("alignment", alignment, 1)
    if bucket_numel is not None:
        check_int("bucket_numel", bucket_numel, 1)
    by_key: dict[tuple[int, str, str, int], list[int]] = {}
    for i, m in enumerate(metas):
        if m.requires_grad:
            block = check_int(f"block_of({m.name!r})", block_of(m), 0) if block_of is not None else 0
            head = check_int(f"head_of({m.name!r})", head_of(m), 0) if head_of is not None else 0
            if head and (block or m.numel % head):
                raise ValueError(f"param {m.name!r} ({m.numel} elements) cannot be cut at head edges of {head} "
                                 f"elements{' with a quantization block' if block else ''}: keep it whole")
            by_key.setdefault((m.group, *_key(m), block, head), []).append(i)
    chunks = [(key, idx) for key, members in by_key.items() for idx in _cut(metas, members, bucket_numel)]
    chunks.sort(key=lambda chunk: -chunk[1][0])  # backward completes a buffer when its first param is ready
    buffers = tuple(_flat_buffer(metas, key, idx, world_size, alignment) for key, idx in chunks)
    return FlatLayout(world_size, alignment, buffers, bucket_numel)


def reduction_units(flat: FlatLayout, whole: Sequence[int] = ()) -> tuple[tuple[str, int], ...]:
    """Under ``reduce_scatter_grads``, the order in which every rank starts its gradients' reductions:
    each flat buffer (``("flat", buffer)``, reduce-scattered) and each whole param of a hybrid plan
    (``("whole", param)``, reduced into its owner), by their first param, last first. Backward
    completes a unit when its first param's gradient is made, so this is the order backward
    completes them in, and no unit waits for one behind it."""
    units = [(b.params[0], ("flat", k)) for k, b in enumerate(flat.buffers)] + [(i, ("whole", i)) for i in whole]
    return tuple(unit for _, unit in sorted(units, key=lambda first_unit: -first_unit[0]))


def _cut(metas: Sequence[ParamMeta], members: list[int], cap: int | None) -> list[list[int]]:
    """Consecutive runs of ``members`` of at most ``cap`` elements, cut from the last param back."""
    if cap is None:
        return [members]
    runs: list[list[int]] = []
    size = 0
    for i in reversed(members):
        if not runs or size + metas[i].numel > cap:  # an over-cap param gets a run of its own
            runs.append([])
            size = 0
        runs[-1].insert(0, i)
        size += metas[i].numel
    return runs


def _flat_buffer(metas, key, idx, world_size, alignment) -> FlatBuffer:
    numels = [metas[i].numel for i in idx]
    offsets = _offsets(numels)
    total = offsets[-1]
    group, device, dtype, block, head = key
    unit = block or head  # never both (see flat_layout)
    quantum = world_size * (math.lcm(alignment, unit) if unit else alignment)
    padded = max(quantum, math.ceil(total / quantum) * quantum)
    shard = padded // world_size
    segments = tuple(_segments(off, n, shard) for off, n in zip(offsets, numels))
    return FlatBuffer(device, dtype, group, tuple(idx), tuple(offsets[:-1]), total, padded, shard, segments, block,
                      head)


def _segments(offset: int, numel: int, shard: int) -> tuple[Segment, ...]:
    segs = []
    for rank in range(offset // shard, (offset + numel - 1) // shard + 1) if numel else ():
        lo, hi = max(offset, rank * shard), min(offset + numel, (rank + 1) * shard)
        segs.append(Segment(rank, lo - offset, hi - offset))
    return tuple(segs)


def _offsets(numels: Sequence[int]) -> list[int]:
    out = [0]
    for n in numels:
        out.append(out[-1] + n)
    return out


def _key(m: ParamMeta) -> tuple[str, str]:
    return (m.device, m.dtype)
