"""What parameters cost: optimizer-state bytes, partition weights, and bytes on the wire.

The per-optimizer figures are those of `torch.optim`'s default (non-fused, non-capturable)
implementations: ``slots`` state tensors shaped like the parameter (in its dtype) plus
``scalar_bytes`` of per-parameter scalars (Adam's float32 ``step`` tensor). State exists only for
trainable parameters, because torch creates it lazily on the first gradient.

Low-bit rules (``"adamw8bit"``, ``"adamw4bit"``: `zero.functional.contrib.adamw_8bit`, torchao's
``AdamW8bit``) keep each moment block-wise quantized: one byte (8-bit) or half a byte (4-bit) a
element plus one float32 scale a block, for params of at least ``min_numel`` elements that
divide into blocks; smaller ones keep full-precision moments. ``"adamw8bit/128"`` names another
block size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zero.plans.checks import check_int
from zero.plans.meta import ParamMeta, itemsize

__all__ = ["bus_bytes", "BUS_FACTORS",
           "OptimizerState", "OPTIMIZERS", "LOW_BIT_MIN_NUMEL", "optimizer_state", "state_bytes", "weights",
           "sync_bytes", "check_master_dtype", "master_itemsize", "state_itemsize"]


@dataclass(frozen=True)
class OptimizerState:
    """State an optimizer keeps per parameter: ``slots`` param-shaped tensors + scalars, and
    the work of its step.

    A rule that orthogonalises matrices (Muon) has ``ns_steps`` > 0: each 2-D parameter (a
    matrix, as `zero.functional.contrib.muon` routes them) holds ``matrix_slots`` tensors and
    costs Newton-Schulz matmuls; the others take the elementwise rule of ``slots``.
    """

    slots: int
    scalar_bytes: int = 0
    matrix_slots: int | None = None  # slots of a matrix, when they differ (Muon: its momentum)
    ns_steps: int = 0  # Newton-Schulz steps per matrix and step (0: an elementwise rule)
    # Temporaries torch's for-loop step makes at once, in tensors the size of the one it steps
    # (Adam's ``exp_avg_sq.sqrt()`` and its quotient, and a coupled decay's ``grad.add(param)``),
    # and those of the tensor before it still alive meanwhile (Adam's ``denom``, until reassigned).
    step_temps: int = 2
    step_temps_held: int = 1
    # Block-wise quantized moments (torchao's): ``bits`` per element (0: full precision) and one
    # float32 scale per ``block_size`` elements, for params with ``min_numel`` elements or more.
    bits: int = 0
    block_size: int = 0
    min_numel: int = 0
    # The step takes at most this many elements of a tensor at a time (0: all of it), its
    # temporaries in float32: zero's low-bit step goes by chunks of 2^16 (zero.functional.quantize).
    step_chunk: int = 0

    def block_for(self, meta: ParamMeta) -> int:
        """The quantization block of ``meta``'s moments, or 0 when they keep full precision
        (frozen, fewer than ``min_numel`` elements, or not a whole number of blocks): decided by
        the whole param's size, so no plan can change it."""
        return self.block_size if self.quantizes(meta.numel) and meta.requires_grad else 0

    def quantizes(self, numel: int) -> bool:
        """Whether a param of ``numel`` elements gets quantized moments (torchao's rule)."""
        return self.bits > 0 and numel >= self.min_numel and numel % self.block_size == 0

    def moments_bytes(self, numel: int, itemsize: int, block: int = 0) -> int:
        """Bytes of the ``slots`` moments of ``numel`` elements: quantized in blocks of ``block``
        (codes and float32 scales), or full precision at ``itemsize`` bytes (``block`` 0)."""
        if not block:
            return self.slots * numel * itemsize
        return self.slots * (numel * self.bits // 8 + numel // block * 4)

    def is_matrix(self, meta: ParamMeta) -> bool:
        """Whether ``meta`` is a matrix this rule orthogonalises."""
        return self.ns_steps > 0 and len(meta.shape) == 2

    def slots_for(self, meta: ParamMeta) -> int:
        """Param-shaped state tensors ``meta`` holds when trainable."""
        return self.matrix_slots if self.matrix_slots is not None and self.is_matrix(meta) else self.slots

    def bytes_for(self, meta: ParamMeta) -> int:
        return self.slots_for(meta) * meta.nbytes + self.scalar_bytes if meta.requires_grad else 0

    def step_flops(self, meta: ParamMeta) -> int:
        """Floating-point operations of one step of ``meta`` (0 when frozen): its elements for an
        elementwise rule; for a matrix orthogonalised, ``ns_steps`` quintic steps on it in the
        orientation whose Gram matrix is the smaller (``m <= n``): ``X X^T`` (2 m^2 n), its
        square (2 m^3) and the product with ``X`` (2 m^2 n), plus its elements."""
        if not meta.requires_grad:
            return 0
        if not self.is_matrix(meta):
            return meta.numel
        m, n = sorted(meta.shape)
        return self.ns_steps * (4 * m * m * n + 2 * m**3) + meta.numel


OPTIMIZERS: dict[str, OptimizerState] = {
    "sgd": OptimizerState(0, step_temps=1, step_temps_held=0),
    "sgd_momentum": OptimizerState(1, step_temps=2, step_temps_held=0),
    "adam": OptimizerState(2, 4, step_temps=3),
    "adamw": OptimizerState(2, 4),
    "adam_amsgrad": OptimizerState(3, 4),
    "nadam": OptimizerState(2, 8),  # step and mu_product
    "radam": OptimizerState(2, 4),
    "adamax": OptimizerState(2, 4),
    "adagrad": OptimizerState(1, 4),
    "adadelta": OptimizerState(2, 4),
    "rmsprop": OptimizerState(1, 4),
    "rprop": OptimizerState(2, 4),
    "lion": OptimizerState(1),
    "lamb": OptimizerState(2, 4),
    # zero.functional.contrib.muon: a momentum per matrix (5 Newton-Schulz steps); AdamW for the rest
    "muon": OptimizerState(2, 4, matrix_slots=1, ns_steps=5),
}
LOW_BIT_MIN_NUMEL = 4096  # torchao's (after bitsandbytes'): smaller params keep full-precision moments
# zero.functional.contrib's low-bit Adam (torchao's maps and blocks): a 0-d count per state, no per-param scalars
for _name, _bits, _block in (("adam8bit", 8, 256), ("adamw8bit", 8, 256), ("adam4bit", 4, 128), ("adamw4bit", 4, 128)):
    # its step's temporaries: about ten float32s an element of a chunk (MemTracker on the in-place step)
    OPTIMIZERS[_name] = OptimizerState(2, 0, bits=_bits, block_size=_block, min_numel=LOW_BIT_MIN_NUMEL,
                                       step_temps=10, step_temps_held=0, step_chunk=1 << 16)


def optimizer_state(optimizer: str | OptimizerState) -> OptimizerState:
    """Look up an optimizer's state shape by name (see ``OPTIMIZERS``)."""
    if isinstance(optimizer, OptimizerState):
        return optimizer
    key = str(optimizer).lower()
    name, _, block = key.partition("/")
    if name not in OPTIMIZERS or block and not (OPTIMIZERS[name].bits and block.isdigit() and int(block) > 0
                                                and int(block) % 2 == 0):
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(sorted(OPTIMIZERS))} (a low-bit one "
                         "with another even block size as 'adamw8bit/128')")
    return dataclasses.replace(OPTIMIZERS[name], block_size=int(block)) if block else OPTIMIZERS[name]


def state_bytes(meta: ParamMeta, optimizer: str | OptimizerState = "adam", master_dtype: str | None = None) -> int:
    """Bytes of optimizer state ``optimizer`` keeps for ``meta`` (0 for frozen params), in the
    master dtype when the optimizer steps master copies."""
    if not meta.requires_grad:
        return 0
    spec = optimizer_state(optimizer)
    if spec.bits:
        return spec.moments_bytes(meta.numel, state_itemsize(meta.dtype, master_dtype), spec.block_for(meta))
    return spec.slots_for(meta) * meta.numel * state_itemsize(meta.dtype, master_dtype) + spec.scalar_bytes


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
            optimizer: str | OptimizerState = "adam", master_dtype: str | None = None) -> list[int]:
    """The load each parameter puts on the rank that owns it.

    ``"numel"`` counts every parameter, frozen ones included (torch's rule); ``"state_bytes"``
    counts the optimizer state it will hold (with ``master_dtype``, its master copy too), so
    frozen parameters weigh nothing. When no
    parameter has state (plain SGD), ``"state_bytes"`` balances trainable elements instead, since
    any placement is then equally good for memory and compute is what is left to balance.
    ``"step_flops"`` counts the work of its step (`OptimizerState.step_flops`: its elements,
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
        spec = optimizer_state(optimizer)
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
               "broadcast": (1, False), "reduce": (1, False)}


def bus_bytes(kind: str, buffer_bytes: int, world: int) -> int:
    """Bytes each rank sends (= receives) in collective ``kind`` over a buffer of ``buffer_bytes``
    (the whole buffer: an all-gather's output, a reduce-scatter's input) in a group of ``world``:
    all-gather and reduce-scatter ``(W - 1) / W`` of it, all-reduce ``2 (W - 1) / W``, broadcast
    and reduce all of it (nccl-tests' bus bytes); nothing in a group of one. ``kind`` may be a
    `zero.backends.comm` function's name (``all_gather_rows``, ``reduce_sum_to`` ...)."""
    base = next((k for k in sorted(BUS_FACTORS, key=len, reverse=True) if kind.startswith(k)), None)
    if base is None:
        raise ValueError(f"unknown collective {kind!r}; known: {sorted(BUS_FACTORS)}")
    if world <= 1:
        return 0
    times, ring = BUS_FACTORS[base]
    return times * buffer_bytes * (world - 1) // world if ring else times * buffer_bytes


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
