"""How a `ZeroRedundancyOptimizer` executes its plan: one object per mode, chosen once (`make_mode`).

- `WholeParams` (whole-param plans): steps the params it owns with their own (DDP's) gradients;
  syncs by all-gathering rows of packed params, or broadcasts.
- `FlatShards` (flat plans): steps a 1-D shard per flat buffer, its gradient the pieces of the
  params' gradients copied in (`CopiedGradients`); syncs by one all-gather per buffer.
  Under a hybrid plan (flat, with some params whole) it also steps the whole params it owns and
  syncs them by their owners' rows. With ``reduce_scatter_grads=True`` its gradients are
  `ReducedGradients` (`zero.backends.grads`: reduce-scattered during backward, in place of DDP,
  each whole param's summed into its owner).
- `ReduceScatteredShards` (flat plans without whole params, ``reduce_scatter_grads=True``): the
  step of an element-wise torch rule pipelined buffer by buffer with the sync.
- `DDPOverlap` (whole-param plans by DDP's buckets, ``overlap_with_ddp=True``): steps each
  bucket's owned params inside DDP's comm hook; syncs at the end of backward.

Each answers the questions of `Mode` (`base`): which live tensor the local optimizer steps for
each of the rank's holdings, a step with its gradients and sync, and what freezing params,
adding a group and ``Join`` mean in it; its `Gradients` (`gradients`, ``mode.gradients``) say
where the gradients are and what ``zero_grad``, ``no_sync`` and the non-finite check mean. Modes map no state: what a
rank holds is the plan's (`zero.plans.holdings`), kept by the optimizer's `RankState`, and every
state format reads it there. A new mode is a `Mode` subclass (one base) in a module here and one
branch of `make_mode`; `ZeroRedundancyOptimizer` does not change.
"""

from __future__ import annotations

from typing import Any

import torch

from zero._lazy import module_getattr
from zero.backends.comm import Reducer
from zero.backends.local_optimizer import check_one_rank_steps_all, check_shardable
from zero.backends.modes.base import Mode
from zero.backends.modes.ddp_overlap import DDPOverlap
from zero.backends.modes.flat import FlatShards
from zero.backends.modes.gradients import CopiedGradients, Gradients, ReducedGradients
from zero.backends.modes.reduce_scatter import ReduceScatteredShards
from zero.backends.modes.whole import WholeParams
from zero.backends.rank_state import RankState
from zero.plans.meta import ParamMeta

__all__ = ["Mode", "Gradients", "CopiedGradients", "WholeParams", "FlatShards", "ReduceScatteredShards", "DDPOverlap",
           "make_mode"]


def make_mode(state: RankState, metas: list[ParamMeta], *, optimizer_class: Any, overlap_with_ddp: bool,
              reduce_scatter_grads: bool, bucket_view: bool | None, chunk_bytes: int,
              reduce_dtype: torch.dtype | None = None, defaults: dict | None = None,
              find_unused_parameters: bool = False, reducer: Any = None) -> Mode:
    """The mode that executes the rank state's plan with these options (``ValueError`` for
    combinations that cannot run)."""
    plan = state.plan
    if find_unused_parameters and not reduce_scatter_grads:
        raise ValueError("find_unused_parameters=True is for the gradients zero reduces itself "
                         "(reduce_scatter_grads=True); with DDP, pass it to DDP: "
                         "DistributedDataParallel(model, find_unused_parameters=True)")
    if reduce_dtype is not None and not reduce_scatter_grads:
        raise ValueError(f"reduce_dtype={reduce_dtype} is the dtype of the gradients' reduce-scatter, which runs "
                         "only with reduce_scatter_grads=True (with DDP, DDP reduces in the params' dtype; use a "
                         "DDP comm hook to change it): pass reduce_scatter_grads=True and a flat plan, or drop it")
    if reducer is not None and not reduce_scatter_grads:
        raise ValueError(f"reducer={reducer!r} reduces the gradients' buckets, which zero reduces only with "
                         "reduce_scatter_grads=True (with DDP, DDP reduces them; use a DDP comm hook): pass "
                         "reduce_scatter_grads=True and a flat plan, or drop it")
    if reducer is not None and not isinstance(reducer, Reducer):
        raise TypeError(f"reducer must be a zero.backends.comm.Reducer (MeanReducer, Int8Reducer ...), got "
                        f"{type(reducer).__name__}")
    check_one_rank_steps_all(optimizer_class, plan.world_size)
    if plan.flat is not None:
        check_shardable(optimizer_class, defaults or {})
        if overlap_with_ddp:
            raise ValueError("overlap_with_ddp=True steps whole params as DDP's buckets arrive: use a "
                             "whole-param plan (flat plans reduce-scatter instead: reduce_scatter_grads=True)")
        if reduce_scatter_grads and not plan.hybrid:
            return ReduceScatteredShards(state, metas, reduce_dtype, find_unused_parameters, reducer)
        reduced = (lambda flats, _: ReducedGradients(state, metas, flats, reduce_dtype, find_unused_parameters,
                                                     reducer)) if reduce_scatter_grads else None
        return FlatShards(state, metas, bucket_view, chunk_bytes, gradients=reduced)
    if reduce_scatter_grads:
        raise ValueError("reduce_scatter_grads=True needs a flat plan (strategy='flat'): whole-param plans "
                         "leave every rank the full gradients, as DDP does")
    cls = DDPOverlap if overlap_with_ddp else WholeParams
    return cls(state, metas, bucket_view, chunk_bytes)

__getattr__ = module_getattr(__name__)  # a submodule not imported yet resolves on first access
