"""Parameter synchronisation after a sharded step: executes a `zero.BucketLayout`.

For each (device, dtype) the ranks' buckets become rows of one ``[world_size, n]`` tensor and a
single all-gather moves them, instead of one broadcast per parameter (torch's default) or per
rank (torch's bucket view).

- ``bucket_view=True``: the rows *are* the storage; trainable params are views into their
  owner's row (torch's ``parameters_as_bucket_view``), so the all-gather writes them directly.
- ``bucket_view=False``: params keep their own storage; each step packs this rank's pieces into
  its row, all-gathers, and copies the other rows out, chunk by chunk so the scratch rows stay
  under ``chunk_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.layout import BucketLayout, Piece, row_chunks

__all__ = ["ParamSync"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128)}


class ParamSync:
    """All-gathers updated params, one (device, dtype) at a time, as ``layout`` places them."""

    def __init__(self, params: Sequence[torch.Tensor], layout: BucketLayout, rank: int, group: Any,
                 bucket_view: bool, chunk_bytes: int):
        self.params, self.layout, self.rank, self.group = list(params), layout, rank, group
        self.bucket_view = bucket_view
        self._keys = []
        for key in layout.keys():
            row = max(1, layout.row_numel(key))
            dtype = _DTYPES.get(key[1]) or getattr(torch, key[1])
            chunk = row if bucket_view else max(1, min(row, chunk_bytes // (dtype.itemsize * layout.world_size)))
            rows = torch.empty(layout.world_size, chunk, dtype=dtype, device=torch.device(key[0]))
            chunks = [row_chunks(b, chunk, row) for b in layout.at(key)]  # [rank][chunk] -> pieces
            self._keys.append((rows, chunks))
            if bucket_view:
                self._view_params(rows, layout.at(key))

    @property
    def collectives_per_step(self) -> int:
        return sum(len(chunks[0]) for _, chunks in self._keys)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The row tensors: the bucket storage with ``bucket_view``, else scratch."""
        return [rows for rows, _ in self._keys]

    @torch.no_grad()
    def sync(self) -> None:
        for rows, chunks in self._keys:
            for c in range(len(chunks[0])):
                if not self.bucket_view:
                    self._copy(chunks[self.rank][c], rows[self.rank], to_rows=True)
                comm.all_gather_rows(rows, self.rank, self.group)
                if not self.bucket_view:
                    for r, per_chunk in enumerate(chunks):
                        if r != self.rank:
                            self._copy(per_chunk[c], rows[r], to_rows=False)

    def release(self) -> None:
        """Give bucket-viewed params their own storage again (before a rebuild)."""
        if self.bucket_view:
            with torch.no_grad():
                for rows, chunks in self._keys:
                    for per_rank in chunks:
                        for piece in per_rank[0]:
                            p = self.params[piece.param]
                            p.data = p.data.clone()

    def _view_params(self, rows: torch.Tensor, buckets) -> None:
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
