"""`Mode`: the questions every way of executing a plan answers for `ZeroRedundancyOptimizer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.join import JoinHook

from zero.backends import comm
from zero.backends.local_optimizer import local_groups as groups_of
from zero.backends.modes.gradients import Gradients
from zero.backends.rank_state import RankState
from zero.backends.sync import ViewWatch
from zero.functional import sharding
from zero.plans.holdings import LocalTensor
from zero.plans.meta import ParamMeta
from zero.plans.plan import Plan

__all__ = ["Mode", "Begin", "local_groups", "build_sharding"]

# Called by a mode's `step` before it touches anything: checks the params, starts the ranks'
# check-in and hands the outer groups' settings to the local optimizer; returns ``verify``.
Begin = Callable[[], Callable[[], None]]


class Mode:
    """One way of executing a `zero.Plan` on this rank: the live tensors, the step and its sync.

    `ZeroRedundancyOptimizer` holds one mode, chosen once at construction (`zero.backends.modes.make_mode`),
    beside the rank's `RankState` (the plan, what it gives this rank, the local optimizer), which
    the mode reads and steps. A mode answers: which tensor the local optimizer steps for each of
    the rank's holdings (`tensor`), one step with its gradients and sync (`step`), and what a change
    of params (`retrain`, `extend`) and ``Join`` mean in it. Its `Gradients` (``gradients``) answer
    for the gradients: where they are, ``zero_grad``, ``no_sync``, the non-finite check. It maps
    no state: every state format reads the holdings (`zero.backends.checkpoint`).
    """

    storage: ViewWatch  # the params whose storage the mode's sync writes (their storage must not move)
    overlaps_ddp = False  # steps inside DDP's comm hook (`zero.backends.modes.DDPOverlap`)

    def __init__(self, state: RankState, gradients: Gradients | None = None):
        self.state = state
        self.gradients = gradients if gradients is not None else Gradients(state)  # DDP's
        self.trainable = [p.requires_grad for p in self.params]

    @property
    def params(self) -> list[torch.Tensor]:
        return self.state.params

    @property
    def plan(self) -> Plan:
        return self.state.plan

    def tensor(self, t: LocalTensor) -> torch.Tensor:
        """The live tensor the local optimizer steps for ``t``, one of this rank's holdings."""
        raise NotImplementedError

    def step(self, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        """One optimizer step: the gradients of what this rank steps, the local step, the sync."""
        raise NotImplementedError

    def sync_params(self) -> None:
        """Every rank's params from what their steppers hold now (the sync that ends a step)."""
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

    def held_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Where the gradients are reduced here (``reduce_scatter_grads``): the averaged gradients
        this rank steps, every reduction waited for, each beside the tensor it steps (a shard, an
        owned whole param), to clip or unscale before the step. ``None``: the params' ``.grad``
        hold the whole averaged gradients, as DDP leaves them."""
        got = self.gradients.settled()
        if got is None:
            return None
        outputs, kept = got
        held: dict[int, list] = {}  # per buffer: its shard, or a head buffer's views with their rows of it
        for t in self.state.holdings.tensors:
            if not t.whole:
                held.setdefault(t.buffer, []).append((self.tensor(t), t.offset, t.numel if t.piece is not None else 0))
        pairs = [(x, g[o:o + n].view_as(x) if n else g) for k, g in enumerate(outputs) for x, o, n in held.get(k, ())]
        return [*pairs, *((self.params[i], g) for i, g in kept.items())]

    def join_hook(self, step: Callable[[], Any]) -> JoinHook:
        """What a rank that ran out of inputs does under ``Join``: by default it still steps the
        params it owns (``step``), with the shadowed, all-reduced gradients, and syncs them."""
        self.gradients.check_join()
        return _StepJoinHook(step)


def local_groups(state: RankState, tensor: Callable[[LocalTensor], torch.Tensor]) -> list[dict]:
    """The local optimizer's groups: every global group's settings, with what this rank steps
    (``tensor``: the mode's live tensor of each holding). Named groups name what they hold, but
    under a plain flat plan, whose shards have no name."""
    named = state.plan.flat is None or state.plan.hybrid or state.plan.split_heads
    return groups_of(state.param_groups, state.holdings, tensor, named)


def build_sharding(state: RankState, tensor: Callable[[LocalTensor], torch.Tensor],
                   reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   every_group: bool = True) -> sharding.Sharding:
    """What `zero.functional.sharding` needs to answer whole-tensor questions in a step: the
    pieces of whole params each local tensor (``tensor`` of a holding) holds, and the ranks' sum
    and maximum (``None``: over the optimizer's group)."""
    held, params, plan = state.holdings, state.params, state.plan
    pieces = {}
    for j, t in enumerate(held.tensors):
        hs = held.pieces(j)
        block = plan.flat.buffers[t.buffer].block if t.buffer is not None else 0
        pieces[id(tensor(t))] = sharding.Pieces(tuple(h.param for h in hs), tuple(h.end - h.start for h in hs),
                                                tuple(h.start for h in hs), block)
    whole = plan.flat is None  # every rank steps whole params: a property of the plan
    reduce = reduce or comm.summed(state.process_group, state.device)
    reduce_max = reduce_max or comm.maxed(state.process_group, state.device)
    made = sharding.Sharding(pieces, tuple(p.dtype for p in params), reduce, reduce_max, every_group=every_group,
                             whole_params=whole, names=() if whole else tuple(m.name for m in plan.metas),
                             numels=tuple(p.numel() for p in params), shapes=tuple(tuple(p.shape) for p in params))
    state.sharding = made  # a state started outside a step (to load a checkpoint into) asks it too
    return made


class _StepJoinHook(JoinHook):
    def __init__(self, step: Callable[[], Any]):
        self.step = step

    def main_hook(self) -> None:
        self.step()
