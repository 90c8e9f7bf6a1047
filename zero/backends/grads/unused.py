"""DDP's unused-parameter protocol (``find_unused_parameters=True``) for the gradients zero
reduces itself: a param no backward reached counts as zeros in its unit, and once every unit has
started, one all-reduce says which params no rank reached at all.

A whole param no rank reached keeps no gradient, so its owner does not step it (as torch's
optimizers skip a ``None`` gradient); a flat shard steps as one tensor, so a param in one that no
rank reached steps with a zero gradient: said once, by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from zero.backends import comm

__all__ = ["Unused"]


class Unused:
    """Which params the backward passes of an iteration reached, here and on every rank."""

    def __init__(self, names: Sequence[str], whole: Sequence[int], group: Any, device: torch.device):
        self.names, self.whole, self.group, self.device = names, set(whole), group, device
        self.told = False  # the warning about flat params no rank reached is said once
        self.reset()

    def reset(self) -> None:
        """A new iteration: nothing reached, nothing agreed."""
        self.reached: set[int] = set()  # params some backward reached here since zero_grad
        self.agreed = False  # the ranks agreed this iteration (`agree`)
        self.everywhere: set[int] = set()  # params no backward reached on any rank

    def agree(self, members: Sequence[int]) -> None:
        """After every reduction has started (the same collectives in the same order on every rank):
        one all-reduce of which of ``members`` each rank reached, as DDP does; once an iteration."""
        if self.agreed:
            return
        self.agreed = True
        reached = torch.zeros(len(self.names), dtype=torch.float32, device=self.device)
        reached[sorted(self.reached)] = 1.0
        comm.all_reduce_max(reached, self.group)
        self.everywhere = {i for i in members if reached[i] == 0}
        flat = sorted(i for i in self.everywhere if i not in self.whole)
        if flat and not self.told:
            self.told = True
            names = ", ".join(self.names[i] for i in flat[:5]) + (" ..." if len(flat) > 5 else "")
            warnings.warn(f"{len(flat)} params got no gradient on any rank in this iteration ({names}): they sit in "
                          "flat shards, which step as one tensor, so they step with a zero gradient (their "
                          "momentum and weight decay go on), where DDP(find_unused_parameters=True) + torch would "
                          "leave them alone. Keep such params whole (a hybrid plan's whole=) for DDP's behaviour. "
                          "Said once.", stacklevel=3)
