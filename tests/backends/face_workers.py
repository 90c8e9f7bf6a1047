"""Per-rank bodies of the torch-contract tests (test_face_contract.py): every zero optimizer
(ZeRO's modes over plain params, `zero.functional.Optimizer` over FSDP2, ZeRO over HSDP) saved and
restored through torch's own state-dict functions and torchtitan's flat helpers, as a torchtitan
user's checkpointer does, against one process."""

from __future__ import annotations

import copy

import torch
from fsdp2_workers import fixed_grads, full, groups, make_model, make_rule, set_grads, sharded
from hsdp_workers import hsdp

import zero.functional as F
from zero.backends import ZeroRedundancyOptimizer as Zero

# kind -> (world sizes it runs at, how its model is placed, which optimizer steps it)
KINDS = ("fsdp2", "hsdp", "zero-whole", "zero-flat", "zero-hybrid", "zero2")


def build(kind: str, spec, world_size: int):
    """``kind``'s model (fsdp2_workers' uneven one, float64) and optimizer stepping ``spec``."""
    model = make_model()
    if kind == "fsdp2":
        return sharded(model), None
    if kind == "hsdp":
        model = hsdp(model, world_size, 2)
        return model, Zero(groups(model), make_rule(spec))
    if kind == "torch-fsdp2":
        model = sharded(model)
        return model, torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.05)
    # (a flat plan keeps whole what the rule needs whole: Muon's matrices make it hybrid)
    strategy = {"zero-whole": "sorted_greedy", "zero-flat": "flat", "zero-hybrid": "flat", "zero2": "flat"}[kind]
    return model, Zero(groups(model), make_rule(spec), strategy=strategy, reduce_scatter_grads=kind == "zero2")


def built(kind: str, spec, world_size: int):
    model, opt = build(kind, spec, world_size)
    return model, opt if opt is not None else F.Optimizer(groups(model), make_rule(spec))


def step(kind: str, model, opt, k: int) -> None:
    """One step at fixed gradients, the same on every rank (so their mean is one process's):
    set on the params, or (ZeRO-2, which reduces them itself) made by a backward of ``<p, g>``."""
    grads = fixed_grads(model, k)
    if kind == "zero2":
        sum((p * g).sum() for p, g in zip(model.parameters(), grads)).backward()
    else:
        set_grads(model, grads)
    opt.step()
    opt.zero_grad()


def neutral(rank: int, world_size: int, kind: str, spec, steps: int = 6) -> dict:
    """The run with torch's ``get_state_dict`` called mid-run (and torchtitan's ``init_optim_state``
    on the fresh optimizer) against the run without: bit for bit, and the state tensors it returned."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torchtitan.components.optimizer.utils import init_optim_state

    runs, got = [], 0
    for probe in (False, True):
        model, opt = built(kind, spec, world_size)
        if probe:
            init_optim_state(opt)
        for k in range(steps):
            if probe and k == steps // 2:
                osd = get_state_dict(model, opt)[1]
                got = sum(isinstance(v, torch.Tensor) for st in osd["state"].values() for v in st.values())
            step(kind, model, opt, k)
        runs.append([full(p.detach()) for p in model.parameters()])
    return {"same": all(torch.equal(a, b) for a, b in zip(*runs)), "tensors": got}


def save_through_torch(rank: int, world_size: int, kind: str, spec, path: str, steps: int = 3,
                       flat: bool = False) -> None:
    """``steps`` steps, then torch's ``get_state_dict`` + ``dcp.save`` (``flat``: torchtitan's
    ``get_flat_optim_state_dict`` for the optimizer, as its ``OptimizersContainer.state_dict`` does)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, init_optim_state

    model, opt = built(kind, spec, world_size)
    for k in range(steps):
        step(kind, model, opt, k)
    if flat:
        init_optim_state(opt)
        sd = {"model": get_model_state_dict(model), "optim": get_flat_optim_state_dict(opt)}
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
    dcp.save(sd, checkpoint_id=path)


def resume_through_torch(rank: int, world_size: int, kind: str, spec, path: str, first: int = 3, steps: int = 3,
                         flat: bool = False) -> list[torch.Tensor]:
    """A fresh optimizer (built after the model, torch's habit), loaded with torch's functions
    (``get_state_dict``'s tensors filled by ``dcp.load``, then ``set_state_dict``; ``flat``:
    torchtitan's ``init_optim_state`` + ``load_flat_optim_state_dict``), ``steps`` more steps:
    the whole params."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torchtitan.components.optimizer.utils import (
        get_flat_optim_state_dict,
        init_optim_state,
        load_flat_optim_state_dict,
    )

    model, opt = built(kind, spec, world_size)
    if flat:
        init_optim_state(opt)
        sd = {"model": get_model_state_dict(model), "optim": get_flat_optim_state_dict(opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        load_flat_optim_state_dict(opt, sd["optim"])
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for k in range(first, first + steps):
        step(kind, model, opt, k)
    return [full(p.detach()) for p in model.parameters()]


def one_process(rank: int, world_size: int, spec, steps: int = 6) -> list[torch.Tensor]:
    """``spec`` on one process's plain params (None: torch.optim.AdamW), ``steps`` fixed-gradient steps."""
    model = make_model()
    opt = torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.05) if spec is None else \
        F.Optimizer(groups(model), make_rule(spec))
    for k in range(steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def torch_zero_parity(rank: int, world_size: int, optimizer_class: str, maximize: bool, torchs: bool = False,
                      as_on_cuda: bool = True) -> list[torch.Tensor]:
    """torch's own ``test_local_optimizer_parity`` (test/distributed/optim/test_zero_redundancy_optimizer.py),
    on CPU gloo: DDP + ZeroRedundancyOptimizer (``torchs``: torch's own) against DDP + the local
    optimizer, 20 batches, trainability toggled in the second half, then the state dicts
    cross-loaded and reloaded, one step after each; returns the final params.

    torch's ``state_dict()`` hands out its live tensors, and its ``load_state_dict`` keeps a tensor
    already on the param's device: so on CPU the consolidated dict loaded into the local optimizer is
    stepped there, and reloading it reloads the stepped values (torch's own ZeRO then differs by
    2.2e-4 at the last check). On CUDA, where torch's test runs, that load copies the CPU dict to
    the GPU; ``as_on_cuda`` copies it as that load does."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    zero_class = Zero
    if torchs:
        from torch.distributed.optim import ZeroRedundancyOptimizer as zero_class
    torch.manual_seed(rank)
    cls = getattr(torch.optim, optimizer_class)
    defaults = {"maximize": True} if maximize else {}
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model.test_buffer = torch.nn.Buffer(torch.ones(1) * rank)
    sharded_optimizer = zero_class(model.parameters(), cls, lr=1e-3, **defaults)
    sharded_ddp = DDP(model, broadcast_buffers=True, find_unused_parameters=True)
    local_model = copy.deepcopy(model)
    ddp_optimizer = cls(local_model.parameters(), lr=1e-3, **defaults)
    ddp_model = DDP(local_model, broadcast_buffers=True, find_unused_parameters=True)

    def check_step(parity: bool = True) -> None:
        batch = torch.rand(64, 2)

        def closure_ddp():
            ddp_optimizer.zero_grad()
            loss = ddp_model(batch).abs().sum()
            loss.backward()
            return loss

        def closure_sharded():
            sharded_optimizer.zero_grad()
            loss = sharded_ddp(batch).abs().sum()
            loss.backward()
            return loss

        losses = ddp_optimizer.step(closure=closure_ddp), sharded_optimizer.step(closure=closure_sharded)
        if parity:
            torch.testing.assert_close(*losses)
            for a, b in zip(sharded_ddp.parameters(), ddp_model.parameters()):
                torch.testing.assert_close(a, b, msg="models differ after a step")

    for i in range(20):
        check_step()
        if i > 10:
            next(ddp_model.parameters()).requires_grad = bool(i % 2)
            next(sharded_ddp.parameters()).requires_grad = bool(i % 2)
    ddp_state_dict = ddp_optimizer.state_dict()
    sharded_optimizer.consolidate_state_dict(to=0)
    box = [sharded_optimizer.state_dict() if rank == 0 else {}]
    dist.broadcast_object_list(box, src=0)
    sharded_state_dict = box[0]
    ddp_state_dict_ref = copy.deepcopy(ddp_state_dict)
    ddp_optimizer.load_state_dict(copy.deepcopy(sharded_state_dict) if as_on_cuda else sharded_state_dict)
    sharded_optimizer.load_state_dict(ddp_state_dict)
    check_step()
    ddp_optimizer.load_state_dict(ddp_state_dict_ref)
    sharded_optimizer.load_state_dict(sharded_state_dict)
    check_step(parity=as_on_cuda)
    return [p.detach().clone() for p in sharded_ddp.parameters()]


def placements(rank: int, world_size: int) -> list[str]:
    """Over FSDP2, a param's state entries: DTensors like it, live."""
    model, opt = built("fsdp2", ("from_torch", dict(optimizer_class="AdamW", lr=1e-2)), world_size)
    step("fsdp2", model, opt, 0)
    weight = model[0].weight
    entry = opt.state[weight]
    assert sorted(entry) == ["exp_avg", "exp_avg_sq", "step"]
    assert entry["exp_avg"].placements == weight.placements and entry["exp_avg"].shape == weight.shape
    before = entry["exp_avg"].to_local().clone()
    step("fsdp2", model, opt, 1)
    assert not torch.equal(entry["exp_avg"].to_local(), before), "a live view: the next step moves it"
    return [type(opt.state[p]["exp_avg"]).__name__ for p in list(model.parameters())[:4]]
