"""Parameter synchronisation after a sharded step: executes `zero.sync_rows` of a `BucketLayout`.

For each (device, dtype) the ranks' packed params form the rows of one ``[world_size, chunk]``
tensor moved by `comm.all_gather_rows`, instead of one broadcast per parameter (torch's default).

- ``bucket_view=True``: the rows *are* the storage; trainable params are views into their
  owner's row (torch's ``parameters_as_bucket_view``), so the collective writes them directly.
- ``bucket_view=False``: params keep their own storage. Large params (``DIRECT_NUMEL``
  elements or more) are broadcast straight from their owner into every replica, with no copy;
  the small ones, where latency dominates, are packed into scratch rows chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.plans.layout import BucketLayout, Piece, SyncRows, sync_rows

__all__ = ["ParamSync", "DIRECT_NUMEL"]

DIRECT_NUMEL = 1 << 18  # 1 MiB of float32: from here one broadcast beats a pack and an unpack


class ParamSync:
    """Moves every updated param from its owner to all ranks, as ``layout`` places them."""

    def __init__(self, params: Sequence[torch.Tensor], layout: BucketLayout, rank: int, group: Any,
                 bucket_view: bool, chunk_bytes: int):
        self.params, self.rank, self.group, self.bucket_view = list(params), rank, group, bucket_view
        plans = sync_rows(layout) if bucket_view else sync_rows(layout, DIRECT_NUMEL, chunk_bytes)
        self.plans = plans
        self._rows = [self._allocate(p, layout.world_size) for p in plans]

    @torch.no_grad()
    def sync(self) -> None:
        for plan, rows in zip(self.plans, self._rows):
            for c in range(len(plan.pieces[0]) if plan.chunk else 0):
                if not self.bucket_view:
                    self._copy(plan.pieces[self.rank][c], rows[self.rank], to_rows=True)
                comm.all_gather_rows(rows, self.rank, self.group)
                if not self.bucket_view:
                    for r, per_chunk in enumerate(plan.pieces):
                        if r != self.rank:
                            self._copy(per_chunk[c], rows[r], to_rows=False)
            for owner, i in plan.direct:
                comm.broadcast_from(self.params[i].detach(), owner, self.group)

    def release(self) -> None:
        """Give bucket-viewed params their own storage again (before a rebuild)."""
        if self.bucket_view:
            with torch.no_grad():
                for i in self._viewed():
                    self.params[i].data = self.params[i].data.clone()

    def _allocate(self, plan: SyncRows, world_size: int) -> torch.Tensor | None:
        if not plan.chunk:
            return None
        example = self.params[next(p.param for per_rank in plan.pieces for p in per_rank[0])]
        rows = torch.empty(world_size, plan.chunk, dtype=example.dtype, device=example.device)
        if self.bucket_view:  # one chunk per row: each piece is a whole param
            with torch.no_grad():
                for r, per_rank in enumerate(plan.pieces):
                    for p in per_rank[0]:
                        param = self.params[p.param]
                        view = rows[r, p.row_start:p.row_start + p.end].view_as(param)
                        view.copy_(param.data)
                        param.data = view
        return rows

    def _viewed(self) -> list[int]:
        return [p.param for plan in self.plans if plan.chunk for per_rank in plan.pieces for p in per_rank[0]]

    def _copy(self, pieces: Sequence[Piece], row: torch.Tensor, to_rows: bool) -> None:
        if not pieces:
            return
        flat = [self.params[p.param].detach().view(-1)[p.start:p.end] for p in pieces]
        slots = [row[p.row_start:p.row_start + p.end - p.start] for p in pieces]
        dst, src = (slots, flat) if to_rows else (flat, slots)
        torch._foreach_copy_(dst, src)
