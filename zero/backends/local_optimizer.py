"""The local optimizer of a rank: which groups it gets, what it is, and what its state looks like.

The local optimizer is whatever the user named: a ``torch.optim.Optimizer`` class, or a
`zero.functional` transformation (or factory), run through `zero.functional.Optimizer`. Its groups
are every param group's settings with the tensors this rank steps (`local_groups`, read from the
plan's `zero.plans.holdings`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

import torch

from zero.functional import GradientTransformation, Optimizer
from zero.functional.adapters.group_settings import check_not_optax, from_factory
from zero.functional.adapters.torch_rules import TORCH_CLASSES, from_torch
from zero.plans.holdings import Holdings, LocalTensor

__all__ = ["make_local_optimizer", "rule_of", "local_groups", "copy_hyperparams", "choose_foreach", "is_functional",
           "check_state_keys",
           "per_element_keys", "check_shardable", "initial_state", "state_nbytes", "is_per_element",
           "saved_by_settings", "mentions", "opaque_optax", "check_one_rank_steps_all"]


def make_local_optimizer(optimizer_class: Any, groups: list[dict], defaults: dict,
                         per_param: bool = False) -> torch.optim.Optimizer:
    """Build the local optimizer over ``groups`` (this rank's share of every param group).

    ``optimizer_class`` is a ``torch.optim.Optimizer`` subclass (built with ``**defaults``), or
    what `rule_of` makes a `zero.functional` rule of, run by `zero.functional.Optimizer`.
    ``per_param``: a transformation steps the params in changing sets (see
    `zero.functional.FunctionalOptimizer`).
    """
    check_not_optax(optimizer_class, "optimizer_class")
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer):
        return optimizer_class(groups, **defaults)
    return Optimizer(groups, rule_of(optimizer_class, defaults), per_param=per_param)


def rule_of(optimizer_class: Any, defaults: dict) -> GradientTransformation:
    """The `zero.functional` rule ``optimizer_class`` with ``defaults`` names: a
    `GradientTransformation` as it is (``defaults`` must be empty); a factory such as
    ``zero.functional.adam`` built with ``**defaults`` into exactly what the built transformation
    gives (`zero.functional.adapters.group_settings.from_factory`), so each group's values (``lr``
    for ``learning_rate``) and lr schedulers reach it; a ``torch.optim`` class as
    `zero.functional.from_torch` mirrors it (torch's names and group keys kept), where zero steps
    the rule itself (over FSDP2's params)."""
    check_not_optax(optimizer_class, "optimizer_class")
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer):
        if optimizer_class.__name__ not in TORCH_CLASSES or getattr(torch.optim, optimizer_class.__name__, None) \
                is not optimizer_class:
            raise TypeError(f"{optimizer_class.__module__}.{optimizer_class.__qualname__} is stepped here as "
                            "zero.functional.from_torch mirrors it, which knows torch's classes "
                            f"{sorted(TORCH_CLASSES)}: use one of them or a zero.functional rule")
        return from_torch(optimizer_class.__name__, **defaults)
    if isinstance(optimizer_class, GradientTransformation):
        if defaults:
            raise TypeError(f"optimizer_class is a GradientTransformation, so it takes no keyword "
                            f"hyperparameters; got {sorted(defaults)}")
        return optimizer_class
    if callable(optimizer_class) and not isinstance(optimizer_class, type):
        return from_factory(optimizer_class, defaults)
    raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass or a zero.functional "
                    f"transformation or factory, got {optimizer_class!r}")


def is_functional(optim: torch.optim.Optimizer) -> bool:
    return isinstance(optim, Optimizer)


def local_groups(param_groups: list[dict], held: Holdings, tensor_of: Callable[[LocalTensor], torch.Tensor],
                 named: bool = True) -> list[dict]:
    """The local optimizer's groups: every global group's settings, with the tensors this rank
    steps (``tensor_of`` each of ``held.tensors``, in order).

    Every rank gets every group, possibly empty, so group ``k`` means the same on all ranks.
    With ``named``, a group of named params keeps the names of what it holds (transformations
    step them by name): a whole param its own, this rank's shard of flat buffer ``k``
    ``<flat shard k>``, the heads of a param in a head buffer's shard the param's."""
    firsts = [0]
    for g in param_groups:
        firsts.append(firsts[-1] + len(g["params"]))
    out = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": []} for g in param_groups]
    for g, local in zip(param_groups, out):
        if named and "param_names" in g:
            local["param_names"] = []
    for t in held.tensors:
        local = out[t.group]
        local["params"].append(tensor_of(t))
        if "param_names" in local:
            names = param_groups[t.group]["param_names"]
            of = t.param if t.whole else t.piece  # a whole param, or the heads of one in a head buffer's shard
            local["param_names"].append(names[of - firsts[t.group]] if of is not None else f"<flat shard {t.buffer}>")
    return out


def copy_hyperparams(src: list[dict], dst: list[dict], skip: tuple[str, ...] = ()) -> None:
    """Copy every group setting but ``params``, their names and ``skip`` (lr schedulers write one
    side, optimizers read the other)."""
    if len(src) != len(dst):
        raise RuntimeError(f"{len(src)} param groups cannot sync with {len(dst)}")
    for s, d in zip(src, dst):
        for key, value in s.items():
            if key not in ("params", "param_names") and key not in skip:
                d[key] = value


# torch's classes whose foreach step is bitwise their for-loop step on the CPU, every option, in
# float32 and float64 (tests/backends/test_local_foreach.py; bfloat16 differs in the last bit).
# Which of their groups take it is the plan's rule (`zero.plans.local_step.takes_foreach`), which
# the footprint counts the temporaries of.
FOREACH_ON_CPU = frozenset({"Adam", "AdamW", "SGD"})


def choose_foreach(optim: torch.optim.Optimizer, groups: Collection[int]) -> bool:
    """Give torch's foreach step to each of the local optimizer's ``groups`` (by position: those
    the plan says take it, `zero.plans.local_step.foreach_groups`) that leaves the choice to torch
    (``foreach=None``, not fused, differentiable or capturable, no tensor ``lr`` or ``betas``),
    where ``optim`` is one of `FOREACH_ON_CPU`. Whether it did: the outer groups then keep their
    ``None`` (`zero.backends.rank_state.RankState.pull`)."""
    cls = type(optim)
    if not groups or cls.__name__ not in FOREACH_ON_CPU or getattr(torch.optim, cls.__name__, None) is not cls:
        return False
    chose = False
    for k, g in enumerate(optim.param_groups):
        if k in groups and g.get("foreach", False) is None and _settings_allow(g):
            g["foreach"] = chose = True
    return chose


def _settings_allow(group: dict) -> bool:
    if group.get("fused") or group.get("differentiable") or group.get("capturable"):
        return False
    if any(isinstance(v, torch.Tensor) for v in (group.get("lr"), *group.get("betas", ()))):  # for-loop only
        return False
    # SGD's foreach step would add the momentum into the user's own gradients
    return not (group.get("nesterov") and not group.get("weight_decay") and not group.get("maximize"))


def check_state_keys(saved: dict, optim: torch.optim.Optimizer) -> None:
    """``ValueError`` when ``saved`` lacks per-param state the local optimizer keeps (a state dict
    of another optimizer class), naming the param, the missing keys and the likely source.

    What the local optimizer keeps is found by stepping a copy of it, with each group's settings,
    on a one-element param. `zero.functional` local optimizers check their own states.
    """
    if is_functional(optim):
        return
    expected = [_state_keys(type(optim), group) for group in optim.param_groups]
    for k, group in enumerate(saved["param_groups"]):
        for i in group["params"]:
            keys = set(saved["state"].get(i) or ())
            missing = expected[k] - keys if expected[k] is not None and keys else set()
            if missing:
                name = type(optim).__name__
                raise ValueError(f"state_dict's state for param {i} has {sorted(keys)} but {name} keeps "
                                 f"{sorted(expected[k])} (missing {sorted(missing)}): it was saved by another "
                                 f"optimizer, {saved_by_settings(group)} judging by its settings, not by {name}")


@torch.no_grad()
def initial_state(optim: torch.optim.Optimizer, which: set[int]) -> None:
    """Give the params of a ``torch.optim`` optimizer at positions ``which`` (across its groups)
    that have no state yet the state they would start from: zeros shaped like the param where the
    class keeps per-element tensors, zero ``step`` (the keys found as `check_state_keys` finds
    them). Loading fills it in place."""
    j = -1
    for group in optim.param_groups:
        probed = None
        for p in group["params"]:
            j += 1
            if j not in which or optim.state.get(p):
                continue
            probed = probed if probed is not None else _probe(type(optim), group)
            if probed is None:
                raise ValueError(f"cannot tell which state {type(optim).__name__} keeps with these settings "
                                 "(stepping a CPU copy of it failed), so its state cannot be made to load into")
            optim.state[p] = {k: (torch.zeros_like(p) if v.shape == (2,) else torch.zeros_like(v))
                              if isinstance(v, torch.Tensor) else v for k, v in probed.items()}


def is_per_element(key: str, value: Any, per_element: set[str] | None) -> bool:
    """Whether a state entry is shaped like its param (``per_element``: those keys; None: every
    tensor with dimensions), as opposed to per-param scalars such as ``step``."""
    if not isinstance(value, torch.Tensor):
        return False
    return key in per_element if per_element is not None else value.dim() > 0


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensor state a torch optimizer holds (what `zero.make_plan` predicts per rank)."""
    return sum(v.nbytes for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def per_element_keys(optim: torch.optim.Optimizer) -> set[str] | None:
    """The state keys a torch optimizer keeps shaped like the param (not per-param scalars such as
    ``step``), found as `check_state_keys` finds them; None when it cannot tell (functional ones)."""
    if is_functional(optim) or not optim.param_groups:
        return None
    probed = _probe(type(optim), optim.param_groups[0])
    if probed is None:
        return None
    return {k for k, v in probed.items() if isinstance(v, torch.Tensor) and v.shape == (2,)}


def _state_keys(cls: type, group: dict) -> set[str] | None:
    probed = _probe(cls, group)
    return None if probed is None else set(probed)


def _probe(cls: type, group: dict) -> dict | None:
    """The state ``cls`` keeps for a two-element param after one step with ``group``'s settings."""
    accepted = inspect.signature(cls).parameters
    p = torch.zeros(2, requires_grad=True)
    try:
        probe = cls([p], **{k: v for k, v in group.items() if k in accepted and k != "params"})
        p.grad = torch.zeros(2)
        probe.step()
    except (RuntimeError, ValueError, TypeError):  # e.g. capturable=True needs CUDA: cannot tell here
        return None
    return dict(probe.state[p])


def saved_by_settings(group: dict) -> str:
    """The ``torch.optim`` class whose constructor's options best match a saved group's keys.

    Adam and AdamW keep the same keys; ``decoupled_weight_decay`` (saved by torch >= 2.6) tells
    them apart, and without it both are named."""
    keys = set(group) - {"params", "initial_lr"}
    classes = [c for c in vars(torch.optim).values()
               if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer]

    def overlap(cls: type) -> float:
        options = set(inspect.signature(cls).parameters)
        return len(keys & options) / len(keys | options)

    best = max(classes, key=overlap)
    if best in (torch.optim.Adam, torch.optim.AdamW):
        decoupled = group.get("decoupled_weight_decay")
        return "torch.optim.Adam or torch.optim.AdamW" if decoupled is None else \
            f"torch.optim.{'AdamW' if decoupled else 'Adam'}"
    return f"torch.optim.{best.__name__}"


# Rules that need a whole tensor at once, which a flat plan's 1-D shards cannot give them.
_NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")
# torchao's low-bit optimizers, and zero's rules with the same numbers
_TORCHAO_LOW_BIT = {"AdamW8bit": "adamw_8bit", "AdamW4bit": "adamw_4bit", "Adam8bit": "adam_8bit",
                    "Adam4bit": "adam_4bit", "AdamWFp8": "adamw_8bit (8-bit, not fp8)",
                    "AdamFp8": "adam_8bit (8-bit, not fp8)"}


def check_shardable(optimizer_class: Any, defaults: dict) -> None:
    """``ValueError`` when a flat plan cannot run ``optimizer_class``: a ``torch.optim`` class whose
    rule is not element-wise, an Optax transformation (`from_optax`), whose rule zero cannot
    see into, or a mask or partition (given in the transformation, or as a factory's ``mask=``
    default), which picks params a flat shard does not keep apart. Whole-param plans run all."""
    name = getattr(optimizer_class, "__name__", "")
    if isinstance(optimizer_class, type) and getattr(optimizer_class, "__module__", "").startswith("torchao") \
            and name in _TORCHAO_LOW_BIT:
        raise ValueError(f"torchao.optim.{name} decides 8-bit or full-precision state and its quantization blocks "
                         "from the size of the tensor it is given, so on a flat plan's shards its numbers change "
                         "with the world size (pytorch/ao#4912): use zero.functional.contrib."
                         f"{_TORCHAO_LOW_BIT[name]}, which decides by the whole param and steps whole blocks, or a "
                         "whole-param plan (strategy='sorted_greedy'), where torchao's class runs as it is")
    if isinstance(optimizer_class, type) and name in _NOT_ELEMENTWISE:
        raise ValueError(f"torch.optim.{name} needs whole tensors (its rule is not element-wise), so it cannot "
                         "step a flat plan's shards: use a whole-param plan (strategy='sorted_greedy')")
    if isinstance(optimizer_class, GradientTransformation) and mentions(optimizer_class, "from_optax"):
        raise ValueError("a from_optax transformation runs Optax's own code, which cannot be told that it steps "
                         "pieces of tensors: use a whole-param plan, or zero.functional's own rule")
    masks = [k for k, v in defaults.items() if "mask" in k and v is not None]
    if masks or isinstance(optimizer_class, GradientTransformation) and (mentions(optimizer_class, "masked")
                                                                         or mentions(optimizer_class, "partition")):
        raise ValueError("a masked or partitioned transformation picks params by name or position, but a flat "
                         "plan's local optimizer steps shards that each hold pieces of several params: use a "
                         "whole-param plan (names reach the masks there), or put the params each rule steps in "
                         "their own param group (a flat plan packs each group's buffers apart)")


def opaque_optax(tx: Any) -> bool:
    """Whether ``tx`` runs Optax's own code not declared per tensor (``from_optax(..., per_tensor=
    True)``): code that may read several tensors at once, which zero cannot see into."""
    spec = getattr(tx, "spec", None)
    if spec is None:
        return False
    if spec.name == "from_optax":
        return not spec.args.get("per_tensor", False)
    inner = spec.args.get("inner")
    return any(opaque_optax(link) for link in spec.links) or (isinstance(inner, GradientTransformation)
                                                               and opaque_optax(inner))


def check_one_rank_steps_all(optimizer_class: Any, world_size: int) -> None:
    """``ValueError`` when the ranks each step some of the params with a `from_optax` rule not
    declared per tensor: Optax's ``clip_by_global_norm`` (any norm over several tensors) would
    read only the rank's own."""
    if world_size > 1 and isinstance(optimizer_class, GradientTransformation) and opaque_optax(optimizer_class):
        raise ValueError(f"a from_optax transformation runs Optax's own code, which zero cannot see into: on "
                         f"{world_size} ranks each rank steps some of the params, and a norm over several tensors "
                         "(optax.clip_by_global_norm) would read only its own. If it treats each tensor alone "
                         "(optax.adam, lion, adafactor), say so: from_optax(tx, per_tensor=True); else use "
                         "zero.functional's own rules (F.chain(F.clip_by_global_norm(...), ...)), whose norms sum "
                         "over the ranks")


def mentions(tx: Any, name: str) -> bool:
    """Whether transformation ``tx`` (or a link or inner transformation of it) is ``name``'s."""
    spec = getattr(tx, "spec", None)
    if spec is None:
        return False
    inner = spec.args.get("inner")
    return spec.name == name or any(mentions(link, name) for link in spec.links) or (
        isinstance(inner, GradientTransformation) and mentions(inner, name))
