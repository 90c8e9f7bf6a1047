"""The start of a step over FSDP2's params, as ZeRO's starts (`zero.functional.adapters.face`):
every rank of the mesh checks in (steps taken, the groups' settings such as ``lr``, the plan and
which params train compared; the rank and setting that differ named, `zero.backends.consistency`),
carrying whether the gradient rows it holds have NaN or inf; the policy
(`zero.functional.adapters.nonfinite`) then warns, skips on every rank together, or raises, naming
the params and the ranks whose rows held them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zero.backends import comm
from zero.backends.consistency import OptimizerChecks
from zero.functional.adapters.nonfinite import all_finite

__all__ = ["Fsdp2Guard"]


class _Checked:
    """What `OptimizerChecks` reads of an optimizer over FSDP2's params (a `RankState` elsewhere)."""

    def __init__(self, executor: Any, optimizer: Any):
        self._executor, self._optimizer = executor, optimizer

    @property
    def steps(self) -> int:
        return self._optimizer.steps

    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups

    @property
    def params(self) -> list[torch.Tensor]:
        return self._optimizer.all_params()

    @property
    def plan(self) -> Any:
        return self._executor.plan

    @property
    def process_group(self) -> Any:
        return self._executor.mesh_group

    @property
    def comm_device(self) -> torch.device:
        return comm.device_for(self.process_group, self.params[0].device)


def _plan_facts(plan: Any) -> list[tuple[str, Any]]:
    """An FSDP2 plan as labelled values: each param's name, shape, dtype, dim, owner and block."""
    return [(f"param {i} (name, shape, dtype, dim, owner, block)",
             (m.name, m.shape, m.dtype, plan.dims[i], plan.owner[i], plan.blocks[i])) for i, m in enumerate(plan.metas)]


class Fsdp2Guard:
    """The collective half of a step's start over FSDP2's params (`zero.functional.adapters.nonfinite.StepGuard`)."""

    def __init__(self, executor: Any, optimizer: Any):
        self._optimizer = optimizer
        self._checked = _Checked(executor, optimizer)
        trainable = lambda: [p.requires_grad for p in optimizer.all_params()]  # noqa: E731
        self._checks = OptimizerChecks(self._checked, trainable, lambda: False, _plan_facts)

    def _fake(self) -> bool:  # a simulated rank: no other rank to agree with, no values to check
        return comm.is_fake(self._checked.process_group)

    def _local_grads(self) -> list[tuple[int, torch.Tensor]]:
        return [(t, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                for t, p in enumerate(self._optimizer.all_params()) if p.grad is not None]

    def local_nonfinite(self) -> bool:
        return not self._fake() and not all_finite([g for _, g in self._local_grads()])

    def check_in(self, flag: int) -> Callable[[], list[list[int]]]:
        return self._checks.check_in("step", carried=(flag,))

    def flagged_names(self) -> list[str]:
        mine = [t for t, g in self._local_grads() if not all_finite([g])]
        everyone = comm.all_gather_object(mine, self._checked.process_group)
        return [self._checked.plan.metas[t].name for t in sorted({t for got in everyone for t in got})]

    def where(self, ranks: list[int]) -> str:
        return (f"in the gradient rows rank {', '.join(map(str, ranks))} hold{'s' if len(ranks) == 1 else ''}, after "
                "FSDP2 reduced them (every rank holding those rows has them: the rank that made them cannot be told)")
