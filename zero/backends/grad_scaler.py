"""`ShardedGradScaler`: ``torch.amp.GradScaler`` whose loss scale agrees across the ranks of a
`ZeroRedundancyOptimizer` whose gradients are reduce-scattered.

torch's scaler decides whether a step overflowed from the gradients it sees on its own rank. With
``reduce_scatter_grads=True`` those are the rank's unreduced gradients, and an overflow may show
only in another rank's shard of the sum: the ranks would grow and back off their scales apart.
The optimizer's step already checks the reduced gradients it steps and agrees with every rank
(one all-reduce of the flag); this scaler takes that agreed flag for its update. fairscale's
``ShardedGradScaler`` is the anchor.
"""

from __future__ import annotations

from typing import Any

import torch

from zero.backends.zero_optimizer import ZeroRedundancyOptimizer

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """Use as ``torch.amp.GradScaler``; with a `ZeroRedundancyOptimizer` its scale follows the
    optimizer's agreed check (other optimizers get torch's behaviour)."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if _reduce_scattered(optimizer):
            raise ValueError("unscale_ before step: with reduce_scatter_grads=True the params' .grad are this rank's "
                             "unreduced gradients, so unscaling or clipping them means nothing for the step. Clip in "
                             "the optimizer's chain (zero.functional.clip_by_global_norm sees the sharded global norm)")
        super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        if _reduce_scattered(optimizer):  # the step checks the reduced gradients; the unreduced may be in flight
            return {found_inf.device: found_inf}
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(optimizer, ZeroRedundancyOptimizer) or not self.is_enabled():
            return super().step(optimizer, *args, **kwargs)
        optimizer._sharded_scaler = True
        out = super().step(optimizer, *args, **kwargs)
        agreed = optimizer.agreed_found_inf
        if agreed is not None:  # the update that follows reads these
            for found in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                found.copy_(agreed)
        return out


def _reduce_scattered(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer) and not optimizer.mode.scaler_sees_grads
