"""Per-rank bodies of the non-finite gradient tests (`zero.backends.nonfinite`)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from helpers import make_model
from torch.nn.parallel import DistributedDataParallel as DDP

import zero
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import hook_with_zero_step

# mode -> how the optimizer is built, and whether DDP reduces the gradients
MODES = {
    "whole": (dict(), True),
    "flat": (dict(strategy="flat"), True),
    "hybrid": (dict(plan="hybrid"), True),
    "rs": (dict(strategy="flat", reduce_scatter_grads=True), False),
    "rs-hybrid": (dict(plan="hybrid", reduce_scatter_grads=True), False),
    "overlap": (dict(overlap_with_ddp=True), True),
}
BAD = "2.weight"  # the param whose gradient gets a NaN, on rank ``bad_rank`` only


def _build(mode: str, policy: str, world_size: int):
    model = make_model("small", dtype=torch.float64)
    kwargs, ddp = dict(MODES[mode][0]), MODES[mode][1]
    if kwargs.get("plan") == "hybrid":
        metas = zero.param_metas(list(model.named_parameters()))
        kwargs["plan"] = zero.make_plan(metas, world_size, "flat", whole=lambda m: m.name == BAD)
    net = DDP(model) if ddp else model
    opt = Zero(list(model.named_parameters()), torch.optim.Adam, lr=1e-2, nonfinite=policy, **kwargs)
    if mode == "overlap":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        net.register_comm_hook(None, hook_with_zero_step(allreduce_hook, net, opt))
    return model, net, opt


def _with_nan(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("nan")
    return grad


def nan_on_one_rank(rank: int, world_size: int, mode: str, policy: str, bad_rank: int = 1, bad_step: int | None = 2,
                    steps: int = 4, omit: int | None = None) -> dict:
    """``steps`` iterations (forward, backward, step); at ``bad_step`` one element of ``BAD``'s
    gradient on ``bad_rank`` is NaN before it is reduced (DDP: a hook on the param's gradient).
    ``omit``: that iteration is left out altogether (what a skipped step must equal)."""
    model, net, opt = _build(mode, policy, world_size)
    bad = dict(model.named_parameters())[BAD]
    seen, error, params = [], None, []
    for it in range(steps):
        if it == omit:
            continue
        opt.zero_grad()
        poison = rank == bad_rank and it == bad_step
        handle = bad.register_hook(_with_nan) if poison else None
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * it + rank), dtype=torch.float64)
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                net(x).square().sum().backward()
                opt.step()
            except FloatingPointError as e:
                error = (it, str(e))
        if handle is not None:
            handle.remove()
        seen += [(it, str(w.message)) for w in caught if issubclass(w.category, RuntimeWarning)]
        if it == bad_step:
            params = [bool(torch.equal(a, b)) for a, b in zip(model.parameters(), before)]
        if error is not None:
            break
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    dist.barrier()
    return {"warnings": seen, "error": error, "unchanged_at_bad_step": params, "finite": finite,
            "params": [p.detach().clone() for p in model.parameters()], "skipped": opt.skipped_steps}


def clean_steps_collectives(rank: int, world_size: int, policy: str) -> dict:
    """The collectives zero makes in clean steps (no NaN): the flag rides in the check-in."""
    from helpers import CountingCalls

    from zero.backends import comm

    model, net, opt = _build("rs", policy, world_size)
    with CountingCalls(comm, "all_gather_into") as check_ins, CountingCalls(comm, "all_gather_object") as names:
        for it in range(3):
            opt.zero_grad()
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * it + rank), dtype=torch.float64)
            net(x).square().sum().backward()
            opt.step()
    return {"check_ins": check_ins.calls, "names": names.calls}
