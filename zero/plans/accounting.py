"""What parameters cost: optimizer-state bytes, partition weights, and bytes on the wire.

The per-optimizer figures are those of `torch.optim`'s default (non-fused, non-capturable)
implementations: ``slots`` state tensors shaped like the parameter (in its dtype) plus
``scalar_bytes`` of per-parameter scalars (Adam's float32 ``step`` tensor). State exists only for
trainable parameters, because torch creates it lazily on the first gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zero.plans.checks import check_int
from zero.plans.meta import ParamMeta, itemsize

__all__ = ["OptimizerState", "OPTIMIZERS", "optimizer_state", "state_bytes", "weights",
           "sync_bytes", "check_master_dtype", "master_itemsize", "state_itemsize"]


@dataclass(frozen=True)
class OptimizerState:
    """State an optimizer keeps per parameter: ``slots`` param-shaped tensors + scalars."""

    slots: int
    scalar_bytes: int = 0

    def bytes_for(self, meta: ParamMeta) -> int:
        return self.bytes_of(meta.nbytes, 1) if meta.requires_grad else 0

    def bytes_of(self, nbytes: int, count: int) -> int:
        """State of ``count`` trainable params holding ``nbytes`` between them."""
        return self.slots * nbytes + self.scalar_bytes * count


OPTIMIZERS: dict[str, OptimizerState] = {
    "sgd": OptimizerState(0),
    "sgd_momentum": OptimizerState(1),
    "adam": OptimizerState(2, 4),
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
}


def optimizer_state(optimizer: str | OptimizerState) -> OptimizerState:
    """Look up an optimizer's state shape by name (see ``OPTIMIZERS``)."""
    if isinstance(optimizer, OptimizerState):
        return optimizer
    key = str(optimizer).lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[key]


def state_bytes(meta: ParamMeta, optimizer: str | OptimizerState = "adam", master_dtype: str | None = None) -> int:
    """Bytes of optimizer state ``optimizer`` keeps for ``meta`` (0 for frozen params), in the
    master dtype when the optimizer steps master copies."""
    if not meta.requires_grad:
        return 0
    return optimizer_state(optimizer).bytes_of(meta.numel * state_itemsize(meta.dtype, master_dtype), 1)


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
    A callable maps each `ParamMeta` to a non-negative int.
    """
    if weight == "numel":
        return [m.numel for m in metas]
    if weight == "state_bytes":
        ws = [state_bytes(m, optimizer, master_dtype) +
              (m.numel * master_itemsize(m.dtype, master_dtype) if m.requires_grad else 0) for m in metas]
        return ws if any(ws) else [m.numel if m.requires_grad else 0 for m in metas]
    if callable(weight):
        return [check_int(f"weight({m.name!r})", weight(m)) for m in metas]
    raise ValueError(f"unknown weight {weight!r}; use 'numel', 'state_bytes' or a callable")


def sync_bytes(shard_bytes: Sequence[int], collective: str) -> list[tuple[int, int]]:
    """(sent, received) bytes per rank for one parameter sync after the local step.

    ``"broadcast"``: each rank sends its shard to every peer and receives every other shard
    (the logical volume, as with torch's per-rank broadcasts). ``"all_gather"``: a ring
    all-gather of equal blocks, so every shard is padded to the largest one and each rank both
    sends and receives ``(W - 1)`` blocks.
    """
    w = len(shard_bytes)
    total = sum(shard_bytes)
    if collective == "broadcast":
        return [((w - 1) * b, total - b) for b in shard_bytes]
    if collective == "all_gather":
        block = max(shard_bytes, default=0)
        return [((w - 1) * block, (w - 1) * block)] * w
    raise ValueError(f"unknown collective {collective!r}; use 'broadcast' or 'all_gather'")
