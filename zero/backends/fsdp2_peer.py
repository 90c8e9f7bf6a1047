"""FSDP2, the peer, measured the way `zero.backends.simulate` measures zero: one rank of a large job
under torch's fake process group and ``FakeTensorMode``, its peak by torch's own ``FSDPMemTracker``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) is ZeRO-3: params, gradients and optimizer state
all sharded, each layer's params all-gathered for its forward and again for its backward, its
gradients reduce-scattered as they are made. Its peak per rank is therefore the shards plus the
largest layers unsharded at once, where ZeRO-1/2 keep every param whole.

The model is rebuilt from parameter metadata: one module per transformer layer (the params named
up to a number, ``layers.N.`` as the presets and Hugging Face models name them) and one per
other param (the embedding, the final norm, the head), each wrapped by ``fully_shard``, as
torchtitan wraps its blocks and embeddings, then the root. Its forward
reads every param once, through a scalar, so the measured memory is the params', gradients' and
optimizer's, activations aside, as in `simulate`.

The peak is the second iteration's (everything alive at its start included), the steady state the
plan predicts. In the first, DTensor's sharding propagation, which caches its result per op, runs
each op on fake tensors of the params' global shapes, and under the simulation's own
``FakeTensorMode`` the tracker counts them as memory (it skips them only under another fake
mode): GPT-2's first AdamW step at 8 ranks counted 607 MB of "optimizer state" where the state is
124 MB, in no collective. A real rank allocates none of them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zero.backends.fake_runs import OPTIMIZER_CLASSES, batch_loss, batch_tokens, fake_group, peak_only
from zero.plans.fsdp2_memory import units
from zero.plans.meta import ParamMeta, param_metas

__all__ = ["fsdp2_peak", "measure", "run", "batch_run", "tracked", "shard_units",
           "Fsdp2Run", "Fsdp2RankRun",
           "simulate_fsdp2", "layered", "few_chunks"]

# FSDPMemTracker's categories under the names of `zero.plans.fsdp2_memory`'s (its TEMP: the
# gradients autograd makes in backward, the step's temporaries in the step)
_CATEGORIES = {"sharded_param": "sharded_params", "sharded_grad": "sharded_grads", "opt": "optimizer_state",
               "unsharded_param": "unsharded_params", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}


class _Layer(nn.Module):
    def __init__(self, metas: Sequence[ParamMeta], dtype: torch.dtype | None):
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.empty(m.shape, dtype=dtype or getattr(torch, m.dtype)),
                                                     requires_grad=m.requires_grad) for m in metas])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(p.sum() for p in self.params)


class _Layered(nn.Module):
    def __init__(self, layers: list[_Layer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def layered(metas: Sequence[ParamMeta], dtype: torch.dtype | None = None) -> nn.Module:
    """A module with ``metas``' params (``dtype``: all in it) in ``layers``, in order: one per
    `zero.plans.fsdp2_memory.units` unit (a transformer layer, the params whose names share the
    prefix up to their first number: ``layers.3``, ``h.3``; or one other param: the embedding,
    the final norm, the head)."""
    metas = list(metas)
    return _Layered([_Layer([metas[i] for i in unit], dtype) for unit in units(metas)])


class _Chunks(Sequence):
    """What ``list(torch.chunk(tensor, n, dim))`` padded with empty tensors to ``n`` holds (FSDP2's
    ``_chunk_with_empty``), each chunk made when it is read: the same views, at the same offsets."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        self.size = -(-tensor.size(dim) // n) if tensor.size(dim) else 0  # torch.chunk's chunk size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        start, length = i * self.size, self.tensor.size(self.dim)
        if not length:  # torch.chunk of an empty dim: n empty views of the tensor
            return self.tensor.narrow(self.dim, 0, 0)
        if start < length:
            return self.tensor.narrow(self.dim, start, min(self.size, length - start))
        return self[0].new_empty(0)


@contextlib.contextmanager
def few_chunks() -> Iterator[None]:
    """FSDP2 chunks every param into one view per rank when it shards it and reads two of them
    (its own and the first); under ``FakeTensorMode`` at 1,024 ranks making the other views was
    three quarters of a 7B model's measurement. In the block each view is made when read: the
    same views, so the same memory (`tests/backends/test_fsdp2_peer.py` measures both ways).
    Outside torch versions with ``_fsdp_param._chunk_with_empty`` it changes nothing."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = _Chunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


def fsdp2_peak(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, *,
               optimizer: str = "adamw", master_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, every_chunk: bool = False) -> int:
    """The peak bytes of ``rank`` of ``world_size`` training ``params`` with FSDP2 (`measure`), in a
    process of its own: in one process the same configuration measured twice gave two figures
    (GPT-2 at 64 ranks: 496.3 MB the first time, 340.6 MB after, one embedding apart), so each
    figure is taken as a fresh job's process takes it, whatever was measured before. ``params``:
    metadata, or a picklable model factory."""
    from zero.backends.fresh import in_fresh_process

    return in_fresh_process(measure, params, world_size, rank, optimizer=optimizer, master_dtype=master_dtype,
                            reduce_dtype=reduce_dtype, every_chunk=every_chunk)


def measure(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, *,
            optimizer: str = "adamw", master_dtype: torch.dtype | None = None,
            reduce_dtype: torch.dtype | None = None, every_chunk: bool = False) -> int:
    """The peak bytes of ``rank`` of ``world_size`` training ``params`` (a model factory, or
    metadata) with FSDP2 and ``torch.optim``'s ``optimizer``, in the second of two iterations (`run`).

    ``master_dtype``: FSDP2's mixed precision as torchtitan runs it: the sharded params (the
    optimizer's) in this dtype, all-gathered and computed in the params' own
    (``MixedPrecisionPolicy(param_dtype=...)``); ``reduce_dtype``: the gradients' reduce-scatter's.
    ``every_chunk``: let FSDP2 make every rank's view of each param as it does (see `few_chunks`)."""
    return run(params, world_size, rank, optimizer=optimizer, master_dtype=master_dtype, reduce_dtype=reduce_dtype,
               every_chunk=every_chunk).measured_peak_bytes


@dataclass(frozen=True)
class Fsdp2Run:
    """One simulated rank under FSDP2 (HSDP at ``replicas`` > 1): its measured peak and the
    categories of `FSDPMemTracker` at it, and the bytes it sent in the last iteration's
    collectives, within its replica (FSDP2's all-gathers and reduce-scatters, zero's exchanges) and
    across replicas (HSDP's all-reduce, zero's all-gathers), as nccl-tests count them."""

    rank: int
    world_size: int
    replicas: int
    measured_peak_bytes: int
    measured_by_category: dict[str, int]
    sent: dict[str, int]
    # where the measured peak came ("backward of layers.1", "step"): a description, not compared
    measured_moment: str = field(default="", compare=False)


def run(params: Callable[[], nn.Module] | Sequence[ParamMeta], world_size: int, rank: int, *,
        optimizer: str = "adamw", master_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
        every_chunk: bool = False, replicas: int = 1, zero: bool = False,
        batch: tuple[int, int] | None = None) -> Fsdp2Run:
    """`measure`'s run, on a ``replicas x world_size / replicas`` mesh (HSDP) when ``replicas`` > 1,
    stepped by ``torch.optim``'s ``optimizer`` or, with ``zero``, by `zero.ZeroRedundancyOptimizer`
    over the same class (its state sharded over the replicas too).

    ``batch`` ``(B, T)``: the model itself (a factory's, or a LLaMA preset's: `preset_models`) runs
    forward and backward on ``B x T`` token ids, so activations and their temporaries are measured
    too (`batch_run` measures the same on real tensors); without it, a forward reading each param
    once (the params', gradients' and state's memory alone)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from zero.backends.fake_runs import as_fake, built_on_meta

    if batch is not None:
        meta_model = built_on_meta(params if callable(params) else lambda: _llama(params))
    with fake_group(rank, world_size), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        mesh = _mesh(world_size, replicas)  # outside FakeTensorMode: the mesh reads real tensors
        with FakeTensorMode():
            if batch is not None:
                model = as_fake(meta_model)
                with contextlib.nullcontext() if every_chunk else few_chunks():
                    shard_units(model, mesh)
                return tracked(model, mesh, optimizer, zero, batch_tokens(model, batch), rank, world_size, replicas)
            metas = params if not callable(params) else param_metas(params())
            compute = {m.dtype for m in metas if m.requires_grad}
            policy = MixedPrecisionPolicy(
                param_dtype=getattr(torch, compute.pop()) if master_dtype is not None and len(compute) == 1 else None,
                reduce_dtype=reduce_dtype)
            model = layered(metas, master_dtype)
            with contextlib.nullcontext() if every_chunk else few_chunks():
                shard_units(model, mesh, policy)
            return tracked(model, mesh, optimizer, zero, torch.zeros(()), rank, world_size, replicas)


def batch_run(factory: Callable[[], nn.Module] | Sequence[ParamMeta], batch: tuple[int, int], *, replicas: int = 1,
              optimizer: str = "adamw", zero: bool = False, seed: int = 0, iterations: int = 3) -> Fsdp2Run:
    """What `run` with ``batch`` simulates, on real tensors: this rank of the default (real) process
    group trains ``factory``'s model (or a LLaMA preset's) under FSDP2 (HSDP with ``replicas``),
    measured by the same ``FSDPMemTracker``, in the last of ``iterations``: a real rank's collectives
    run beside its compute, and in a process's first iterations one can still hold the next unit's
    all-gather when the peak comes (measured: one unit's params more, once in a fresh process)."""
    import torch.distributed as dist

    torch.manual_seed(seed)
    model = factory() if callable(factory) else _llama(factory)
    world_size = dist.get_world_size()
    mesh = _mesh(world_size, replicas)
    shard_units(model, mesh)
    return tracked(model, mesh, optimizer, zero, batch_tokens(model, batch), dist.get_rank(), world_size, replicas,
                   iterations)


def _llama(metas: Sequence[ParamMeta]) -> nn.Module:
    from zero.backends.preset_models import llama_like

    return llama_like(metas)


def shard_units(model: nn.Module, mesh: Any, policy: Any = None) -> None:
    """``fully_shard`` each unit of ``model`` (`zero.plans.fsdp2_memory.units`: a transformer layer,
    or the module of one other param: the embedding, the final norm, the head), then the root, as
    torchtitan wraps its models and as the plan predicts."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zero.plans.fsdp2_memory import unit_of

    policy = policy or MixedPrecisionPolicy()
    done = set()
    for name, _ in model.named_parameters():
        unit = unit_of(name)
        path = unit if unit != name else name.rpartition(".")[0]
        if path and path not in done:
            fully_shard(model.get_submodule(path), mesh=mesh, mp_policy=policy)
            done.add(path)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def tracked(model: nn.Module, mesh: Any, optimizer: str, zero: bool, x: torch.Tensor, rank: int, world_size: int,
            replicas: int, iterations: int = 2) -> Fsdp2Run:
    """``iterations`` of ``model`` (sharded on ``mesh``) on input ``x`` under ``FSDPMemTracker``;
    the last one's peak, its categories and the bytes it sent."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    cls_name, settings = OPTIMIZER_CLASSES[optimizer]
    cls = getattr(torch.optim, cls_name)
    opt = cls(model.parameters(), **settings) if not zero else _zero(model, cls, settings)
    tracker = peak_only(FSDPMemTracker)(model, opt)
    tracker.track_inputs((x,))
    with tracker:
        for k in range(iterations):
            last = k == iterations - 1
            if last:  # the steady state's peak, as the plan predicts (see the module)
                tracker.restart_peak()
            with _sent(mesh) if last else contextlib.nullcontext() as sent:
                out = model(x)
                (out if x.dim() == 0 else batch_loss(out, x)).backward()
                del out
                opt.step()
            opt.zero_grad()
            tracker.reset_mod_stats()  # (the tracker's per-module records hold one iteration)
    snapshot = {}
    for device in tracker.get_tracker_snapshot("peak").values():
        for key, value in device.items():
            name = str(getattr(key, "name", key)).lower()
            snapshot[name] = snapshot.get(name, 0) + int(value)
    total = snapshot.pop("total")
    return Fsdp2Run(rank, world_size, replicas, total, snapshot, dict(sent), getattr(tracker, "peak_moment", ""))


def _mesh(world_size: int, replicas: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        return init_device_mesh("cpu", (world_size,))
    if world_size % replicas:
        raise ValueError(f"{replicas} replicas do not divide {world_size} ranks")
    return init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


def _zero(model: nn.Module, cls: type, settings: dict) -> Any:
    from zero.backends.zero_optimizer import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), cls, **settings)


@contextlib.contextmanager
def _sent(mesh: Any) -> Iterator[dict[str, int]]:
    """The bytes this rank sends in the block's collectives (FSDP2's, through ``torch.distributed``,
    and zero's, recorded by `zero.backends.comm.recording`), ``"within"`` a replica and ``"across"``
    replicas (the replicate group's)."""
    import torch.distributed as dist

    from zero.backends import comm
    from zero.plans.accounting import bus_bytes

    across = mesh.get_group(0) if mesh.ndim == 2 else None
    out = {"within": 0, "across": 0}
    # FSDP2's collectives, by the name it calls and where the tensor that sizes the buffer is
    names = {"all_gather_single": ("all_gather", "output_tensor", 0), "reduce_scatter_single": ("reduce_scatter",
                                                                                                 "input", 1),
             "all_reduce": ("all_reduce", "tensor", 0)}
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}  # (torch 2.x's names vary)

    def wrapped(name: str) -> Callable:
        kind, key, at = names[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            group, tensor = kwargs.get("group"), kwargs[key] if key in kwargs else args[at]
            where = "across" if across is not None and group == across else "within"
            out[where] += bus_bytes(kind, tensor.numel() * tensor.element_size(), dist.get_world_size(group))
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, wrapped(name))
    try:
        with comm.recording() as made:
            yield out
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    for c in made:  # zero's own that do not call the names above: exchanges with owners, over the replicas
        if c.kind in ("exchange", "all_gather_into", "broadcast_from"):
            out["within" if c.kind == "exchange" else "across"] += c.bus_bytes


@dataclass(frozen=True)
class Fsdp2RankRun:
    """`simulate_fsdp2`'s rank: measured (`Fsdp2Run`) beside the plan's prediction
    (`zero.plans.fsdp2_memory.Fsdp2Footprint`), in ``zero simulate``'s fields."""

    measured: Fsdp2Run
    predicted: Any
    batch: tuple[int, int] | None = None  # the run's forward and backward on this batch (activations measured)

    @property
    def rank(self) -> int:
        return self.measured.rank

    @property
    def world_size(self) -> int:
        return self.measured.world_size

    @property
    def measured_peak_bytes(self) -> int:
        return self.measured.measured_peak_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        return self.predicted.peak_bytes

    def as_dict(self) -> dict[str, Any]:
        got = {_CATEGORIES.get(k, k): v for k, v in self.measured.measured_by_category.items() if v}
        temp = "step_temps" if self.predicted.peak_phase == "step" else "unsharded_grads"
        got[temp] = got.pop("temp", 0)
        names = dict.fromkeys([*self.predicted.by_category, *got])
        by_category = {k: {"predicted": self.predicted.by_category.get(k, 0), "measured": got.get(k, 0)}
                       for k in names}
        sent = {k: {"predicted": self.predicted.sent[k], "measured": self.measured.sent[k]}
                for k in ("within", "across")}
        return {"rank": self.rank, "world_size": self.world_size, "replicas": self.measured.replicas,
                "predicted_peak_bytes": self.predicted_peak_bytes, "measured_peak_bytes": self.measured_peak_bytes,
                "peak_phase": self.predicted.peak_phase, "by_category": by_category,
                "collective_bytes": sum(self.measured.sent.values()),
                "plan_collective_bytes": sum(self.predicted.sent.values()), "sent": sent,
                "ddp_allreduce_bytes": 0, "collectives": [],
                "measured_peak_phase": self.measured.measured_moment,
                **({"batch": list(self.batch), "activation_bytes": self.activation_bytes} if self.batch else {})}

    @property
    def activation_bytes(self) -> int:
        """The activations autograd kept for backward, at the run's peak (``FSDPMemTracker``'s ``act``)."""
        return self.measured.measured_by_category.get("act", 0)


def simulate_fsdp2(params: Sequence[ParamMeta], world_size: int, rank: int, *, replicas: int = 1,
                   optimizer: str = "adamw", zero: bool = False, batch: tuple[int, int] | None = None,
                   model: Callable[[], nn.Module] | None = None) -> Fsdp2RankRun:
    """``rank`` of ``world_size`` training ``params`` (metadata) under FSDP2 (HSDP with ``replicas``
    > 1), stepped by ``torch.optim``'s ``optimizer`` or zero's over the replicas (``zero``):
    measured (`run`, in a process of its own, as `fsdp2_peak`) beside the plan's prediction
    (`zero.plans.fsdp2_memory.fsdp2_footprint`). Kept under ``ZERO_SIMULATE_CACHE`` as
    `zero.backends.simulate` keeps its runs.

    ``batch`` ``(B, T)``: the run is the model's own forward and backward on ``B x T`` token ids
    (``model``: a picklable factory of the model ``params`` describe; without it, a LLaMA preset's
    module), so its peak holds the activations and temporaries the plan leaves out."""
    from zero.backends.fake_runs import cached, optimizer_class
    from zero.backends.fresh import in_fresh_process
    from zero.plans.fsdp2_memory import fsdp2_footprint

    optimizer_class(optimizer)  # a name a simulation runs, else a ValueError naming the choices
    predicted = fsdp2_footprint(list(params), world_size, rank, replicas=replicas, optimizer=optimizer, zero=zero)

    def measured() -> Fsdp2Run:
        source = model if batch is not None and model is not None else list(params)
        return in_fresh_process(run, source, world_size, rank, optimizer=optimizer, replicas=replicas, zero=zero,
                                batch=batch)
    if batch is not None and model is not None:
        return Fsdp2RankRun(measured(), predicted, batch)  # (a factory's run is not kept: see `cached`)
    options = {"engine": "fsdp2", "replicas": replicas, "optimizer": optimizer, "zero": zero,
               **({"batch": tuple(batch)} if batch is not None else {})}
    return Fsdp2RankRun(cached(tuple(params), world_size, rank, options, Fsdp2Run, measured), predicted, batch)
