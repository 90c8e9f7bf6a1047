"""Per-rank bodies of the hybrid-plan tests: flat plans that keep some params whole, for the rules
that need them whole (Muon, Adafactor, SM3, NovoGrad), against one process."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from helpers import (
    CountingCalls,
    fixed_grads,
    groups_of,
    make_model,
    mode_name,
    same_on_every_rank,
    set_grads,
    train,
    worst,
)
from helpers import side_by_side as side_by_side_steps
from muon_workers import side_by_side

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import checkpoint, comm
from zero.backends.local_optimizer import state_nbytes


def matrices(meta) -> bool:
    return len(meta.shape) == 2


def everything(meta) -> bool:
    return True


def first_weight(meta) -> bool:
    return meta.shape == (33, 7)

# name: (transformation, whole=, plan optimizer): make_model's weights are 33x7, 5x33, 64x5, 40x64
# and 3x40; Adafactor factors the four whose smaller side is at least 5 and steps the 3x40 (and
# the biases) element by element, in the shards.
RULES = {
    "muon": (lambda: zf.contrib.muon(0.02, weight_decay=0.01, adam_weight_decay=0.01), None, "muon"),
    "adafactor": (lambda: zf.adafactor(1e-2, min_dim_size_to_factor=5, weight_decay_rate=0.01),
                  lambda m: len(m.shape) == 2 and min(m.shape) >= 5, "sgd"),
    "sm3": (lambda: zf.sm3(1e-2), matrices, "sgd"),
    "novograd": (lambda: zf.novograd(1e-2, weight_decay=0.01), everything, "sgd"),
    # rules that read whole tensors' axes, on whole params and on shards in one step
    "axis_rules": (lambda: zf.chain(zf.adaptive_grad_clip(0.05), zf.centralize(), zf.clip_by_block_rms(0.02),
                                    zf.sgd(1e-2, momentum=0.9)), first_weight, "sgd_momentum"),
}


def hybrid_plan(groups, world_size: int, rule: str, whole=RULES, weight: str = "numel"):
    _, default_whole, optimizer = RULES[rule]
    return zero.make_plan(zero.param_metas(groups), world_size, "flat", weight, optimizer,
                          whole=default_whole if whole is RULES else whole)


def rules_vs_one_process(rank: int, world_size: int, rules: list[str], steps: int = 20) -> dict:
    """`rule_vs_one_process` for each of ``rules`` (``"muon_by_name"``: `named_muon`), in one set of ranks."""
    return {rule: named_muon(rank, world_size, steps) if rule == "muon_by_name" else
            rule_vs_one_process(rank, world_size, rule, steps) for rule in rules}


def rule_vs_one_process(rank: int, world_size: int, rule: str, steps: int = 20) -> dict:
    """``rule`` under its hybrid plan and one process, float64, two param groups, one frozen
    bias; each rank counts its Newton-Schulz runs."""
    ours_m, ref_m = make_model("plan"), make_model("plan")
    groups = groups_of(ours_m, False)
    plan = hybrid_plan(groups, world_size, rule, weight="step_flops" if rule == "muon" else "numel")
    ours = Zero(groups, RULES[rule][0](), plan=plan)
    ref = zf.Optimizer(groups_of(ref_m, False), RULES[rule][0]())
    calls, largest = side_by_side(ours_m, ours, ref_m, ref, rank, world_size, steps)
    owned = [i for i in plan.partition.params_of(rank) if len(plan.metas[i].shape) == 2]
    counts = [None] * world_size
    dist.all_gather_object(counts, calls)
    return {"worst": largest, "same": same_on_every_rank(ours_m), "calls": calls, "owned_matrices": len(owned),
            "all_calls": counts, "whole": len(plan.whole), "buffers": len(plan.flat.buffers),
            "mode": mode_name(ours)}


def refused(rank: int, world_size: int, rule: str, whole) -> str:
    """The error a step of ``rule`` under a hybrid plan keeping ``whole`` whole raises on this rank
    (a rank whose shards hold no piece of the tensor fails in the next collective instead)."""
    model = make_model("plan")
    groups = groups_of(model, False)
    opt = Zero(groups, RULES[rule][0](), plan=hybrid_plan(groups, world_size, rule, whole))
    set_grads(model, fixed_grads(list(model.parameters()), 0))
    try:
        opt.step()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def adamw_leg(rank: int, world_size: int, load_from: str | None, save_to: str, start: int, steps: int) -> dict:
    """torch's AdamW under a hybrid plan (its matrices whole): resume from ``load_from``, train,
    save. A path ending ``.pt`` is a global (torch) state dict, any other a sharded checkpoint."""
    model = make_model("plan")
    groups = groups_of(model)
    plan = zero.make_plan(zero.param_metas(groups), world_size, "flat", optimizer="adamw", whole=matrices)
    opt = Zero(groups, torch.optim.AdamW, plan=plan, lr=1e-2, weight_decay=0.1)
    if load_from and not load_from.endswith(".pt"):
        checkpoint.load(load_from, model, opt)
    elif load_from:
        saved = torch.load(load_from, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    train(model, opt, range(start, start + steps))
    if not save_to.endswith(".pt"):
        checkpoint.save(save_to, model, opt)
    else:
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, save_to)
        dist.barrier()
    return {"params": [p.detach().double().numpy().copy() for p in model.parameters()],
            "state_bytes": state_nbytes(opt.optim), "planned": plan.ranks[rank].state_bytes}


def functional_resume(rank: int, world_size: int, steps: int = 10) -> float:
    """Muon's transformation state saved after ``steps`` and loaded into a fresh optimizer on the
    same plan: ``steps`` more equal ``2 * steps`` straight (largest relative difference)."""
    tx = RULES["muon"][0]
    straight_m, resumed_m = make_model("plan"), make_model("plan")
    straight_g, resumed_g = groups_of(straight_m, False), groups_of(resumed_m, False)
    plan = hybrid_plan(straight_g, world_size, "muon")
    straight = Zero(straight_g, tx(), plan=plan)
    first = Zero(resumed_g, tx(), plan=plan)
    grads = lambda k: fixed_grads(list(straight_m.parameters()), k)  # noqa: E731
    side_by_side_steps([(straight_m, straight), (resumed_m, first)], grads, range(steps))
    first.consolidate_state_dict(to=0)
    saved = [first.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(saved, src=0)
    resumed = Zero(resumed_g, tx(), plan=plan)
    resumed.load_state_dict(saved[0])
    return side_by_side_steps([(resumed_m, resumed), (straight_m, straight)], grads, range(steps, 2 * steps))


def one_tensor_shard(rank: int, world_size: int, steps: int = 5) -> float:
    """A flat plan whose rank-0 shard is exactly one whole 2x2 matrix while rank 1's holds two
    vectors: ``centralize`` (row means) must still take every rank through the same all-reduce
    and read the matrix's rows, not its flat shard's."""
    def params():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(*s, dtype=torch.float64)) for s in ((2, 2), (2,), (2,))]

    ours_p, ref_p = params(), params()
    tx = lambda: zf.chain(zf.centralize(), zf.sgd(0.1, momentum=0.9))  # noqa: E731
    ours = Zero(ours_p, tx(), strategy="flat")
    ref = zf.Optimizer(ref_p, tx())
    for step in range(steps):
        for ps in (ours_p, ref_p):
            for p, g in zip(ps, fixed_grads(ps, step)):
                p.grad = g
        ours.step()
        ref.step()
    return max(float((a - b).abs().max().detach()) for a, b in zip(ours_p, ref_p))


def by_name(tree):
    """Muon's dimension numbers by name, as Moonlight routes: the first layer (the 'embedding')
    and the biases to AdamW, the other weights to Muon as torch's (out, in) matrices."""
    dims = zf.contrib.MuonDimensionNumbers(1, 0)
    return {n: dims if n.endswith("weight") and not n.startswith("0.") else None for n in tree}


def muon_by_name(name: str) -> bool:
    return name.endswith("weight") and not name.startswith("0.")


def named_muon_tx():
    return zf.contrib.muon(0.02, weight_decay=0.01, adam_weight_decay=0.01, muon_weight_dimension_numbers=by_name)


def named_muon(rank: int, world_size: int, steps: int = 20) -> float:
    """Muon routed by name (`by_name`) under a hybrid plan whose whole params are those Muon
    weights (the first layer's weight stays flat, with AdamW): against one process."""
    ours_m, ref_m = make_model("plan"), make_model("plan")
    plan = zero.make_plan(zero.param_metas(ours_m), world_size, "flat", optimizer="muon",
                          whole=lambda m: muon_by_name(m.name))
    ours = Zero(ours_m.named_parameters(), named_muon_tx(), plan=plan)
    ref = zf.Optimizer(ref_m.named_parameters(), named_muon_tx())
    return side_by_side(ours_m, ours, ref_m, ref, rank, world_size, steps)[1]


def reduce_scattered_vs_ddp(rank: int, world_size: int, rules: list[str], steps: int = 6, micro: int = 2) -> dict:
    """Per rule: ours under its hybrid plan with ``reduce_scatter_grads=True`` (no DDP; params from
    rank 0's by broadcast) against DDP + one optimizer over all params, each rank on its own
    data, ``micro`` micro-batches a step (all but the last under ``no_sync``). Also: the whole
    params' reduces made during backward, and who holds their gradients (after backward no
    param holds one; after the step each owner keeps its own means only)."""
    from plan_workers import _batch, _iteration
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for rule in rules:
        ours_m, ref_m = make_model("plan", seed=rank), make_model("plan", seed=0)
        groups = groups_of(ours_m, False)
        plan = hybrid_plan(groups, world_size, rule)
        ours = Zero(groups, RULES[rule][0](), plan=plan, reduce_scatter_grads=True)
        ddp = DDP(ref_m, bucket_cap_mb=0.005)
        ref = zf.Optimizer(groups_of(ref_m, False), RULES[rule][0]())
        largest, kept, reduces = 0.0, True, []
        params = list(ours_m.parameters())
        for step in range(steps):
            with CountingCalls(comm, "reduce_sum_to") as count:  # the whole params' reduces, during backward
                for m in range(micro):
                    with ours.no_sync() if m < micro - 1 else contextlib.nullcontext():
                        ours_m(_batch(step, rank, m)).square().mean().backward()
            reduces.append(count.calls)
            kept &= all(params[i].grad is None for i in plan.whole)  # after backward: no rank holds one
            ours.step()
            mine = {i for i in plan.whole if plan.partition.owner[i] == rank}
            kept &= set(ours.mode.gradients.source.kept) == mine  # the owner only keeps its mean
            ours.zero_grad()
            _iteration(ddp, ref, ddp.no_sync, step, rank, micro)
            largest = max(largest, worst(ours_m, ref_m))
        out[rule] = {"worst": largest, "only_owners_keep_whole_grads": kept, "mode": mode_name(ours),
                     "reduces": reduces, "whole": len(plan.whole)}
    return out


def masters_reduced(rank: int, world_size: int, steps: int = 4) -> list:
    """bf16 params on fp32 masters, gradients reduced in fp32, AdamW: a hybrid plan (matrices
    whole) with ``reduce_scatter_grads=True``; returns the params (compared with a flat plan's)."""
    out = []
    for whole in (matrices, None):
        model = make_model("plan", seed=rank, dtype=torch.bfloat16)
        groups = groups_of(model)
        plan = zero.make_plan(zero.param_metas(groups), world_size, "flat", optimizer="adamw",
                              master_dtype="float32", whole=whole)
        opt = Zero(groups, torch.optim.AdamW, plan=plan, reduce_scatter_grads=True, master_dtype=torch.float32,
                   reduce_dtype=torch.float32, lr=1e-2, weight_decay=0.1)
        from plan_workers import _batch

        for step in range(steps):
            model(_batch(step, rank).to(torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        out.append([p.detach().float().numpy().copy() for p in model.parameters()])
    return out


def all_but_last_weight(meta) -> bool:
    """Every matrix whole but the 3x40 one: at 4 ranks its pieces lie on ranks 1-3, none on rank 0."""
    return len(meta.shape) == 2 and meta.shape != (3, 40)
