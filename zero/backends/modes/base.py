"""`Mode`: the questions every way of executing a plan answers for `ZeroRedundancyOptimizer`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.algorithms.join import JoinHook

from zero.backends.local_optimizer import LocalStep
from zero.backends.sync import ViewWatch
from zero.plans.chunks import Held
from zero.plans.meta import ParamMeta
from zero.plans.plan import Plan

__all__ = ["Mode", "Begin"]

# Called by a mode's `step` before it touches anything: checks the params, starts the ranks'
# check-in and hands the outer groups' settings to the local optimizer; returns ``verify``.
Begin = Callable[[], Callable[[], None]]


class Mode:
    """One way of executing a `zero.Plan` on this rank.

    `ZeroRedundancyOptimizer` holds one mode, chosen once at construction (`zero.backends.modes.make_mode`),
    and calls only these methods: what this rank steps (`local_groups`), one step with its
    gradients and sync (`step`), the map between the local optimizer's state and the global state
    dict (`to_global`, `to_local`), and what a change of params (`retrain`, `extend`), ``zero_grad``,
    ``no_sync`` and ``Join`` mean in this mode. A mode reads nothing of the optimizer: what it
    needs comes as arguments.
    """

    storage: ViewWatch  # the params whose storage the mode's sync writes (their storage must not move)
    scaler_sees_grads = True  # the params' .grad are the gradients stepped, as a GradScaler reads them

    def __init__(self, params: Sequence[torch.Tensor], plan: Plan, rank: int, group: Any):
        self.params, self.plan, self.rank, self.group = list(params), plan, rank, group
        self.trainable = [p.requires_grad for p in self.params]

    def local_groups(self, param_groups: list[dict]) -> list[dict]:
        """The local optimizer's groups: every global group's settings, with what this rank steps."""
        raise NotImplementedError

    def step(self, local: LocalStep, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        """One optimizer step: the gradients of what this rank steps, the local step, the sync."""
        raise NotImplementedError

    def to_global(self, shards: Sequence[dict], param_groups: list[dict], per_element: set[str] | None) -> dict:
        """The global (plain ``torch.optim``) state dict out of every rank's local one."""
        raise NotImplementedError

    def to_local(self, saved: dict, per_element: set[str] | None) -> dict:
        """This rank's local state dict, cut out of a global one."""
        raise NotImplementedError

    def holdings(self) -> tuple[Held, ...]:
        """What this rank's local optimizer holds of each param (`zero.plans.chunks.Held`)."""
        raise NotImplementedError

    def chunks(self, index: int) -> tuple[tuple[int, int, int], ...]:
        """Every rank's ``(rank, start, end)`` elements of param ``index``'s state."""
        raise NotImplementedError

    def trainability_changed(self) -> bool:
        """Whether a param was frozen or unfrozen since the mode was built (read every step)."""
        return [p.requires_grad for p in self.params] != self.trainable

    def retrain(self, metas: Sequence[ParamMeta]) -> None:
        """Follow params frozen or unfrozen since the mode was built (``metas``: the params now)."""
        raise NotImplementedError

    def check_extendable(self) -> None:
        """``ValueError`` if ``add_param_group`` cannot extend this mode (before anything changes)."""

    def extend(self, plan: Plan, params: Sequence[torch.Tensor], metas: Sequence[ParamMeta], n_groups: int) -> None:
        """Execute ``plan``, made for the params with a new group, from now on."""
        raise NotImplementedError

    def zero_grad(self, default: Callable[[], None]) -> None:
        """``zero_grad``: torch's (``default``) unless the mode keeps the gradients itself."""
        default()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        raise RuntimeError("no_sync() is for reduce_scatter_grads=True; with DDP use ddp_model.no_sync()")
        yield  # pragma: no cover

    def join_hook(self, step: Callable[[], Any]) -> JoinHook:
        """What a rank that ran out of inputs does under ``Join``: by default it still steps the
        params it owns (``step``), with the shadowed, all-reduced gradients, and syncs them."""
        return _StepJoinHook(step)


class _StepJoinHook(JoinHook):
    def __init__(self, step: Callable[[], Any]):
        self.step = step

    def main_hook(self) -> None:
        self.step()
