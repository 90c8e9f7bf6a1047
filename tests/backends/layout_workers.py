"""Random layouts (#66 item 4): a seeded draw of params (uneven matrices, a vector, an embedding),
ranks, executor (ZeRO flat, hybrid, flat with per-head matrices cut at head edges, or whole-param;
FSDP2), rule and dtype (float64, or bf16 with
float32 masters under ZeRO); each case stepped on the ranks and compared with one process, or
refused by a ``ValueError`` naming a param. Shared by the suite's bounded draw and
``bench/random_layouts.py``'s thousand."""

from __future__ import annotations

import random

import torch
from torch import nn

import zero
import zero.functional as F
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.plans.costs import COSTS

# rule -> (builder of the transformation, the plan's cost model)
RULES = {
    "adamw": (lambda: F.adamw(1e-2, weight_decay=0.01), "adamw"),
    "lion": (lambda: F.lion(1e-3), "lion"),
    "lamb": (lambda: F.lamb(1e-2), "lamb"),
    "adafactor": (lambda: F.adafactor(1e-2, min_dim_size_to_factor=2), "adamw"),
    "muon": (lambda: F.contrib.muon(1e-2), "muon"),
    # per-head (#67): each matrix's rows in the first of 4, 3, 2 heads that divides them, else whole
    "per-head gram muon": (lambda: F.contrib.muon(1e-2, ns_method="gram", muon_weight_dimension_numbers=_heads),
                           "muon"),
    "muon_8bit": (lambda: F.contrib.muon_8bit(1e-2), "muon_8bit"),
    "adopt": (lambda: F.contrib.adopt(1e-2), "adopt"),
    "ademamix": (lambda: F.contrib.ademamix(1e-2), "ademamix"),
    "schedule_free_adamw": (lambda: F.contrib.schedule_free_adamw(1e-2, warmup_steps=2), "schedule_free_adamw"),
    "prodigy": (lambda: F.contrib.prodigy(weight_decay=0.01), "prodigy"),
    "dog": (lambda: F.contrib.dog(), "dog"),
    "madgrad": (lambda: F.contrib.madgrad(1e-2), "madgrad"),
    "galore": (lambda: F.contrib.galore(1e-2, rank=2, update_proj_gap=2), "galore"),
    "lbfgs": (lambda: F.lbfgs(1e-2, memory_size=3, linesearch=None), "sgd"),
    "normalize + sgd": (lambda: F.chain(F.normalize_by_update_norm(), F.sgd(1e-2)), "sgd"),
}
def _heads(tree: dict) -> dict:
    from zero.functional.contrib import MuonDimensionNumbers as Dims

    def of(p):
        return Dims(1, 0, heads=next((h for h in (4, 3, 2) if p.shape[0] % h == 0), 1)) if p.ndim == 2 else None
    return {n: of(p) for n, p in tree.items()}


EXECUTORS = ("zero_flat", "zero_hybrid", "zero_whole", "fsdp2", "zero_split")
STEPS = 4


def draw(rng: random.Random, worlds: tuple[int, ...] = (1, 2, 3, 4)) -> dict:
    """One case: shapes, ranks, executor, rule, dtype."""
    shapes = [(rng.randint(1, 40), rng.randint(1, 20)) for _ in range(rng.randint(1, 2))]
    shapes.append((rng.randint(1, 50),))  # a vector (a bias, a norm)
    if rng.random() < 0.5:
        shapes.append((rng.randint(10, 60), rng.randint(4, 12)))  # an embedding
    rng.shuffle(shapes)
    executor = rng.choice(EXECUTORS)
    dtype = "bf16_masters" if executor != "fsdp2" and rng.random() < 0.25 else "float64"
    rule = rng.choice(sorted(RULES))
    if executor == "zero_split":  # a plan that cuts heads: the rule that reads them (the draw's numbers unchanged)
        rule = "per-head gram muon"
    return {"shapes": shapes, "world": rng.choice(worlds), "executor": executor, "rule": rule, "dtype": dtype}


def draws(seed: int, n: int, worlds: tuple[int, ...] = (1, 2, 3, 4)) -> list[dict]:
    rng = random.Random(seed)
    return [draw(rng, worlds) for _ in range(n)]


class Bag(nn.Module):
    """The case's params, named p0, p1 ... (one module: FSDP2 shards them all, rows unevenly)."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(len(shapes))
        for i, s in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)))


def _grads(shapes: list[tuple[int, ...]], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _reference(case: dict) -> list[torch.Tensor]:
    """One process: float64 params, or float32 params with bf16 gradients rounded to bf16 at the end."""
    masters = case["dtype"] == "bf16_masters"
    bag = Bag(case["shapes"], torch.bfloat16 if masters else torch.float64)
    if masters:
        bag = bag.float()
    opt = F.Optimizer(list(bag.named_parameters()), RULES[case["rule"]][0]())
    for k in range(STEPS):
        for p, g in zip(bag.parameters(), _grads(case["shapes"], k)):
            p.grad = g.to(torch.bfloat16).to(p.dtype) if masters else g.clone()
        opt.step()
    return [p.detach().to(torch.bfloat16 if masters else torch.float64).double() for p in bag.parameters()]


def _sharded(case: dict, world: int) -> list[torch.Tensor]:
    masters = case["dtype"] == "bf16_masters"
    bag = Bag(case["shapes"], torch.bfloat16 if masters else torch.float64)
    tx, cost = RULES[case["rule"]]
    if case["executor"] == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        bag = fully_shard(bag)
        opt = F.Optimizer(list(bag.named_parameters()), tx())
    else:
        named = list(bag.named_parameters())
        metas = zero.param_metas(named)
        cost = cost if cost in COSTS else "adamw"
        extra = {"master_dtype": "float32"} if masters else {}
        if case["executor"] == "zero_split" and any(_heads({"w": torch.empty(s)})["w"].heads > 1
                                                    for s in case["shapes"] if len(s) == 2):
            plan = None  # per-head matrices cut at head edges (the rule asked for its heads)
        elif case["executor"] == "zero_whole":
            plan = zero.make_plan(metas, world, "sorted_greedy", optimizer=cost, **extra)
        else:
            whole = [m.name for m in metas if len(m.shape) == 2] if case["executor"] in ("zero_hybrid", "zero_split") \
                else ()
            plan = zero.make_plan(metas, world, "flat", optimizer=cost, whole=whole, **extra)
        split = {"strategy": "flat", "split_heads": True} if plan is None else {"plan": plan}
        opt = Zero(named, tx(), master_dtype=torch.float32 if masters else None, **split)
    for k in range(STEPS):
        for p, g in zip(bag.parameters(), _grads(case["shapes"], k)):
            g = g.to(p.dtype)
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)  # alike on every rank
            p.grad = g
        opt.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double() for p in bag.parameters()]


def outcome(case: dict, world: int) -> tuple[str, str]:
    """("equal", worst gap), ("refused", the message naming a param) or ("wrong", what)."""
    try:
        got = _sharded(case, world)
    except ValueError as e:
        named = any(f"p{i}" in str(e) for i in range(len(case["shapes"])))
        return ("refused" if named else "wrong"), str(e)[:300]
    ref = _reference(case)
    masters = case["dtype"] == "bf16_masters"
    worst = 0.0
    for a, b in zip(got, ref):
        scale = max(float(b.abs().max()), 1e-30)
        worst = max(worst, float((a - b).abs().max()) / scale)
    bound = 2 ** -7 if masters else 1e-10  # bf16: a rounding apart at most; float64: sums in another order
    return ("equal" if worst <= bound else "wrong"), f"{worst:.2e}"


def run_cases(rank: int, world_size: int, cases: list[dict]) -> list[tuple[str, str]]:
    """Every case drawn for this many ranks, in one run of the ranks."""
    return [outcome(case, world_size) for case in cases]
