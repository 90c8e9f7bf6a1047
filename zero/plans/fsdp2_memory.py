"""FSDP2's and HSDP's memory per rank, predicted from parameter metadata: the plan's footprint of
``fully_shard`` (each transformer layer one unit, as torchtitan wraps them), with ``torch.optim``'s
state over the shards, or zero's sharded over the replicas too (`zero.plans.fsdp2`).

What a rank holds, as FSDP2 (torch 2.x) allocates it:

- **sharded params**: each param's rows ``torch.chunk`` gives a rank, padded to the chunk (every
  rank keeps the padded size);
- **sharded gradients**: each unit's reduce-scatter output, padded the same way, which its
  gradients stay views of;
- **optimizer state**: the rule's slots over each rank's rows (unpadded: ``zeros_like`` of the
  local tensor), and its per-param scalars; with zero over the replicas, the slots over the rank's
  part only (`Fsdp2Plan.part`);
- **in flight, in backward**: the unit being differentiated's unsharded params and its gradients,
  the next unit's all-gather output (FSDP2 prefetches one unit in backward) and the last unit's
  reduce-scatter input (kept until the next reduce-scatter is issued); then, as the unit's
  gradients are reduced, its params resharded, its gradients, its reduce-scatter's input and
  output; all padded but the gradients autograd makes;
- **in the step**: ``torch.optim``'s temporaries (on the CPU its single-tensor path: the largest
  param's ``denom``; on CUDA its default foreach step: ``foreach_temps`` of every local shard of a
  param group at once), or zero's all-gather over the replicas (the largest bucket's output and
  send buffer, `Fsdp2Plan.gather_buckets`).

The peak is the largest of the backward's moments (one per unit, the sharded gradients growing as
units are reduced) and the step's. Activations are not counted (the simulation's model has none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zero.plans.costs import cost_of
from zero.plans.fsdp2 import chunk_rows, make_fsdp2_plan
from zero.plans.meta import ParamMeta, itemsize

__all__ = ["Fsdp2Footprint", "fsdp2_footprint", "units", "unit_of"]


def unit_of(name: str) -> str:
    """The ``fully_shard`` unit of the param ``name``: its transformer layer (the name up to its
    first number: ``layers.3``, ``h.3``), or the param itself (the embedding, final norm, head)."""
    parts = name.split(".")
    at = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
    return name if at is None else ".".join(parts[:at + 1])


def units(metas: Sequence[ParamMeta]) -> list[list[int]]:
    """The params of each unit (indices into ``metas``), units in order of their first param."""
    out: dict[str, list[int]] = {}
    for i, m in enumerate(metas):
        out.setdefault(unit_of(m.name), []).append(i)
    return list(out.values())


@dataclass(frozen=True)
class Fsdp2Footprint:
    """One rank's predicted peak under FSDP2 (``replicas`` > 1: HSDP), and what it is made of."""

    rank: int
    world_size: int
    replicas: int
    peak_bytes: int
    peak_phase: str
    by_category: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)  # bytes sent per iteration: "within" / "across" replicas

    def as_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "replicas": self.replicas,
                "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase, "by_category": dict(self.by_category),
                "sent": dict(self.sent)}


def fsdp2_footprint(metas: Sequence[ParamMeta], world_size: int, rank: int, *, replicas: int = 1,
                    optimizer: str = "adamw", zero: bool = False) -> Fsdp2Footprint:
    """The peak of ``rank`` of ``world_size`` ranks (``replicas`` x ``world_size / replicas``)
    training ``metas`` with FSDP2 and ``optimizer``'s state (a `zero.plans.costs` name), torch's
    over each replica's shards or, with ``zero``, zero's over every rank."""
    if world_size % replicas:
        raise ValueError(f"{replicas} replicas do not divide {world_size} ranks")
    shards = world_size // replicas
    metas = list(metas)
    plan = make_fsdp2_plan(metas, shards, optimizer, replicas=replicas if zero else 1)
    me = rank if zero else rank % shards
    shard = rank % shards
    padded = [_padded(m, shards) for m in metas]
    sizes = [itemsize(m.dtype) for m in metas]
    spec = cost_of(optimizer)
    fixed = {"sharded_params": sum(p * s for p, s in zip(padded, sizes)),
             "optimizer_state": plan.state_bytes(me) if zero else sum(
                 spec.state_bytes(_local(m, shards, shard), s) for m, s in zip(metas, sizes) if m.requires_grad)}
    step = _step(plan, metas, sizes, me, zero, shards, spec)
    moments = _backward(metas, units(metas), padded, sizes, shards) + [step]
    phase, moment = max(moments, key=lambda pm: sum(pm[1].values()))
    by = {**fixed, **moment}
    sent = _sent(plan, metas, padded, sizes, shards, replicas, me if zero else None)
    return Fsdp2Footprint(rank, world_size, replicas, sum(by.values()), phase, by, sent)


def _sent(plan, metas: list[ParamMeta], padded: list[int], sizes: list[int], shards: int, replicas: int,
          me: int | None) -> dict[str, int]:
    """Bytes a rank sends in one iteration, as nccl-tests count them (`zero.plans.accounting.bus_bytes`):
    within its replica, FSDP2's all-gather of every unit in forward and again in backward and its
    reduce-scatter of the gradients, and (zero, ``me``) the exchanges with the whole params' owners;
    across replicas, HSDP's all-reduce of the gradient shards and zero's all-gathers of the parts."""
    from zero.plans.accounting import bus_bytes

    full = sum(shards * p * s for p, s in zip(padded, sizes))
    grads = sum(shards * p * s for p, s, m in zip(padded, sizes, metas) if m.requires_grad)
    within = 2 * bus_bytes("all_gather", full, shards) + bus_bytes("reduce_scatter", grads, shards)
    across = bus_bytes("all_reduce", grads // shards, replicas)
    if me is not None:
        within += sum(a + b for a, b in plan.exchange_bytes(me).values())
        across += _gather_sent(plan, metas, me)
    return {"within": within, "across": across}


def _padded(meta: ParamMeta, shards: int) -> int:
    """Elements of a rank's padded rows of ``meta`` (the chunk, whatever rows it holds)."""
    if not meta.shape:
        return 1
    return chunk_rows(meta.shape[0], shards)[0][1] * math.prod(meta.shape[1:]) if meta.shape[0] else 0


def _local(meta: ParamMeta, shards: int, shard: int) -> ParamMeta:
    """``meta`` as the rank's unpadded rows of it (the tensor ``zeros_like`` copies)."""
    if not meta.shape:
        return meta
    rows = chunk_rows(meta.shape[0], shards)[shard][1]
    return ParamMeta(meta.name, (rows,) + tuple(meta.shape[1:]), meta.dtype, meta.device, meta.group,
                     meta.requires_grad)


def _backward(metas: list[ParamMeta], groups: list[list[int]], padded: list[int], sizes: list[int],
              shards: int) -> list[tuple[str, dict[str, int]]]:
    """Each unit's moment in backward (units in reverse): the gradients reduced before it, its
    unsharded params and gradients, the next unit's all-gather and the last one's reduce-scatter."""
    full = [sum(shards * padded[i] * sizes[i] for i in g) for g in groups]
    grads = [sum(metas[i].numel * sizes[i] for i in g if metas[i].requires_grad) for g in groups]
    shard_grads = [sum(padded[i] * sizes[i] for i in g if metas[i].requires_grad) for g in groups]
    out, reduced = [], 0
    for k in reversed(range(len(groups))):
        unit = unit_of(metas[groups[k][0]].name)
        ahead = full[k - 1] if k else 0  # the next unit's all-gather, prefetched
        out.append((f"backward of {unit}",
                    {"sharded_grads": reduced, "unsharded_params": full[k], "unsharded_grads": grads[k],
                     "all_gather": ahead, "reduce_scatter": full[k + 1] if k + 1 < len(groups) else 0}))
        # its post-backward: params resharded, the gradients copied into the reduce-scatter's input
        # (the last one's released), the output made
        out.append((f"reduce-scatter of {unit}",
                    {"sharded_grads": reduced + shard_grads[k], "unsharded_grads": grads[k],
                     "all_gather": ahead, "reduce_scatter": full[k]}))
        reduced += shard_grads[k]
    return out


def _step(plan, metas: list[ParamMeta], sizes: list[int], me: int, zero: bool, shards: int, spec: Any
          ) -> tuple[str, dict[str, int]]:
    """The step's moment: every sharded gradient, and the step's largest temporaries."""
    grads = sum(_padded(m, shards) * s for m, s in zip(metas, sizes) if m.requires_grad)
    if zero and plan.replicas > 1:
        temps = 0
        for dtype in dict.fromkeys(m.dtype for m in metas if m.requires_grad):
            for group in dict.fromkeys(m.group for m in metas):
                these = [i for i, m in enumerate(metas) if m.requires_grad and (m.dtype, m.group) == (dtype, group)]
                for bucket in plan.gather_buckets(these, me):  # its send and output, and one param's slots
                    slots = [plan.slot(i, me) for i in bucket]
                    held = (plan.replicas + 1) * sum(slots) + plan.replicas * max(slots)
                    temps = max(temps, held * itemsize(dtype))
    elif spec.foreach_temps is not None and _on_cuda(metas):
        # torch's default on CUDA is its foreach step: a temporary the size of each local shard of a
        # param group (of one dtype) at once
        held: dict[tuple[int, str], int] = {}
        for m, s in zip(metas, sizes):
            if m.requires_grad:
                held[m.group, m.dtype] = held.get((m.group, m.dtype), 0) + _local(m, shards, me % shards).numel * s
        temps = spec.foreach_temps * max(held.values(), default=0)
    else:  # torch's single-tensor rule: one param's temporaries at a time, the largest param's
        temps = max((_local(m, shards, me % shards).numel * s for m, s in zip(metas, sizes) if m.requires_grad),
                    default=0)
    return "step", {"sharded_grads": grads, "step_temps": temps}


def _on_cuda(metas: list[ParamMeta]) -> bool:
    trained = [m for m in metas if m.requires_grad]
    return bool(trained) and all(str(m.device).startswith("cuda") for m in trained)


def _gather_sent(plan, metas: list[ParamMeta], me: int) -> int:
    """Bytes ``me`` sends in zero's collectives over its replicate group, as nccl-tests count
    them: the all-gathers of the parts, and the broadcasts of the whole params' pieces (all of
    each, on every rank of the group)."""
    from zero.plans.accounting import bus_bytes

    shard, total = me % plan.world_size, 0
    for group, dtype in dict.fromkeys((m.group, m.dtype) for m in metas if m.requires_grad):
        these = [i for i, m in enumerate(metas) if m.requires_grad and (m.group, m.dtype) == (group, dtype)]
        for bucket in plan.gather_buckets(these, me):
            total += bus_bytes("all_gather", plan.replicas * sum(plan.slot(i, me) for i in bucket) * itemsize(dtype),
                               plan.replicas)
        total += sum(plan.local_numel(i, shard) * itemsize(dtype) for i in these if plan.owner[i] >= 0)
    return total
