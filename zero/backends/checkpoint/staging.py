"""Where a background save copies the state before training goes on (`save(..., async_save=True)`).

By default each save copies into fresh host memory (torch's ``BlockingAsyncStager``), freed once
its write is done. With ``keep_staging=True`` the copy's memory is kept for the next save of the
same layout (`KeptStaging`): the first save pays for its pages, every later one only copies, and
most of a fresh copy's time is the kernel handing out its pages (docs/checkpoints.md has the
figures). The cost is the copy's memory held between saves (a rank's share of the model and its
optimizer state) instead of only while a save is written: until a kept save of another layout
replaces it, or the process ends. Reusing it is safe because a save first waits for this
process's background saves (`files.save`), so no write is still reading the buffers it overwrites.
The copies are made by torch's own helpers, those its ``BlockingAsyncStager`` uses (whose cached
mode pins memory, which needs an accelerator).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

__all__ = ["KeptStaging", "kept_staging"]


class KeptStaging(AsyncStager):
    """A stager that copies into the host buffers it made for the last state of this layout (the
    tensors' keys, types, shapes, dtypes and local pieces); another layout drops them and makes new
    ones. Non-tensor values (steps, settings) come from the state being saved, never the buffers."""

    _synchronize_after_execute = False  # the copy is done when `stage` returns

    def __init__(self):
        self._layout: Any = None
        self._buffers: dict | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        layout = _layout(state_dict)
        if layout != self._layout:
            self._buffers = self._layout = None  # the old buffers freed before the new are made
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._layout = layout
        return _copy_state_dict(state_dict, self._buffers)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` copies before it returns."""

    def close(self) -> None:
        """The buffers stay for the next save (`kept_staging` holds this stager for the process)."""


_KEPT: KeptStaging | None = None


def kept_staging() -> KeptStaging:
    """This process's `KeptStaging` (one: a process keeps one staged copy, that of its last save)."""
    global _KEPT
    if _KEPT is None:
        _KEPT = KeptStaging()
    return _KEPT


def _layout(obj: Any) -> Any:
    """What a staged copy of ``obj`` must match to be reused: its structure and, per tensor, what
    its buffer holds (a copy into a buffer of another shape would broadcast, not fail)."""
    if isinstance(obj, dict):
        return tuple((k, _layout(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj).__name__, tuple(_layout(v) for v in obj)
    if isinstance(obj, DTensor):
        return ("DTensor", tuple(obj.shape), obj.dtype, tuple(obj.to_local().shape), tuple(obj.placements),
                id(obj.device_mesh))
    if type(obj).__name__ == "ShardedTensor":
        return ("ShardedTensor", tuple(obj.size()), tuple((tuple(s.metadata.shard_offsets), tuple(s.tensor.shape),
                                                           s.tensor.dtype) for s in obj.local_shards()))
    if isinstance(obj, torch.Tensor):
        return "Tensor", tuple(obj.shape), obj.dtype
    return type(obj).__name__
