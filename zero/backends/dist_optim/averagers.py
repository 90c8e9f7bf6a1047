"""Model averagers for post-local SGD, with torch's semantics and one all-reduce per dtype and device.

`PeriodicModelAverager` and `HierarchicalModelAverager` mirror
``torch.distributed.algorithms.model_averaging`` (they subclass its ``ModelAverager``, so torch's
own ``PostLocalSGDOptimizer`` accepts them too). When to average comes from `zero.plans.averaging_schedule`;
this module only runs the all-reduce.

Differences from torch, on purpose: params are written in place (``copy_``), so views such as
`ZeroRedundancyOptimizer`'s bucket views stay views; params of different dtypes are averaged in
their own buffers instead of being up-cast into one; 16-bit floats are summed in float32.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from zero.backends import comm
from zero.plans.averaging_schedule import (
    check_period,
    check_warmup,
    hierarchical_level,
    hierarchy,
    periodic_due,
    subgroup_blocks,
)
from zero.plans.meta import param_groups
from zero.plans.shards import by_key

__all__ = ["ModelAverager", "PeriodicModelAverager", "HierarchicalModelAverager", "average_parameters",
           "params_to_average"]


def params_to_average(params: Iterable[Any]) -> list[torch.Tensor]:
    """The params with a gradient, from tensors or param-group dicts: frozen or unused ones keep theirs."""
    flat = [p for group in param_groups(params) for p in group["params"]]
    for i, p in enumerate(flat):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] is a {type(p).__name__}, not a tensor")
    return [p for p in flat if p.grad is not None]


def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    # Summing world_size values in bf16/fp16 drops low bits torch's mixed-dtype path keeps.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@torch.no_grad()
def average_parameters(params: Iterable[Any], process_group: Any = None) -> int:
    """Set every param with a gradient to its mean over ``process_group``, in place.

    One flattened all-reduce per (device, dtype); returns how many ran (0 off the group).
    """
    group = comm.resolve_group(process_group, "average_parameters")
    chosen = params_to_average(params)
    if not comm.in_group(group) or not chosen:
        return 0
    size = comm.group_size(group)
    buckets = by_key([(p.device, p.dtype) for p in chosen])
    for (_, dtype), idx in buckets.items():
        ps = [chosen[i] for i in idx]
        flat = torch.cat([p.detach().reshape(-1) for p in ps]).to(_reduce_dtype(dtype))
        flat.div_(size)  # before the sum, as torch does, so the results agree bit for bit
        comm.all_reduce_sum(flat, group)
        offset = 0
        for p in ps:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    return len(buckets)


class PeriodicModelAverager(ModelAverager):
    """Average params across ``process_group`` every ``period`` steps once ``warmup_steps`` have run.

    Call `average_parameters` once per training step, after the optimizer step; ``step`` counts
    those calls (a param-group list is one call, however many groups it has).
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group: Any = None):
        super().__init__(comm.resolve_group(process_group, "PeriodicModelAverager"))
        self.period, self.warmup_steps = check_period(period), check_warmup(warmup_steps)
        if period == 1:
            warnings.warn("period=1 all-reduces every parameter every step, no cheaper than DDP's gradient "
                          "all-reduce: use DDP alone", stacklevel=2)

    def average_parameters(self, params: Iterable[Any]) -> None:
        params = list(params)  # a generator must be read once even on steps that do not average
        if periodic_due(self.step, self.period, self.warmup_steps):
            average_parameters(params, self.process_group)
        self.step += 1


class HierarchicalModelAverager(ModelAverager):
    """Average in nested groups with different periods (hierarchical SGD), torch's semantics.

    ``period_group_size_dict`` maps period -> group size, lowest level first, e.g. ``{2: 2, 8: 4}``
    on 4 ranks: pairs of consecutive ranks average every 2 steps, all 4 every 8 (and at a step
    divisible by 8 only the global average runs). Every process of the default group must build
    it, in the same order, because it creates the subgroups (``torch.distributed.new_group``).
    """

    def __init__(self, period_group_size_dict: Mapping[int, int], warmup_steps: int = 0, process_group: Any = None):
        super().__init__(comm.resolve_group(process_group, "HierarchicalModelAverager"))
        self.warmup_steps = check_warmup(warmup_steps)
        levels = hierarchy(period_group_size_dict, comm.group_size(self.process_group))
        if levels[-1][0] == 1:
            warnings.warn("the largest period is 1: every level averages every step, no cheaper than DDP alone",
                          stacklevel=2)
        self.periods = tuple(period for period, _ in levels)
        self.period_process_group_dict = {
            period: self.process_group if size == levels[-1][1]
            else comm.new_subgroup(self.process_group, subgroup_blocks(levels[-1][1], size))
            for period, size in levels}

    def average_parameters(self, params: Iterable[Any]) -> None:
        params = list(params)
        level = hierarchical_level(self.step, self.periods, self.warmup_steps)
        if level is not None:
            average_parameters(params, self.period_process_group_dict[self.periods[level]])
        self.step += 1
