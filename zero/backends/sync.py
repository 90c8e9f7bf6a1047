"""Parameter synchronisation after a sharded step: executes `zero.sync_rows` of a `BucketLayout`.

For each (device, dtype) the ranks' packed params form the rows of one ``[world_size, chunk]``
tensor moved by `comm.all_gather_rows`, instead of one broadcast per parameter (torch's default).
Params of ``DIRECT_NUMEL`` elements or more may instead be broadcast straight from their owner
into every replica's own storage. Three ways, by ``parameters_as_bucket_view``:

- ``None`` (the default): packed params are views into the rows (the rows *are* their storage),
  so the collective writes them in place, with no copies. Every param is packed while the rows
  (each as wide as the widest) pad by at most ``PAD_LIMIT``; beyond that, large params go direct
  and the padding is paid on small params only (whole-tensor plans of big models at large world
  sizes leave many ranks nearly empty: rows as wide as the largest tensor would be huge).
- ``True`` (torch's ``parameters_as_bucket_view``): every trainable param is a view into a row.
- ``False``: params keep their own storage. Large ones go direct; the small ones are packed into
  scratch rows chunk by chunk, copied in and out (at most ``chunk_bytes`` of scratch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero.backends import comm
from zero.backends.consistency import wait_for
from zero.plans import layout as plan_layout
from zero.plans.layout import BucketLayout, Piece, SyncRows, param_sync_rows

__all__ = ["ParamSync", "ViewWatch", "DIRECT_NUMEL", "PAD_LIMIT"]

DIRECT_NUMEL = plan_layout.DIRECT_NUMEL  # module settings (a test may patch them): see param_sync_rows
PAD_LIMIT = plan_layout.PAD_LIMIT


class ParamSync:
    """Moves every updated param from its owner to all ranks, as ``layout`` places them."""

    def __init__(self, params: Sequence[torch.Tensor], layout: BucketLayout, rank: int, group: Any,
                 bucket_view: bool | None, chunk_bytes: int):
        self.params, self.rank, self.group = list(params), rank, group
        self.views = bucket_view is not False  # packed params are views into the rows
        self.plans = param_sync_rows(layout, bucket_view, chunk_bytes, DIRECT_NUMEL, PAD_LIMIT)
        self._rows = [self._allocate(p, layout.world_size) for p in self.plans]
        self.watch = ViewWatch(self.params, self._viewed() if self.views else [], comm.is_fake(group))

    @torch.no_grad()
    def sync(self) -> None:
        for plan, rows in zip(self.plans, self._rows):
            for c in range(len(plan.pieces[0]) if plan.chunk else 0):
                if not self.views:
                    self._copy(plan.pieces[self.rank][c], rows[self.rank], to_rows=True)
                for work in comm.all_gather_rows(rows, self.rank, self.group, async_op=True):
                    wait_for(work, self.group, "the params' all-gather")
                if not self.views:
                    for r, per_chunk in enumerate(plan.pieces):
                        if r != self.rank:
                            self._copy(per_chunk[c], rows[r], to_rows=False)
            for owner, i in plan.direct:
                work = comm.broadcast_from(self.params[i].detach(), owner, self.group, async_op=True)
                wait_for(work, self.group, "the params' broadcast")

    def scratch_bytes(self) -> int:
        """Bytes of rows that are scratch, not the params' storage (``parameters_as_bucket_view=False``)."""
        return 0 if self.views else sum(r.nbytes for r in self._rows if r is not None)

    def release(self) -> None:
        """Give bucket-viewed params their own storage again (before a rebuild)."""
        if self.views:
            with torch.no_grad():
                for i in self._viewed():
                    self.params[i].data = self.params[i].data.clone()

    def _allocate(self, plan: SyncRows, world_size: int) -> torch.Tensor | None:
        if not plan.chunk:
            return None
        example = self.params[next(p.param for per_rank in plan.pieces for p in per_rank[0])]
        rows = torch.empty(world_size, plan.chunk, dtype=example.dtype, device=example.device)
        if self.views:  # one chunk per row: each piece is a whole param
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


class ViewWatch:
    """Tells when params that were made views into a sync's storage have been given other storage
    (``param.data = ...``, ``module.to(...)``), which the sync would then no longer reach.
    ``fake``: under torch's fake process group the params are fake tensors, with no storage to
    compare: the watch steps aside."""

    def __init__(self, params: Sequence[torch.Tensor], indices: Sequence[int], fake: bool = False):
        # in the params' order, so that the error names the first param moved
        self.params, self.indices, self.fake = params, sorted(indices), fake
        self.pointers = [] if fake else [params[i].data_ptr() for i in self.indices]

    def joined(self, other: ViewWatch) -> ViewWatch:
        """One watch over both watches' params."""
        return ViewWatch(self.params, self.indices + other.indices, self.fake)

    def check(self) -> None:
        """``ValueError`` naming the first param whose storage moved (about 0.1 us per param)."""
        if self.fake or [self.params[i].data_ptr() for i in self.indices] == self.pointers:
            return
        i = next(i for i, ptr in zip(self.indices, self.pointers) if self.params[i].data_ptr() != ptr)
        raise ValueError(f"params[{i}] was given new storage after the optimizer was built (param.data = ..., "
                         "module.to(...)), so the optimizer's sync no longer writes it: build the optimizer "
                         "after moving or casting the model")
