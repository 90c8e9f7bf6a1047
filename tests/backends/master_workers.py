"""Per-rank bodies of the master-weight tests: bf16 params, fp32 masters, against one process.

The reference (`MasterReference`) is the recipe written out by hand: one process keeps fp32
copies of the bf16 params, steps the optimizer on them with the gradients cast to fp32, and
writes the copies rounded to bf16 into the params.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from helpers import ddp_grads, fixed_grads, groups_of, make_model, set_grads
from plan_workers import RULES
from torch import nn

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends.local_optimizer import state_nbytes
from zero.backends.precision import MASTER_KEY

BF16 = torch.bfloat16


class MasterReference:
    """One process: the optimizer steps fp32 copies of the params; the params get them rounded."""

    def __init__(self, groups: list[dict], make):
        self.params = [p for g in groups for p in g["params"]]
        self.masters = [p.detach().float() for p in self.params]
        by_id = {id(p): m for p, m in zip(self.params, self.masters)}
        self.optim = make([{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in groups])

    @torch.no_grad()
    def step(self, grads: list | None = None) -> None:
        """``grads``: the masters' gradients where they are not the params' cast up."""
        for k, (p, m) in enumerate(zip(self.params, self.masters)):
            m.grad = grads[k] if grads is not None else None if p.grad is None else p.grad.float()
        self.optim.step()
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                p.copy_(m)


def make_rule(name: str):
    rule, kwargs, _ = RULES[name]
    if isinstance(rule, type):
        return lambda groups: rule(groups, **kwargs)
    return lambda groups: zf.Optimizer(groups, rule)


def masters_vs_reference(rank: int, world_size: int, name: str, strategy: str, steps: int = 12) -> dict:
    """Ours with ``master_dtype=float32`` on bf16 params under ``strategy`` against `MasterReference`
    on the same (DDP-averaged) gradients; the masters compared after consolidation on rank 0."""
    ours_m, ref_m = make_model("plan", dtype=BF16), make_model("plan", dtype=BF16)
    rule, kwargs, accounting = RULES[name]
    functional = not isinstance(rule, type)
    groups = groups_of(ours_m, not functional)
    plan = zero.make_plan(zero.param_metas(groups), world_size, strategy, optimizer=accounting or "sgd",
                          master_dtype="float32")
    ours = Zero(groups, rule, plan=plan, **kwargs)
    ref = MasterReference(groups_of(ref_m, not functional), make_rule(name))
    for step in range(steps):
        grads = ddp_grads(list(ours_m.parameters()), step, rank, world_size)
        set_grads(ours_m, grads)
        set_grads(ref_m, grads)
        ours.step()
        ref.step()
    bf16_equal = all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), ref_m.parameters()))
    bf16_differ = sum(int((a != b).sum()) for a, b in zip(ours_m.parameters(), ref_m.parameters()))
    measured = state_nbytes(ours.optim), ours.masters.nbytes()
    cost = plan.ranks[rank]
    ours.consolidate_state_dict(to=0)
    out = {"bf16_equal": bf16_equal, "bf16_differ": bf16_differ, "measured": measured,
           "planned": (cost.state_bytes, cost.master_bytes),
           "state_dtypes": sorted({str(v.dtype) for st in ours.optim.state.values() for v in st.values()
                                   if isinstance(v, torch.Tensor) and v.dim()})}
    if rank == 0:
        saved = ours.state_dict()["state"]
        diffs = [_rel(saved[i][MASTER_KEY], m) for i, m in enumerate(ref.masters) if i in saved]
        out["masters_exact"] = all(d == 0 for d in diffs)
        out["masters_rel"] = max(diffs)
        out["n_masters"] = len(diffs)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the tensor's largest value (elements near 0 have no
    meaningful relative error in fp32)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def single_process(steps: int) -> list[torch.Tensor]:
    model = make_model("plan", dtype=BF16)
    ref = MasterReference(groups_of(model), make_rule("adamw"))
    for step in range(steps):
        set_grads(model, fixed_grads(list(model.parameters()), step))
        ref.step()
    return [p.detach().double() for p in model.parameters()]


def _batch(step: int, rank: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randn(6, 7, generator=gen).to(BF16)


def reduce_scattered(rank: int, world_size: int, reduce_dtype, steps: int = 6, micro: int = 2) -> dict:
    """Flat plan, gradients reduce-scattered in ``reduce_dtype``, fp32 masters, ``micro``
    micro-batches under no_sync; against `MasterReference` on the gradients summed by hand:
    each rank's bf16 gradients, summed over micro-batches and ranks in ``reduce_dtype``."""
    ours_m, ref_m = make_model("plan", dtype=BF16), make_model("plan", dtype=BF16)
    groups = groups_of(ours_m)
    ours = Zero(groups, torch.optim.AdamW, strategy="flat", reduce_scatter_grads=True, master_dtype=torch.float32,
                reduce_dtype=reduce_dtype, lr=1e-2, weight_decay=0.1)
    ref = MasterReference(groups_of(ref_m), make_rule("adamw"))
    for step in range(steps):
        for m in range(micro):
            with ours.no_sync() if m < micro - 1 else contextlib.nullcontext():
                ours_m(_batch(step, rank, m)).square().mean().backward()
        ours.step()
        ours.zero_grad()
        ref.step(_reference_grads(ref_m, step, rank, world_size, micro, reduce_dtype or BF16))
    worst = max(_rel(a, b.float()) for a, b in zip(ours_m.parameters(), ref_m.parameters()))
    equal = all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), ref_m.parameters()))
    shard_grads = ours.mode.gradients.source.outputs
    return {"worst": worst, "equal": equal, "grad_dtypes": sorted({str(g.dtype) for g in shard_grads})}


def _reference_grads(model: nn.Module, step: int, rank: int, world_size: int, micro: int, dtype) -> list:
    sums = [torch.zeros(p.shape, dtype=dtype) for p in model.parameters()]
    for m in range(micro):
        model.zero_grad()
        model(_batch(step, rank, m)).square().mean().backward()
        for s, p in zip(sums, model.parameters()):
            if p.grad is not None:
                s.add_(p.grad)
    model.zero_grad()
    grads = []
    for s, p in zip(sums, model.parameters()):
        dist.all_reduce(s)
        grads.append((s / world_size).float() if p.requires_grad else None)
        p.grad = torch.zeros_like(p) if p.requires_grad else None  # only its presence is read (write-back)
    return grads


def inf_on_one_shard(rank: int, world_size: int, steps: int = 6, sharded: bool = True) -> dict:
    """fp16 params, fp32 masters, gradients reduce-scattered in fp32, a dynamic loss scale: rank
    1's gradient of one param is inf at steps 2 and 4 (only its input to the reduce-scatter)."""
    from zero.backends import ShardedGradScaler

    model = make_model("plan", dtype=torch.float16)
    groups = groups_of(model)
    opt = Zero(groups, torch.optim.AdamW, strategy="flat", reduce_scatter_grads=True, master_dtype=torch.float32,
               reduce_dtype=torch.float32, lr=1e-2)
    scaler = (ShardedGradScaler if sharded else torch.amp.GradScaler)("cpu", init_scale=2.0**10, growth_interval=2)
    target = list(model.parameters())[-2]
    history = []
    for step in range(steps):
        loss = model(_batch(step, rank, 0).half()).float().square().mean()
        hook = target.register_hook(lambda g: torch.full_like(g, float("inf"))) \
            if rank == 1 and step in (2, 4) else None
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            scaler.step(opt)
        except ValueError as e:
            return {"error": str(e)}
        scaler.update()
        opt.zero_grad()
        moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        history.append((float(scaler.get_scale()), moved))
    params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return {"history": history, "params": params.numpy(), "finite": bool(params.isfinite().all())}


def cuda_masters(rank: int, world_size: int, strategy: str, steps: int = 8) -> dict:
    """On one GPU (NCCL): bf16 params on fp32 masters against `MasterReference` with fused AdamW,
    and the bytes the optimizer allocates (masters + state) against the plan's figures."""
    device = torch.device("cuda", rank)
    ours_m, ref_m = make_model("plan", dtype=BF16).to(device), make_model("plan", dtype=BF16).to(device)
    groups = groups_of(ours_m)
    plan = zero.make_plan(zero.param_metas(groups), world_size, strategy, optimizer="adamw", master_dtype="float32")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    ours = Zero(groups, torch.optim.AdamW, plan=plan, lr=1e-2, weight_decay=0.1, fused=True)
    ref = MasterReference(groups_of(ref_m),
                          lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, fused=True))
    for step in range(steps):
        grads = [None if g is None else g.to(device) for g in fixed_grads(list(ours_m.parameters()), step)]
        set_grads(ours_m, grads)
        set_grads(ref_m, grads)
        ours.step()
        ref.step()
    held = state_nbytes(ours.optim) + ours.masters.nbytes()
    return {"equal": all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), ref_m.parameters())),
            "held": held, "planned": plan.ranks[rank].state_bytes + plan.ranks[rank].master_bytes,
            "allocated_since": torch.cuda.memory_allocated(device) - before}
