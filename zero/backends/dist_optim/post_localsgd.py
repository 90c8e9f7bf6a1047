"""Post-local SGD: step a local optimizer every step, average the model every few steps.

`PostLocalSGDOptimizer` is torch's, plus: the local optimizer may be a sharded one
(`ZeroRedundancyOptimizer` over a subgroup), and DDP's ``post_localSGD_hook`` can be paired
with the averager so that the two cannot disagree about when local SGD starts.

What is averaged: the *parameters* that have a gradient (model weights), across the averager's
group. Optimizer state (momenta, Adam moments) stays local, as in torch; with a sharded local
optimizer each rank's shard of that state stays on it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

from zero.plans.averaging_schedule import hierarchical_level, periodic_due

__all__ = ["PostLocalSGDOptimizer", "register_post_local_sgd_hook", "check_hook_pairing", "replicas_agree"]


def register_post_local_sgd_hook(model: torch.nn.Module, averager: Any, subgroup: Any = None,
                                 post_local_gradient_allreduce: bool = True) -> PostLocalSGDState:
    """Register torch's ``post_localSGD_hook`` on a DDP ``model``, paired with ``averager``.

    The hook all-reduces gradients over the averager's group for ``averager.warmup_steps``
    iterations, then within ``subgroup`` (None: one group per machine, torch's default). Returns
    the hook's state; pass it to `PostLocalSGDOptimizer` as ``hook_state``.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"model must be a DistributedDataParallel, got {type(model).__name__}")
    state = PostLocalSGDState(process_group=averager.process_group, subgroup=subgroup,
                              start_localSGD_iter=averager.warmup_steps,
                              post_local_gradient_allreduce=post_local_gradient_allreduce)
    model.register_comm_hook(state, post_localSGD_hook)
    return state


def check_hook_pairing(hook_state: PostLocalSGDState, averager: Any) -> None:
    """A ``ValueError`` if DDP's hook and the averager disagree about when local SGD starts, or are at
    different points of it (the hook's ``iter`` counts backward passes, the averager's ``step`` steps).
    """
    start, warmup = hook_state.start_localSGD_iter, averager.warmup_steps
    if start != warmup:
        raise ValueError(f"post_localSGD_hook starts local SGD at iteration {start} but the averager's "
                         f"warmup_steps is {warmup}: set PostLocalSGDState(start_localSGD_iter={warmup})")
    hook_local = hook_state.iter >= start  # the next backward reduces within the subgroup
    if averager.step >= warmup and not hook_local:
        raise ValueError(f"the averager is past its warm-up (step {averager.step}) but post_localSGD_hook is "
                         f"still all-reducing globally (iter {hook_state.iter} of {start})")
    if hook_local and averager.step + 1 < warmup:
        raise ValueError(f"post_localSGD_hook has started local SGD (iter {hook_state.iter}) but the averager "
                         f"is still warming up (step {averager.step} of {warmup}): one optimizer step per "
                         "backward pass is what keeps them together")


def replicas_agree(averager: Any) -> bool:
    """Whether every rank of the averager's group holds the same params after the step just taken:
    in warm-up (gradients all-reduced over the group), or right after an average over all of it."""
    last = averager.step - 1
    if last < averager.warmup_steps:
        return True
    periods = getattr(averager, "periods", None)
    if periods is not None:
        return hierarchical_level(last, periods, averager.warmup_steps) == len(periods) - 1
    period = getattr(averager, "period", None)
    return period is not None and periodic_due(last, period, averager.warmup_steps)


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Wrap ``optim`` (any ``torch.optim.Optimizer``, a `zero.functional.Optimizer` or a
    `ZeroRedundancyOptimizer`) and run ``averager`` after each of its steps.

    ``hook_state``: the state of DDP's ``post_localSGD_hook`` when one is registered (see
    `register_post_local_sgd_hook`). It is checked against the averager at construction and at
    every step, and `load_state_dict` moves it to the restored step.
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: Any, *, hook_state: PostLocalSGDState | None = None):
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optim must be a torch.optim.Optimizer, got {type(optim).__name__}")
        if not (callable(getattr(averager, "average_parameters", None)) and hasattr(averager, "step")):
            raise TypeError(f"averager must be a model averager (average_parameters and step), "
                            f"got {type(averager).__name__}")
        if hook_state is not None:
            check_hook_pairing(hook_state, averager)
        # Not Optimizer.__init__: the groups, defaults and state are the local optimizer's own.
        self.optim, self.averager, self.hook_state = optim, averager, hook_state
        self.param_groups = optim.param_groups
        self.defaults = optim.defaults

    @property
    def state(self):  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return f"PostLocalSGDOptimizer({self.optim!r}, {type(self.averager).__name__})"

    def step(self, closure=None):  # type: ignore[override]
        if self.hook_state is not None:
            check_hook_pairing(self.hook_state, self.averager)
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.optim.add_param_group(param_group)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """For a sharded local optimizer: gather its state on rank ``to`` before `state_dict`."""
        if not hasattr(self.optim, "consolidate_state_dict"):
            raise TypeError(f"{type(self.optim).__name__} keeps its whole state; call state_dict() directly")
        self.optim.consolidate_state_dict(to)

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's state dict with the averager's ``"step"``."""
        sd = self.optim.state_dict()
        sd["step"] = self.averager.step
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the local optimizer's state and the averager's step (0, with a warning, if missing)."""
        state_dict = dict(state_dict)
        step = state_dict.pop("step", None)
        self.optim.load_state_dict(state_dict)
        self.restore_step(step)

    def restore_step(self, step: int | None) -> None:
        """Put the averager (and DDP's hook) at a saved ``step`` (0, with a warning, if None)."""
        if step is None:
            warnings.warn("the state dict has no 'step' for the model averager: it restarts at step 0, "
                          "so its warm-up runs again", stacklevel=3)
            step = 0
        self.averager.step = step
        if self.hook_state is not None:
            self.hook_state.iter = min(step, self.hook_state.start_localSGD_iter)
