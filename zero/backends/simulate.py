"""One rank of a large job, simulated: the real `ZeroRedundancyOptimizer` step under torch's fake process
group and ``FakeTensorMode``, its memory measured by torch's ``MemTracker`` and its collectives
recorded (`zero.backends.comm.recording`), beside what the plan predicts (`zero.plans.footprint`).

Nothing is computed and no memory is taken: a rank of a 1,024-rank job on a 70B model runs in
seconds. The params are fake tensors (from the model's own constructor, or from its metadata);
their gradients are made by autograd one param at a time, in reverse order, as backward makes
them (the model's input is not needed, and no activation is counted). Two iterations run, so the
second backward meets the optimizer state the first step made: the steady state's peak.

With ``ZERO_SIMULATE_CACHE`` naming a directory, a run from metadata is kept there, keyed by its
inputs, zero's source and torch's version, and the same run asked again (by another process too:
a notebook, ``zero simulate``) is read back instead of run again. The test suite shares one per
session; nothing is kept without it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zero.backends import comm
from zero.backends.fake_runs import (
    as_fake,
    batch_loss,
    batch_tokens,
    built_on_meta,
    cached,
    fake_group,
    optimizer_class,
    peak_only,
    require_no_group,
)
from zero.backends.local_optimizer import state_nbytes
from zero.backends.sync import ParamSync
from zero.plans.accounting import bus_bytes
from zero.plans.footprint import Footprint, ddp_allreduce_bytes, footprint
from zero.plans.meta import ParamMeta

__all__ = ["RankRun", "simulate", "tracked_zero", "zero_batch_run"]

@dataclass(frozen=True)
class RankRun:
    """What one simulated rank held and moved, measured, beside the plan's `Footprint`."""

    rank: int
    world_size: int
    measured_peak_bytes: int  # MemTracker's peak over two iterations
    by_category: dict[str, int]  # measured after the last step, read off the optimizer (see `_measured`)
    collectives: tuple[tuple[str, str, int, int], ...]  # (kind, dtype, group size, bytes), in the last step
    predicted: Footprint
    # bytes each rank sends in DDP's all-reduce beside ZeRO-1 (no reduce_scatter_grads): from the
    # plan, not simulated (no DDP runs here); 0 where zero reduces the gradients itself
    ddp_allreduce_bytes: int = 0
    batch: tuple[int, int] | None = None  # the model's forward and backward ran on this batch
    activation_bytes: int = 0  # what autograd kept for backward at the peak (MemTracker's activations)
    # where the measured peak came ("backward of layers.1", "step"): a description, not compared
    measured_moment: str = field(default="", compare=False)

    @property
    def predicted_peak_bytes(self) -> int:
        return self.predicted.peak

    @property
    def collective_bytes(self) -> int:
        """Bytes this rank sent (= received) in the step's collectives, as nccl-tests count them."""
        return sum(bus_bytes(kind, n, size) for kind, _, size, n in self.collectives)

    def as_dict(self) -> dict[str, Any]:
        """Per category: predicted and measured between steps; ``transient``: at the peak (measured:
        the peak less what is held between steps). Collective bytes are what a rank sends (=
        receives) in a step, as nccl-tests count them (`zero.plans.accounting.bus_bytes`)."""
        held = sum(self.by_category.values())
        by_category = {k: {"predicted": self.predicted.resident[k], "measured": self.by_category.get(k, 0)}
                       for k in self.predicted.resident if k != "transient"}
        by_category["transient"] = {"predicted": self.predicted.peak - sum(self.predicted.resident.values()),
                                    "measured": self.measured_peak_bytes - held}
        return {"rank": self.rank, "world_size": self.world_size, "predicted_peak_bytes": self.predicted.peak,
                "measured_peak_bytes": self.measured_peak_bytes, "peak_phase": self.predicted.phase,
                "by_category": by_category,
                "collective_bytes": self.collective_bytes, "plan_collective_bytes": self.predicted.collective_bytes,
                "ddp_allreduce_bytes": self.ddp_allreduce_bytes, "collectives": [list(c) for c in self.collectives],
                "measured_peak_phase": self.measured_moment,
                **({"batch": list(self.batch), "activation_bytes": self.activation_bytes} if self.batch else {})}


def simulate(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, *,
             optimizer: str = "adamw", strategy: str = "sorted_greedy", master_dtype: torch.dtype | None = None,
             reduce_scatter_grads: bool = False, reduce_dtype: torch.dtype | None = None, whole: Any = None,
             parameters_as_bucket_view: bool | None = None, dtype: torch.dtype | None = None,
             batch: tuple[int, int] | None = None) -> RankRun:
    """Run ``rank`` of ``world_size`` under the fake process group: build the params (``params``: a
    function building the model, called under ``FakeTensorMode``, or parameter metadata; ``dtype``
    casts them), the plan (`zero.make_plan` with ``strategy``, the state of ``optimizer``,
    ``master_dtype``; ``whole=``: a hybrid plan; flat plans in buckets sized as the optimizer's own),
    a `ZeroRedundancyOptimizer` executing it with ``torch.optim``'s rule, and two iterations.
    Runs from metadata are kept under ``ZERO_SIMULATE_CACHE`` when it is set (see the module).

    ``batch`` ``(B, T)``: each iteration is the model's own forward and backward on ``B x T`` token
    ids (a factory's model, or a LLaMA preset's: `zero.backends.preset_models`), so the peak holds
    its activations (``activation_bytes``); without it, each param's gradient is made alone."""
    cls, settings = optimizer_class(optimizer)
    require_no_group()
    options = dict(optimizer=optimizer, strategy=strategy, master_dtype=master_dtype, whole=whole, dtype=dtype,
                   reduce_scatter_grads=reduce_scatter_grads, reduce_dtype=reduce_dtype,
                   parameters_as_bucket_view=parameters_as_bucket_view, batch=batch)
    return cached(params, world_size, rank, options, RankRun,
                  lambda: _run(params, world_size, rank, cls, settings, **options))


def _run(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, cls: type,
         settings: dict, *, optimizer: str, strategy: str, master_dtype: torch.dtype | None,
         reduce_scatter_grads: bool, reduce_dtype: torch.dtype | None, whole: Any,
         parameters_as_bucket_view: bool | None, dtype: torch.dtype | None,
         batch: tuple[int, int] | None) -> RankRun:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zero.backends.zero_optimizer import ZeroRedundancyOptimizer

    if batch is not None and not callable(params):
        from zero.backends.preset_models import llama_like

        params = functools.partial(llama_like, params)
    if callable(params):
        params = built_on_meta(params)  # outside the fake mode: its params are plain meta tensors
    with fake_group(rank, world_size), FakeTensorMode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")  # inside torch's own
        model = _model(params, dtype)
        plan = _plan(model, world_size, strategy, optimizer, master_dtype, whole)
        peak, act, collectives, opt, moment = tracked_zero(
            model, lambda: ZeroRedundancyOptimizer(model.parameters(), cls, plan=plan,
                                                   reduce_scatter_grads=reduce_scatter_grads, reduce_dtype=reduce_dtype,
                                                   parameters_as_bucket_view=parameters_as_bucket_view, **settings),
            batch)
        measured = _measured(model, opt)
    predicted = footprint(plan, rank, reduce_scatter_grads=reduce_scatter_grads, bucket_view=parameters_as_bucket_view,
                          reduce_dtype=None if reduce_dtype is None else str(reduce_dtype).removeprefix("torch."))
    return RankRun(rank, world_size, peak, measured, tuple((c.kind, c.dtype, c.group_size, c.bytes)
                                                           for c in collectives), predicted,
                   0 if reduce_scatter_grads else ddp_allreduce_bytes(plan), batch, act, moment)


def tracked_zero(model: nn.Module, make_optimizer: Callable[[], Any], batch: tuple[int, int] | None
                 ) -> tuple[int, int, list, Any, str]:
    """Two iterations of ``model`` stepped by ``make_optimizer()`` (built under the tracker) under
    torch's ``MemTracker``: the peak, the activations at it, the last step's collectives, the
    optimizer and where the peak came. ``batch``: the model's forward and backward on token ids;
    else each param's gradient alone."""
    tracker = _tracker()
    tracker.track_external(model)
    with tracker:
        opt = make_optimizer()
        tokens = batch_tokens(model, batch) if batch is not None else None
        step = (lambda: _iteration(model, opt)) if batch is None else \
            (lambda: (batch_loss(model(tokens), tokens).backward(), opt.step()))
        step()
        opt.zero_grad()
        tracker.reset_mod_stats()  # (its per-module records hold one iteration of a real forward)
        with comm.recording() as collectives:
            step()
    snapshots = tracker.get_tracker_snapshot("peak").values()
    peak = sum(snapshot["Total"] for snapshot in snapshots)
    act = sum(v for snapshot in snapshots for k, v in snapshot.items() if getattr(k, "name", "") == "ACT")
    return peak, act, list(collectives), opt, getattr(tracker, "peak_moment", "")


def zero_batch_run(metas: Sequence[ParamMeta], batch: tuple[int, int], *, optimizer: str = "adamw",
                   strategy: str = "sorted_greedy", seed: int = 0) -> tuple[int, int]:
    """What `simulate` with ``batch`` simulates, on real tensors: this rank of the default (real)
    process group trains a LLaMA preset's module (`zero.backends.preset_models`) with
    `ZeroRedundancyOptimizer` over the same plan, measured by the same ``MemTracker`` over the same
    two iterations: (peak, activations at it)."""
    import torch.distributed as dist

    from zero.backends.preset_models import llama_like
    from zero.backends.zero_optimizer import ZeroRedundancyOptimizer

    cls, settings = optimizer_class(optimizer)
    torch.manual_seed(seed)
    model = llama_like(metas)
    plan = _plan(model, dist.get_world_size(), strategy, optimizer, None, None)
    peak, act, _, _, _ = tracked_zero(model, lambda: ZeroRedundancyOptimizer(model.parameters(), cls, plan=plan,
                                                                          **settings), batch)
    return peak, act


def _tracker() -> Any:
    """torch's ``MemTracker``, without its re-reading of the whole optimizer state after every
    ``optimizer.step()``: a pipelined ZeRO-2 step calls its local optimizer once per bucket, which made
    that re-reading buckets x state tensors, a fifth of a 1,024-rank run. It only re-labels tensors
    the step made, which the tracker already counted under the optimizer's label as they were made
    (its pre-step hook sets it): the runs are the same to the byte (tests/backends/test_simulate.py)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(peak_only(MemTracker)):
        def _track_optimizer_states(self, reftype: Any, optimizer: Any) -> None:
            pass

    return Tracker()


def _plan(model: nn.Module, world_size: int, strategy: str, optimizer: str, master_dtype: torch.dtype | None,
          whole: Any) -> Any:
    from zero.plans.layout import default_bucket_numel
    from zero.plans.meta import param_metas
    from zero.plans.plan import make_plan

    master = None if master_dtype is None else str(master_dtype).removeprefix("torch.")
    metas = param_metas(model)
    bucket = default_bucket_numel(metas, world_size) if strategy == "flat" else None  # as the optimizer sizes them
    return make_plan(metas, world_size, strategy, optimizer=optimizer, bucket_numel=bucket,
                     master_dtype=master, whole=whole)


def _model(params: nn.Module | Sequence[ParamMeta], dtype: torch.dtype | None) -> nn.Module:
    """The model (under the active ``FakeTensorMode``): ``params`` (built on ``meta``) made fake,
    or a `ParameterList` of ``params``' metadata (names, shapes, dtypes, frozen or not); ``dtype``
    casts it."""
    if isinstance(params, nn.Module):
        model = as_fake(params)
    else:
        model = nn.ParameterList([nn.Parameter(torch.empty(m.shape, dtype=getattr(torch, m.dtype)),
                                               requires_grad=m.requires_grad) for m in params])
    if dtype is not None:  # (Module.to cannot swap fake parameters in place)
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    return model


def _iteration(model: nn.Module, opt: Any) -> None:
    """Gradients one param at a time, in reverse order (as backward makes them), then a step."""
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        p.reshape(-1)[:0].backward(p.new_empty(0))  # (an empty output: only the gradient is allocated)
    opt.step()


def _measured(model: nn.Module, opt: Any) -> dict[str, int]:
    """What the rank holds after the last step, read off the live objects."""
    storages = {}
    for p in model.parameters():
        st = p.untyped_storage()
        storages[id(st)] = st.nbytes()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    grads += sum(g.nbytes for g in opt.mode.gradients.held_tensors())  # shards' (flat), whole params' kept (ZeRO-2)
    sync = getattr(opt.mode, "sync", None)  # a whole-param plan's `ParamSync`
    scratch = sync.scratch_bytes() if isinstance(sync, ParamSync) else 0
    return {"params": sum(storages.values()), "sync_rows": scratch, "masters": opt.masters.nbytes(),
            "state": state_nbytes(opt.optim), "grads": grads}
