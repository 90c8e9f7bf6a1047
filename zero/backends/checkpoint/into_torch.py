"""A `zero.functional` rule's checkpoint continued by the ``torch.optim`` class with the same maths
(``zero.functional.adamw -> torch.optim.AdamW``, ``adam -> Adam`` or ``AdamW`` without decay,
``sgd -> SGD``): the other way of `zero.backends.checkpoint.torch_state`. The moments are read under
zero's paths into torch's own state tensors (DCP reshards them into any layout: FSDP2's DTensors,
plain params), the rule's count becomes torch's per-param ``step``, and the saved settings torch's
group settings; torch's ``set_state_dict`` then takes them, and the run goes on as zero's would have.

The class may be stepped by torch itself (`load_into_torch`) or by one of zero's optimizers built
with it (``ZeroRedundancyOptimizer(params, torch.optim.AdamW)``, `from_torch`: `ZeroTorchLoad`)."""

from __future__ import annotations

import os
from typing import Any

import torch

from zero.backends.checkpoint.torch_state import TORCH_RULES, is_torch_state, read_groups, saved_by, state_keys
from zero.backends.precision import MASTER_KEY

__all__ = ["load_into_torch", "is_torch_optimizer", "ZeroTorchLoad", "torch_class_stepped"]

_COUNTS = ("inner_state.0.count", "count")  # the rule's own count, else its injected hyperparameters'


def is_torch_optimizer(optimizer: Any) -> bool:
    """A ``torch.optim`` optimizer, not one of zero's (the drop-in, a `zero.functional.Optimizer`,
    the post-local SGD wrapper around the drop-in)."""
    return isinstance(optimizer, torch.optim.Optimizer) and not type(optimizer).__module__.startswith("zero.")


def load_into_torch(checkpoint_id: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, metadata: Any,
                    group: Any = None) -> None:
    """Load the checkpoint a `zero.functional` rule saved into ``optimizer`` (its torch counterpart),
    or one a ``torch.optim`` optimizer saved, as torch's own functions load it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if is_torch_state(metadata):  # torch's own state: as torch's functions load it
        model_sd, optim_sd = get_state_dict(model, optimizer)
        request = {"model": model_sd, "optim": optim_sd}
        dcp.load(request, checkpoint_id=checkpoint_id, process_group=group)
        return set_state_dict(model, optimizer, model_state_dict=request["model"], optim_state_dict=request["optim"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    load = ZeroTorchLoad(metadata, checkpoint_id, type(optimizer).__name__, optim_sd)
    request = {"model": model_sd, "optim": load.request}
    dcp.load(request, checkpoint_id=checkpoint_id, planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
             process_group=group)
    load.finish()
    set_state_dict(model, optimizer, model_state_dict=request["model"], optim_state_dict=optim_sd)


def torch_class_stepped(optimizer: Any) -> str | None:
    """The ``torch.optim`` class whose maths one of zero's optimizers steps with (``"AdamW"``: built
    with the class, or a `from_torch` rule), else None."""
    from zero.backends.checkpoint.torch_state import local_optimizer
    from zero.backends.local_optimizer import is_functional
    from zero.functional.adapters.torch_rules import torch_class_of

    local = local_optimizer(optimizer)
    if is_functional(local):
        return torch_class_of(local.rule(0))
    return type(local).__name__ if type(local).__module__.startswith("torch.optim") else None


class ZeroTorchLoad:
    """A `zero.functional` rule's saved state requested under its paths for the tensors of
    ``torch.optim.<name>``'s state dict ``optim_sd`` (`request`; checked first, so a refusal comes
    before anything is loaded), then its count and settings written in under torch's names (`finish`)."""

    def __init__(self, metadata: Any, path: Any, name: str, optim_sd: dict):
        rule = next((r for r in TORCH_RULES.values() if r.torch_class == name), None)
        saver = saved_by(metadata, path)
        known = set(rule.state) | set(_COUNTS) if rule is not None else set()
        keys = {k for k in state_keys(metadata) if not k.startswith("hyperparams.")}
        if rule is None or not set(rule.state) <= keys or not keys <= known:
            raise ValueError(f"the checkpoint's optimizer state was saved by {saver}, and torch.optim.{name} loads "
                             "zero's state only from the rule with the same maths, built alone (zero.functional."
                             "adamw into AdamW, adam into Adam or AdamW, sgd into SGD)")
        self.optim_sd, self.name = optim_sd, name
        self.counted = next((c for c in _COUNTS if c in keys), None) if rule.counted else None
        self.counts = {fqn: torch.zeros((), dtype=torch.int32) for fqn in optim_sd["state"]}
        self.request = {"state": {fqn: {**{path_: st[key] for path_, key in rule.state.items() if key in st},
                                        **({self.counted: self.counts[fqn]} if self.counted else {}),
                                        **({MASTER_KEY: st[MASTER_KEY]} if MASTER_KEY in st else {})}
                                  for fqn, st in optim_sd["state"].items()}, "param_groups": []}
        saved, _ = read_groups(metadata, os.fspath(path), len(optim_sd["param_groups"]))
        self.settings = [_torch_settings(s, g, name, k)
                         for k, (s, g) in enumerate(zip(saved, optim_sd["param_groups"]))]

    def finish(self) -> None:
        for fqn, st in self.optim_sd["state"].items():
            if self.counted and "step" in st:
                st["step"] = torch.full_like(st["step"], float(self.counts[fqn]))
        for group_sd, settings in zip(self.optim_sd["param_groups"], self.settings):
            group_sd.update(settings)


def _torch_settings(saved: dict, group: dict, name: str, k: int) -> dict[str, Any]:
    """The rule's saved group settings under torch's names (those the torch group has); one torch's
    class cannot honour is a ``ValueError`` naming it."""
    def refuse(setting: str, why: str) -> None:
        raise ValueError(f"param group {k} of the checkpoint has {setting}={saved[setting]!r}, which "
                         f"torch.optim.{name} does not have ({why}): it cannot continue that run")

    if saved.get("eps_root"):
        refuse("eps_root", "torch adds eps outside the square root only")
    if saved.get("weight_decay") and name in ("Adam", "SGD"):
        refuse("weight_decay", f"zero's rule decays the params decoupled; torch's {name} by L2 in the gradient: "
               "load it into AdamW")
    out: dict[str, Any] = {}
    if name == "AdamW" and "b1" in saved and "weight_decay" not in saved:
        out["weight_decay"] = 0.0  # zero.functional.adam: AdamW without decay
    if saved.get("lr") is not None:
        out["lr"] = float(saved["lr"])
    if saved.get("b1") is not None and saved.get("b2") is not None:
        out["betas"] = (float(saved["b1"]), float(saved["b2"]))
    out.update({k: float(saved[k]) for k in ("eps", "weight_decay", "momentum") if saved.get(k) is not None})
    return {k: v for k, v in out.items() if k in group}
