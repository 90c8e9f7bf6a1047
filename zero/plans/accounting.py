"""What parameters cost: optimizer-state bytes, partition weights, and bytes on the wire.

Each rule's state and step are its cost model's (`zero.plans.costs`: element-wise, Newton-Schulz
matrices, low-bit; ``OPTIMIZERS`` by name, ``"adamw8bit/128"`` a low-bit one with another block
size). State exists only for trainable parameters, because torch creates it lazily on the first
gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from zero.plans.checks import check_int
from zero.plans.costs import COSTS, LOW_BIT_MIN_NUMEL, RuleCost, cost_of
from zero.plans.meta import ParamMeta, itemsize

__all__ = ["bus_bytes", "BUS_FACTORS",
           "OPTIMIZERS", "LOW_BIT_MIN_NUMEL", "state_bytes", "weights",
           "sync_bytes", "check_master_dtype", "master_itemsize", "state_itemsize"]


# The rules' cost models by name (`zero.plans.costs.COSTS`), under the name `zero` exports.
OPTIMIZERS: dict[str, RuleCost] = COSTS


def state_bytes(meta: ParamMeta, optimizer: str | RuleCost = "adam", master_dtype: str | None = None) -> int:
    """Bytes of optimizer state ``optimizer`` keeps for ``meta`` (0 for frozen params), in the
    master dtype when the optimizer steps master copies."""
    if not meta.requires_grad:
        return 0
    return cost_of(optimizer).state_bytes(meta, state_itemsize(meta.dtype, master_dtype))


# Float dtypes by precision: a master copy must be at least as precise as its param.
_PRECISION = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def check_master_dtype(master_dtype: str | None, metas: Sequence[ParamMeta]) -> str | None:
    """The master dtype's name (``"float32"``; ``"torch.float32"`` too), or None; ``ValueError``
    for a non-float dtype or one less precise than a trainable param's, naming that param."""
    if master_dtype is None:
        return None
    name = str(master_dtype).removeprefix("torch.")
    if name not in _PRECISION:
        raise ValueError(f"master_dtype must be a float dtype ({', '.join(_PRECISION)}), got {master_dtype!r}")
    for m in metas:
        if m.requires_grad and m.dtype in _PRECISION and (
                _PRECISION[name] < _PRECISION[m.dtype] or _PRECISION[name] == _PRECISION[m.dtype] and name != m.dtype):
            raise ValueError(f"master_dtype {name} is less precise than param {m.name!r}'s {m.dtype}: master copies "
                             "must hold at least what the params do")
    return name


def master_itemsize(dtype: str, master_dtype: str | None) -> int:
    """Bytes per element of the master copy kept for a trainable param of ``dtype`` (0 when the
    optimizer steps the param itself: no master dtype, or the param already in it)."""
    return 0 if master_dtype is None or master_dtype == dtype else itemsize(master_dtype)


def state_itemsize(dtype: str, master_dtype: str | None) -> int:
    """Bytes per element of optimizer state: the master dtype's when there are masters."""
    return itemsize(master_dtype or dtype)


Weight = str | Callable[[ParamMeta], int]


def weights(metas: Sequence[ParamMeta], weight: Weight = "numel",
            optimizer: str | RuleCost = "adam", master_dtype: str | None = None) -> list[int]:
    """The load each parameter puts on the rank that owns it.

    ``"numel"`` counts every parameter, frozen ones included (torch's rule); ``"state_bytes"``
    counts the optimizer state it will hold (with ``master_dtype``, its master copy too), so
    frozen parameters weigh nothing. When no
    parameter has state (plain SGD), ``"state_bytes"`` balances trainable elements instead, since
    any placement is then equally good for memory and compute is what is left to balance.
    ``"step_flops"`` counts the work of its step (`zero.plans.costs.RuleCost.step_flops`: its elements,
    or for Muon's matrices their Newton-Schulz matmuls), so ranks finish their steps together.
    A callable maps each `ParamMeta` to a non-negative int.
    """
    if weight == "numel":
        return [m.numel for m in metas]
    if weight == "state_bytes":
        ws = [state_bytes(m, optimizer, master_dtype) +
              (m.numel * master_itemsize(m.dtype, master_dtype) if m.requires_grad else 0) for m in metas]
        return ws if any(ws) else [m.numel if m.requires_grad else 0 for m in metas]
    if weight == "step_flops":
        spec = cost_of(optimizer)
        return [spec.step_flops(m) for m in metas]
    if callable(weight):
        return [check_int(f"weight({m.name!r})", weight(m)) for m in metas]
    raise ValueError(f"unknown weight {weight!r}; use 'numel', 'state_bytes', 'step_flops' or a callable")


# Bytes each rank sends (and receives) in one collective, as nccl-tests count them for their bus
# bandwidth: the buffer's bytes times a factor of the group's size W (ring algorithms). Every
# figure of collective traffic zero prints (`zero plan`, `zero simulate`, `Footprint`, the
# recorder's `bus_bytes`) is in this unit.
# kind: (times the buffer, whether by (W - 1) / W as a ring moves it)
BUS_FACTORS = {"all_gather": (1, True), "reduce_scatter": (1, True), "all_reduce": (2, True),
               "all_to_all": (1, True), "broadcast": (1, False), "reduce": (1, False),
               "exchange": (1, False)}  # an all-to-all of uneven chunks, counted as the bytes sent to others


def bus_bytes(kind: str, buffer_bytes: int, world: int) -> int:
    """Bytes each rank sends (= receives) in collective ``kind`` over a buffer of ``buffer_bytes``
    (the whole buffer: an all-gather's output, a reduce-scatter's input) in a group of ``world``:
    all-gather, reduce-scatter and all-to-all ``(W - 1) / W`` of it, all-reduce ``2 (W - 1) / W``, broadcast
    and reduce all of it (nccl-tests' bus bytes); nothing in a group of one. ``kind`` may be a
    `zero.backends.comm` function's name (``all_gather_rows``, ``reduce_sum_to`` ...)."""
    if world <= 1:
        _collective(kind)  # an unknown name is an error in a group of one too
        return 0
    times, ring = BUS_FACTORS[_collective(kind)]
    return times * buffer_bytes * (world - 1) // world if ring else times * buffer_bytes


@functools.cache
def _collective(kind: str) -> str:
    """The `BUS_FACTORS` kind a name is (its longest prefix there): read once per name, since a
    plan at 1,024 ranks asks for hundreds of thousands of collectives' bytes."""
    base = next((k for k in sorted(BUS_FACTORS, key=len, reverse=True) if kind.startswith(k)), None)
    if base is None:
        raise ValueError(f"unknown collective {kind!r}; known: {sorted(BUS_FACTORS)}")
    return base


def sync_bytes(shard_bytes: Sequence[int], collective: str) -> list[tuple[int, int]]:
    """(sent, received) bytes per rank for one parameter sync after the local step, in
    `bus_bytes`' unit (equal under ring algorithms).

    ``"broadcast"``: one broadcast per rank of its shard, each counting its whole buffer: every
    rank sends and receives the sum of the shards. ``"all_gather"``: a ring all-gather of equal
    blocks, so every shard is padded to the largest one and each rank sends and receives
    ``(W - 1)`` blocks.
    """
    w = len(shard_bytes)
    if collective == "broadcast":
        per_rank = sum(bus_bytes("broadcast", b, w) for b in shard_bytes)
        return [(per_rank, per_rank)] * w
    if collective == "all_gather":
        per_rank = bus_bytes("all_gather", w * max(shard_bytes, default=0), w)
        return [(per_rank, per_rank)] * w
    raise ValueError(f"unknown collective {collective!r}; use 'broadcast' or 'all_gather'")
