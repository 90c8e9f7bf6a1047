"""``overlap_with_ddp=True``: the step runs inside DDP's comm hook (`zero.backends.ddp_hooks`), bucket
by bucket, while backward goes on; ``step()`` in the loop is then a no-op.

Ownership is per param, planned from DDP's bucket layout when the hook is made (`attach`), before
the first backward, so the first iteration already updates the params. The local optimizer
steps stand-ins sharing the params' storage, so DDP's and autograd's ``.grad`` stay untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.join import JoinHook

from zero.backends import clipping, comm
from zero.backends.modes.base import Begin, build_sharding, local_groups
from zero.backends.modes.whole import WholeParams
from zero.backends.nonfinite import where
from zero.functional import sharding
from zero.functional.adapters.nonfinite import NonFinite, all_finite, message
from zero.plans.ddp_buckets import ddp_bucket_partition
from zero.plans.holdings import LocalTensor
from zero.plans.meta import ParamMeta, param_metas

__all__ = ["DDPOverlap"]


class DDPOverlap(WholeParams):
    """Whole params owned by DDP's buckets, each stepped by its owner as soon as its bucket is reduced."""

    overlaps_ddp = True

    attached = False  # set by `attach`: the hook steps the rank state's local optimizer

    def tensor(self, t: LocalTensor) -> torch.Tensor:
        return self.stand_ins[t.param]

    nonfinite: NonFinite | None = None  # set by `attach`: the optimizer's handling of NaN and inf
    _bad: set[int] = set()  # params whose reduced gradient held NaN or inf in this backward

    def attach(self, bucket_cap_mb: float, shard_buckets: bool, nonfinite: NonFinite | None = None) -> None:
        """Own params by DDP's buckets (planned before the first backward) and step them inside the
        hook, with a local optimizer built for that ownership (`zero.backends.ddp_hooks`)."""
        if self.attached:
            raise ValueError("this optimizer is already stepping inside a DDP comm hook (or has stepped): "
                             "register hook_with_zero_step once, before training")
        metas = param_metas(self.state.param_groups)
        partition = ddp_bucket_partition(metas, self.state.world_size, bucket_cap_mb, shard_buckets)
        self.state.replan(self.plan.with_partition(partition))
        self._build(metas)
        self.state.build(local_groups(self.state, self.tensor), per_param=True)
        self.attached, self.nonfinite, self._bad = True, nonfinite, set()
        clipping.register(self, [p for p in self.params if p.requires_grad])

    def held_grads(self) -> None:
        """Clipping: an error, since each bucket was stepped inside backward, before a clip could run."""
        raise ValueError("overlap_with_ddp=True steps each DDP bucket inside backward, so the step has used the "
                         "gradients before they can be clipped: use overlap_with_ddp=False to clip")

    def _made_sharding(self) -> sharding.Sharding:
        """The stand-ins (made here: after the sync has placed the params' storage, which they
        share), and a sharding that refuses whole-model quantities (one bucket steps at a time)."""
        self.stand_ins = {i: self.params[i].detach() for i in self.plan.partition.params_of(self.state.rank)}

        def refuse(t: torch.Tensor) -> torch.Tensor:
            raise ValueError("this rule needs the whole model's gradients (a global norm, a finiteness check ...), "
                             "but overlap_with_ddp=True steps one DDP bucket at a time: use overlap_with_ddp=False")

        return build_sharding(self.state, self.tensor, refuse, refuse, every_group=False)

    def step(self, closure: Callable[[], float] | None, kwargs: dict, begin: Begin) -> Any:
        """The step ran inside backward: only a closure (which runs backward) is left."""
        if not self.attached:
            raise RuntimeError("overlap_with_ddp=True: register zero.backends.hook_with_zero_step(hook, ddp, "
                               "optimizer) on the DDP model before training; the step then runs inside backward")
        if self.state.scaling is not None:
            raise ValueError("overlap_with_ddp=True steps inside backward, before a GradScaler can check the "
                             "gradients: use overlap_with_ddp=False with a loss scale (bf16 needs none)")
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def step_bucket(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        """Step the params of one reduced DDP bucket that this rank owns. Every rank checks the
        whole bucket for NaN and inf (it holds all of it), so every rank finds the same params."""
        if self.nonfinite is not None and self.state.scaling is None and not comm.is_fake(self.state.process_group) \
                and not all_finite(grads):
            self._bad.update(i for i, g in zip(indices, grads) if not all_finite([g]))
        mine = [(self.stand_ins[i], g) for i, g in zip(indices, grads)
                if i in self.stand_ins and self.params[i].requires_grad]
        if not mine:
            return
        for stand_in, g in mine:
            stand_in.grad = g.view_as(stand_in)
        try:
            self.state.run(self.sharding)
        finally:
            for stand_in, _ in mine:
                stand_in.grad = None

    def broadcast(self, indices: list[int]) -> list[Any]:
        """Start sending each trainable param of a bucket from its owner (the interleaved hook)."""
        owner = self.plan.partition.owner
        return [comm.broadcast_from(self.params[i].data, owner[i], self.state.process_group, async_op=True)
                for i in indices if self.params[i].requires_grad]

    def end_of_backward(self, synced: bool) -> None:
        """Every bucket is stepped: sync the params (unless the hook already broadcast them)."""
        if self.trainability_changed():
            self.retrain([])
        if not synced:
            self.sync.sync()
        self.state.stepped()
        bad, self._bad = sorted(self._bad), set()
        if bad:  # every rank alike: raised (or warned) after the buckets it could not hold back
            text = message(self.state.steps, [self.plan.metas[i].name for i in bad], where(None, False),
                           self.nonfinite.policy)
            self.nonfinite.report(text.replace("nothing was stepped", "raised at the end of backward, its buckets "
                                               "stepped already (overlap_with_ddp steps them as they arrive)"))

    def retrain(self, metas: list[ParamMeta]) -> None:
        raise ValueError("params were frozen or unfrozen after the comm hook was registered: with "
                         "overlap_with_ddp=True build the optimizer and the hook again")

    def check_extendable(self) -> None:
        raise ValueError("add_param_group with overlap_with_ddp=True: DDP's buckets decide which rank owns each "
                         "param; build the optimizer (and register the hook) with every param group")

    def join_hook(self, step: Callable[[], Any]) -> JoinHook:
        # The comm hook steps and syncs while DDP's join hook shadows the all-reduces.
        return JoinHook()
