"""`ZeroRedundancyOptimizer` over FSDP2's params: the optimizer state and step sharded over HSDP's
replicas as well as its shards (ZeRO-1 over the replicate dim, pytorch/pytorch#148257).

``fully_shard`` on a ``replicas x shards`` mesh leaves every replica holding the same pieces, so
``torch.optim`` over them keeps each piece's state once per replica. `ReplicaShardedOptimizer` is
the `zero.functional.Optimizer` whose executor (`zero.backends.fsdp2.Fsdp2Executor`) plans over
the replicas too: each rank steps its part of its pieces and the whole matrices it owns across the
mesh, and one all-gather per replicate group and dtype brings the other replicas' parts. A rank
holds ``1 / (replicas x shards)`` of the state. On a 1-D mesh it steps as `zero.functional.Optimizer`.
`zero.ZeroRedundancyOptimizer` builds one when its params are DTensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zero.backends.local_optimizer import rule_of
from zero.backends.precision import resolve_dtype
from zero.functional.adapters.optimizer import Optimizer

__all__ = ["ReplicaShardedOptimizer", "named_groups"]

# ZeroRedundancyOptimizer's keywords that place params or reduce gradients: FSDP2 does both here.
_FSDP2_DECIDES = {"process_group": None, "parameters_as_bucket_view": None, "overlap_with_ddp": False, "plan": None,
                  "strategy": None, "sync_chunk_mb": None, "reduce_scatter_grads": False, "reduce_dtype": None,
                  "find_unused_parameters": False, "bucket_cap_mb": None, "reducer": None, "split_heads": False}


def named_groups(groups: list[dict]) -> list[dict]:
    """``groups`` (`zero.plans.meta.param_groups`' form: tensors and ``"param_names"``) as torch
    takes named params: ``(name, tensor)`` pairs."""
    out = []
    for g in groups:
        names = g.get("param_names")
        rest = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        out.append({**rest, "params": list(zip(names, g["params"])) if names else list(g["params"])})
    return out


class ReplicaShardedOptimizer(Optimizer):
    """What ``zero.ZeroRedundancyOptimizer(params, optimizer_class, **defaults)`` is over FSDP2's
    DTensor params: a `zero.functional.Optimizer` (torch's optimizer protocol, state dicts, DCP
    through `zero.backends.checkpoint`) whose step is sharded over HSDP's replicas too.

    ``master_dtype`` (e.g. ``torch.float32`` over bf16 params): each rank steps master copies of
    what it steps, in this dtype, and writes them back rounded, so the all-gathers move the params'
    dtype; the masters are sharded as the state is. ``nonfinite``: what a step does with gradients
    holding NaN or inf, as `zero.ZeroRedundancyOptimizer`'s (``"warn"``, ``"skip"``, ``"raise"``),
    decided at the start every zero optimizer shares (`zero.functional.adapters.face`).
    FSDP2 places the params and reduces the gradients, so the keywords of ZeRO's own placement and
    reduction are a ``ValueError`` here.
    """

    def __init__(self, params: Iterable, optimizer_class: Any, *, master_dtype: torch.dtype | str | None = None,
                 nonfinite: str = "warn", **options: Any):
        given = {k: v for k, v in options.items() if k in _FSDP2_DECIDES and v is not _FSDP2_DECIDES[k]
                 and v != _FSDP2_DECIDES[k]}
        if given:
            name, value = next(iter(given.items()))
            raise ValueError(f"ZeroRedundancyOptimizer over FSDP2's DTensor params: {name}={value!r} is not taken "
                             "(FSDP2 places the params and reduces the gradients; the mesh is the params' own)")
        defaults = {k: v for k, v in options.items() if k not in _FSDP2_DECIDES}
        self.master_dtype = resolve_dtype(master_dtype, "master_dtype")
        super().__init__(params, rule_of(optimizer_class, defaults), nonfinite=nonfinite)

    def executor_options(self) -> dict[str, Any]:
        return {"over_replicas": True, "master_dtype": self.master_dtype}
