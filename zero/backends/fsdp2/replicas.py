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

from zero.backends import comm
from zero.backends.local_optimizer import check_not_optax
from zero.backends.nonfinite import NonFinite, all_finite, message
from zero.backends.precision import resolve_dtype
from zero.functional.adapters.group_settings import from_factory
from zero.functional.adapters.optimizer import Optimizer
from zero.functional.adapters.torch_rules import TORCH_CLASSES, from_torch
from zero.functional.base import GradientTransformation

__all__ = ["ReplicaShardedOptimizer", "has_dtensors", "named_groups"]

# ZeroRedundancyOptimizer's keywords that place params or reduce gradients: FSDP2 does both here.
_FSDP2_DECIDES = {"process_group": None, "parameters_as_bucket_view": None, "overlap_with_ddp": False, "plan": None,
                  "strategy": None, "sync_chunk_mb": None, "reduce_scatter_grads": False, "reduce_dtype": None,
                  "find_unused_parameters": False, "bucket_cap_mb": None, "reducer": None}


def has_dtensors(groups: list[dict]) -> bool:
    """Whether any param of ``groups`` (`zero.plans.meta.param_groups`' form) is a DTensor."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for g in groups for p in g["params"])


def named_groups(groups: list[dict]) -> list[dict]:
    """``groups`` (`zero.plans.meta.param_groups`' form: tensors and ``"param_names"``) as torch
    takes named params: ``(name, tensor)`` pairs."""
    out = []
    for g in groups:
        names = g.get("param_names")
        rest = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        out.append({**rest, "params": list(zip(names, g["params"])) if names else list(g["params"])})
    return out


def _rule(optimizer_class: Any, defaults: dict) -> GradientTransformation:
    """The rule ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)`` steps: a
    ``torch.optim`` class as `zero.functional.from_torch` mirrors it, a transformation as it is, a
    factory built with ``defaults`` (its settings then param-group keys)."""
    check_not_optax(optimizer_class, "optimizer_class")
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer):
        if optimizer_class.__name__ not in TORCH_CLASSES or getattr(torch.optim, optimizer_class.__name__, None) \
                is not optimizer_class:
            raise TypeError("ZeroRedundancyOptimizer over FSDP2's params steps torch's classes "
                            f"{sorted(TORCH_CLASSES)} (as zero.functional.from_torch mirrors them) or a "
                            "zero.functional rule, not "
                            f"{optimizer_class.__module__}.{optimizer_class.__qualname__}")
        return from_torch(optimizer_class.__name__, **defaults)
    if isinstance(optimizer_class, GradientTransformation):
        if defaults:
            raise TypeError(f"optimizer_class is a GradientTransformation, so it takes no keyword hyperparameters; "
                            f"got {sorted(defaults)}")
        return optimizer_class
    if callable(optimizer_class) and not isinstance(optimizer_class, type):
        return from_factory(optimizer_class, defaults)
    raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass or a zero.functional transformation "
                    f"or factory, got {optimizer_class!r}")


class ReplicaShardedOptimizer(Optimizer):
    """What ``zero.ZeroRedundancyOptimizer(params, optimizer_class, **defaults)`` is over FSDP2's
    DTensor params: a `zero.functional.Optimizer` (torch's optimizer protocol, state dicts, DCP
    through `zero.backends.checkpoint`) whose step is sharded over HSDP's replicas too.

    ``master_dtype`` (e.g. ``torch.float32`` over bf16 params): each rank steps master copies of
    what it steps, in this dtype, and writes them back rounded, so the all-gathers move the params'
    dtype; the masters are sharded as the state is. ``nonfinite``: what a step does with gradients
    holding NaN or inf, as `zero.ZeroRedundancyOptimizer`'s (``"warn"``, ``"skip"``, ``"raise"``).
    FSDP2 places the params and reduces the gradients, so the keywords of ZeRO's own placement and
    reduction are a ``ValueError`` here.
    """

    over_replicas = True  # read by zero.backends.fsdp2.executor

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
        self.nonfinite = NonFinite(nonfinite)
        super().__init__(params, _rule(optimizer_class, defaults))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """`zero.functional.Optimizer.step`, after the gradients' check for NaN and inf
        (``nonfinite``): ``"warn"`` names the params whose rows here hold them (no collective),
        ``"skip"`` and ``"raise"`` agree across the mesh first (one all-reduce of a flag)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._checked_nonfinite():
            return loss
        super().step()
        return loss

    def _checked_nonfinite(self) -> bool:
        """Whether to skip this step (``"skip"`` and some rank's gradients hold NaN or inf)."""
        executor = self.executor
        if executor is None or comm.is_fake(executor.layout.group):  # (a simulated rank's values are not there)
            return False
        named = [(n, p.grad.to_local()) for g in self.param_groups
                 for n, p in zip(g.get("param_names") or map(str, range(len(g["params"]))), g["params"])
                 if p.grad is not None]
        bad = not all_finite([t for _, t in named])
        if self.nonfinite.policy != "warn":  # every rank decides alike: the flag's maximum over the mesh
            flag, device = torch.tensor([float(bad)]), executor.mesh.device_type
            for group in (g for g in (executor.layout.group, executor.layout.replica_group) if g is not None):
                flag = comm.maxed(group, torch.device(device))(flag)
            bad = bool(flag.item())
        if not bad:
            return False
        names = [n for n, t in named if not all_finite([t])]
        found = ("in the rows of this rank" if names else "in other ranks' rows") + \
            ", after FSDP2 reduced them (every rank holding those rows has them)"
        skip = self.nonfinite.report(message(self._steps + 1, names, found, self.nonfinite.policy))
        self.skipped_steps += skip  # (with a rule's apply_if_finite skips: one count, as ZeRO's)
        return skip


def _register() -> None:
    from zero.backends.zero_optimizer import ZeroRedundancyOptimizer

    ZeroRedundancyOptimizer.register(ReplicaShardedOptimizer)


_register()
