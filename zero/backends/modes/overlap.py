"""``overlap_with_ddp=True``: the step runs inside DDP's comm hook (`zero.backends.overlap`), bucket
by bucket, while backward goes on; ``step()`` in the loop is then a no-op.

Ownership is per param, planned from DDP's bucket layout when the hook is made (`attach`), before
the first backward, so the first iteration already updates the params. The local optimizer
steps stand-ins sharing the params' storage, so DDP's and autograd's ``.grad`` stay untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.algorithms.join import JoinHook

from zero.backends import comm
from zero.backends.local_optimizer import LocalStep, local_groups
from zero.backends.modes.base import Begin
from zero.backends.modes.whole import WholeParams
from zero.functional import sharding
from zero.plans.meta import ParamMeta
from zero.plans.plan import Plan

__all__ = ["DDPOverlap"]


class DDPOverlap(WholeParams):
    """Whole params owned by DDP's buckets, each stepped by its owner as soon as its bucket is reduced."""

    local: LocalStep | None = None  # set by `attach`: the hook steps it

    def local_groups(self, param_groups: list[dict]) -> list[dict]:
        self.stand_ins = {i: self.params[i].detach() for i in self.plan.partition.params_of(self.rank)}
        return local_groups(param_groups, self.indices[self.rank],
                            [self.stand_ins.get(i, p) for i, p in enumerate(self.params)])

    def attach(self, plan: Plan, metas: Sequence[ParamMeta], make_local: Callable[[list[dict]], LocalStep],
               param_groups: list[dict]) -> LocalStep:
        """Execute ``plan`` (ownership by DDP's buckets) with a local optimizer built for it."""
        if self.local is not None:
            raise ValueError("this optimizer is already stepping inside a DDP comm hook (or has stepped): "
                             "register hook_with_zero_step once, before training")
        self.plan = plan
        self._build(metas)
        self.local = make_local(self.local_groups(param_groups))
        self.rules = self._refuse_whole_model_rules()
        return self.local

    def _refuse_whole_model_rules(self) -> sharding.Sharding:
        def refuse(t: torch.Tensor) -> torch.Tensor:
            raise ValueError("this rule needs the whole model's gradients (a global norm, a finiteness check ...), "
                             "but overlap_with_ddp=True steps one DDP bucket at a time: use overlap_with_ddp=False")

        pieces = {id(p): sharding.Pieces((i,), (p.numel(),), (0,)) for i, p in self.stand_ins.items()}
        return sharding.Sharding(pieces, tuple(p.dtype for p in self.params), refuse, every_group=False,
                                 numels=tuple(p.numel() for p in self.params),
                                 shapes=tuple(tuple(p.shape) for p in self.params), whole_params=True)

    def step(self, local: LocalStep, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        """The step ran inside backward: only a closure (which runs backward) is left."""
        if self.local is None:
            raise RuntimeError("overlap_with_ddp=True: register zero.backends.hook_with_zero_step(hook, ddp, "
                               "optimizer) on the DDP model before training; the step then runs inside backward")
        if local.scaling is not None:
            raise ValueError("overlap_with_ddp=True steps inside backward, before a GradScaler can check the "
                             "gradients: use overlap_with_ddp=False with a loss scale (bf16 needs none)")
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def step_bucket(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        """Step the params of one reduced DDP bucket that this rank owns."""
        mine = [(self.stand_ins[i], g) for i, g in zip(indices, grads)
                if i in self.stand_ins and self.params[i].requires_grad]
        if not mine:
            return
        for stand_in, g in mine:
            stand_in.grad = g.view_as(stand_in)
        try:
            self.local.run(self.rules)
        finally:
            for stand_in, _ in mine:
                stand_in.grad = None

    def broadcast(self, indices: list[int]) -> list[Any]:
        """Start sending each trainable param of a bucket from its owner (the interleaved hook)."""
        owner = self.plan.partition.owner
        return [comm.broadcast_from(self.params[i].data, owner[i], self.group, async_op=True)
                for i in indices if self.params[i].requires_grad]

    def end_of_backward(self, synced: bool) -> None:
        """Every bucket is stepped: sync the params (unless the hook already broadcast them)."""
        if self.trainability_changed():
            self.retrain(())
        if not synced:
            self.sync.sync()
        self.local.stepped()

    def retrain(self, metas: Sequence[ParamMeta]) -> None:
        raise ValueError("params were frozen or unfrozen after the comm hook was registered: with "
                         "overlap_with_ddp=True build the optimizer and the hook again")

    def check_extendable(self) -> None:
        raise ValueError("add_param_group with overlap_with_ddp=True: DDP's buckets decide which rank owns each "
                         "param; build the optimizer (and register the hook) with every param group")

    def join_hook(self, step: Callable[[], Any]) -> JoinHook:
        # The comm hook steps and syncs while DDP's join hook shadows the all-reduces.
        return JoinHook()
