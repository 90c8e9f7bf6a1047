"""Per-rank bodies of the post-local SGD tests (run by `distributed.run_ranks`).

Each body trains two copies of one model side by side on the same gradients: ours
(`zero.backends` averagers and `PostLocalSGDOptimizer`) and torch's, and compares the params
exactly after every step. Gradients differ across ranks after the warm-up (local SGD), so the
averaging is what keeps replicas together.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from helpers import CommCounter, assert_params_close, ddp_grads, groups_of, make_model, same_on_every_rank, set_grads
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager as TorchHierarchical,
)
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGD
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

import zero
from zero.backends import (
    HierarchicalModelAverager,
    PeriodicModelAverager,
    PostLocalSGDOptimizer,
    ZeroRedundancyOptimizer,
    register_post_local_sgd_hook,
)
from zero.backends.local_optimizer import state_nbytes

LOCAL = {"sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)), "adam": (torch.optim.Adam, dict(lr=1e-2))}
WARMUP = 3


def averagers(kind: str, world_size: int):
    """(ours, torch's), built in the same order on every rank (the hierarchical ones make groups)."""
    if kind == "periodic":
        return PeriodicModelAverager(3, WARMUP), torch_averagers.PeriodicModelAverager(3, WARMUP)
    levels = {2: 2, 6: world_size}
    return HierarchicalModelAverager(levels, WARMUP), TorchHierarchical(levels, WARMUP)


def local_sgd_grads(params, step: int, rank: int, world_size: int, group=None) -> list:
    """All-reduced over the world during the warm-up, then over ``group`` (None: this rank's own)."""
    if step < WARMUP:
        return ddp_grads(params, step, rank, world_size)
    if group is None:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        return [torch.randn(p.shape, generator=gen, dtype=p.dtype) if p.requires_grad else None for p in params]
    return ddp_grads(params, step, rank, dist.get_world_size(group), group=group)


def parity(rank: int, world_size: int, kind: str, local: str, steps: int = 14) -> dict:
    """Ours vs torch's, one layer frozen, two param groups; reload mid-run and continue alike."""
    cls, kw = LOCAL[local]
    ours_m, theirs_m = make_model("small"), make_model("small")
    for m in (ours_m, theirs_m):
        m[1].weight.requires_grad_(False)
    ours_avg, theirs_avg = averagers(kind, world_size)
    ours = PostLocalSGDOptimizer(cls(groups_of(ours_m), **kw), ours_avg)
    theirs = TorchPostLocalSGD(cls(groups_of(theirs_m), **kw), theirs_avg)
    sizes, resumed = [], None
    for step in range(steps):
        if step == 7:
            resumed = _resume(ours, ours_m, kind, world_size, cls, kw)
        grads = local_sgd_grads(list(ours_m.parameters()), step, rank, world_size)
        models = [(ours_m, ours), (theirs_m, theirs)] + ([resumed] if resumed else [])
        for m, _ in models:
            set_grads(m, grads)
        with CommCounter() as count:
            ours.step()
        sizes.append(count.group_sizes("all_reduce_sum"))
        if sizes[-1] == [world_size]:
            assert same_on_every_rank(ours_m), f"{kind}/{local} step {step}: replicas differ after a global average"
        theirs.step()
        if resumed:
            resumed[1].step()
            assert_params_close(resumed[0], ours_m, exact=True, what=f"{kind}/{local} resumed at 7, step {step}")
        assert_params_close(ours_m, theirs_m, exact=True, what=f"{kind}/{local} step {step} vs torch")
    assert ours_m[1].weight.equal(make_model("small")[1].weight), "a frozen param is neither stepped nor averaged"
    return {"sizes": sizes, "step": ours.averager.step}


def _resume(ours, ours_m, kind, world_size, cls, kw):
    """A fresh model, optimizer and averager loaded from ``ours``' state dict at this point."""
    sd = copy.deepcopy(ours.state_dict())
    model = copy.deepcopy(ours_m)
    fresh = PostLocalSGDOptimizer(cls(groups_of(model), **kw), averagers(kind, world_size)[0])
    fresh.load_state_dict(sd)
    assert fresh.averager.step == ours.averager.step == sd["step"] == 7
    return model, fresh


def parity_matrix(rank: int, world_size: int) -> dict:
    return {(kind, local): parity(rank, world_size, kind, local)
            for kind in ("periodic", "hierarchical") for local in LOCAL}


def with_zero(rank: int, world_size: int, steps: int = 12) -> dict:
    """Local SGD with sharded optimizer state: ZeRO over pairs of ranks, averaging across all.

    Gradients are all-reduced within each pair after the warm-up (what post_localSGD_hook does
    with a subgroup); ours runs with bucket views, which in-place averaging keeps as views.
    """
    pair, _ = dist.new_subgroups(2)
    ours_m, theirs_m = make_model("small"), make_model("small")
    ours = PostLocalSGDOptimizer(
        ZeroRedundancyOptimizer(groups_of(ours_m), torch.optim.Adam, process_group=pair,
                                parameters_as_bucket_view=True, lr=1e-2),
        PeriodicModelAverager(2, WARMUP))
    theirs = TorchPostLocalSGD(TorchZero(groups_of(theirs_m), torch.optim.Adam, process_group=pair, lr=1e-2),
                               torch_averagers.PeriodicModelAverager(2, WARMUP))
    ptrs = [p.data_ptr() for p in ours_m.parameters()]
    for step in range(steps):
        grads = local_sgd_grads(list(ours_m.parameters()), step, rank, world_size, group=pair)
        for m, opt in ((ours_m, ours), (theirs_m, theirs)):
            set_grads(m, grads)
            opt.step()
        assert_params_close(ours_m, theirs_m, exact=True, what=f"ZeRO local optimizer, step {step}")
        assert same_on_every_rank(ours_m, group=pair), f"step {step}: the pair's replicas differ"
    assert ptrs == [p.data_ptr() for p in ours_m.parameters()], "params are still views into the buckets"
    plan = zero.make_plan(zero.param_metas(ours.param_groups), 2, optimizer="adam")
    ours.consolidate_state_dict(to=0)
    sd = ours.state_dict() if dist.get_rank(pair) == 0 else None
    return {"state_bytes": state_nbytes(ours.optim.optim), "plan_bytes": plan.ranks[dist.get_rank(pair)].state_bytes,
            "same_everywhere": same_on_every_rank(ours_m), "sd_step": None if sd is None else sd["step"]}


def with_ddp_hook(rank: int, world_size: int, steps: int = 10) -> dict:
    """DDP + post_localSGD_hook (subgroups of 2) + SGD: ours paired by register_post_local_sgd_hook."""
    pair, _ = dist.new_subgroups(2)
    ours_m, theirs_m = DDP(make_model("small")), DDP(make_model("small"))
    ours_avg = PeriodicModelAverager(4, WARMUP)
    hook_state = register_post_local_sgd_hook(ours_m, ours_avg, subgroup=pair)
    theirs_m.register_comm_hook(PostLocalSGDState(None, pair, start_localSGD_iter=WARMUP), post_localSGD_hook)
    ours = PostLocalSGDOptimizer(torch.optim.SGD(ours_m.parameters(), lr=0.01), ours_avg, hook_state=hook_state)
    theirs = TorchPostLocalSGD(torch.optim.SGD(theirs_m.parameters(), lr=0.01),
                               torch_averagers.PeriodicModelAverager(4, WARMUP))
    for step in range(steps):
        x = torch.randn(5, 7, generator=torch.Generator().manual_seed(100 * step + rank))
        for m, opt in ((ours_m, ours), (theirs_m, theirs)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        assert_params_close(ours_m.module, theirs_m.module, exact=True, what=f"DDP + hook, step {step}")
    return {"iter": hook_state.iter, "step": ours_avg.step, "same": same_on_every_rank(ours_m.module),
            "same_in_pair": same_on_every_rank(ours_m.module, group=pair)}


def mixed_dtypes(rank: int, world_size: int) -> dict:
    """fp32 + bf16 + fp64 params, different on every rank: averaged to the float64 mean, rounded once."""
    from zero.backends import average_parameters

    model = make_model("small", dtypes=(torch.float32, torch.bfloat16, torch.float64))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * rank + i)).to(p.dtype))
            p.grad = torch.zeros_like(p)
    exact = []
    for p in model.parameters():
        every = [torch.empty_like(p, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(every, p.detach().to(torch.float64))
        exact.append(torch.stack(every).mean(0))
    with CommCounter() as count:
        average_parameters(model.parameters())
    for p, want in zip(model.parameters(), exact):
        tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 8e-3}[p.dtype]
        torch.testing.assert_close(p.to(torch.float64), want.to(p.dtype).to(torch.float64), rtol=tol, atol=tol)
    return {"reduces": count.calls("all_reduce_sum"), "same": same_on_every_rank(model)}
