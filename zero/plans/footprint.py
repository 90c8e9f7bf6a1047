"""What a rank holds and moves while it executes a plan, in a given mode: its memory at the peak of a
training iteration, by category, and the bytes it hands to collectives in a step.

The executor (`zero.backends.ZeroRedundancyOptimizer`) allocates exactly what this module counts, so
the peak is predicted from metadata alone: `zero simulate` runs the real step under torch's fake
process group and compares. The categories:

- ``params``: the params' storage: flat buffers (padded), a whole-param sync's rows where params
  view them (``parameters_as_bucket_view``), each other param's own, frozen ones included.
- ``sync_rows``: scratch rows of a sync that copies params (``parameters_as_bucket_view=False``).
- ``masters``: the master copies of what the rank steps; ``state``: its optimizer state (steady
  state: the state exists from the first step on).
- ``grads``: gradients held from backward to the next ``zero_grad``: every trainable param's whole
  gradient where DDP leaves them (ZeRO-1; DDP with ``gradient_as_bucket_view=True``, which keeps
  no second copy in its buckets), and a flat plan's shard-sized copies of its pieces; with
  ``reduce_scatter_grads`` only the rank's shards of the mean (in ``reduce_dtype``), and the mean
  gradients an owner keeps of a hybrid plan's whole params (in ``reduce_dtype``).
- ``transient``: what the moment of the peak adds and then drops. In backward, with
  ``reduce_scatter_grads``: the buckets filling and in flight (at most `IN_FLIGHT_BUCKETS`, a
  hybrid plan's whole params being units of their own), the one gradient autograd has just made
  and its cast, walking the params in reverse order as backward makes them and the units in the
  plan's order (`zero.plans.layout.reduction_units`). In the step: the
  masters' gradients cast up (unless reduced in the master dtype), reduced gradients cast to
  their shard's dtype, and the rule's own temporaries (torch's for-loop step:
  `zero.plans.costs.RuleCost.step_temps` of the tensor it steps, ``step_temps_held`` of the one before;
  its foreach step, where zero takes it (`zero.plans.local_step`): ``foreach_temps`` of every
  tensor one call steps).

Collectives are listed with the bytes of the buffer this rank hands each one, per step: the params'
sync (each flat buffer's all-gather; a whole-param sync's rows and direct broadcasts) and, with
``reduce_scatter_grads``, each bucket's reduce-scatter and each whole param's reduce; their total,
``collective_bytes``, is what a rank sends (= receives), as nccl-tests count it
(`zero.plans.accounting.bus_bytes`). The ranks' check-in and what a sharded rule asks for itself
(a global norm) are not counted; DDP's all-reduce beside a plan without ``reduce_scatter_grads``
is `ddp_allreduce_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zero.plans.accounting import bus_bytes, master_itemsize, state_itemsize
from zero.plans.costs import cost_of
from zero.plans.holdings import holdings
from zero.plans.layout import IN_FLIGHT_BUCKETS, SyncRows, bucket_views, param_sync_rows, reduction_units
from zero.plans.local_step import foreach_groups
from zero.plans.meta import itemsize
from zero.plans.reduction import reduction_collectives

if TYPE_CHECKING:
    from zero.plans.plan_fields import PlanFields as Plan  # the fields are all this module reads

__all__ = ["Footprint", "footprint", "ddp_allreduce_bytes", "CATEGORIES", "SYNC_CHUNK_BYTES"]

CATEGORIES = ("params", "sync_rows", "masters", "state", "grads", "transient")
SYNC_CHUNK_BYTES = 16 * 2**20  # the scratch a copying sync uses by default (``sync_chunk_mb=16``)


@dataclass(frozen=True)
class Footprint:
    """One rank's memory and traffic under a plan and mode (see `footprint`).

    ``at_peak``: bytes by category (`CATEGORIES`) at the iteration's peak (its ``phase``:
    "backward" or "step"); ``peak``: their sum; ``resident``: what stays
    between steps (nothing transient); ``collectives``: (kind, bytes) of every collective the
    rank makes in a step, sorted, as `zero.backends.comm.recording` names them. Under a real
    group the executor adds one check-in per step (``all_gather_into`` of 56 bytes per rank:
    `zero.backends.consistency`), which steps aside under torch's fake group; a rule that asks
    whole-model questions (a global norm) adds its all-reduces.
    """

    rank: int
    phase: str
    at_peak: dict[str, int]
    resident: dict[str, int]
    collectives: tuple[tuple[str, int], ...]
    world: int = 1
    by_phase: dict[str, int] | None = None  # the total at each moment the peak is sought in ("backward", "step")

    @property
    def peak(self) -> int:
        return sum(self.at_peak.values())

    @property
    def collective_bytes(self) -> int:
        """Bytes this rank sends (= receives) in its collectives of a step, as nccl-tests count
        them (`zero.plans.accounting.bus_bytes`)."""
        return sum(bus_bytes(kind, n, self.world) for kind, n in self.collectives)


def footprint(plan: Plan, rank: int, *, reduce_scatter_grads: bool = False, reduce_dtype: str | None = None,
              bucket_view: bool | None = None, sync_chunk_bytes: int = SYNC_CHUNK_BYTES,
              reducer: Any = None) -> Footprint:
    """What ``rank`` holds and moves executing ``plan`` with these `ZeroRedundancyOptimizer` options
    (``reduce_dtype`` a dtype name; None: the params'). The peak is the larger of backward's and
    the local step's, in steady state (the optimizer state exists from the first step on).

    ``reducer``: the gradient reducer's name (`zero.plans.reduction`: ``"mean"``, the default, or
    ``"int8/256"``), or a `zero.backends.comm.Reducer` (its ``spec``): the collectives each
    bucket's reduction makes. Its own scratch memory (an int8 reducer's codes) is not in the peak,
    which counts the buckets as the plain one holds them."""
    metas, flat = plan.metas, plan.flat
    reduce = None if reduce_dtype is None else str(reduce_dtype).removeprefix("torch.")
    rows = _rows(plan, bucket_view, sync_chunk_bytes)
    static = {"params": _param_bytes(plan, rows, bucket_view), "sync_rows": _scratch_rows(rows, bucket_view),
              "masters": plan.ranks[rank].master_bytes, "state": plan.ranks[rank].state_bytes}
    temps = _step_temporaries(plan, rank, reduce_scatter_grads, reduce)
    if reduce_scatter_grads:
        shards = sum(b.shard_numel * itemsize(reduce or b.dtype) for b in flat.buffers)
        kept = _kept_whole(plan, rank, reduce)  # an owner's whole params' mean gradients
        kept_then, transient = _backward_peak(plan, rank, reduce)
        moments = {"backward": (shards + kept_then, transient), "step": (shards + kept, temps)}
        resident = shards + kept
    else:
        copies = sum(b.shard_numel * itemsize(b.dtype) for b in flat.buffers) if flat else 0
        resident = sum(m.nbytes for m in metas if m.requires_grad) + copies
        moments = {"backward": (resident, 0), "step": (resident, temps)}
    phase = max(moments, key=lambda k: sum(moments[k]))
    grads, transient = moments[phase]
    return Footprint(rank, phase, {**static, "grads": grads, "transient": transient},
                     {**static, "grads": resident, "transient": 0},
                     _collectives(plan, rows, reduce_scatter_grads, reduce, reducer), plan.world_size,
                     {k: sum(static.values()) + sum(v) for k, v in moments.items()})


def executed_stage_bytes(plan: Plan) -> dict[str, int | None]:
    """``plan.stage_bytes()`` with the ZeRO-1 and ZeRO-2 rows the peak the executor reaches
    running the plan (`footprint`: params' storage and padding, buckets, the step's temporaries),
    ZeRO-2's for a flat plan only (``reduce_scatter_grads`` needs one; else the row is None)."""
    rows: dict[str, int | None] = dict(plan.stage_bytes())
    keys = list(rows)
    rows[keys[1]] = max(footprint(plan, r).peak for r in range(plan.world_size))
    rows[keys[2]] = max(footprint(plan, r, reduce_scatter_grads=True).peak
                        for r in range(plan.world_size)) if plan.flat is not None else None
    return rows


def ddp_allreduce_bytes(plan: Plan) -> int:
    """Bytes each rank sends in DDP's all-reduce of every trainable gradient, in a step of a plan
    run without ``reduce_scatter_grads`` (ZeRO-1 beside DDP): not the executor's, and not
    simulated, but part of the iteration's traffic (`zero.plans.accounting.bus_bytes`)."""
    return bus_bytes("all_reduce", sum(m.nbytes for m in plan.metas if m.requires_grad), plan.world_size)


def _rows(plan: Plan, bucket_view: bool | None, chunk_bytes: int) -> tuple[SyncRows, ...]:
    """The rows a whole-param sync moves (a hybrid plan's whole params'; none for a flat plan)."""
    if plan.partition is None or (plan.flat is not None and not plan.whole):
        return ()
    return param_sync_rows(bucket_views(plan.metas, plan.partition), bucket_view, chunk_bytes)


def _param_bytes(plan: Plan, rows: Sequence[SyncRows], bucket_view: bool | None) -> int:
    """The params' storage: flat buffers, rows the params view, and every other param's own."""
    metas, flat = plan.metas, plan.flat
    in_flat = {i for b in flat.buffers for i in b.params} if flat else set()
    viewed = {p.param for r in rows if r.chunk for per_rank in r.pieces for p in per_rank[0]} \
        if bucket_view is not False else set()
    own = sum(m.nbytes for i, m in enumerate(metas) if i not in in_flat and i not in viewed)
    row_bytes = sum(r.chunk * len(r.pieces) * itemsize(r.dtype) for r in rows) if bucket_view is not False else 0
    return own + row_bytes + (sum(b.padded_numel * itemsize(b.dtype) for b in flat.buffers) if flat else 0)


def _scratch_rows(rows: Sequence[SyncRows], bucket_view: bool | None) -> int:
    return sum(r.chunk * len(r.pieces) * itemsize(r.dtype) for r in rows) if bucket_view is False else 0


def _backward_peak(plan: Plan, rank: int, reduce: str | None) -> tuple[int, int]:
    """Backward's peak beyond the shards, walking the trainable params in reverse order (as
    backward makes their gradients) and the reduction units in the plan's order: what the owner
    has kept of its whole params' means by then, and the rest: the buckets filling and in flight,
    the gradient autograd has just made (and its cast to ``reduce``, for a whole param)."""
    flat, metas = plan.flat, plan.metas
    owner = plan.partition.owner if plan.whole else ()
    units = reduction_units(flat, plan.whole)
    unit_of, size = {}, []
    for u, (kind, k) in enumerate(units):
        members = flat.buffers[k].params if kind == "flat" else (k,)
        unit_of.update({i: (u, len(members)) for i in members})
        numel, dtype = (flat.buffers[k].padded_numel, flat.buffers[k].dtype) if kind == "flat" else \
            (metas[k].numel, metas[k].dtype)
        size.append(numel * itemsize(reduce or dtype))
    filling: dict[int, int] = {}  # unit -> params still to come
    flight: list[int] = []
    kept, done, peak = 0, 0, (0, 0)  # the owner's kept means so far; units started (in the plan's order)

    def at(extra: int = 0) -> tuple[int, int]:
        return max(peak, (kept, sum(size[u] for u in filling) + sum(size[u] for u in flight) + extra), key=sum)

    for i in reversed(range(len(metas))):
        if not metas[i].requires_grad:
            continue
        u, members = unit_of[i]
        whole = units[u][0] == "whole"
        cast = whole and size[u] != metas[i].nbytes
        if u not in filling and not whole:
            filling[u] = members
        peak = at(metas[i].nbytes + (size[u] if cast else 0))  # a whole param's gradient becomes its bucket
        filling[u] = filling.get(u, members) - 1
        while done < len(units) and filling.get(done) == 0:
            del filling[done]
            flight.append(done)
            peak = at()
            done += 1
            if len(flight) > IN_FLIGHT_BUCKETS:
                landed = flight.pop(0)
                kind, k = units[landed]
                kept += size[landed] if kind == "whole" and owner[k] == rank else 0
    return peak


def _kept_whole(plan: Plan, rank: int, reduce: str | None) -> int:
    """The mean gradients an owner keeps of its whole params, in ``reduce`` (or their dtype)."""
    owner = plan.partition.owner if plan.whole else ()
    return sum(plan.metas[i].numel * itemsize(reduce or plan.metas[i].dtype) for i in plan.whole if owner[i] == rank)


def _step_temporaries(plan: Plan, rank: int, reduce_scattered: bool, reduce: str | None) -> int:
    """Bytes the step makes and drops: masters' gradients cast up, reduced gradients cast to their
    shard's dtype, and the rule's own: under torch's for-loop `zero.plans.costs.RuleCost.step_temps`
    of the tensor it steps and ``step_temps_held`` of the one before it (in the local optimizer's
    order, within a group); under its foreach step (`zero.plans.local_step.takes_foreach`)
    ``foreach_temps`` of every tensor one call steps at once: the group's, or one buffer's shard
    when the step is pipelined buffer by buffer (``reduce_scattered``, no param kept whole)."""
    held, master = holdings(plan, rank), plan.master_dtype
    spec = cost_of(plan.optimizer)
    casts, rule, before = 0, 0, (-1, 0)  # (group, bytes of one temporary) of the tensor stepped before
    foreach = {g: n for g, (_, n) in foreach_groups(plan, held).items()} if spec.foreach_temps is not None else {}
    for t in held.tensors:
        dtype = plan.metas[t.param].dtype if t.whole else plan.flat.buffers[t.buffer].dtype
        if t.whole and not plan.metas[t.param].requires_grad:
            continue
        grad_dtype = (reduce or dtype) if reduce_scattered else dtype
        if master_itemsize(dtype, master) and grad_dtype != master:
            casts += t.numel * itemsize(master)
        elif reduce_scattered and grad_dtype != dtype and grad_dtype != master:
            casts += t.numel * itemsize(dtype)
        one = min(t.numel, spec.step_chunk) * 4 if spec.step_chunk else t.numel * state_itemsize(dtype, master)
        if t.group in foreach:  # a hybrid plan's step is not pipelined: every tensor in one call
            together = one if reduce_scattered and not plan.hybrid else foreach[t.group]
            rule = max(rule, spec.foreach_temps * together)
        else:
            rule = max(rule, spec.step_temps * one + (spec.step_temps_held * before[1] if before[0] == t.group else 0))
        before = (t.group, one)
    return casts + rule


def _collectives(plan: Plan, rows: Sequence[SyncRows], reduce_scattered: bool, reduce: str | None,
                 reducer: Any = None) -> tuple[tuple[str, int], ...]:
    out = []
    for r in rows:
        out += [("all_gather_rows", r.chunk * len(r.pieces) * itemsize(r.dtype))] * (len(r.pieces[0]) if r.chunk else 0)
        out += [("broadcast_from", plan.metas[i].nbytes) for _, i in r.direct]
    for b in plan.flat.buffers if plan.flat else ():
        out.append(("all_gather_rows", b.padded_numel * itemsize(b.dtype)))
        if reduce_scattered:
            spec = "mean" if reducer is None else getattr(reducer, "spec", reducer)
            out += reduction_collectives(spec, b.padded_numel, reduce or b.dtype, plan.world_size)
    if reduce_scattered:
        out += [("reduce_sum_to", plan.metas[i].numel * itemsize(reduce or plan.metas[i].dtype)) for i in plan.whole]
    return tuple(sorted(out))
