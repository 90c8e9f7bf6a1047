"""Per-rank bodies of the SOAP and Shampoo backend tests: each rule under ZeRO's hybrid plans and
over FSDP2's params against one process, with the runs of each whole-matrix kernel per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import ddp_grads, groups_of, make_model, same_on_every_rank, side_by_side

import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.functional.contrib import kronecker
from zero.plans.costs import cost_of


# refreshed within the tests' steps: SOAP's bases every 3 steps, Shampoo's roots every 3 (blocks of 16)
def by_name(tree):
    """Factors by name, as practice routes: the first layer (the 'embedding') and the biases without,
    the other weights as torch's (out, in) matrices."""
    dims = zf.contrib.MuonDimensionNumbers(1, 0)
    return {n: dims if n.endswith("weight") and not n.startswith("0.") else None for n in tree}


RULES = {"soap": lambda: zf.contrib.soap(1e-2, weight_decay=0.01, precondition_frequency=3),
         "soap_by_name": lambda: zf.contrib.soap(1e-2, precondition_frequency=3, weight_dimension_numbers=by_name),
         "shampoo": lambda: zf.contrib.shampoo(1e-2, graft_type="rmsprop", start_preconditioning_step=3,
                                               preconditioning_compute_steps=3, block_size=16)}


def _runs() -> int:
    return sum(kronecker.CALLS.values())


def under_zero(rank: int, world_size: int, rule: str, steps: int = 9) -> dict:
    """``rule`` under ``ZeroRedundancyOptimizer(strategy="flat")`` (a hybrid plan the rule makes:
    the tensors with factors whole) against one process, float64, two param groups, a frozen
    bias; this rank's kernel runs and state bytes beside the plan's."""
    ours_m, ref_m = make_model("plan"), make_model("plan")
    named = rule.endswith("by_name")  # the rule asks for names: the params go in named
    ours = Zero(ours_m.named_parameters() if named else groups_of(ours_m, False), RULES[rule](), strategy="flat")
    ref = zf.Optimizer(ref_m.named_parameters() if named else groups_of(ref_m, False), RULES[rule]())
    runs = 0

    def step(opt):
        nonlocal runs
        before = _runs()
        opt.step()
        runs += _runs() - before if opt is ours else 0

    worst = side_by_side([(ours_m, ours), (ref_m, ref)], lambda k: ddp_grads(list(ours_m.parameters()), k, rank,
                                                                               world_size), range(steps), step=step)
    plan = ours.plan
    spec = cost_of(plan.optimizer)
    mine = [i for i in plan.whole if plan.partition.owner[i] == rank]
    counts = [None] * world_size
    dist.all_gather_object(counts, runs)
    return {"worst": worst, "same": same_on_every_rank(ours_m), "runs": runs, "all_runs": counts,
            "optimizer": plan.optimizer, "whole": [plan.metas[i].name for i in plan.whole],
            "owned_whole": [plan.metas[i].name for i in mine],
            "state_bytes": ours.optim.state_nbytes(), "planned": plan.ranks[rank].state_bytes,
            "factored": {m.name: spec.whole(m) for m in plan.metas}}


def over_fsdp2(rank: int, world_size: int, rule: str, steps: int = 7) -> dict:
    """``rule`` over a ``fully_shard``-ed model (the FSDP2 owner path): this rank's kernel runs
    and owned params, and (on rank 0, which alone runs one process's steps beside; nan elsewhere)
    the params against one process."""
    import fsdp2_workers as fw

    model = fw.sharded(fw.make_model())
    alone = fw.make_model() if rank == 0 else None
    opt = zf.Optimizer(model.parameters(), RULES[rule]())
    ref = zf.Optimizer(alone.parameters(), RULES[rule]()) if alone is not None else None
    runs = 0
    for k in range(steps):
        grads = fw.fixed_grads(model, k)
        fw.set_grads(model, grads)
        before = _runs()
        opt.step()
        runs += _runs() - before
        if ref is not None:
            fw.set_grads(alone, grads)
            ref.step()
    whole = [fw.full(a.detach()) for a in model.parameters()]  # a collective: every rank takes part
    worst = float("nan") if alone is None else max(float((a - b.detach()).abs().max() / b.detach().abs().max())
                                                   for a, b in zip(whole, alone.parameters()))
    counts = [None] * world_size
    dist.all_gather_object(counts, runs)
    return {"worst": worst, "runs": runs, "all_runs": counts, "owned": len(opt.executor.plan.owned(rank))}


def zero_leg(rank: int, world_size: int, rule: str, load_from: str | None, save_to: str | None, start: int,
             steps: int) -> list[torch.Tensor]:
    """``rule`` under ZeRO's hybrid plan at this world size: load the sharded checkpoint at
    ``load_from`` (saved under another plan), step ``start`` .. ``start + steps`` on fixed
    gradients, save to ``save_to``; the params."""
    from helpers import fixed_grads, set_grads

    from zero.backends import checkpoint

    model = make_model("plan")
    opt = Zero(groups_of(model, False), RULES[rule](), strategy="flat")
    if load_from:
        checkpoint.load(load_from, model, opt)
    for k in range(start, start + steps):
        set_grads(model, fixed_grads(list(model.parameters()), k))
        opt.step()
    if save_to:
        checkpoint.save(save_to, model, opt)
    return [p.detach().clone() for p in model.parameters()]


def one_process(rank: int, world_size: int, rule: str, steps: int) -> list[torch.Tensor]:
    from helpers import fixed_grads, set_grads

    model = make_model("plan")
    opt = zf.Optimizer(groups_of(model, False), RULES[rule]())
    for k in range(steps):
        set_grads(model, fixed_grads(list(model.parameters()), k))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
