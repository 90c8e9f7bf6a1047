"""Per-rank bodies of the low-bit state tests (run by `helpers.run_ranks` in fresh processes):
8-bit and 4-bit Adam under whole, flat and hybrid plans, with and without fp32 masters, and
their checkpoints across world sizes and plans."""

from __future__ import annotations

import optree
import torch
from helpers import fixed_grads, set_grads
from torch import nn

import zero
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import checkpoint as ckpt
from zero.functional import contrib

RULES = {"8bit": contrib.adamw_8bit, "4bit": contrib.adamw_4bit, "adam8bit": contrib.adam_8bit}


def lowbit_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    """Uneven layers: weights of 8,192, 6,144 and 4,608 elements (quantized: whole 256-blocks),
    one of 4,100 (over the threshold, not whole blocks: full precision) and small ones."""
    torch.manual_seed(seed)
    layers = [nn.Linear(64, 128), nn.Linear(128, 41), nn.Linear(41, 100), nn.Linear(100, 48), nn.Linear(48, 96),
              nn.Linear(96, 5)]
    return nn.Sequential(*layers).to(dtype)


def groups(model: nn.Sequential) -> list[dict]:
    """Two named param groups, the second at another learning rate."""
    named = list(model.named_parameters())
    first, rest = named[:6], named[6:]
    return [{"params": [p for _, p in first], "param_names": [n for n, _ in first]},
            {"params": [p for _, p in rest], "param_names": [n for n, _ in rest], "lr": 5e-3}]


def tx_of(rule: str):
    return RULES[rule](1e-2, weight_decay=0.05) if rule != "adam8bit" else RULES[rule](1e-2, weight_decay=0.01)


def plan_for(model: nn.Module, world_size: int, strategy: str, rule: str, masters: bool) -> zero.Plan | None:
    """The plan of ``strategy``: ``"flat"`` and ``"hybrid"`` made block-aligned by the optimizer's
    own name (``hybrid`` keeps the 6,144-element weight whole); None: let the optimizer make it."""
    name = {"8bit": "adamw8bit", "4bit": "adamw4bit", "adam8bit": "adam8bit"}[rule]
    master = "float32" if masters else None
    metas = zero.param_metas(groups(model))
    if strategy == "hybrid":
        return zero.make_plan(metas, world_size, "flat", optimizer=name, master_dtype=master, whole=[metas[2].name])
    if strategy == "flat-own":
        return None
    return zero.make_plan(metas, world_size, strategy, optimizer=name, master_dtype=master)


def train(rank: int, world_size: int, rule: str, strategy: str, masters: bool, steps: int) -> dict:
    """``steps`` steps on the same gradients on every rank; the params (as float64 lists), the
    state bytes this rank holds and the plan's figure for it."""
    model = lowbit_model(torch.bfloat16 if masters else torch.float32)
    plan = plan_for(model, world_size, strategy, rule, masters)
    kwargs = {"plan": plan} if plan is not None else {"strategy": "flat"}
    opt = Zero(groups(model), tx_of(rule), master_dtype=torch.float32 if masters else None, **kwargs)
    for k in range(steps):
        set_grads(model, fixed_grads(list(model.parameters()), k))
        opt.step()
    return {"params": [p.detach().to(torch.float64) for p in model.parameters()],
            "state_bytes": state_bytes(opt), "planned": opt.plan.ranks[rank].state_bytes,
            "plan": str(opt.plan.optimizer), "path": str(opt.path[0].kernel)}


def state_bytes(opt: Zero) -> int:
    """Bytes of the per-param state the local optimizer holds (codes, scales, full-precision
    moments), without the 0-d step counts the params share."""
    total = 0
    for k in range(len(opt.optim.param_groups)):
        for state in opt.optim.set_states(k).values():
            total += sum(x.nbytes for x in optree.tree_leaves(state)
                         if isinstance(x, torch.Tensor) and x.dim() > 0)
    return total


def save_then_resume(rank: int, world_size: int, path: str, rule: str, strategy: str, steps: tuple[int, int],
                     phase: str) -> dict:
    """``phase="save"``: ``steps[0]`` steps, then a DCP checkpoint at ``path``. ``"resume"``: load
    it (this world size and plan may differ) and take ``steps[1]`` more."""
    model = lowbit_model()
    plan = plan_for(model, world_size, strategy, rule, False)
    opt = Zero(groups(model), tx_of(rule), **({"plan": plan} if plan is not None else {"strategy": "flat"}))
    first, more = steps
    if phase == "resume":
        ckpt.load(path, model, opt)
    for k in range(first) if phase == "save" else range(first, first + more):
        set_grads(model, fixed_grads(list(model.parameters()), k))
        opt.step()
    if phase == "save":
        ckpt.save(path, model, opt)
    return {"params": [p.detach().to(torch.float64) for p in model.parameters()]}


def consolidated_save_then_resume(rank: int, world_size: int, path: str, rule: str, strategy: str,
                                  steps: tuple[int, int], phase: str) -> dict:
    """As `save_then_resume`, in torch's consolidated format: ``consolidate_state_dict`` and
    ``state_dict`` on rank 0, ``torch.save``-d with the model's; ``"resume"`` loads both on every
    rank (this world size and plan may differ) and takes ``steps[1]`` more steps."""
    model = lowbit_model()
    plan = plan_for(model, world_size, strategy, rule, False)
    opt = Zero(groups(model), tx_of(rule), **({"plan": plan} if plan is not None else {"strategy": "flat"}))
    first, more = steps
    if phase == "resume":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    for k in range(first) if phase == "save" else range(first, first + more):
        set_grads(model, fixed_grads(list(model.parameters()), k))
        opt.step()
    if phase == "save":
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    return {"params": [p.detach().to(torch.float64) for p in model.parameters()]}


def zero2_vs_ddp(rank: int, world_size: int, rule: str, steps: int) -> list[torch.Tensor]:
    """ZeRO-2 (gradients reduce-scattered into block-aligned shards) with the low-bit rule beside
    DDP + the same rule in `zero.functional.Optimizer`, each rank on its own data: the largest
    difference of their params after each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero.functional as zf

    ours_m, ref_m = lowbit_model(), lowbit_model()
    ours = Zero(groups(ours_m), tx_of(rule), strategy="flat", reduce_scatter_grads=True)
    ddp = DDP(ref_m)
    ref = zf.Optimizer(groups(ref_m), tx_of(rule))
    worst = []
    for k in range(steps):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * k + rank))
        for model, opt in ((ours_m, ours), (ddp, ref)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        worst.append(max(float((p - q).abs().max()) for p, q in zip(ours_m.parameters(), ref_m.parameters())))
    return worst
