"""Whose optimizer state a DCP checkpoint holds, and torch's state loaded by the rule with the same maths.

A checkpoint saved with ``torch.optim.AdamW`` (by zero's `save`, or FSDP2's ``dcp.save`` of torch's
``get_state_dict``) holds ``exp_avg``, ``exp_avg_sq`` and ``step`` per param and the groups' ``lr``,
``betas``, ``eps``, ``weight_decay``: the state of ``zero.functional.adamw`` under other names.
`from_torch` loads it into that rule directly (``AdamW -> adamw``, ``Adam -> adam``, ``SGD ->
sgd``): the moments into the rule's ``mu``/``nu`` (or SGD's buffer into its ``trace``), in place
and resharded by DCP as any state is; torch's per-param ``step`` into the rule's count; the saved
settings into the param groups, as torch's ``load_state_dict`` restores them. The run then goes
on as torch's own would. A setting the rule does not have (AMSGrad, ``maximize``, SGD's dampening,
Adam's coupled weight decay) is a ``ValueError`` naming it; so is any other pair of rules, naming
both (`saved_by`, `loading`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from zero.backends.precision import MASTER_KEY

__all__ = ["saved_by", "loading", "from_torch", "TorchLoad", "TORCH_STATE_KEYS", "TORCH_RULES", "read_groups",
           "state_keys", "is_torch_state", "local_optimizer"]

# per-param state keys torch.optim's classes save (a checkpoint holding these is torch.optim's)
TORCH_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                              "acc_delta", "sum", "exp_inf", "mu_product", "ax", "eta", "prev", "step_size",
                              "grad_avg"})


@dataclass(frozen=True)
class _Rule:
    """How a ``torch.optim`` class's state is a `zero.functional` rule's: state keys (the rule's
    path -> torch's), whether torch's ``step`` is the rule's count, and the settings."""

    torch_class: str
    state: dict[str, str]
    counted: bool


TORCH_RULES = {
    "zero.functional.adamw": _Rule("AdamW", {"inner_state.0.mu": "exp_avg", "inner_state.0.nu": "exp_avg_sq"}, True),
    "zero.functional.adam": _Rule("Adam", {"inner_state.0.mu": "exp_avg", "inner_state.0.nu": "exp_avg_sq"}, True),
    "zero.functional.sgd": _Rule("SGD", {"inner_state.0.trace": "momentum_buffer"}, False),
}


def state_keys(metadata: Any) -> set[str]:
    """The optimizer's per-param state keys in a checkpoint (their last dotted parts after the FQN
    are not known without the model: a torch key is one word, a zero.functional path several)."""
    params = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
    keys = set()
    for k in metadata.state_dict_metadata:
        if k.startswith("optim.state."):
            rest = k.removeprefix("optim.state.")
            fqn = max((p for p in params if rest.startswith(p + ".")), key=len, default=None)
            keys.add(rest[len(fqn) + 1:] if fqn else rest.rsplit(".", 1)[-1])
    return keys - {MASTER_KEY}


def _settings(metadata: Any) -> set[str]:
    """The param groups' setting names a checkpoint holds (``optim.param_groups.<k>.<name>``)."""
    out = set()
    for k in metadata.state_dict_metadata:
        if k.startswith("optim.param_groups."):
            parts = k.split(".")
            if len(parts) > 3 and parts[3] != "params":
                out.add(parts[3])
    return out


def is_torch_state(metadata: Any) -> bool:
    keys = state_keys(metadata)
    return bool(keys) and keys <= TORCH_STATE_KEYS


def saved_by(metadata: Any, path: str | os.PathLike | None = None) -> str:
    """The optimizer that saved a checkpoint, as its state and settings tell (``torch.optim.AdamW
    (exp_avg, exp_avg_sq, step)``; ``a zero.functional rule (inner_state.0.mu, ...)``)."""
    keys = sorted(state_keys(metadata))
    if not keys:
        return "an optimizer that kept no state (or none was saved)"
    shown = ", ".join(keys[:6]) + (", ..." if len(keys) > 6 else "")
    if set(keys) <= TORCH_STATE_KEYS:
        return f"{_torch_class(metadata, path)} (state {shown})"
    return f"a zero.functional rule (state {shown})"


def _torch_class(metadata: Any, path: str | os.PathLike | None) -> str:
    """The ``torch.optim`` class whose constructor's options best match the saved settings."""
    from zero.backends.local_optimizer import saved_by_settings

    group = dict.fromkeys(_settings(metadata))
    if "decoupled_weight_decay" in group and path is not None:
        group["decoupled_weight_decay"] = _read_setting(metadata, path, "decoupled_weight_decay")
    return saved_by_settings(group)


def _read_setting(metadata: Any, path: str | os.PathLike, name: str) -> Any:
    """Group 0's setting ``name``, read from the checkpoint alone (no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    key = next((k for k in metadata.state_dict_metadata if k.startswith("optim.param_groups.")
                and k.endswith("." + name)), None)
    if key is None:
        return None
    box = {key: None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(box, checkpoint_id=os.fspath(path), no_dist=True)
    return box[key]


def loading(optimizer: Any) -> str:
    """The rule a sharded optimizer steps with, named as it was built."""
    from zero.backends.local_optimizer import is_functional
    from zero.functional.adapters.group_settings import rule_name

    optim = local_optimizer(optimizer)
    if is_functional(optim):
        return rule_name(optim.rule(0))
    return f"{type(optim).__module__.split('.')[0]}.optim.{type(optim).__name__}" \
        if type(optim).__module__.startswith("torch.optim") else type(optim).__qualname__


def local_optimizer(optimizer: Any) -> Any:
    """The optimizer that steps the rule: a ZeroRedundancyOptimizer's local one, or itself (a
    `zero.functional.Optimizer` over FSDP2's params)."""
    state = getattr(optimizer, "rank_state", None)
    return optimizer if state is None else state.optim


class TorchLoad:
    """A torch.optim checkpoint's state requested under torch's names for a `zero.functional`
    rule's own tensors (`request`), its settings and steps read and checked first (so that a
    refusal comes before anything is loaded, on every rank alike), then written in (`finish`)."""

    def __init__(self, rule: _Rule, name: str, optim_sd: dict, metadata: Any, path: str | os.PathLike):
        self.rule, self.name, self.optim_sd = rule, name, optim_sd
        state: dict[str, dict] = {}
        for fqn, mine in optim_sd["state"].items():
            state[fqn] = {key: mine[p] for p, key in rule.state.items() if p in mine}
            if MASTER_KEY in mine:
                state[fqn][MASTER_KEY] = mine[MASTER_KEY]
        self.request = {"state": state, "param_groups": []}
        self._check_paths(optim_sd)
        groups, steps = read_groups(metadata, path, len(optim_sd["param_groups"]))
        self.settings = []
        for k, (group, saved) in enumerate(zip(optim_sd["param_groups"], groups)):
            if saved.get("params") is not None and list(saved["params"]) != list(group["params"]):
                raise ValueError(f"param group {k} of the checkpoint holds {list(saved['params'])[:6]}, this "
                                 f"optimizer's {list(group['params'])[:6]}: build the optimizer with the same groups")
            self.settings.append(_settings_for(rule, name, saved, group, k))
        self.steps = _one_step_a_group(rule, name, optim_sd, steps) if rule.counted else None

    def _check_paths(self, optim_sd: dict) -> None:
        """Every tensor of the rule's state has its torch counterpart (a chain around the rule,
        a schedule's state, would have more)."""
        known = set(self.rule.state) | {"count", "inner_state.0.count", MASTER_KEY}
        for fqn, mine in optim_sd["state"].items():
            extra = sorted(k for k in mine if k not in known and not k.startswith("hyperparams."))
            if extra:
                raise ValueError(f"the checkpoint holds torch.optim.{self.rule.torch_class}'s state, which loads into "
                                 f"{self.name} as built by its alias; this one keeps {extra} for {fqn!r} too (a chain "
                                 "around it, or a schedule's state): build the alias alone, or convert the checkpoint")

    def finish(self) -> None:
        """After the load: torch's steps into the rule's counts, its settings into the groups and
        the hyperparameters the state keeps."""
        sd = self.optim_sd
        for k, (group, settings) in enumerate(zip(sd["param_groups"], self.settings)):
            group.update(settings)
            for fqn in group["params"]:
                mine = sd["state"].get(fqn, {})
                for hp, value in settings.items():
                    leaf = mine.get(f"hyperparams.{'learning_rate' if hp == 'lr' else hp}")
                    if isinstance(leaf, torch.Tensor):
                        leaf.fill_(value)
                for key in ("count", "inner_state.0.count") if self.steps is not None else ():
                    if isinstance(mine.get(key), torch.Tensor):
                        mine[key].fill_(self.steps[k])


def read_groups(metadata: Any, path: str | os.PathLike, n: int) -> tuple[list[dict], dict[str, float]]:
    """Each of the first ``n`` groups' saved settings (``params`` too), and every param's ``step``,
    read from the checkpoint alone, by every rank alike."""
    import warnings

    import torch.distributed.checkpoint as dcp

    saved = metadata.state_dict_metadata
    box: dict[str, Any] = {}
    for key in saved:
        parts = key.split(".")
        if key.startswith("optim.param_groups.") and len(parts) == 4 and int(parts[2]) < n:
            box[key] = None
        elif key.startswith("optim.state.") and key.endswith(".step") and hasattr(saved[key], "chunks"):
            box[key] = torch.zeros(tuple(saved[key].size), dtype=saved[key].properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(box, checkpoint_id=os.fspath(path), no_dist=True)
    groups = [{k.split(".")[3]: v for k, v in box.items() if k.startswith(f"optim.param_groups.{g}.")}
              for g in range(n)]
    steps = {k.removeprefix("optim.state.").removesuffix(".step"): float(v) for k, v in box.items()
             if k.startswith("optim.state.")}
    return groups, steps


def _one_step_a_group(rule: _Rule, name: str, optim_sd: dict, steps: dict[str, float]) -> list[int]:
    """torch's step of each group's params, which must agree: the rule keeps one count for the
    params it steps together (a frozen param, saved without state, has none)."""
    out = []
    for k, group in enumerate(optim_sd["param_groups"]):
        seen = {fqn: steps[fqn] for fqn in group["params"] if fqn in steps}
        if len(set(seen.values())) > 1:
            (a, x), (b, y) = sorted(seen.items(), key=lambda item: item[1])[::len(seen) - 1]
            raise ValueError(f"torch.optim.{rule.torch_class} kept a step per param, and in param group {k} they "
                             f"differ ({a!r} at step {x:g}, {b!r} at {y:g}); {name} keeps one count for the params "
                             "it steps together: they cannot load into it")
        out.append(int(next(iter(seen.values()), 0)))
    return out


def _settings_for(rule: _Rule, name: str, saved: dict, group: dict, k: int) -> dict[str, Any]:
    """torch's saved settings of group ``k`` as the rule's group keys; those it cannot honour refused."""
    def refuse(setting: str, value: Any, why: str) -> None:
        raise ValueError(f"param group {k} of the checkpoint (torch.optim.{rule.torch_class}) has {setting}={value!r}, "
                         f"which {name} does not have ({why}): it cannot continue that run")

    for setting, off in (("amsgrad", False), ("maximize", False), ("dampening", 0)):
        if saved.get(setting, off) not in (off, None):
            refuse(setting, saved[setting], "its maths has no such option")
    if rule.torch_class == "Adam" and saved.get("weight_decay"):
        refuse("weight_decay", saved["weight_decay"], "torch's Adam decays by L2 in the gradient; load it into "
               "a ZeroRedundancyOptimizer stepping torch.optim.Adam")
    if rule.torch_class == "SGD" and saved.get("weight_decay"):
        refuse("weight_decay", saved["weight_decay"], "torch's SGD decays by L2 in the gradient")
    out: dict[str, Any] = {"lr": float(saved["lr"])} if saved.get("lr") is not None else {}
    if rule.torch_class in ("Adam", "AdamW") and saved.get("betas") is not None:
        out["b1"], out["b2"] = map(float, saved["betas"])
    if rule.torch_class in ("Adam", "AdamW"):
        out.update({k: float(saved[k]) for k in ("eps", "weight_decay") if saved.get(k) is not None and k in group})
        out["eps_root"] = 0.0
    if rule.torch_class == "SGD":
        momentum = float(saved.get("momentum") or 0.0)
        if ("momentum" in group) != (momentum != 0.0):
            refuse("momentum", momentum, f"built with momentum={group.get('momentum')}: build it with the "
                   "checkpoint's momentum")
        if "momentum" in group:
            out["momentum"] = momentum
        if saved.get("nesterov") is not None and bool(saved["nesterov"]) != _nesterov(group):
            refuse("nesterov", saved["nesterov"], "built with the other nesterov, a setting fixed when it is built")
    return {key: value for key, value in out.items() if key in group}


def _nesterov(group: dict) -> bool:
    return bool(group.get("nesterov", False))


def _matches(saver: str, rule: _Rule) -> bool:
    if saver.startswith(f"torch.optim.{rule.torch_class} "):
        return True  # torch before 2.6 saved no decoupled_weight_decay: its Adam and AdamW look alike
    return rule.torch_class in ("Adam", "AdamW") and saver.startswith("torch.optim.Adam or torch.optim.AdamW ")


def from_torch(metadata: Any, path: str | os.PathLike, optimizer: Any, optim_sd: dict) -> TorchLoad | None:
    """The load of a torch.optim checkpoint into a `zero.functional` rule with the same maths, or
    None when there is nothing to translate (not torch's state, or not a functional rule). A
    functional rule without a torch counterpart is a ``ValueError`` naming both."""
    from zero.backends.local_optimizer import is_functional
    from zero.functional.adapters.torch_rules import torch_class_of

    local = local_optimizer(optimizer)
    if not is_torch_state(metadata) or not is_functional(local) or torch_class_of(local.rule(0)) is not None:
        return None  # (a from_torch rule keeps torch's names itself: its state loads as it is)
    name = loading(optimizer)
    rule = TORCH_RULES.get(name)
    saver = saved_by(metadata, path)
    if rule is None or not _matches(saver, rule):
        raise ValueError(f"the checkpoint's optimizer state was saved by {saver}, and this optimizer steps {name}: "
                         "torch.optim's state loads directly into the rule with the same maths only (torch.optim."
                         "AdamW into zero.functional.adamw, Adam into adam, SGD into sgd)")
    return TorchLoad(rule, name, optim_sd, metadata, path)
