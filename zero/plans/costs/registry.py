"""The registry: a rule's name (what ``make_plan(..., optimizer=...)`` takes) -> its cost model.

A new rule adds one line here (its family's model, with its numbers); a new family, a module
beside `base` answering `RuleCost`.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from zero.plans.costs.base import Elementwise, RuleCost
from zero.plans.costs.kronecker import Shampoo, Soap
from zero.plans.costs.low_rank import LowRank
from zero.plans.costs.lowbit import LOW_BIT_MIN_NUMEL, LowBit
from zero.plans.costs.newton_schulz import NewtonSchulz

__all__ = ["COSTS", "cost_of", "cost_name", "rule_cost"]

# the figures of torch.optim's default (for-loop) implementations: state tensors, per-param scalars
COSTS: dict[str, RuleCost] = {
    # (and of their foreach step, where zero runs it on the CPU: Adam's ``_foreach_sqrt`` of every
    # tensor, a coupled decay's copy of the gradients dropped before it; SGD's passes in place)
    "sgd": Elementwise(0, step_temps=1, step_temps_held=0, foreach_temps=0),
    "sgd_momentum": Elementwise(1, step_temps=2, step_temps_held=0, foreach_temps=0),
    "adam": Elementwise(2, 4, step_temps=3, foreach_temps=1),
    "adamw": Elementwise(2, 4, foreach_temps=1),
    "adam_amsgrad": Elementwise(3, 4, foreach_temps=1),
    "nadam": Elementwise(2, 8),  # step and mu_product
    "radam": Elementwise(2, 4),
    "adamax": Elementwise(2, 4),
    "adagrad": Elementwise(1, 4),
    "adadelta": Elementwise(2, 4),
    "rmsprop": Elementwise(1, 4),
    "rprop": Elementwise(2, 4),
    "lion": Elementwise(1),
    "lamb": Elementwise(2, 4),
    # zero.functional.contrib.muon: a momentum per matrix (5 Newton-Schulz steps); AdamW for the rest
    "muon": NewtonSchulz(2, 4, matrix_slots=1, ns_steps=5),
    "muon_8bit": NewtonSchulz(2, 4, matrix_slots=1, ns_steps=5, int8_block=2048),  # its momentum in int8 codes
    # zero.functional.contrib.soap and .shampoo at their defaults (another setting: pass Soap(...), Shampoo(...));
    # their step counts are one 0-d tensor per transformation, not per param
    # zero.functional.contrib's Optax rules: a count per set of params (no per-param scalars)
    "adopt": Elementwise(2),
    "ademamix": Elementwise(3),
    "simplified_ademamix": Elementwise(2),
    "schedule_free_adamw": Elementwise(2),  # z and the second moment (Adam without its first)
    "schedule_free_sgd": Elementwise(1),  # z
    "prodigy": Elementwise(4, step_reductions=1),  # two moments, the sum s, the start x0; two sums a step
    "dog": Elementwise(1, step_reductions=1),  # the start; the distance and the gradients' norm a step
    "dowg": Elementwise(1, step_reductions=1),
    "madgrad": Elementwise(3),  # the sums of g and g^2, the start
    "cocob": Elementwise(5),  # the start, and four sums and maxima
    "acprop": Elementwise(2),
    "dadapt_adamw": Elementwise(3, step_reductions=1),
    "momo": Elementwise(1, step_reductions=1),
    "momo_adam": Elementwise(2, step_reductions=1),
    "galore": LowRank(2),  # at its defaults (rank 128, a new projection every 200 steps); Adam's two moments
    "sophia": Elementwise(2),  # the momentum and the Hessian's diagonal
    "soap": Soap(),
    "shampoo": Shampoo(),
}
# zero.functional.contrib's low-bit Adam (torchao's maps and blocks): a 0-d count per state, no per-param
# scalars; its step's temporaries about ten float32s an element of a chunk of 2^16 (MemTracker on the step)
for _name, _bits, _block in (("adam8bit", 8, 256), ("adamw8bit", 8, 256), ("adam4bit", 4, 128), ("adamw4bit", 4, 128)):
    COSTS[_name] = LowBit(2, 0, step_temps=10, step_temps_held=0, step_chunk=1 << 16, bits=_bits, block_size=_block,
                          min_numel=LOW_BIT_MIN_NUMEL)


_SETTINGS = re.compile(r"^([a-z0-9_]+)\((.*)\)$")


def cost_of(rule: str | RuleCost) -> RuleCost:
    """The cost model of a rule by name (see `COSTS`; a low-bit one with another even block size
    as ``"adamw8bit/128"``; any model with other settings as `cost_name` writes it,
    ``"shampoo(block_size=128)"``), or the model itself."""
    if isinstance(rule, RuleCost):
        return rule
    key = str(rule).lower()
    settings = _SETTINGS.match(key)
    if settings:
        return _with_settings(settings.group(1), settings.group(2), rule)
    name, _, block = key.partition("/")
    known = COSTS.get(name)
    if known is None or block and not (isinstance(known, LowBit) and block.isdigit() and int(block) > 0
                                       and int(block) % 2 == 0):
        raise ValueError(f"unknown optimizer {rule!r}; known: {', '.join(sorted(COSTS))} (a low-bit one "
                         "with another even block size as 'adamw8bit/128'; others' settings as "
                         "'shampoo(block_size=128)')")
    return dataclasses.replace(known, block_size=int(block)) if block else known


def _with_settings(name: str, text: str, rule: str) -> RuleCost:
    if name not in COSTS:
        raise ValueError(f"unknown optimizer {name!r} in {rule!r}; known: {', '.join(sorted(COSTS))}")
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        settings = {k.arg: _literal(k.value) for k in call.keywords}
        if call.args or None in settings:
            raise ValueError
    except (SyntaxError, ValueError):
        raise ValueError(f"optimizer {rule!r}: settings are written name=value, e.g. 'shampoo(block_size=128)'") \
            from None
    return rule_cost(name, settings, strict=True)


_NAMES = {"true": True, "false": False, "none": None}  # as a plan keeps them: its optimizer name lowercased


def _literal(node: ast.expr) -> object:
    if isinstance(node, ast.Name) and node.id.lower() in _NAMES:
        return _NAMES[node.id.lower()]
    return ast.literal_eval(node)


def rule_cost(name: str, settings: dict, strict: bool = False) -> RuleCost:
    """``COSTS[name]`` with the fields its model has set from ``settings`` (a rule's own
    arguments: the others are the rule's, not its cost's); ``strict``: an unknown one is a
    ``ValueError``."""
    model = COSTS[name]
    settings = model.from_rule(settings) if hasattr(model, "from_rule") else settings
    fields = {f.name for f in dataclasses.fields(model)}
    unknown = sorted(set(settings) - fields)
    if strict and unknown:
        raise ValueError(f"the cost of {name!r} has no setting {unknown}; it has {sorted(fields)}")
    return dataclasses.replace(model, **{k: v for k, v in settings.items() if k in fields})


def cost_name(name: str, model: RuleCost) -> str:
    """How a plan names ``model``, a model of rule ``name``: the name alone at the registry's
    settings, else with the settings that differ (``"shampoo(block_size=128)"``), which
    `cost_of` reads back."""
    base = COSTS[name]
    changed = [f"{f.name}={getattr(model, f.name)!r}" for f in dataclasses.fields(model)
               if getattr(model, f.name) != getattr(base, f.name)]
    return f"{name}({', '.join(changed)})" if changed else name
