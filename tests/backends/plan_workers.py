"""Per-rank bodies of the plan-execution tests: `ZeroRedundancyOptimizer(plan=...)` against one process.

Every body trains the model twice on the same gradients (each rank's own, all-reduced and
averaged, as DDP leaves them): once sharded by the plan, once by one optimizer over all params.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from helpers import CommCounter, ddp_grads, fixed_grads, groups_of, make_model, set_grads, side_by_side, worst

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import comm
from zero.backends.local_optimizer import state_nbytes
from zero.plans.footprint import footprint
from zero.plans.plan import PLAN_STRATEGIES

RULES = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), "adamw"),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3), "sgd_momentum"),
    "clip_adamw": (zf.chain(zf.clip_by_global_norm(1.0), zf.adamw(1e-2, weight_decay=0.1)), {}, None),
    "lamb": (zf.lamb(1e-2, weight_decay=0.01), {}, None),
    # rules that read whole tensors' axes: units, rows, mean squares summed over every rank's pieces
    "whole_tensor_rules": (zf.chain(zf.adaptive_grad_clip(0.05), zf.centralize(), zf.clip_by_block_rms(0.02),
                                    zf.sgd(1e-2, momentum=0.9)), {}, None),
}


def reference(name: str, groups: list[dict]) -> torch.optim.Optimizer:
    rule, kwargs, _ = RULES[name]
    if isinstance(rule, type):
        return rule(groups, **kwargs)
    return zf.Optimizer(groups, rule)


def train_pair(rank: int, world_size: int, name: str, plan_of, steps: int, mixed: bool = False) -> dict:
    """Train ours under ``plan_of(metas, world_size)`` and one process side by side; report the largest
    relative difference, whether bf16 params are bit-equal, state bytes and collectives per step."""
    ours_m, ref_m = make_model("plan", mixed=mixed), make_model("plan", mixed=mixed)
    rule, kwargs, accounting = RULES[name]
    functional = not isinstance(rule, type)
    groups = groups_of(ours_m, not functional)
    plan = plan_of(zero.param_metas(groups), world_size)
    ours = Zero(groups, rule, plan=plan, **kwargs)
    ref = reference(name, groups_of(ref_m, not functional))
    counts = []

    def step(opt):
        if opt is not ours:
            return opt.step()
        with CommCounter() as c:
            ours.step()
        counts.append((c.calls("all_gather_rows"), c.calls("all_reduce_sum")))

    largest = side_by_side([(ours_m, ours), (ref_m, ref)],
                           lambda k: ddp_grads(list(ours_m.parameters()), k, rank, world_size), range(steps),
                           step=step)
    bf16_equal = all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), ref_m.parameters())
                     if a.dtype == torch.bfloat16)
    return {"worst": largest, "bf16_equal": bf16_equal, "counts": counts, "state_bytes": state_nbytes(ours.optim),
            "plan_state_bytes": zero.make_plan(plan.metas, world_size, plan.strategy, plan.weight,
                                               accounting or "sgd").ranks[rank].state_bytes,
            "buffers": len(plan.flat.buffers) if plan.flat else None}


def flat(metas, world_size):
    return zero.make_plan(metas, world_size, "flat")


def flat_matrix(rank: int, world_size: int, steps: int = 20) -> dict:
    return {name: train_pair(rank, world_size, name, flat, steps) for name in RULES}


def flat_mixed(rank: int, world_size: int, steps: int = 12) -> dict:
    return {name: train_pair(rank, world_size, name, flat, steps, mixed=True) for name in ("adamw", "clip_adamw")}


def every_strategy(rank: int, world_size: int, steps: int = 6) -> dict:
    out = {}
    for strategy in PLAN_STRATEGIES:
        for weight in ("numel", "state_bytes"):
            def plan_of(metas, ws, s=strategy, w=weight):
                made = zero.make_plan(metas, ws, s, w, "adamw")
                return zero.Plan.from_json(made.to_json())  # a reloaded plan runs as the made one
            out[strategy, weight] = train_pair(rank, world_size, "adamw", plan_of, steps)
    out["clip_whole"] = train_pair(rank, world_size, "clip_adamw", lambda m, ws: zero.make_plan(m, ws), steps)
    return out


def different_plans(rank: int, world_size: int) -> dict:
    """Rank 0 executes a flat plan, the others sorted_greedy: the first step must say so on every rank."""
    model = make_model("plan")
    groups = groups_of(model)
    strategy = "flat" if rank == 0 else "sorted_greedy"
    opt = Zero(groups, torch.optim.AdamW, plan=zero.make_plan(zero.param_metas(groups), world_size, strategy), lr=1e-2)
    set_grads(model, ddp_grads(list(model.parameters()), 0, rank, world_size))
    try:
        opt.step()
    except ValueError as e:
        return {"message": str(e)}
    return {"message": None}


def reshard_leg(rank: int, world_size: int, strategy: str, load_from: str | None, save_to: str,
                start: int, steps: int, masters: bool = False) -> dict:
    """Train ``steps`` steps from ``start`` under ``strategy``, resuming from ``load_from``; save the
    global state. ``masters``: bf16 params stepped on fp32 masters (which travel in the state)."""
    model = make_model("plan", dtype=torch.bfloat16) if masters else make_model("plan")
    if load_from:
        saved = torch.load(load_from, weights_only=True)
        model.load_state_dict(saved["model"])
    groups = groups_of(model)
    opt = Zero(groups, torch.optim.AdamW, strategy=strategy, master_dtype=torch.float32 if masters else None,
               lr=1e-2, weight_decay=0.1)
    if load_from:
        opt.load_state_dict(saved["optim"])
    for step in range(start, start + steps):
        set_grads(model, fixed_grads(list(model.parameters()), step))
        opt.step()
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        state = opt.state_dict()
        plain = torch.optim.AdamW(groups_of(make_model("plan")), lr=1e-2, weight_decay=0.1)
        plain.load_state_dict(state)  # the plain torch format, loadable by torch's own class
        torch.save({"model": model.state_dict(), "optim": state}, save_to)
    dist.barrier()
    return {"params": [p.detach().double().numpy().copy() for p in model.parameters()]}


def single_process(steps: int) -> list[torch.Tensor]:
    model = make_model("plan")
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        set_grads(model, fixed_grads(list(model.parameters()), step))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _batch(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randn(6, 7, generator=gen, dtype=torch.float64)


def _iteration(model, opt, no_sync, step: int, rank: int, micro: int, counter=None) -> int | None:
    """One step; returns what ``counter`` counted as reduce-scattered by the end of backward.
    ``no_sync`` None: every micro-batch's backward reduces (the gradients accumulate reduced)."""
    for m in range(micro):
        with no_sync() if no_sync is not None and m < micro - 1 else contextlib.nullcontext():
            model(_batch(step, rank, m)).square().mean().backward()
    during_backward = counter.bytes("reduce_scatter_sum") if counter else None
    opt.step()
    opt.zero_grad()
    return during_backward


def reduce_scatter_vs_ddp(rank: int, world_size: int, name: str, steps: int = 6, micro: int = 1,
                          bucket_numel: int | None = 700, no_sync: bool = True) -> dict:
    """Ours (flat plan, gradients reduce-scattered, no DDP) against DDP + one optimizer over all params,
    each rank on its own data, ``micro`` micro-batches per step (all but the last under no_sync, or
    with ``no_sync=False`` each reduced as it comes, on both sides). Also the gradient bytes a
    rank holds after each backward: params' grads and whole-size buckets (the shards aside)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours_m, ref_m = make_model("plan", rank), make_model("plan", 0)  # ours starts from rank 0's params by broadcast
    rule, kwargs, _ = RULES[name]
    functional = not isinstance(rule, type)
    groups = groups_of(ours_m, not functional)
    plan = zero.make_plan(zero.param_metas(groups), world_size, "flat", bucket_numel=bucket_numel)
    ours = Zero(groups, rule, plan=plan, reduce_scatter_grads=True, **kwargs)
    ddp = DDP(ref_m, bucket_cap_mb=0.005)
    ref = reference(name, groups_of(ref_m, not functional))
    largest, moved = 0.0, []
    for step in range(steps):
        with CommCounter() as c:
            in_backward = _iteration(ours_m, ours, ours.no_sync if no_sync else None, step, rank, micro, c)
        _iteration(ddp, ref, ddp.no_sync if no_sync else None, step, rank, micro)
        moved.append((c.bytes("reduce_scatter_sum"), c.bytes("all_gather_rows"), in_backward))
        largest = max(largest, worst(ours_m, ref_m))
    model_bytes = sum(p.numel() * p.element_size() for p in ours_m.parameters() if p.requires_grad)
    return {"worst": largest, "moved": moved, "model_bytes": model_bytes, "buffers": len(plan.flat.buffers),
            "padded_bytes": sum(b.padded_numel * 8 for b in plan.flat.buffers)}


def gradient_memory(rank: int, world_size: int, no_sync: bool) -> dict:
    """32 x Linear(512, 512) under a flat plan of 1 MiB buckets, gradients reduce-scattered, two
    micro-batches (the first under ``no_sync``, or each reduced as it comes): the gradient bytes
    this rank holds after each backward (params' grads and whole-size buckets; the shards apart)."""
    from torch import nn

    from zero.backends.grads.engine import IN_FLIGHT

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(32)])
    plan = zero.make_plan(zero.param_metas(model), world_size, "flat", bucket_numel=1 << 18)
    opt = Zero(model.parameters(), torch.optim.AdamW, plan=plan, reduce_scatter_grads=True, lr=1e-3)
    shards, held = opt.mode.gradients.source, []
    for m in range(2):
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(10 * rank + m))
        with opt.no_sync() if no_sync and m == 0 else contextlib.nullcontext():
            model(x).square().mean().backward()
        held.append(sum(p.grad.nbytes for p in model.parameters() if p.grad is not None) + shards.engine.held_bytes())
    opt.step()
    return {"held": held, "param_bytes": sum(p.nbytes for p in model.parameters()),
            "bucket_bytes": max(b.padded_numel for b in plan.flat.buffers) * 4, "in_flight": IN_FLIGHT,
            "shard_bytes": sum(g.nbytes for g in shards.outputs)}


def clip_vs_ddp(rank: int, world_size: int, how: str, norm_type: float = 2.0, hybrid: bool = False,
                max_norm: float = 0.1, steps: int = 5) -> dict:
    """Ours (flat plan, gradients reduce-scattered; ``hybrid``: matrices whole) clipping after each
    backward, against DDP + AdamW + ``torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)``:
    ``how`` "method" is ``opt.clip_grad_norm_``, "torch" torch's call on ``model.parameters()``,
    "value" ``clip_grad_value_`` on both sides. Reports both sides' norms and the params' gap."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours_m, ref_m = make_model("plan", rank), make_model("plan", 0)
    groups = groups_of(ours_m)
    whole = (lambda m: len(m.shape) == 2) if hybrid else None
    plan = zero.make_plan(zero.param_metas(groups), world_size, "flat", bucket_numel=700, whole=whole)
    ours = Zero(groups, torch.optim.AdamW, plan=plan, reduce_scatter_grads=True, lr=1e-2, weight_decay=0.1)
    ddp = DDP(ref_m, bucket_cap_mb=0.005)
    ref = torch.optim.AdamW(groups_of(ref_m), lr=1e-2, weight_decay=0.1)
    norms, largest = [], 0.0
    for step in range(steps):
        pair = []
        for model, opt in ((ours_m, ours), (ddp, ref)):
            model(_batch(step, rank)).square().mean().backward()
            if how == "value":
                pair.append(torch.nn.utils.clip_grad_value_(model.parameters(), 2e-3))
            elif how == "method" and opt is ours:
                pair.append(float(ours.clip_grad_norm_(max_norm, norm_type)))
            else:
                pair.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
            opt.step()
            opt.zero_grad()
        norms.append(pair)
        largest = max(largest, worst(ours_m, ref_m))
    return {"norms": norms, "worst": largest}


RECORDED_MODES = {  # name: (strategy, whole, reduce_scatter_grads, parameters_as_bucket_view)
    "whole_rows": ("sorted_greedy", None, False, False), "whole_views": ("sorted_greedy", None, False, True),
    "flat": ("flat", None, False, None), "zero2": ("flat", None, True, None),
    "hybrid": ("flat", lambda m: len(m.shape) == 2, False, None),
    "hybrid_zero2": ("flat", lambda m: len(m.shape) == 2, True, None)}


def recorded_vs_plan(rank: int, world_size: int) -> dict:
    """Per mode of `RECORDED_MODES`, the collectives `zero.backends.comm.recording` saw in a
    step's iteration (the second), as sorted (kind, bytes), and the plan's footprint's."""
    out = {}
    for name, (strategy, whole, rs, view) in RECORDED_MODES.items():
        model = make_model("plan", rank)
        groups = groups_of(model)
        plan = zero.make_plan(zero.param_metas(groups), world_size, strategy, bucket_numel=700, whole=whole)
        opt = Zero(groups, torch.optim.AdamW, plan=plan, reduce_scatter_grads=rs, parameters_as_bucket_view=view,
                   lr=1e-2)
        for step in range(2):
            with comm.recording() as made:
                if rs:
                    model(_batch(step, rank)).square().mean().backward()
                else:
                    set_grads(model, ddp_grads(list(model.parameters()), step, rank, world_size))
                opt.step()
                opt.zero_grad()
        predicted = footprint(plan, rank, reduce_scatter_grads=rs, bucket_view=view).collectives
        out[name] = (sorted((c.kind, c.bytes) for c in made), [list(c) for c in predicted])
    return out


class _Experts(torch.nn.Module):
    """A layer, one of ``n`` experts (picked per call: conditional compute), a head."""

    def __init__(self, n: int):
        super().__init__()
        torch.manual_seed(3)
        self.inp = torch.nn.Linear(6, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(n))
        self.out = torch.nn.Linear(8, 2)
        self.double()  # float64: `worst` compares float64 params

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return self.out(torch.tanh(self.experts[e](torch.tanh(self.inp(x)))))


def unused_vs_ddp(rank: int, world_size: int, experts: int, hybrid: bool, micro: int = 1, steps: int = 5,
                  find_unused: bool = True, bucket_numel: int = 40) -> dict:
    """Ours (flat plan, gradients reduce-scattered, ``find_unused_parameters=True``; ``hybrid``: the
    experts whole) against DDP(find_unused_parameters=True) + AdamW, each rank on its own data
    and its own expert per micro-batch, (rank + step + micro) % experts: some experts sit out a
    rank's backward, or every rank's (``bucket_numel`` 40: each expert a bucket of its own; 200:
    experts share buckets). The params' gap, the warnings, or the error's text."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    ours_m, ref_m = _Experts(experts), _Experts(experts)
    whole = (lambda m: m.name.startswith("experts.")) if hybrid else None
    plan = zero.make_plan(zero.param_metas(ours_m), world_size, "flat", bucket_numel=bucket_numel, whole=whole)
    try:
        ours = Zero(ours_m, torch.optim.AdamW, plan=plan, reduce_scatter_grads=True,
                    find_unused_parameters=find_unused, lr=1e-2, weight_decay=0.1)
    except ValueError as e:
        return {"error": str(e)}
    ddp = DDP(ref_m, find_unused_parameters=True)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.1)
    largest, told = 0.0, []
    for step in range(steps):
        for model, opt in ((ours_m, ours), (ddp, ref)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    for m in range(micro):
                        e = (rank + step + m) % experts
                        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + 10 * rank + m),
                                        dtype=torch.float64)
                        model(x, e).square().mean().backward()
                    opt.step()
                except ValueError as err:
                    return {"error": str(err)}
            told += [str(w.message) for w in caught if "got no gradient on any rank" in str(w.message)]
            opt.zero_grad()
        largest = max(largest, worst(ours_m, ref_m))
    assert any(p.dtype == torch.float64 for p in ours_m.parameters())  # what worst compares
    return {"worst": largest, "told": told}
