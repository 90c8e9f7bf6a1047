"""Parameter synchronisation after a sharded step: executes a `zero.BucketLayout`.

For each (device, dtype) the ranks' buckets become rows of one ``[world_size, n]`` tensor moved
by `comm.all_gather_rows`, instead of one broadcast per parameter (torch's default).

- ``bucket_view=True``: the rows *are* the storage; trainable params are views into their
  owner's row (torch's ``parameters_as_bucket_view``), so the collective writes them directly.
- ``bucket_view=False``: params keep their own storage. Large params (``direct_numel``
  elements or more) are broadcast straight from their owner into every replica, with no copy;
  the small ones, where latency dominates, are packed into the rows, chunk by chunk so the
  scratch rows stay under ``chunk_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.layout import Bucket, BucketLayout, Piece, row_chunks, split_bucket

__all__ = ["ParamSync"]

DIRECT_NUMEL = 1 << 18  # 1 MiB of float32: from here one broadcast beats a pack and an unpack


class ParamSync:
    """Moves every updated param from its owner to all ranks, as ``layout`` places them."""

    def __init__(self, params: Sequence[torch.Tensor], layout: BucketLayout, rank: int, group: Any,
                 bucket_view: bool, chunk_bytes: int, direct_numel: int = DIRECT_NUMEL):
        self.params, self.rank, self.group, self.bucket_view = list(params), rank, group, bucket_view
        self._packed: list[tuple[torch.Tensor, list]] = []  # (rows, [rank][chunk] -> pieces)
        self._direct: list[tuple[int, int]] = []  # (owner, param index)
        for key in layout.keys():
            buckets = layout.at(key)
            if not bucket_view:
                split = [split_bucket(b, direct_numel) for b in buckets]
                buckets = [packed for packed, _ in split]
                self._direct += [(b.rank, i) for b, (_, large) in zip(layout.at(key), split) for i in large]
            row = max(b.numel for b in buckets)
            if row == 0:
                continue
            example = self.params[next(i for b in buckets for i in b.params)]
            chunk = row if bucket_view else max(1, min(row, chunk_bytes // (example.element_size() * len(buckets))))
            rows = torch.empty(len(buckets), chunk, dtype=example.dtype, device=example.device)
            self._packed.append((rows, [row_chunks(b, chunk, row) for b in buckets]))
            if bucket_view:
                self._view_params(rows, buckets)

    @property
    def collectives_per_step(self) -> int:
        """Row collectives plus direct broadcasts (a gloo row collective is one broadcast per rank)."""
        return sum(len(chunks[0]) for _, chunks in self._packed) + len(self._direct)

    @torch.no_grad()
    def sync(self) -> None:
        for rows, chunks in self._packed:
            for c in range(len(chunks[0])):
                if not self.bucket_view:
                    self._copy(chunks[self.rank][c], rows[self.rank], to_rows=True)
                comm.all_gather_rows(rows, self.rank, self.group)
                if not self.bucket_view:
                    for r, per_chunk in enumerate(chunks):
                        if r != self.rank:
                            self._copy(per_chunk[c], rows[r], to_rows=False)
        for owner, i in self._direct:
            comm.broadcast_from(self.params[i].detach(), owner, self.group)

    def release(self) -> None:
        """Give bucket-viewed params their own storage again (before a rebuild)."""
        if self.bucket_view:
            with torch.no_grad():
                for _, chunks in self._packed:
                    for per_rank in chunks:
                        for piece in per_rank[0]:
                            p = self.params[piece.param]
                            p.data = p.data.clone()

    def _view_params(self, rows: torch.Tensor, buckets: Sequence[Bucket]) -> None:
        with torch.no_grad():
            for bucket in buckets:
                for i, off in zip(bucket.params, bucket.offsets):
                    p = self.params[i]
                    view = rows[bucket.rank, off:off + p.numel()].view_as(p)
                    view.copy_(p.data)
                    p.data = view

    def _copy(self, pieces: Sequence[Piece], row: torch.Tensor, to_rows: bool) -> None:
        if not pieces:
            return
        flat = [self.params[p.param].detach().view(-1)[p.start:p.end] for p in pieces]
        slots = [row[p.row_start:p.row_start + p.end - p.start] for p in pieces]
        dst, src = (slots, flat) if to_rows else (flat, slots)
        torch._foreach_copy_(dst, src)
