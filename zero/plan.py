"""`Plan`: a partition or flat layout plus what it costs each rank, as one printable value.

A plan is computed from metadata alone, so it can be made for 1024 ranks on a laptop, saved as
JSON, diffed, and checked on every rank by its ``fingerprint``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from zero.accounting import optimizer_state, sync_bytes, weights
from zero.layout import FlatLayout, flat_layout
from zero.meta import ParamMeta, itemsize
from zero.partition import STRATEGIES, Partition, check_metas, partition

__all__ = ["RankCost", "Plan", "make_plan", "PLAN_STRATEGIES"]

PLAN_STRATEGIES = STRATEGIES + ("flat",)
_FORMAT = 1


@dataclass(frozen=True)
class RankCost:
    """What one rank holds and moves (ZeRO-1: full params and grads, a shard of the state)."""

    rank: int
    params: int  # parameters (or parameter pieces, for "flat") this rank updates
    numel: int  # trainable elements this rank updates
    load: int  # the balanced weight this rank owns (padded shard elements for "flat")
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    padding_bytes: int
    broadcast_bytes: tuple[int, int]  # (sent, received) per step, broadcast sync
    all_gather_bytes: tuple[int, int]  # (sent, received) per step, all-gather sync

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.state_bytes + self.padding_bytes


@dataclass(frozen=True)
class Plan:
    """The plan for one model on ``world_size`` ranks; see `make_plan`."""

    metas: tuple[ParamMeta, ...]
    world_size: int
    strategy: str
    weight: str
    optimizer: str
    alignment: int
    partition: Partition | None  # None for "flat"
    flat: FlatLayout | None  # only for "flat"
    ranks: tuple[RankCost, ...]
    imbalance: float
    fingerprint: str

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(_payload(self) | {"fingerprint": self.fingerprint}, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuild a plan saved by `to_json`; raises if it no longer computes to the same plan."""
        data = json.loads(text)
        if data.get("format") != _FORMAT:
            raise ValueError(f"unsupported plan format {data.get('format')!r} (expected {_FORMAT})")
        inputs = data["inputs"]
        plan = make_plan([ParamMeta.from_dict(m) for m in inputs["metas"]], inputs["world_size"],
                         inputs["strategy"], inputs["weight"], inputs["optimizer"], inputs["alignment"])
        if plan.fingerprint != data["fingerprint"]:
            raise ValueError(f"plan fingerprint {data['fingerprint']} does not match the recomputed "
                             f"{plan.fingerprint}: the file was edited or zero's planner changed")
        return plan

    def table(self, max_rows: int = 16):
        """A `rich.table.Table` of per-rank costs (first and last ranks when there are many)."""
        from zero._render import plan_table

        return plan_table(self, max_rows)

    def __str__(self) -> str:
        from zero._render import render

        return render(self.table())


def make_plan(metas: Sequence[ParamMeta], world_size: int, strategy: str = "sorted_greedy",
              weight: str = "numel", optimizer: str = "adam", alignment: int = 1) -> Plan:
    """Partition (or flat-shard) ``metas`` over ``world_size`` ranks and account for the result.

    ``strategy``: one of ``PLAN_STRATEGIES``; ``weight``: ``"numel"`` or ``"state_bytes"``;
    ``optimizer``: a name from `zero.accounting.OPTIMIZERS`, for the state accounting;
    ``alignment``: shard alignment in elements for ``"flat"``.
    """
    metas = tuple(check_metas(metas))
    if strategy not in PLAN_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {PLAN_STRATEGIES}")
    if weight not in ("numel", "state_bytes"):
        raise ValueError(f"make_plan takes weight 'numel' or 'state_bytes', got {weight!r}")
    spec = optimizer_state(optimizer)
    if strategy == "flat":
        part, flat = None, flat_layout(metas, world_size, alignment)
        ranks = _flat_costs(metas, flat, spec)
        lower = sum(r.load for r in ranks) / world_size
    else:
        part, flat = partition(metas, world_size, strategy, weight, spec), None
        ranks = _partition_costs(metas, part, spec)
        ws = weights(metas, weight, spec)
        lower = max(max(ws), sum(ws) / world_size)
    imbalance = max(r.load for r in ranks) / lower if lower else 1.0
    plan = Plan(metas, world_size, strategy, weight, str(optimizer).lower(), alignment, part, flat,
                ranks, imbalance, "")
    return dataclasses.replace(plan, fingerprint=_fingerprint(plan))


def _fingerprint(plan: Plan) -> str:
    """A stable hash of the plan's inputs and placement (everything else derives from them)."""
    metas = [(m.name, m.shape, m.dtype, m.device, m.group, m.requires_grad) for m in plan.metas]
    placement = (plan.partition.order if plan.partition else
                 [(b.device, b.dtype, b.params, b.padded_numel) for b in plan.flat.buffers])
    blob = json.dumps([_FORMAT, metas, plan.world_size, plan.strategy, plan.weight, plan.optimizer,
                       plan.alignment, placement], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _replica_bytes(metas) -> tuple[int, int]:
    return sum(m.nbytes for m in metas), sum(m.nbytes for m in metas if m.requires_grad)


def _partition_costs(metas, part: Partition, spec) -> tuple[RankCost, ...]:
    param_bytes, grad_bytes = _replica_bytes(metas)
    keys = sorted({(m.device, m.dtype) for m in metas if m.requires_grad})
    key_of = {k: j for j, k in enumerate(keys)}
    w = part.world_size
    per_key = [[0] * w for _ in keys]  # trainable bytes each rank owns, per (device, dtype)
    numel, state = [0] * w, [0] * w
    for i, m in enumerate(metas):
        if m.requires_grad:
            r = part.owner[i]
            per_key[key_of[(m.device, m.dtype)]][r] += m.nbytes
            numel[r] += m.numel
            state[r] += spec.bytes_for(m)
    bcast, gather = _sync(per_key, w)
    return tuple(RankCost(r, len(part.params_of(r)), numel[r], part.loads[r], param_bytes, grad_bytes,
                          state[r], 0, bcast[r], gather[r]) for r in range(w))


def _flat_costs(metas, flat: FlatLayout, spec) -> tuple[RankCost, ...]:
    param_bytes, grad_bytes = _replica_bytes(metas)
    w = flat.world_size
    per_key = [[b.shard_numel * itemsize(b.dtype)] * w for b in flat.buffers]
    bcast, gather = _sync(per_key, w)
    pieces, numel = [0] * w, [0] * w
    for b in flat.buffers:
        for segs in b.segments:
            for s in segs:
                pieces[s.rank] += 1
                numel[s.rank] += s.end - s.start
    # State tensors are shaped like the padded shard, one set per buffer, on every rank alike.
    state = sum(spec.slots * b.shard_numel * itemsize(b.dtype) + spec.scalar_bytes for b in flat.buffers)
    padding = sum(b.padding * itemsize(b.dtype) for b in flat.buffers)
    return tuple(RankCost(r, pieces[r], numel[r], flat.shard_numel, param_bytes, grad_bytes, state,
                          padding, bcast[r], gather[r]) for r in range(w))


def _sync(per_key: list[list[int]], world_size: int):
    """Sum (sent, received) over one collective per (device, dtype) key."""
    bcast = [(0, 0)] * world_size
    gather = [(0, 0)] * world_size
    for shard_bytes in per_key:
        bcast = [_add(a, b) for a, b in zip(bcast, sync_bytes(shard_bytes, "broadcast"))]
        gather = [_add(a, b) for a, b in zip(gather, sync_bytes(shard_bytes, "all_gather"))]
    return bcast, gather


def _add(a, b):
    return (a[0] + b[0], a[1] + b[1])


def _payload(plan: Plan) -> dict:
    """Everything a plan says, as JSON-able data."""
    placement = ({"owner": list(plan.partition.owner),
                  "order": [list(o) for o in plan.partition.order]} if plan.partition else
                 {"flat": [{"device": b.device, "dtype": b.dtype, "params": list(b.params),
                            "offsets": list(b.offsets), "numel": b.numel,
                            "padded_numel": b.padded_numel} for b in plan.flat.buffers]})
    return {
        "format": _FORMAT,
        "inputs": {"metas": [m.to_dict() for m in plan.metas], "world_size": plan.world_size,
                   "strategy": plan.strategy, "weight": plan.weight, "optimizer": plan.optimizer,
                   "alignment": plan.alignment},
        "placement": placement,
        "ranks": [{**r.__dict__, "total_bytes": r.total_bytes} for r in plan.ranks],
        "imbalance": plan.imbalance,
    }
