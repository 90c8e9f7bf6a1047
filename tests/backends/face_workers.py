"""Per-rank bodies of the torch-contract tests (test_face_contract.py): every zero optimizer
(ZeRO's modes over plain params, `zero.functional.Optimizer` over FSDP2, ZeRO over HSDP) saved and
restored through torch's own state-dict functions and torchtitan's flat helpers, as a torchtitan
user's checkpointer does, against one process."""

from __future__ import annotations

import copy
from typing import Any

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


# -- torchtitan's OptimizersContainer over zero's rules (docs/torchtitan.md) ----------------------

def titan_container(model: torch.nn.Module, world_size: int) -> Any:
    """docs/torchtitan.md's container: Muon for the weights, zero's AdamW for the rest (torchtitan's
    regex groups, torch's keyword names, its ``foreach`` key), with a warmup LR schedule."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    class ZeroOptimizers(OptimizersContainer):
        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Any:
            return {"Muon": F.torch_optimizer(F.contrib.muon), "AdamW": F.torch_optimizer(torch.optim.AdamW)}[name]

    config = OptimizersContainer.Config(implementation="foreach", param_groups=[
        ParamGroupConfig(pattern=r"weight$", optimizer_name="Muon",
                         optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.01}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.05})])
    optimizers = ZeroOptimizers(config, model_parts=[model])
    return optimizers, LRSchedulersContainer(optimizers, lambda step: min(1.0, (step + 1) / 4))


def titan_run(rank: int, world_size: int, path_in: str | None, path_out: str | None, first: int, steps: int
              ) -> list[torch.Tensor]:
    """torchtitan's container over FSDP2 (plain params on one rank): ``steps`` steps from ``first``,
    resuming from and saving to DCP checkpoints as torchtitan's checkpointer does (the container's
    and the schedulers' ``state_dict``, the model's through torch's function)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = make_model()
    model = sharded(model) if world_size > 1 else model
    optimizers, schedulers = titan_container(model, world_size)
    if path_in:
        sd = {"model": get_model_state_dict(model), "optimizer": optimizers.state_dict(),
              "lr_scheduler": schedulers.state_dict()}
        dcp.load(sd, checkpoint_id=path_in)
        set_model_state_dict(model, sd["model"])
        optimizers.load_state_dict(sd["optimizer"])
        schedulers.load_state_dict(sd["lr_scheduler"])
    for k in range(first, first + steps):
        set_grads(model, fixed_grads(model, k))
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
    if path_out:
        dcp.save({"model": get_model_state_dict(model), "optimizer": optimizers.state_dict(),
                  "lr_scheduler": schedulers.state_dict()}, checkpoint_id=path_out)
    return [full(p.detach()) for p in model.parameters()]


def contract(rank: int, world_size: int, kind: str) -> dict:
    """torch's generic optimizer checks (``test/test_optim.py``'s spirit) on a sharded zero
    optimizer: step and state-dict hooks run, an lr scheduler's rate steps, two state dicts of one
    state are alike, ``len(state)`` is the trainable params on every rank, printing works, and a
    copy is refused by name (it holds process groups)."""
    model, opt = built(kind, ADAMW_SPEC, world_size)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd") or None)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    for k in range(3):
        step(kind, model, opt, k)
        scheduler.step()
    first, second = opt.state_dict(), opt.state_dict()
    same = first.keys() == second.keys() and all(
        a.keys() == b.keys() for a, b in zip(first["state"].values(), second["state"].values()))
    opt.load_state_dict(first)
    seen = list(calls)  # (what follows calls state_dict again)
    elsewhere = ""
    if kind.startswith("zero"):  # consolidated on rank 0: state_dict() there is the global dict, elsewhere an error
        opt.consolidate_state_dict(to=0)
        try:
            elsewhere = str(sorted(opt.state_dict()["state"]))
        except RuntimeError as e:
            elsewhere = str(e)
    try:
        copy.deepcopy(opt)
        copied = "copied"
    except TypeError as e:
        copied = str(e)
    return {"calls": seen, "lr": opt.param_groups[0]["lr"], "same": same, "len": len(opt.state),
            "trainable": sum(p.requires_grad for p in model.parameters()), "repr": "Parameter Group 0" in repr(opt),
            "copied": copied, "elsewhere": elsewhere}


ADAMW_SPEC = ("adamw", dict(learning_rate=1e-2, weight_decay=0.05))


def settings_differ(rank: int, world_size: int, kind: str) -> str:
    """Rank 0 builds lr 1e-3, the others 2e-3: the first step's check-in names the setting and the
    ranks on every rank (before, over FSDP2 the ranks stepped on, drifting apart)."""
    spec = ("adamw", dict(learning_rate=1e-3 if rank == 0 else 2e-3))
    model, opt = built(kind, spec, world_size)
    try:
        step(kind, model, opt, 0)
    except ValueError as e:
        return str(e)
    return "stepped"


def nan_named(rank: int, world_size: int, kind: str, policy: str) -> dict:
    """A NaN in rank 1's gradient rows of the first weight at the second step, under ``policy``:
    what each rank says, and whether it stepped."""
    import warnings

    from torch.distributed.tensor import DTensor

    model, opt = built(kind, ADAMW_SPEC, world_size)
    opt.nonfinite = type(opt.nonfinite)(policy)
    step(kind, model, opt, 0)
    set_grads(model, fixed_grads(model, 1))
    weight = next(model.parameters())
    if rank == 1:
        local = weight.grad.to_local() if isinstance(weight.grad, DTensor) else weight.grad
        local.view(-1)[0] = float("nan")
    before = full(weight.detach())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            opt.step()
        except FloatingPointError as e:
            return {"raised": str(e)}
    return {"warned": [str(w.message) for w in said if "NaN" in str(w.message)],
            "stepped": not torch.equal(before, full(weight.detach()))}


def unused_layer(rank: int, world_size: int) -> list[torch.Tensor]:
    """Three steps whose gradients never reach the last Linear (an unused layer): over FSDP2 (its
    state started when the optimizer was built) as on one process, where the set of params with
    gradients is decided by the first step."""
    model = sharded(make_model()) if world_size > 1 else make_model()
    opt = F.Optimizer(groups(model), make_rule(ADAMW_SPEC))
    for k in range(3):
        set_grads(model, fixed_grads(model, k))
        for p in list(model.parameters())[-2:]:
            p.grad = None
        opt.step()
    return [full(p.detach()) for p in model.parameters()]
