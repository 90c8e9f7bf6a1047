"""Per-rank bodies of the overlap tests: ZeRO stepping inside DDP's comm hook against DDP + one optimizer."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from helpers import groups_of, make_model
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import hook_with_zero_step, hook_with_zero_step_interleaved

RULES = {
    "sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    "adamw": (zf.from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), {}),
    "torch_adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "chain": (zf.chain(zf.add_decayed_weights(1e-3), zf.scale_by_adam(), zf.scale(-1e-2)), {}),
}
HOOKS = {"plain": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return model(torch.randn(6, 7, generator=gen, dtype=torch.float64)).square().mean()


def overlap_vs_ddp(rank: int, world_size: int, name: str, hook: str, shard_buckets: bool, static_graph: bool,
                   as_view: bool, steps: int = 6, mixed: bool = False, find_unused: bool = False) -> dict:
    """Worst relative difference of the float64 params after each of ``steps`` iterations, and
    whether every param (bf16 ones too) equals the reference's to the bit at the end."""
    rule, kwargs = RULES[name]
    torch_class = isinstance(rule, type)
    ours_m, ref_m = make_model("net", mixed=mixed), make_model("net", mixed=mixed)
    ddp_kw = dict(bucket_cap_mb=0.004, static_graph=static_graph, gradient_as_bucket_view=as_view,
                  find_unused_parameters=find_unused)
    ours_ddp, ref_ddp = DDP(ours_m, **ddp_kw), DDP(ref_m, **ddp_kw)
    zero = Zero(groups_of(ours_m, torch_class), rule, overlap_with_ddp=True, **kwargs)
    ours_ddp.register_comm_hook(None, HOOKS[hook](allreduce_hook, ours_ddp, zero, shard_buckets))
    ref = (rule(groups_of(ref_m, True), **kwargs) if torch_class else zf.Optimizer(groups_of(ref_m, False), rule))
    worst = []
    for step in range(steps):
        _loss(ours_ddp, step, rank).backward()
        zero.step()  # a no-op: the step ran inside backward
        zero.zero_grad()
        _loss(ref_ddp, step, rank).backward()
        ref.step()
        ref.zero_grad()
        worst.append(max(float(((a - b).abs() / b.abs().clamp_min(1e-12)).max().detach())
                         for a, b in zip(ours_m.parameters(), ref_m.parameters()) if a.dtype == torch.float64))
    equal = all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), ref_m.parameters()))
    return {"worst": worst, "equal": equal, "owners": list(zero.partition.owner)}


def matrix(rank: int, world_size: int) -> dict:
    out = {}
    for hook in HOOKS:
        for shard in (False, True):
            for static in (False, True):
                for view in (False, True):
                    out[hook, shard, static, view] = overlap_vs_ddp(rank, world_size, "sgd", hook, shard, static, view)
    return out


def rules(rank: int, world_size: int) -> dict:
    """from_torch(AdamW), torch's AdamW and a zero.functional chain; SGD with bf16 + float64 params;
    find_unused_parameters."""
    out = {name: overlap_vs_ddp(rank, world_size, name, "plain", True, False, False)
           for name in ("adamw", "torch_adamw", "chain")}
    out["mixed"] = overlap_vs_ddp(rank, world_size, "sgd", "interleaved", False, False, True, mixed=True)
    out["find_unused"] = overlap_vs_ddp(rank, world_size, "adamw", "plain", False, False, False, find_unused=True)
    return out


def checkpoint_between_modes(rank: int, world_size: int, path: str) -> dict:
    """3 overlapped iterations, consolidate, load into a non-overlapped ZeRO, 3 more; against DDP + SGD for 6."""
    rule, kwargs = RULES["sgd"]
    ours_m, ref_m = make_model("net"), make_model("net")
    ours_ddp, ref_ddp = DDP(ours_m, bucket_cap_mb=0.004), DDP(ref_m, bucket_cap_mb=0.004)
    zero = Zero(groups_of(ours_m, True), rule, overlap_with_ddp=True, **kwargs)
    ours_ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ours_ddp, zero))
    ref = rule(groups_of(ref_m, True), **kwargs)
    for step in range(3):
        _loss(ours_ddp, step, rank).backward()
        zero.zero_grad()
        _loss(ref_ddp, step, rank).backward()
        ref.step()
        ref.zero_grad()
    zero.consolidate_state_dict(to=0)
    saved = zero.state_dict() if rank == 0 else None
    box = [saved]
    dist.broadcast_object_list(box, src=0)
    plain_ddp = DDP(ours_m, bucket_cap_mb=0.004)
    after = Zero(groups_of(ours_m, True), rule, **kwargs)
    after.load_state_dict(box[0])
    for step in range(3, 6):
        _loss(plain_ddp, step, rank).backward()
        after.step()
        after.zero_grad()
        _loss(ref_ddp, step, rank).backward()
        ref.step()
        ref.zero_grad()
    return {"equal": all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), ref_m.parameters())),
            "torch_format": sorted(box[0]["state"][0])}


def no_cycle(rank: int, world_size: int) -> dict:
    model = make_model("net")
    ddp = DDP(model)
    zero = Zero(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    _loss(ddp, 0, rank).backward()
    ref = weakref.ref(ddp)
    del ddp
    gc.collect()
    return {"ddp_freed": ref() is None}


def global_norm_rule(rank: int, world_size: int) -> dict:
    """clip_by_global_norm needs every bucket at once: the backward that steps it must say so."""
    model = make_model("net")
    ddp = DDP(model)
    zero = Zero(model.parameters(), zf.chain(zf.clip_by_global_norm(1.0), zf.sgd(0.1)), overlap_with_ddp=True)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    try:
        _loss(ddp, 0, rank).backward()
    except RuntimeError as e:
        return {"message": str(e)}
    return {"message": None}


def torch_scenario(rank: int, world_size: int) -> dict:
    """The scenario of torch's own overlap test (``_test_ddp_zero_overlap``: Linear(1000, 2000),
    Linear(2000, 500), SGD(lr 0.01, momentum 0.9, weight decay 0.001), 5 inputs, loss = sum),
    for its 16 combinations, but with no warm-up iterations: ours must match DDP + SGD from the
    first. Returns, per combination, whether the params equal the reference's within torch's
    default float32 tolerances, and whether they moved at all."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 2000), nn.Linear(2000, 500))
    inputs = [torch.randn(1, 1000) for _ in range(5)]
    sgd = dict(lr=0.01, momentum=0.9, weight_decay=0.001)
    out = {}
    for hook in HOOKS:
        for shard in (False, True):
            for static in (False, True):
                for view in (False, True):
                    ours = DDP(copy.deepcopy(model), gradient_as_bucket_view=view, static_graph=static)
                    zero = Zero(ours.parameters(), torch.optim.SGD, overlap_with_ddp=True, **sgd)
                    ours.register_comm_hook(None, HOOKS[hook](allreduce_hook, ours, zero, shard_buckets=shard))
                    ref = DDP(copy.deepcopy(model), gradient_as_bucket_view=view, static_graph=static)
                    local = torch.optim.SGD(ref.parameters(), **sgd)
                    before = [p.detach().clone() for p in ours.parameters()]
                    for x in inputs:
                        zero.zero_grad()
                        ours(x).sum().backward()
                        local.zero_grad()
                        ref(x).sum().backward()
                        local.step()
                    close = all(torch.allclose(a, b, rtol=1.3e-6, atol=1e-5)
                                for a, b in zip(ours.parameters(), ref.parameters()))
                    moved = any(not torch.equal(a, b) for a, b in zip(ours.parameters(), before))
                    out[hook, shard, static, view] = (close, moved)
    return out


def join_uneven(rank: int, world_size: int, hook: str) -> dict:
    """Rank r gets 3 + r inputs, under Join([ddp, zero]); DDP + SGD on the rank with the most inputs
    is the reference. Every rank's params must equal it (a joined rank keeps stepping what it owns)."""
    from torch.distributed.algorithms.join import Join

    rule, kwargs = RULES["sgd"]
    ours_m, ref_m = make_model("net"), make_model("net")
    ours_ddp, ref_ddp = DDP(ours_m, bucket_cap_mb=0.004), DDP(ref_m, bucket_cap_mb=0.004)
    zero = Zero(ours_m.parameters(), rule, overlap_with_ddp=True, **kwargs)
    ours_ddp.register_comm_hook(None, HOOKS[hook](allreduce_hook, ours_ddp, zero))
    ref = rule(ref_m.parameters(), **kwargs)
    with Join([ours_ddp, zero]):
        for step in range(3 + rank):
            _loss(ours_ddp, step, rank).backward()
            zero.step()
            zero.zero_grad()
    with Join([ref_ddp]):
        for step in range(3 + rank):
            _loss(ref_ddp, step, rank).backward()
            ref.step()
            ref.zero_grad()
    last = world_size - 1
    params = [p.detach().clone() for p in (ref_m if rank == last else ours_m).parameters()]
    dist.broadcast_object_list(box := [params], src=last)
    return {"equal": all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(ours_m.parameters(), box[0]))}
