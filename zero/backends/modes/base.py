"""`Mode`: the questions every way of executing a plan answers for `ZeroRedundancyOptimizer`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.algorithms.join import JoinHook

from zero.backends import comm
from zero.backends.local_optimizer import local_groups
from zero.backends.nonfinite import all_finite
from zero.backends.rank_state import RankState
from zero.backends.sync import ViewWatch
from zero.functional import sharding
from zero.plans.holdings import Holdings, LocalTensor
from zero.plans.meta import ParamMeta
from zero.plans.plan import Plan

__all__ = ["Mode", "Begin", "no_accumulation"]

# Called by a mode's `step` before it touches anything: checks the params, starts the ranks'
# check-in and hands the outer groups' settings to the local optimizer; returns ``verify``.
Begin = Callable[[], Callable[[], None]]


class Mode:
    """One way of executing a `zero.Plan` on this rank: the live tensors, gradients and syncs.

    `ZeroRedundancyOptimizer` holds one mode, chosen once at construction (`zero.backends.modes.make_mode`),
    beside the rank's `RankState` (the plan, what it gives this rank, the local optimizer), which
    the mode reads and steps. A mode answers: which tensor the local optimizer steps for each of
    the rank's holdings (`tensor`), one step with its gradients and sync (`step`), and what a change
    of params (`retrain`, `extend`), ``zero_grad``, ``no_sync`` and ``Join`` mean in it. It maps no
    state: every state format reads the holdings (`zero.backends.checkpoint`).
    """

    storage: ViewWatch  # the params whose storage the mode's sync writes (their storage must not move)
    scaler_sees_grads = True  # the params' .grad are the gradients stepped, as a GradScaler reads them

    def __init__(self, state: RankState):
        self.state = state
        self.trainable = [p.requires_grad for p in self.params]

    @property
    def params(self) -> list[torch.Tensor]:
        return self.state.params

    @property
    def plan(self) -> Plan:
        return self.state.plan

    @property
    def holdings(self) -> Holdings:
        return self.state.holdings

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def group(self) -> Any:
        return self.state.process_group

    def tensor(self, t: LocalTensor) -> torch.Tensor:
        """The live tensor the local optimizer steps for ``t``, one of this rank's holdings."""
        raise NotImplementedError

    def local_groups(self) -> list[dict]:
        """The local optimizer's groups: every global group's settings, with what this rank steps.
        Named groups name what they hold, but under a plain flat plan, whose shards have no name."""
        named = self.plan.flat is None or self.plan.hybrid
        return local_groups(self.state.param_groups, self.holdings, self.tensor, named)

    def build_sharding(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    every_group: bool = True) -> sharding.Sharding:
        """What `zero.functional.sharding` needs to answer whole-tensor questions in a step: the
        pieces of whole params each local tensor holds (from the holdings), and the ranks' sum and
        maximum (``None``: over the optimizer's group)."""
        held, params = self.holdings, self.params
        pieces = {}
        for j, t in enumerate(held.tensors):
            hs = held.pieces(j)
            block = self.plan.flat.buffers[t.buffer].block if t.buffer is not None else 0
            pieces[id(self.tensor(t))] = sharding.Pieces(tuple(h.param for h in hs), tuple(h.end - h.start for h in hs),
                                                         tuple(h.start for h in hs), block)
        whole = self.plan.flat is None  # every rank steps whole params: a property of the plan
        device = self.state.device
        reduce = reduce or comm.summed(self.group, device)
        reduce_max = reduce_max or comm.maxed(self.group, device)
        made = sharding.Sharding(pieces, tuple(p.dtype for p in params), reduce, reduce_max, every_group=every_group,
                                  whole_params=whole, names=() if whole else tuple(m.name for m in self.plan.metas),
                                  numels=tuple(p.numel() for p in params), shapes=tuple(tuple(p.shape) for p in params))
        self.state.sharding = made  # a state started outside a step (to load a checkpoint into) asks it too
        return made

    def step(self, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        """One optimizer step: the gradients of what this rank steps, the local step, the sync."""
        raise NotImplementedError

    def trainability_changed(self) -> bool:
        """Whether a param was frozen or unfrozen since the mode was built (read every step)."""
        return [p.requires_grad for p in self.params] != self.trainable

    def retrain(self, metas: list[ParamMeta]) -> None:
        """Follow params frozen or unfrozen since the mode was built (``metas``: the params now)."""
        raise NotImplementedError

    def check_extendable(self) -> None:
        """``ValueError`` if ``add_param_group`` cannot extend this mode (before anything changes)."""

    def extend(self, metas: list[ParamMeta]) -> None:
        """Execute the rank state's plan, made again for the params with a new group, from now on."""
        raise NotImplementedError

    def zero_grad(self, default: Callable[[], None]) -> None:
        """``zero_grad``: torch's (``default``) unless the mode keeps the gradients itself."""
        default()

    def start_reductions(self) -> None:
        """Before the step's check-in: start the gradients' reductions backward left pending (only
        where the mode reduces them itself), so every rank issues the same collectives in order."""

    def held_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Where the mode reduces the gradients itself (``reduce_scatter_grads``): the averaged
        gradients this rank steps, every reduction waited for, each beside the tensor it steps
        (a shard, an owned whole param), to clip or unscale before the step. ``None``: the
        params' ``.grad`` hold the whole averaged gradients, as DDP leaves them."""
        return None

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside only accumulate: for modes that reduce gradients themselves."""
        return no_accumulation()

    # -- non-finite gradients (`zero.backends.nonfinite`) ----------------------------------------

    checks_local_grads = False  # the gradients checked are this rank's own, before their reduction

    def param_grad_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """``(param, gradient piece)`` of each piece of a param this rank steps, read from the
        params' ``.grad`` (DDP's averaged gradients)."""
        out = []
        for h in self.holdings.held:
            grad = self.params[h.param].grad
            if grad is not None:
                out.append((h.param, grad.reshape(-1)[h.start:h.end]))
        return out

    def grad_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """``(param, gradient piece)`` of each piece of a param this rank steps, averaged, as the step reads it."""
        return self.param_grad_pieces()

    def local_nonfinite(self) -> bool:
        """Whether the gradients this rank checks hold NaN or inf (one pass over them)."""
        return not all_finite([g for _, g in self.grad_pieces()])

    def nonfinite_params(self) -> list[int]:
        """The params whose averaged gradients, in the pieces this rank steps, hold NaN or inf."""
        return sorted({i for i, g in self.grad_pieces() if not all_finite([g])})

    def join_hook(self, step: Callable[[], Any]) -> JoinHook:
        """What a rank that ran out of inputs does under ``Join``: by default it still steps the
        params it owns (``step``), with the shadowed, all-reduced gradients, and syncs them."""
        return _StepJoinHook(step)


@contextlib.contextmanager
def no_accumulation() -> Iterator[None]:
    """``no_sync`` where gradients are DDP's to reduce, not the optimizer's: an error saying so."""
    raise RuntimeError("no_sync() is for reduce_scatter_grads=True; with DDP use ddp_model.no_sync()")
    yield  # pragma: no cover


class _StepJoinHook(JoinHook):
    def __init__(self, step: Callable[[], Any]):
        self.step = step

    def main_hook(self) -> None:
        self.step()
