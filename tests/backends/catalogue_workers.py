"""Per-rank bodies of the tests of #66's rules under the sharded executors: schedule-free's
``eval()`` / ``train()`` on ZeRO (flat, hybrid, masters) and on FSDP2, Prodigy's sums, MoMo fed
the loss by ``step(closure)``; each against one process's `zero.functional.Optimizer`."""

from __future__ import annotations

import fsdp2_workers as fw
import torch

import zero
import zero.functional as F
from zero.backends import ZeroRedundancyOptimizer as Zero

RULE = dict(learning_rate=1e-2, warmup_steps=2, weight_decay=0.01)


def _run(opt, model, steps: int, first: int = 0, grads_in: torch.dtype | None = None) -> None:
    for k in range(first, first + steps):
        grads = fw.fixed_grads(model, k)
        fw.set_grads(model, grads if grads_in is None else [g.to(grads_in).to(g.dtype) for g in grads])
        opt.step()


def _snap(model, rounded: torch.dtype | None = None) -> list[torch.Tensor]:
    return [fw.full(p.detach()).to(rounded or p.dtype).double() for p in model.parameters()]


def one_process(rank: int, world_size: int, masters: bool = False) -> dict[str, list[torch.Tensor]]:
    """y after 4 steps, x (eval), y again (train), and y after 3 more steps; ``masters``: what
    float32 masters of bf16 params hold (float32 params, bf16 gradients), rounded to bf16."""
    if not masters:
        model = fw.make_model()
        return _phases(F.Optimizer(fw.groups(model), F.contrib.schedule_free_adamw(**RULE)), model)
    model = fw.make_model(torch.bfloat16).float()
    opt = F.Optimizer(fw.groups(model), F.contrib.schedule_free_adamw(**RULE))
    return _phases(opt, model, grads_in=torch.bfloat16, rounded=torch.bfloat16)


def _phases(opt, model, grads_in: torch.dtype | None = None, rounded: torch.dtype | None = None
            ) -> dict[str, list[torch.Tensor]]:
    out = {}
    _run(opt, model, 4, grads_in=grads_in)
    out["y"] = _snap(model, rounded)
    opt.eval()
    opt.eval()  # twice: a no-op
    out["x"] = _snap(model, rounded)
    try:
        opt.step()
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    opt.train()
    out["y again"] = _snap(model, rounded)
    _run(opt, model, 3, first=4, grads_in=grads_in)
    out["after"] = _snap(model, rounded)
    return out


def zero_run(rank: int, world_size: int, kind: str) -> dict[str, list[torch.Tensor]]:
    """ZeRO with a flat plan, a hybrid plan (the 64 x 96 weight whole) or a whole-param plan with
    float32 masters over bf16 params."""
    dtype = torch.bfloat16 if kind == "masters" else torch.float64
    model = fw.make_model(dtype)
    groups = fw.groups(model)
    metas = zero.param_metas(groups)
    if kind == "flat":
        plan = zero.make_plan(metas, world_size, "flat", optimizer="schedule_free_adamw")
    elif kind == "hybrid":
        plan = zero.make_plan(metas, world_size, "flat", optimizer="schedule_free_adamw", whole=["4.weight"])
    else:
        plan = zero.make_plan(metas, world_size, "sorted_greedy", optimizer="schedule_free_adamw",
                              master_dtype="float32")
    extra = {"master_dtype": torch.float32} if kind == "masters" else {}
    opt = Zero(groups, F.contrib.schedule_free_adamw, plan=plan, **RULE, **extra)
    return _phases(opt, model)


def fsdp2_run(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    model = fw.sharded(fw.make_model())
    opt = F.Optimizer(fw.groups(model), F.contrib.schedule_free_adamw(**RULE))
    return _phases(opt, model)


def prodigy_sums(rank: int, world_size: int) -> tuple[list, float]:
    """The all-reduces one Prodigy step makes under a flat plan (kind, dtype, bytes), and its
    worst gap to one process after 5 steps."""
    from zero.backends import comm

    model, ref = fw.make_model(), fw.make_model()
    groups = fw.groups(model)
    plan = zero.make_plan(zero.param_metas(groups), world_size, "flat", optimizer="prodigy")
    opt = Zero(groups, F.contrib.prodigy, plan=plan, weight_decay=0.01)
    one = F.Optimizer(fw.groups(ref), F.contrib.prodigy(weight_decay=0.01))
    _run(one, ref, 5)
    _run(opt, model, 4)
    fw.set_grads(model, fw.fixed_grads(model, 4))
    with comm.recording() as made:
        opt.step()
    reduces = [(c.kind, c.dtype, c.bytes) for c in made if c.kind.startswith("all_reduce")]
    return reduces, max(float((a - b).abs().max()) for a, b in zip(_snap(model), _snap(ref)))


def _loss(model) -> torch.Tensor:
    """A loss every rank computes alike from the whole params (what MoMo reads with the gradients)."""
    return sum((fw.full(p.detach()).double() ** 2).sum() for p in model.parameters()) * 1e-2


def momo_closure(rank: int, world_size: int, engine: str) -> list[torch.Tensor]:
    """MoMo-Adam for 5 steps, its loss from ``step(closure)``, under ZeRO (float32 masters over bf16
    params: the closure runs before the masters step) or FSDP2; ``engine`` "one": one process."""
    masters = engine == "zero masters"
    model = fw.make_model(torch.bfloat16) if masters else fw.make_model()
    if engine == "fsdp2":
        model = fw.sharded(model)
    groups = fw.groups(model)
    kwargs = dict(learning_rate=0.05, weight_decay=0.01)
    if engine.startswith("zero"):
        plan = zero.make_plan(zero.param_metas(groups), world_size, "flat", optimizer="adamw",
                              master_dtype="float32" if masters else None)
        opt = Zero(groups, F.contrib.momo_adam, plan=plan, master_dtype=torch.float32 if masters else None, **kwargs)
    else:
        opt = F.Optimizer(groups, F.contrib.momo_adam(**kwargs))
    for k in range(5):
        fw.set_grads(model, fw.fixed_grads(model, k))
        opt.step(lambda: _loss(model))
    return _snap(model)


def lbfgs_closure_refused(rank: int, world_size: int, strategy: str) -> str:
    """L-BFGS's line search by ``step(closure)`` under ZeRO: the error every rank raises."""
    model = fw.make_model()
    groups = fw.groups(model)
    opt = Zero(groups, F.lbfgs(), plan=zero.make_plan(zero.param_metas(groups), world_size, strategy))
    fw.set_grads(model, fw.fixed_grads(model, 0))
    try:
        opt.step(lambda: _loss(model))
    except ValueError as e:
        return str(e)
    return ""


def hutchinson_refused(rank: int, world_size: int) -> str:
    """Sophia's Hutchinson estimate under a flat plan: the error every rank raises."""
    model = fw.make_model()
    groups = fw.groups(model)
    plan = zero.make_plan(zero.param_metas(groups), world_size, "flat", optimizer="sophia")
    opt = Zero(groups, F.contrib.sophia(1e-2), plan=plan)
    fw.set_grads(model, fw.fixed_grads(model, 0))
    try:
        opt.step(obj_fn=lambda p: sum((x ** 2).sum() for x in optree_leaves(p)))
    except ValueError as e:
        return str(e)
    return ""


def optree_leaves(tree):
    import optree

    return optree.tree_leaves(tree)
