"""`RankState`: what this rank holds of a sharded optimizer, as one public object.

A `ZeroRedundancyOptimizer` is three things wired together: a `zero.Plan`, the executor of it
(`zero.backends.modes`: live buffers, gradients, syncs) and this, the rank's holdings and its local
step. ``optimizer.rank_state`` is the one place that says what a rank holds: the params and their
groups, the plan and what it gives this rank (`zero.plans.holdings`), the local optimizer over
those tensors with its master copies, and the moves between them: settings to and from the
local optimizer, gradients into the masters and the stepped masters back into the live tensors,
and the local state dict. The state formats (`zero.backends.checkpoint`), the grad scaler and the
DDP hooks read it; none of them reads a private attribute of the optimizer or its executor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zero.backends import comm
from zero.backends.local_optimizer import choose_foreach, copy_hyperparams, is_functional, per_element_keys
from zero.backends.precision import MASTER_KEY, Masters, Scaling
from zero.functional import sharding
from zero.plans.holdings import Holdings, holdings
from zero.plans.local_step import foreach_groups
from zero.plans.plan import Plan

__all__ = ["RankState"]

_NOT_SETTINGS = ("params", "param_names")

# groups (this rank's tensors, one dict per param group), per_param -> the local optimizer
MakeOptimizer = Callable[[list[dict], bool], torch.optim.Optimizer]


class RankState:
    """What this rank holds, and its local step.

    Attributes:
        params: every param of the optimizer, in ``param_groups`` order (param ``i`` is global
            index ``i`` in state dicts and plans).
        param_groups: the optimizer's groups: the truth users and lr schedulers write.
        plan, holdings: the `zero.Plan` executed, and what it gives this rank
            (`zero.plans.holdings.Holdings`: the local optimizer's tensors, the pieces in them).
        optim: the local optimizer, over the tensors ``holdings.tensors`` describes (the executor
            gives them: owned params, flat shards, stand-ins); ``masters``: its master copies.
        steps: the steps every rank agreed to take.
        rank, world_size, process_group: where this rank is.
        scaling: the loss scale's part in the step being taken (None without a ``GradScaler``);
        agreed_found_inf: the flag every rank agreed on in the last step a scaler drove.
    """

    def __init__(self, params: list[torch.Tensor], param_groups: list[dict], plan: Plan, rank: int, group: Any,
                 make_optimizer: MakeOptimizer, master_dtype: torch.dtype | None):
        self.params, self.param_groups = params, param_groups
        self.rank, self.world_size, self.process_group = rank, plan.world_size, group
        # a simulated rank's tensors have no data to compare with their masters: that check steps aside
        self.make_optimizer, self.masters = make_optimizer, Masters(master_dtype, check=not comm.is_fake(group))
        self.optim: torch.optim.Optimizer | None = None
        self.steps = 0
        self.sharding: sharding.Sharding | None = None  # answers a rule's whole-tensor questions
        self.scaling: Scaling | None = None
        self.agreed_found_inf: torch.Tensor | None = None
        self.skipping = False  # every rank agreed to skip this step (non-finite gradients, nonfinite="skip")
        self._scaler_agrees = False
        self.replan(plan)

    def replan(self, plan: Plan) -> None:
        """Hold what ``plan`` gives this rank from now on (its executor follows it)."""
        self.plan, self.holdings = plan, holdings(plan, self.rank, len(self.param_groups))
        # the local groups the plan gives torch's foreach step on the CPU (on CUDA it is torch's own choice)
        self.foreach = frozenset(k for k, (device, _) in foreach_groups(plan, self.holdings).items()
                                 if device.startswith("cpu"))

    def build(self, groups: list[dict], per_param: bool = False) -> None:
        """(Re)build the local optimizer over ``groups`` (this rank's tensors, one dict per param
        group), each tensor replaced by its master where it has one (`Masters.wrap`)."""
        self.masters = Masters(self.masters.dtype, self.masters.check)
        self.optim = self.make_optimizer(self.masters.wrap(groups, self.frozen()), per_param)
        self.pull()

    def add_group(self, group: dict) -> None:
        """A new group for the local optimizer (its tensors get masters as the first ones did)."""
        self.optim.add_param_group(self.masters.wrap([group], self.frozen())[0])
        self.pull()

    def adopt_unfrozen(self) -> None:
        """Give a master to each tensor unfrozen since the local optimizer was built."""
        self.masters.adopt(self.optim, self.frozen())

    def frozen(self) -> set[int]:
        return {id(p) for p in self.params if not p.requires_grad}

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def comm_device(self) -> torch.device:
        """Where tensors for this rank's collectives live (the CPU under gloo)."""
        return comm.device_for(self.process_group, self.device)

    # -- settings: the outer groups are the truth ------------------------------------------------

    def push(self) -> None:
        """Copy the outer groups' settings into the local optimizer's (before it reads them); on
        the CPU torch's foreach step where the user left ``foreach`` to torch and its numbers are
        the for-loop's bits (`zero.backends.local_optimizer.choose_foreach`)."""
        copy_hyperparams(self.param_groups, self.optim.param_groups)
        self._chose_foreach = choose_foreach(self.optim, self.foreach)

    _chose_foreach = False  # the local groups' foreach=True is zero's choice, not the user's setting

    def pull(self) -> None:
        """Bring back the settings the local optimizer fills in (when built, loaded or stepped)."""
        copy_hyperparams(self.optim.param_groups, self.param_groups, ("foreach",) if self._chose_foreach else ())

    def stepped(self) -> None:
        """Count a step every rank agreed to take, and bring back the settings the local optimizer
        wrote into its groups while stepping (as torch's ZeRO does after each step)."""
        self.steps += 1
        self.pull()

    def settings(self) -> list[dict]:
        """The local optimizer's group settings now, to run one step in pieces (`rewind`)."""
        return [{k: v for k, v in g.items() if k not in _NOT_SETTINGS} for g in self.optim.param_groups]

    def rewind(self, settings: list[dict]) -> None:
        """Put back the group settings taken before a step's first piece: a step run buffer by
        buffer then writes its groups once (an optimizer that counts its steps in a group counts
        one per step, not one per buffer)."""
        for group, saved in zip(self.optim.param_groups, settings):
            for key in [k for k in group if k not in saved and k not in _NOT_SETTINGS]:
                del group[key]
            group.update(saved)

    # -- the local step ------------------------------------------------------------------------

    def with_loss(self, kwargs: dict, loss: Any) -> dict:
        """``kwargs`` of the local step given the loss of a closure run before it (a rule that reads
        the loss, MoMo's, gets it as ``value=``, as the local optimizer's own closure would pass it)."""
        if loss is None or not is_functional(self.optim) or "value" in kwargs:
            return kwargs
        return {**kwargs, "value": loss.detach() if isinstance(loss, torch.Tensor) else loss}

    def run(self, sharded: sharding.Sharding, closure: Any = None, grads: dict | None = None, **kwargs: Any) -> Any:
        """One step of the local optimizer; ``sharded`` answers a `zero.functional` rule's questions
        about whole tensors (global norms ...), since the local tensors are pieces of the model.

        With masters, the gradients are cast up into them first (after the closure, which makes
        the gradients), and the stepped masters are rounded into their tensors after. ``grads``:
        gradients wider than their tensor's dtype, by ``id(tensor)``, for its master."""
        loss = None
        if closure is not None and self.masters.dtype is not None:
            with torch.enable_grad():
                loss, closure = closure(), None
            kwargs = self.with_loss(kwargs, loss)
        pairs = self.masters.grads_in(self.optim, grads or {})
        if self.skipping or not self._finite(sharded):
            self.masters.release(pairs)
            return loss
        installed = sharding.installed(self.masters.keyed(sharded)) if is_functional(self.optim) \
            else contextlib.nullcontext()
        try:
            with installed:
                if closure is None:
                    out = self.optim.step(**kwargs)
                else:
                    with torch.enable_grad():
                        out = self.optim.step(closure=closure, **kwargs)
        finally:
            self.masters.release(pairs)
        self.masters.write_back(pairs)
        return loss if loss is not None else out

    def answering(self) -> contextlib.AbstractContextManager:
        """The executor's `sharding.Sharding` installed, outside a step: a `zero.functional` state
        started to load a checkpoint into is laid out as a step would lay it out (a low-bit rule's
        quantized or full-precision moments, decided by the whole params)."""
        if self.sharding is None or not is_functional(self.optim):
            return contextlib.nullcontext()
        return sharding.installed(self.masters.keyed(self.sharding))

    def _finite(self, sharded: sharding.Sharding) -> bool:
        """Without a loss scale, True; with one, unscale what steps and agree that it is finite."""
        if self.scaling is None:
            return True
        grads = [p.grad for g in self.optim.param_groups for p in g["params"] if p.grad is not None]
        device = next((p.device for g in self.optim.param_groups for p in g["params"]), torch.device("cpu"))
        return self.scaling.unscale_and_agree(grads, sharded.reduce, device)

    @contextlib.contextmanager
    def scaled(self, scaling: Scaling | None) -> Iterator[None]:
        """Inside the block the step is driven by a loss scale; ``agreed_found_inf`` is its flag after."""
        self.scaling = scaling
        try:
            yield
        finally:
            self.scaling = None
            self.agreed_found_inf = None if scaling is None else scaling.found_inf

    @contextlib.contextmanager
    def scaler_agrees(self) -> Iterator[None]:
        """Inside the block a scaler that follows the agreed flag drives the step
        (`zero.backends.ShardedGradScaler`)."""
        self._scaler_agrees = True
        try:
            yield
        finally:
            self._scaler_agrees = False

    @property
    def scaler_follows_agreement(self) -> bool:
        return self._scaler_agrees

    # -- the local state dict -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """The local optimizer's state dict, each master under `MASTER_KEY` of its tensor's state."""
        return self.masters.add_to(self.optim.state_dict(), self.optim, always=is_functional(self.optim))

    def load_state_dict(self, local: dict) -> None:
        """Load a local state dict (masters included) into the local optimizer."""
        self.optim.load_state_dict(self.masters.take_from(local, self.optim))
        self.pull()

    def per_element_keys(self) -> set[str] | None:
        """The local state's keys shaped like their tensor (the masters included); None when the
        local optimizer cannot tell (a `zero.functional` one: then every tensor with dimensions)."""
        keys = per_element_keys(self.optim)
        return None if keys is None else keys | {MASTER_KEY}

    def trainable_locals(self) -> set[int]:
        """The local tensors (positions across the local optimizer's groups) that hold trainable params."""
        return {h.local for h in self.holdings.held if self.params[h.param].requires_grad}

    def holdings_of(self, rank: int) -> Holdings:
        """What ``rank`` holds under the same plan (for merging every rank's local state)."""
        return self.holdings if rank == self.rank else holdings(self.plan, rank, len(self.param_groups))
