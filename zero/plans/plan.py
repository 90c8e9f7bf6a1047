"""`Plan`: a partition or flat layout plus what it costs each rank (`zero.plans.cost`), as one
printable, saveable value.

A plan is computed from metadata alone, so it can be made for 1024 ranks on a laptop, saved as
JSON, diffed, and checked on every rank by its ``fingerprint``.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from zero.plans.accounting import check_master_dtype, weights
from zero.plans.cost import partition_costs, stage_bytes
from zero.plans.costs import cost_of
from zero.plans.hybrid import Whole, flat_part, hybrid_placement, resolve_whole, split_by_heads
from zero.plans.meta import ParamMeta, gc_paused
from zero.plans.partition import STRATEGIES, Partition, check_metas, partition
from zero.plans.plan_fields import PlanFields

__all__ = ["Plan", "make_plan", "check_plan", "PLAN_STRATEGIES", "WEIGHTS"]

PLAN_STRATEGIES = STRATEGIES + ("flat",)
WEIGHTS = ("numel", "state_bytes", "step_flops")
_FORMAT = 2  # 2: metas hashed as names + a table of rows (plans saved by format 1 must be made again)


@dataclass(frozen=True)
class Plan(PlanFields):
    """The plan for one model on ``world_size`` ranks (see `make_plan`): its fields
    (`zero.plans.plan_fields.PlanFields`, what executors read), JSON, table and plot. What an
    executor holds running it is a function of the plan: `zero.plans.footprint.footprint` for
    `ZeroRedundancyOptimizer`, `zero.plans.mesh_padding.mesh_state_bytes` for a JAX mesh."""

    def stage_bytes(self) -> dict[str, int]:
        """The busiest rank's bytes with nothing sharded, as planned (ZeRO-1), with gradients
        reduce-scattered (ZeRO-2) and with params sharded too (FSDP): the ZeRO paper's Figure 1
        from metadata, its model states (see `zero.plans.cost.stage_bytes`). The peak the
        executor reaches running this plan is `zero.plans.footprint.executed_stage_bytes`."""
        return stage_bytes(self.ranks)

    def with_partition(self, part: Partition) -> Plan:
        """This plan's params placed by another whole-param ``part`` (e.g. `ddp_bucket_partition`),
        costed and fingerprinted anew."""
        if len(part.owner) != len(self.metas) or part.world_size != self.world_size:
            raise ValueError("the partition is for other params or another world size")
        spec = cost_of(self.optimizer)
        ranks = partition_costs(self.metas, part, spec, self.master_dtype)
        mean = sum(r.load for r in ranks) / self.world_size
        busiest = max(r.load for r in ranks)
        plan = dataclasses.replace(self, strategy=part.strategy, partition=part, flat=None, ranks=ranks,
                                   max_over_mean=busiest / mean if mean else 1.0,
                                   max_over_bound=busiest / max(max(m.numel for m in self.metas), mean)
                                   if mean else 1.0)
        return dataclasses.replace(plan, fingerprint=_fingerprint(plan))

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(_payload(self) | {"fingerprint": self.fingerprint}, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuild a plan saved by `to_json`; raises if it no longer computes to the same plan."""
        data = json.loads(text)
        if data.get("format") != _FORMAT:
            raise ValueError(f"unsupported plan format {data.get('format')!r} (expected {_FORMAT})")
        inputs = data["inputs"]
        if inputs["weight"] == "custom":
            raise ValueError("this plan was weighted by a function, which JSON does not hold: make it again with "
                             "zero.make_plan and the same weight function")
        plan = make_plan([ParamMeta.from_dict(m) for m in inputs["metas"]], inputs["world_size"],
                         inputs["strategy"], inputs["weight"], inputs["optimizer"], inputs["alignment"],
                         inputs.get("bucket_numel"), master_dtype=inputs.get("master_dtype"),
                         whole=inputs.get("whole"), split_heads=inputs.get("split_heads", False))
        if plan.fingerprint != data["fingerprint"]:
            raise ValueError(f"plan fingerprint {data['fingerprint']} does not match the recomputed "
                             f"{plan.fingerprint}: the file was edited or zero's planner changed")
        return plan

    def table(self, max_rows: int = 16):
        """A `rich.table.Table` of per-rank costs (first and last ranks when there are many)."""
        from zero.plans.render import plan_table

        return plan_table(self, max_rows)

    def plot(self, ax=None, **kwargs):
        """Stacked bars of each rank's bytes (see `zero.plans.plot.plot_ranks`; needs matplotlib)."""
        from zero.plans.plot import plot_ranks

        return plot_ranks(self, ax, **kwargs)

    def __str__(self) -> str:
        from zero.plans.render import render

        return render(self.table())


@gc_paused()  # builds per-param lists for up to 100k params (see gc_paused)
def make_plan(metas: Sequence[ParamMeta], world_size: int, strategy: str = "sorted_greedy",
              weight: str = "numel", optimizer: str = "adam", alignment: int = 1,
              bucket_numel: int | None = None, *, master_dtype: str | None = None, whole: Whole = None,
              split_heads: bool = False) -> Plan:
    """Partition (or flat-shard) ``metas`` over ``world_size`` ranks and account for the result.

    ``strategy``: one of ``PLAN_STRATEGIES``; ``weight``: ``"numel"``, ``"state_bytes"`` or
    ``"step_flops"`` (the work of each param's step: ``optimizer="muon"`` balances the
    Newton-Schulz matmuls of its matrices; see `zero.plans.accounting.weights`), or a function
    of a `ParamMeta` (e.g. Muon's cost with embeddings routed to AdamW; such a plan is saved as
    ``weight="custom"`` and `Plan.from_json` cannot rebuild it);
    ``optimizer``: a name from `zero.plans.accounting.OPTIMIZERS`, for the state accounting;
    ``alignment``: shard alignment in elements for ``"flat"``; ``bucket_numel``: for ``"flat"``,
    the most elements per flat buffer (see `zero.flat_layout`); ``master_dtype`` (``"float32"``):
    the optimizer steps master copies of the params in this dtype, with its state in it too, and
    each rank holds those of what it owns (``RankCost.master_bytes``); ``weight="state_bytes"``
    then balances masters and state.

    ``whole`` (``"flat"`` only) makes a *hybrid* plan (`zero.plans.hybrid`): the params it names
    (a list of names, or a function of a `ParamMeta`) are each owned whole by one rank, balanced
    by ``weight`` (``"balanced"``), and the rest are flat-sharded. For rules that need some tensors
    whole: Muon's matrices, Adafactor's factored matrices, SM3's covers. ``None``: what
    ``optimizer`` needs whole (``"muon"``: its matrices), else nothing (a plain flat plan).
    ``split_heads`` (``"flat"`` only): of those, the ones the rule steps head by head along their
    first axis (``"muon(heads=...)"``, per-head Muon) are cut at head edges instead, into head
    buffers (`zero.plans.layout.FlatBuffer.head`) whose shards are whole heads: every rank steps
    an equal share of their heads where they lie, and no rank owns a whole matrix of them.

    Balance is reported two ways, since they answer different questions: ``max_over_mean`` is
    the busiest rank's load over the mean (how far from an even split: what memory per rank
    costs), ``max_over_bound`` over the best any plan of this kind could do, which for
    whole-tensor plans is at least the largest tensor (how far from optimal for this model:
    1.0 can still mean 2x the mean when one tensor is half the model). A flat plan splits
    elements, so its bound is the mean.
    """
    metas = tuple(check_metas(metas))
    if strategy not in PLAN_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {PLAN_STRATEGIES}")
    if not callable(weight) and weight not in WEIGHTS:
        raise ValueError(f"make_plan takes weight {', '.join(map(repr, WEIGHTS))} or a function of a ParamMeta, "
                         f"got {weight!r}")
    if whole is not None and strategy != "flat":
        raise ValueError(f"whole= picks the params a flat plan keeps whole; strategy {strategy!r} keeps every param "
                         "whole already: drop whole=, or use strategy='flat'")
    spec = cost_of(optimizer)
    master_dtype = check_master_dtype(master_dtype, metas)
    if split_heads and strategy != "flat":
        raise ValueError(f"split_heads cuts a flat plan's per-head matrices at head edges; strategy {strategy!r} "
                         "keeps every param whole: use strategy='flat'")
    keep = resolve_whole(metas, whole, spec) if strategy == "flat" else ()
    keep, cut = split_by_heads(metas, keep, spec) if split_heads else (keep, ())
    if split_heads and not cut:
        raise ValueError(f"split_heads=True, but optimizer {optimizer!r} steps none of the params it keeps whole "
                         "head by head, so nothing would be cut: name each matrix's heads in it "
                         "(\"muon(heads={'wq': 32})\", per-head Muon; not muon_8bit, whose codes' blocks lie in whole "
                         "matrices), or drop split_heads")
    if callable(weight) and strategy == "flat" and not keep:
        raise ValueError("a flat plan splits elements evenly and takes no weight function (a hybrid plan, with "
                         "whole=, balances its whole params by one)")
    part, flat, ranks, mean, bound = _placement(metas, world_size, strategy, weight, spec, alignment, bucket_numel,
                                                master_dtype, keep, cut)
    busiest = max(r.load for r in ranks)
    plan = Plan(metas=metas, world_size=world_size, strategy=strategy, weight="custom" if callable(weight) else weight,
                optimizer=str(optimizer).lower(), alignment=alignment, bucket_numel=bucket_numel, partition=part,
                flat=flat, ranks=ranks, max_over_mean=busiest / mean if mean else 1.0,
                max_over_bound=busiest / bound if bound else 1.0, fingerprint="", master_dtype=master_dtype,
                whole=keep)
    return dataclasses.replace(plan, fingerprint=_fingerprint(plan))


def _placement(metas: tuple[ParamMeta, ...], world_size: int, strategy: str, weight, spec, alignment: int,
               bucket_numel: int | None, master_dtype: str | None, keep: tuple[int, ...],
               cut: tuple[int, ...] = ()) -> tuple:
    """``(partition, flat layout, rank costs, mean load, best possible load)`` of a plan's kind."""
    if keep:
        return hybrid_placement(metas, keep, world_size, weight, spec, alignment, bucket_numel, master_dtype, cut)
    if strategy == "flat":
        flat, ranks, heads = flat_part(metas, world_size, weight, spec, alignment, bucket_numel, master_dtype, cut)
        if cut:
            ranks = tuple(dataclasses.replace(r, load=r.load + h) for r, h in zip(ranks, heads))
        mean = sum(r.load for r in ranks) / world_size
        return None, flat, ranks, mean, mean
    ws = weights(metas, weight, spec, master_dtype)
    part = partition(metas, world_size, strategy, weight, spec, master_dtype=master_dtype)
    mean = sum(ws) / world_size
    # whole tensors: no rank can hold less than the largest one
    return part, None, partition_costs(metas, part, spec, master_dtype), mean, max(max(ws), mean)


def check_plan(plan: Plan, metas: Sequence[ParamMeta], world_size: int) -> None:
    """``ValueError`` when ``plan`` was made for other params (naming the first that differs) or
    another world size. Names may differ: a plan made from ``model`` names params by attribute."""
    if plan.world_size != world_size:
        raise ValueError(f"the plan is for {plan.world_size} ranks but the process group has {world_size}")
    if len(plan.metas) != len(metas):
        raise ValueError(f"the plan is for {len(plan.metas)} params but the optimizer got {len(metas)}: "
                         "make it with zero.make_plan(zero.param_metas(params), ...) for these params")
    fields = ("shape", "dtype", "device", "group", "requires_grad")
    for i, (planned, given) in enumerate(zip(plan.metas, metas)):
        for field in fields:
            if getattr(planned, field) != getattr(given, field):
                raise ValueError(f"the plan was made for other params: param {i} ({planned.name!r} in the plan) has "
                                 f"{field} {getattr(planned, field)!r} in the plan but {getattr(given, field)!r} here")


def _fingerprint(plan: Plan) -> str:
    """A stable hash of the plan's inputs and placement (everything else derives from them).

    The metas are hashed as their names, a table of the distinct (shape, dtype, device, group,
    requires_grad) and each param's row in it, rather than as one JSON text: a 100k-tensor
    model has a few dozen distinct rows, this is about 5x faster, and the fingerprint is
    computed with every plan and checked on every rank.
    """
    table: dict[tuple, int] = {}
    rows = [table.setdefault(m[1:6], len(table)) for m in plan.metas]  # m[1:6]: shape ... requires_grad
    placement = (plan.partition.order if plan.flat is None else
                 [(b.group, b.device, b.dtype, b.params, b.padded_numel) for b in plan.flat.buffers])
    if plan.hybrid:  # (plain plans keep their fingerprints)
        placement = [placement, plan.partition.order]
    if plan.split_heads:  # (plans without head buffers keep theirs)
        placement = [placement, [b.head for b in plan.flat.buffers]]
    h = hashlib.sha256("\0".join([m.name for m in plan.metas]).encode())
    h.update(_int64_bytes(rows))
    masters = [plan.master_dtype] if plan.master_dtype else []  # plans without masters keep their fingerprints
    h.update(json.dumps([_FORMAT, list(table), plan.world_size, plan.strategy, plan.weight, plan.optimizer,
                         plan.alignment, plan.bucket_numel, placement, *masters], separators=(",", ":")).encode())
    return h.hexdigest()[:16]


def _int64_bytes(values: list[int]) -> bytes:
    data = array.array("q", values)
    if sys.byteorder == "big":  # the same bytes on every machine, so saved plans reload anywhere
        data.byteswap()
    return data.tobytes()


def _whole_names(plan: Plan) -> list[str] | None:
    """The ``whole=`` that makes the plan again: its whole params, and those it cut at head edges
    (which ``split_heads`` cuts again)."""
    if not plan.hybrid and not plan.split_heads:
        return None
    return [plan.metas[i].name for i in sorted({*plan.whole, *plan.cut_at_heads})]


def _payload(plan: Plan) -> dict:
    """Everything a plan says, as JSON-able data."""
    whole = {"owner": list(plan.partition.owner), "order": [list(o) for o in plan.partition.order]} \
        if plan.partition else {}
    if plan.flat is None:
        placement = whole
    else:
        flat = [{"group": b.group, "device": b.device, "dtype": b.dtype, "params": list(b.params),
                 "offsets": list(b.offsets), "numel": b.numel, "padded_numel": b.padded_numel, "block": b.block,
                 **({"head": b.head} if b.head else {})}
                for b in plan.flat.buffers]
        placement = {"whole": whole, "flat": flat} if plan.hybrid else {"flat": flat}
    return {
        "format": _FORMAT,
        "inputs": {"metas": [m.to_dict() for m in plan.metas], "world_size": plan.world_size,
                   "strategy": plan.strategy, "weight": plan.weight, "optimizer": plan.optimizer,
                   "alignment": plan.alignment, "bucket_numel": plan.bucket_numel,
                   "master_dtype": plan.master_dtype,
                   "whole": _whole_names(plan),
                   **({"split_heads": True} if plan.split_heads else {})},
        "placement": placement,
        "ranks": [{**r.__dict__, "total_bytes": r.total_bytes, "total_bytes_grads_sharded": r.total_bytes_grads_sharded}
                  for r in plan.ranks],
        "stage_bytes": plan.stage_bytes(),
        "max_over_mean": plan.max_over_mean,
        "max_over_bound": plan.max_over_bound,
    }
