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

import contextlib
import functools
import hashlib
import os
import pathlib
import pickle
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero.backends import comm
from zero.backends.local_optimizer import state_nbytes
from zero.backends.sync import ParamSync
from zero.plans.accounting import bus_bytes
from zero.plans.footprint import Footprint, ddp_allreduce_bytes, footprint
from zero.plans.meta import ParamMeta

__all__ = ["RankRun", "simulate", "cached", "fake_group", "optimizer_class", "peak_only", "OPTIMIZER_CLASSES"]

# ``optimizer=`` names: the torch.optim class each runs and its settings (the plan's accounting
# counts the state of the rule of the same name, `zero.plans.accounting.OPTIMIZERS`).
OPTIMIZER_CLASSES = {"adamw": ("AdamW", {"lr": 1e-3}), "adam": ("Adam", {"lr": 1e-3}), "sgd": ("SGD", {"lr": 1e-3}),
                     "sgd_momentum": ("SGD", {"lr": 1e-3, "momentum": 0.9})}


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
                "ddp_allreduce_bytes": self.ddp_allreduce_bytes, "collectives": [list(c) for c in self.collectives]}


@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[Any]:
    """torch's fake process group as the default group, ``rank`` of ``world_size``, for the block
    (a default group already set up is a ``RuntimeError``: a simulation takes the process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _require_no_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _require_no_group() -> None:
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized: simulate in a process of its own")


def simulate(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, *,
             optimizer: str = "adamw", strategy: str = "sorted_greedy", master_dtype: torch.dtype | None = None,
             reduce_scatter_grads: bool = False, reduce_dtype: torch.dtype | None = None, whole: Any = None,
             parameters_as_bucket_view: bool | None = None, dtype: torch.dtype | None = None) -> RankRun:
    """Run ``rank`` of ``world_size`` under the fake process group: build the params (``params``: a
    function building the model, called under ``FakeTensorMode``, or parameter metadata; ``dtype``
    casts them), the plan (`zero.make_plan` with ``strategy``, the state of ``optimizer``,
    ``master_dtype``; ``whole=``: a hybrid plan; flat plans in buckets sized as the optimizer's own),
    a `ZeroRedundancyOptimizer` executing it with ``torch.optim``'s rule, and two iterations.
    Runs from metadata are kept under ``ZERO_SIMULATE_CACHE`` when it is set (see the module)."""
    cls, settings = optimizer_class(optimizer)
    _require_no_group()
    options = dict(optimizer=optimizer, strategy=strategy, master_dtype=master_dtype, whole=whole, dtype=dtype,
                   reduce_scatter_grads=reduce_scatter_grads, reduce_dtype=reduce_dtype,
                   parameters_as_bucket_view=parameters_as_bucket_view)
    return cached(params, world_size, rank, options, RankRun,
                  lambda: _run(params, world_size, rank, cls, settings, **options))


def cached(params: Any, world_size: int, rank: int, options: dict, kind: type, compute: Callable[[], Any]) -> Any:
    """``compute()``'s run of ``rank`` of ``world_size`` on ``params`` with ``options`` (each a
    value), read back from ``ZERO_SIMULATE_CACHE`` when a run of the same inputs (and of ``kind``)
    is kept there, else computed and kept (see the module). Runs from a model factory are not kept."""
    key = _cache_key(params, world_size, rank, options)
    run = _cache_read(key, kind)
    if run is None:
        run = compute()
        _cache_write(key, run)
    return run


def _run(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, cls: type,
         settings: dict, *, optimizer: str, strategy: str, master_dtype: torch.dtype | None,
         reduce_scatter_grads: bool, reduce_dtype: torch.dtype | None, whole: Any,
         parameters_as_bucket_view: bool | None, dtype: torch.dtype | None) -> RankRun:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zero.backends.zero_optimizer import ZeroRedundancyOptimizer

    with fake_group(rank, world_size), FakeTensorMode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")  # inside torch's own
        model = _model(params, dtype)
        plan = _plan(model, world_size, strategy, optimizer, master_dtype, whole)
        tracker = _tracker()
        tracker.track_external(model)
        with tracker:
            opt = ZeroRedundancyOptimizer(model.parameters(), cls, plan=plan,
                                          reduce_scatter_grads=reduce_scatter_grads, reduce_dtype=reduce_dtype,
                                          parameters_as_bucket_view=parameters_as_bucket_view, **settings)
            _iteration(model, opt)
            opt.zero_grad()
            with comm.recording() as collectives:
                _iteration(model, opt)
        measured = _measured(model, opt)
        peak = sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
    predicted = footprint(plan, rank, reduce_scatter_grads=reduce_scatter_grads, bucket_view=parameters_as_bucket_view,
                          reduce_dtype=None if reduce_dtype is None else str(reduce_dtype).removeprefix("torch."))
    return RankRun(rank, world_size, peak, measured, tuple((c.kind, c.dtype, c.group_size, c.bytes)
                                                           for c in collectives), predicted,
                   0 if reduce_scatter_grads else ddp_allreduce_bytes(plan))


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


def peak_only(tracker_class: type) -> type:
    """``tracker_class`` (torch's ``MemTracker`` or ``FSDPMemTracker``) keeping the whole rank's
    peak alone, and able to start it again (``restart_peak()``). After every op torch's tracker
    also walks every module it has seen, to keep each one's own peak while it runs: 40% of a
    LLaMA-70B run's time at 1,024 ranks, and the simulations read only the rank's peak
    (``get_tracker_snapshot("peak")``), which this keeps as torch does, to the byte
    (tests/backends/test_simulate.py, tests/backends/test_fsdp2_peer.py). The tracker's peak lives
    in its private fields, which torch gives no other way to read or reset: they are touched here
    only."""
    from copy import deepcopy

    class PeakOnly(tracker_class):
        def _update_peak_stats(self, peak_state: Any) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = deepcopy(snapshot)

        def restart_peak(self) -> None:
            """The peak from now on: what is alive now and what comes, as though tracking began here."""
            self._peak_mem = {device: snapshot["Total"] for device, snapshot in self._curr_mem_snap.items()}
            self._peak_mem_snap = deepcopy(self._curr_mem_snap)

    PeakOnly.__name__ = PeakOnly.__qualname__ = f"PeakOnly{tracker_class.__name__}"
    return PeakOnly


def _cache_key(params: Any, world_size: int, rank: int, options: dict) -> str | None:
    """What a run depends on, hashed: None where it cannot be named (no cache set; a model built by a
    function, whose code is not a value; a ``whole=`` that `make_plan` will refuse)."""
    if not os.environ.get("ZERO_SIMULATE_CACHE") or callable(params):
        return None
    from zero.plans.costs import cost_of
    from zero.plans.hybrid import resolve_whole

    metas = tuple(params)
    whole = options.get("whole")
    if whole is not None:
        if options["strategy"] != "flat":
            return None
        whole = resolve_whole(metas, whole, cost_of(options["optimizer"]))  # a function: what it picks
    inputs = (metas, world_size, rank, sorted({**options, "whole": whole}.items()), _source_digest())
    return hashlib.sha256(repr(inputs).encode()).hexdigest()


@functools.cache
def _source_digest() -> str:
    """zero's own source and torch's version: a run kept by other code is never read back."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(pathlib.Path(__file__).parents[1].rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _cache_read(key: str | None, kind: type) -> Any:
    path = None if key is None else pathlib.Path(os.environ["ZERO_SIMULATE_CACHE"], f"{key}.pkl")
    if path is None or not path.is_file():
        return None
    try:
        run = pickle.loads(path.read_bytes())
    except Exception:  # a file another version or a killed writer left: run again, and replace it
        return None
    return run if isinstance(run, kind) else None


def _cache_write(key: str | None, run: Any) -> None:
    """Written whole or not at all (a temporary file renamed): two processes may write one key."""
    if key is None:
        return
    folder = pathlib.Path(os.environ["ZERO_SIMULATE_CACHE"])
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(pickle.dumps(run))
    os.replace(tmp, folder / f"{key}.pkl")


def optimizer_class(name: str) -> tuple[type, dict]:
    """The ``torch.optim`` class and settings of an ``optimizer=`` name a simulation runs
    (`OPTIMIZER_CLASSES`); another name is a ``ValueError`` naming the choices."""
    if name not in OPTIMIZER_CLASSES:
        raise ValueError(f"unknown optimizer {name!r} for a simulation; choose one of {sorted(OPTIMIZER_CLASSES)}")
    cls_name, settings = OPTIMIZER_CLASSES[name]
    return getattr(torch.optim, cls_name), settings


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


def _model(params: Callable[[], nn.Module] | Sequence[ParamMeta], dtype: torch.dtype | None) -> nn.Module:
    """The model (under the active ``FakeTensorMode``): built by ``params``, or a `ParameterList`
    of ``params``' metadata (names, shapes, dtypes, frozen or not); ``dtype`` casts it."""
    if callable(params):
        model = params()
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
