"""Params that are pieces of sharded storage (FSDP2's DTensors): `Optimizer` steps them through an
executor a backend gives, found by the param's type.

A rule steps plain tensors. A DTensor param of ``fully_shard`` is a rank's piece of a whole
tensor, and stepping it exactly takes collectives: sums over the ranks for norms, whole tensors
on an owner for the rules that need them. Collectives live in ``zero.backends`` (DESIGN.md), so
this module names the backend module by its dotted name (`EXECUTORS`) and loads it only when such
a param is stepped: ``import zero.functional`` still loads no backend, and a plain optimizer never
does. The executor's contract is `Executor`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["EXECUTORS", "Executor", "storage_kind", "executor_for"]

# The sharded-storage types zero steps, by qualified name (the names torch 2.x has used), and the
# module whose ``executor(optimizer)`` steps them.
EXECUTORS = {"torch.distributed.tensor.DTensor": "zero.backends.fsdp2",
             "torch.distributed.tensor._api.DTensor": "zero.backends.fsdp2",
             "torch.distributed._tensor.api.DTensor": "zero.backends.fsdp2"}

Run = Callable[[tuple[int, ...], list[torch.Tensor], list[torch.Tensor]], None]


class Executor(Protocol):
    """Steps one param group of sharded params: ``step_group(k, idx, params, grads, run)`` calls
    ``run(keep, leaves, grads)`` once, with the plain tensors this rank steps of group ``k``'s
    params at positions ``idx`` (``keep``: their positions), inside the `zero.functional.sharding`
    answers that make the rule's whole-tensor quantities exact, and writes the results back."""

    def step_group(self, k: int, idx: tuple[int, ...], params: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor], run: Run) -> None: ...


def storage_kind(param: torch.Tensor) -> str | None:
    """The `EXECUTORS` key ``param``'s type is (or derives from), None for a plain tensor."""
    for cls in type(param).__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in EXECUTORS:
            return name
    return None


def executor_for(optimizer: Any) -> Executor | None:
    """The executor of ``optimizer``'s params (a `zero.functional.Optimizer`), None when they are
    plain tensors. Plain and sharded params in one optimizer are a ``ValueError`` naming one of
    each: a plain param on every rank would count once per rank in a whole-model norm."""
    kinds: dict[str | None, str] = {}
    for k, group in enumerate(optimizer.param_groups):
        names = group.get("param_names") or [f"param_groups[{k}]['params'][{i}]" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"]):
            kinds.setdefault(storage_kind(p), name)
    if None in kinds and len(kinds) == 1:
        return None
    if None in kinds:
        sharded = next(n for kind, n in kinds.items() if kind is not None)
        raise ValueError(f"zero.functional.Optimizer got plain param {kinds[None]!r} beside sharded param {sharded!r} "
                         "(a DTensor): shard every param the optimizer steps (fully_shard the root module too), or "
                         "step the plain ones with another optimizer")
    modules = {EXECUTORS[kind] for kind in kinds}
    if len(modules) > 1:
        raise ValueError(f"zero.functional.Optimizer got params of several sharded kinds: {sorted(kinds)}")
    return importlib.import_module(modules.pop()).executor(optimizer)
