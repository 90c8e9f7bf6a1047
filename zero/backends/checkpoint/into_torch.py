"""A `zero.functional` rule's checkpoint continued by the ``torch.optim`` class with the same maths
(``zero.functional.adamw -> torch.optim.AdamW``, ``adam -> Adam``, ``sgd -> SGD``): the other way of
`zero.backends.checkpoint.torch_state`. The moments are read under zero's paths into torch's own
state tensors (DCP reshards them into any layout: FSDP2's DTensors, plain params), the rule's count
becomes torch's per-param ``step``, and the saved settings torch's group settings; torch's
``set_state_dict`` then takes them, and the run goes on as zero's would have."""

from __future__ import annotations

import os
from typing import Any

import torch

from zero.backends.checkpoint.torch_state import TORCH_RULES, is_torch_state, read_groups, saved_by, state_keys

__all__ = ["load_into_torch", "is_torch_optimizer"]

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
    name = type(optimizer).__name__
    rule = next((r for r in TORCH_RULES.values() if r.torch_class == name), None)
    saver = saved_by(metadata, checkpoint_id)
    known = set(rule.state) | set(_COUNTS) if rule is not None else set()
    keys = {k for k in state_keys(metadata) if not k.startswith("hyperparams.")}
    if rule is None or not set(rule.state) <= keys or not keys <= known:
        raise ValueError(f"the checkpoint's optimizer state was saved by {saver}, and torch.optim.{name} loads zero's "
                         "state only from the rule with the same maths, built alone (zero.functional.adamw into "
                         "AdamW, adam into Adam, sgd into SGD)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    counted = next((c for c in _COUNTS if c in keys), None) if rule.counted else None
    counts = {fqn: torch.zeros((), dtype=torch.int32) for fqn in optim_sd["state"]}
    request = {"model": model_sd, "optim": {"state": {
        fqn: {**{path: st[key] for path, key in rule.state.items()}, **({counted: counts[fqn]} if counted else {})}
        for fqn, st in optim_sd["state"].items()}}}
    dcp.load(request, checkpoint_id=checkpoint_id, planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
             process_group=group)
    for fqn, st in optim_sd["state"].items():
        if counted and "step" in st:
            st["step"] = torch.full_like(st["step"], float(counts[fqn]))
    saved, _ = read_groups(metadata, os.fspath(checkpoint_id), len(optim_sd["param_groups"]))
    for group_sd, settings in zip(optim_sd["param_groups"], saved):
        group_sd.update(_torch_settings(settings, group_sd))
    set_state_dict(model, optimizer, model_state_dict=request["model"], optim_state_dict=optim_sd)


def _torch_settings(saved: dict, group: dict) -> dict[str, Any]:
    """The rule's saved group settings under torch's names (those the torch group has)."""
    out: dict[str, Any] = {}
    if saved.get("lr") is not None:
        out["lr"] = float(saved["lr"])
    if saved.get("b1") is not None and saved.get("b2") is not None:
        out["betas"] = (float(saved["b1"]), float(saved["b2"]))
    out.update({k: float(saved[k]) for k in ("eps", "weight_decay", "momentum") if saved.get(k) is not None})
    return {k: v for k, v in out.items() if k in group}
