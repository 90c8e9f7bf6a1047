"""`ZeroRedundancyOptimizer`'s arguments, checked at the boundary (errors name the bad value), and
the plan it makes when given none."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zero.plans.costs import cost_of
from zero.plans.layout import DDP_BUCKET_CAP_MB, default_bucket_numel
from zero.plans.meta import ParamMeta, param_groups, param_metas
from zero.plans.plan import PLAN_STRATEGIES, Plan, make_plan

__all__ = ["default_plan", "quantized_params", "low_bit_name", "rule_cost_name", "with_heads", "check_blocks",
           "check_plan_arguments", "check_sync_options",
           "check_torch_settings", "normalise_params"]


def default_plan(metas: list[ParamMeta], world_size: int, strategy: str | None,
                 master_dtype: torch.dtype | None, optimizer_class: Any = None, defaults: dict | None = None,
                 bucket_cap_mb: float | None = None, split_heads: bool = False) -> Plan:
    """The plan ``strategy=`` names. A flat plan keeps whole the params the rule itself needs whole
    (`zero.functional.sharding.needs_whole`: Muon's matrices, Adafactor's factored ones ...): a
    hybrid plan, which ``opt.plan`` shows (``flat + N whole``), instead of an error at the first step.
    Its buffers are sized from the model (`zero.plans.layout.default_bucket_numel`), at most
    ``bucket_cap_mb`` MiB (DDP's 25 by default). ``split_heads``: the params the rule steps head by
    head (per-head Muon) are cut at head edges into the flat shards instead of kept whole
    (`zero.make_plan`'s ``split_heads``)."""
    master = None if master_dtype is None else str(master_dtype).removeprefix("torch.")
    optimizer = low_bit_name(quantized_params(metas, optimizer_class, defaults or {})) or \
        _cost_name(metas, optimizer_class, defaults or {}) or "adam"
    if strategy == "flat":
        whole = _needed_whole(metas, optimizer_class, defaults or {})
        bucket = default_bucket_numel(metas, world_size, DDP_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb)
        return make_plan(metas, world_size, "flat", bucket_numel=bucket, master_dtype=master,
                         whole=whole or None, optimizer=optimizer, split_heads=split_heads)
    return make_plan(metas, world_size, strategy or "sorted_greedy", master_dtype=master, optimizer=optimizer)


def _rule(metas: list[ParamMeta], optimizer_class: Any, defaults: dict) -> tuple[Any, dict] | None:
    """A `zero.functional` rule and the trainable params as whole meta shapes by name, to ask the
    rule about them; None for torch's classes (a flat plan runs their rules element by element,
    or refuses them by name) and for params without unique names."""
    from zero.functional.base import GradientTransformation

    if isinstance(optimizer_class, type) or not callable(optimizer_class) and \
            not isinstance(optimizer_class, GradientTransformation):
        return None  # not a rule: building the local optimizer names what it is
    trainable = [m for m in metas if m.requires_grad]
    if len({m.name for m in trainable}) != len(trainable):
        return None  # asked by name: the step checks instead
    tx = optimizer_class if isinstance(optimizer_class, GradientTransformation) else optimizer_class(**defaults)
    return tx, {m.name: (m.shape, getattr(torch, m.dtype)) for m in trainable}


def _cost_name(metas: list[ParamMeta], optimizer_class: Any, defaults: dict) -> str | None:
    """The plan's name for the cost of a `zero.functional` rule that keeps params whole (Muon,
    SOAP, Shampoo: `rule_cost_name`), so the plan counts its factors and balances its work; None
    for other rules (Adam's figures serve)."""
    asked = _rule(metas, optimizer_class, defaults)
    if not asked:
        return None
    from zero.functional.sharding import head_counts

    return with_heads(rule_cost_name(asked[0]), head_counts(*asked, costs=True))


def with_heads(name: str | None, heads: dict[str, int]) -> str | None:
    """A cost's name with the heads its rule reads params by (per-head Muon: each head's
    Newton-Schulz is its own; per-head SOAP and Shampoo: each head's factors), so the plan balances
    the heads' work, not whole matrices'."""
    if not name or not heads or not hasattr(cost_of(name), "heads"):
        return name
    from zero.plans.costs.registry import cost_name

    model = dataclasses.replace(cost_of(name), heads=tuple(sorted(heads.items())))
    return cost_name(name.split("(")[0], model)


def rule_cost_name(tx: Any) -> str | None:
    """The registered cost of rule ``tx`` when it keeps params whole: its alias' name with its
    settings (`zero.plans.costs.cost_name`), found on ``tx`` or a link or inner rule of it; else None."""
    from zero.functional.base import GradientTransformation
    from zero.plans.costs import COSTS
    from zero.plans.costs.registry import cost_name, rule_cost

    spec = getattr(tx, "spec", None)
    if spec is None:
        return None
    name, args = spec.name, spec.args
    if name == "inject_hyperparams":  # a rule as param groups set it: its factory and arguments
        factory, args = args["source"]
        name = getattr(factory, "__name__", "")
        if name not in COSTS:  # a chain around such a rule (or a factory of the user's): what it builds
            return rule_cost_name(factory(**args))
    if name in COSTS and COSTS[name].keeps_whole:
        return cost_name(name, rule_cost(name, args))
    inner = spec.args.get("inner")
    found = (rule_cost_name(t) for t in (*spec.links, inner) if isinstance(t, GradientTransformation))
    return next((name for name in found if name), None)


def _needed_whole(metas: list[ParamMeta], optimizer_class: Any, defaults: dict) -> list[str]:
    """The trainable params' names a `zero.functional` rule needs whole."""
    from zero.functional.sharding import needs_whole

    asked = _rule(metas, optimizer_class, defaults)
    return [] if asked is None else needs_whole(*asked)


def quantized_params(metas: list[ParamMeta], optimizer_class: Any, defaults: dict) -> dict[str, tuple[int, int]]:
    """The trainable params (by name) whose state a `zero.functional` rule keeps quantized, each
    with its (bits, block size), asked of the rule (`zero.functional.sharding.block_sizes`)."""
    from zero.functional.sharding import block_sizes

    asked = _rule(metas, optimizer_class, defaults)
    return {} if asked is None else block_sizes(*asked)


def low_bit_name(found: dict[str, tuple[int, int]]) -> str | None:
    """The plan's name for the state of a low-bit rule (``"adamw8bit"``, ``"adamw4bit/64"``), whose
    figures and block-aligned cuts `zero.make_plan` then gives."""
    kinds = set(found.values())
    if not kinds:
        return None
    if len(kinds) > 1:
        raise ValueError(f"the rule keeps state quantized in several ways ({sorted(kinds)} as (bits, block)), which "
                         "one plan's state figures cannot say: pass plan= made with zero.make_plan")
    (bits, block), = kinds
    name = f"adamw{bits}bit"
    return name if cost_of(name).block_size == block else f"{name}/{block}"


def check_blocks(plan: Plan, metas: list[ParamMeta], optimizer_class: Any, defaults: dict) -> None:
    """``ValueError`` when a flat plan cuts inside a param's quantization blocks (the rule keeps
    its state quantized: `quantized_params`), naming the param: its numbers would change with
    the plan. A whole param (a hybrid plan's) keeps its blocks."""
    if plan.flat is None:
        return
    found = quantized_params(metas, optimizer_class, defaults)
    index = {m.name: i for i, m in enumerate(metas)}
    block_of = {i: b.block for b in plan.flat.buffers for i in b.params}
    for name, (bits, block) in found.items():
        i = index[name]
        if i in block_of and block_of[i] != block:
            raise ValueError(f"param {name!r}'s state is kept in {bits}-bit blocks of {block} elements, but the plan "
                             f"cuts its flat buffer {'at ' + str(block_of[i]) if block_of[i] else 'anywhere'}: "
                             f"make it with zero.make_plan(..., optimizer={low_bit_name({name: (bits, block)})!r}), "
                             "whose shards end at block edges, or pass strategy='flat' and let the optimizer make it")


def check_plan_arguments(plan: Any, strategy: Any, bucket_cap_mb: Any = None, split_heads: Any = False) -> None:
    if not isinstance(split_heads, bool):
        raise TypeError(f"split_heads must be True or False, got {split_heads!r}")
    if split_heads and (strategy != "flat" or plan is not None):
        raise ValueError("split_heads=True cuts the per-head matrices of strategy='flat' at head edges; "
                         + ("a plan given decides its own: make it with zero.make_plan(..., split_heads=True)"
                            if plan is not None else f"strategy={strategy!r} keeps every param whole"))
    if bucket_cap_mb is not None and (strategy != "flat" or plan is not None):
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} sizes the flat buffers of strategy='flat' (DDP's name); "
                         + ("a plan given decides its own: make it with zero.make_plan(..., bucket_numel=...)"
                            if plan is not None else f"strategy={strategy!r} has none"))
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a zero.Plan (from zero.make_plan or Plan.from_json), got {type(plan).__name__}")
    if plan is not None and strategy is not None:
        raise ValueError(f"pass plan= or strategy=, not both (the plan's strategy is {plan.strategy!r})")
    if strategy is not None and strategy not in PLAN_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {PLAN_STRATEGIES}")


def check_sync_options(sync_chunk_mb: Any, bucket_view: Any) -> None:
    if bucket_view is not None and not isinstance(bucket_view, bool):
        raise TypeError(f"parameters_as_bucket_view must be None, True or False, got {bucket_view!r}")
    if sync_chunk_mb is None:
        return
    if isinstance(sync_chunk_mb, bool) or not isinstance(sync_chunk_mb, (int, float)) or sync_chunk_mb <= 0:
        raise ValueError(f"sync_chunk_mb must be a positive number, got {sync_chunk_mb!r}")
    if bucket_view is not False:
        raise ValueError(f"sync_chunk_mb={sync_chunk_mb} sizes the scratch rows of parameters_as_bucket_view=False; "
                         f"with parameters_as_bucket_view={bucket_view} the params are the rows and there is no "
                         "scratch: drop sync_chunk_mb, or pass parameters_as_bucket_view=False")


def normalise_params(params: Any) -> list[dict]:
    """Params as a list of group dicts (generators read once), checked by position first."""
    groups = param_groups(params)
    if not groups or not any(g["params"] for g in groups):
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    metas = param_metas(groups)  # non-tensors, sparse and repeated params fail here, by position
    flat = [p for g in groups for p in g["params"]]
    for m, p in zip(metas, flat):
        if isinstance(p, DTensor):  # zero.ZeroRedundancyOptimizer itself builds its FSDP2 form instead
            raise TypeError(f"params[{m.name}] is a DTensor ({tuple(p.placements)} over {p.device_mesh}), as "
                            "FSDP2's fully_shard makes them: a subclass of ZeroRedundancyOptimizer steps plain params; "
                            "zero.ZeroRedundancyOptimizer(params, ...) itself steps these over FSDP2's mesh "
                            "(zero.backends.fsdp2.ReplicaShardedOptimizer), as zero.functional.Optimizer does")
        if p.requires_grad and not p.is_contiguous():
            raise ValueError(f"params[{m.name}] (shape {tuple(p.shape)}) is not contiguous; "
                             "pass contiguous parameters")
    return groups


def check_torch_settings(optimizer_class: type, defaults: dict, groups: list[dict]) -> None:
    """A torch class's numeric settings (``lr``, ``betas`` ...), in the defaults or a group, are
    numbers: ``lr="1e-3"`` is a ``TypeError`` naming it, not torch's bare ``'<=' not supported``."""
    signature = inspect.signature(optimizer_class.__init__).parameters
    for where, settings in [("", defaults), *((f"param group {k}'s ", g) for k, g in enumerate(groups))]:
        for key, value in settings.items():
            default = signature[key].default if key in signature else None
            numbers = value if isinstance(default, tuple) and isinstance(value, (tuple, list)) else (value,)
            if _numeric(default) and not all(_numeric(v) or isinstance(v, torch.Tensor) for v in numbers):
                raise TypeError(f"{optimizer_class.__name__}: {where}{key} must be a number, "
                                f"got {type(value).__name__} {value!r}")


def _numeric(value: Any) -> bool:
    """A real number, or a tuple of them (``betas``)."""
    if isinstance(value, tuple):
        return bool(value) and all(_numeric(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)
