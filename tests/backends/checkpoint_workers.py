"""Per-rank bodies of the sharded-checkpoint tests (`zero.backends.checkpoint`)."""

from __future__ import annotations

import torch
from helpers import fixed_grads, groups_of, make_model, mode_name, side_by_side, train
from plan_workers import RULES as PLAN_RULES

import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import checkpoint

RULES = {**PLAN_RULES, "from_torch_adamw": (zf.from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), {}, None),
         "sgd_momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9), "sgd_momentum"),
         # zero.functional rules with torch's maths, built with other settings than the checkpoint's:
         # loading a torch.optim checkpoint gives them its settings, as torch's load_state_dict does
         "f_adamw": (zf.adamw(0.5, b1=0.5, weight_decay=0.0), {}, None),
         "f_sgd": (zf.sgd(0.5, momentum=0.1), {}, None)}


def build(strategy: str, masters: bool, rule: str = "adamw"):
    """``rule``: a name in `plan_workers.RULES` (torch classes and zero.functional chains)."""
    model = make_model("plan", dtype=torch.bfloat16) if masters else make_model("plan")
    optimizer_class, kwargs, _ = RULES[rule]
    opt = Zero(groups_of(model, isinstance(optimizer_class, type)), optimizer_class, strategy=strategy,
               master_dtype=torch.float32 if masters else None, **kwargs)
    return model, opt


def dcp_leg(rank: int, world_size: int, strategy: str, load_from: str | None, save_to: str | None,
            start: int, steps: int, masters: bool = False, rule: str = "adamw", async_save: bool = False) -> dict:
    """Train ``steps`` steps from ``start`` under ``strategy``, resuming from the sharded checkpoint
    ``load_from``; save a sharded checkpoint to ``save_to`` (``async_save``: in the background,
    the next step taken before waiting for it; the state was copied when it started)."""
    model, opt = build(strategy, masters, rule)
    if load_from:
        checkpoint.load(load_from, model, opt)
    train(model, opt, range(start, start + steps))
    if save_to and async_save:
        future = checkpoint.save(save_to, model, opt, async_save=True)
        train(model, opt, range(start + steps, start + steps + 1))  # moves the params and state on while the save runs
        future.result()
    elif save_to:
        checkpoint.save(save_to, model, opt)
    state = sum(v.nbytes for st in opt.optim.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return {"params": [p.detach().double().numpy().copy() for p in model.parameters()], "state_bytes": state}


def fsdp2_model(model):
    """``model`` (fp64, `make_model`) with every Linear and the root under FSDP2's ``fully_shard``."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def fsdp2_leg(rank: int, world_size: int, load_from: str | None, save_to: str | None, start: int,
              steps: int) -> dict:
    """As `dcp_leg`, but the model under FSDP2 and torch's own state-dict functions: the path a user
    of FSDP2 takes with a checkpoint `zero` wrote (or the one `zero` reads back)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = fsdp2_model(make_model("plan"))
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.1)
    if load_from:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=load_from)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for step in range(start, start + steps):
        grads = fixed_grads(list(model.parameters()), step)  # alike on every rank: each cuts its piece
        for p, g in zip(model.parameters(), grads):
            p.grad = None if g is None else torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements,
                                                                                       src_data_rank=None)
        opt.step()
    if save_to:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save_to)
    return {"params": [p.full_tensor().detach().double().numpy().copy() for p in model.parameters()]}


def plain_leg(checkpoint_file: str, start: int, steps: int) -> list[torch.Tensor]:
    """One process, plain ``torch.optim.AdamW``, resuming from ``dcp_to_torch_save``'s file through
    torch's own ``set_state_dict`` (which maps the FQN-keyed state onto the params)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    saved = torch.load(checkpoint_file, weights_only=True)
    model = make_model("plan")
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.1)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    train(model, opt, range(start, start + steps))
    return [p.detach().clone() for p in model.parameters()]


def held_views(rank: int, world_size: int, strategy: str) -> dict:
    """What `get_state_dict` hands DCP on this rank: bytes, and whether each is a view of the
    optimizer's own state (nothing copied), against the plan's count for this rank."""
    model, opt = build(strategy, True)
    train(model, opt, range(2))
    own = {v.untyped_storage().data_ptr() for st in opt.optim.state.values() for v in st.values()
           if isinstance(v, torch.Tensor) and v.dim() > 0}
    own |= {m.untyped_storage().data_ptr() for g in opt.optim.param_groups for m in g["params"]}
    _, optim_sd = checkpoint.get_state_dict(model, opt)
    pieces, scalars = [], {}
    for st in optim_sd["state"].values():
        for value in st.values():
            if hasattr(value, "local_shards"):
                pieces += [s.tensor for s in value.local_shards()]
            elif value.dim() > 0:
                pieces.append(value)
            else:  # ``step``: a flat shard's one tensor stands for each param piece in it
                scalars[id(value)] = value.nbytes
    cost, flat = opt.plan.ranks[rank], opt.plan.flat
    # the plan counts a flat shard's padding (state exists for it); a checkpoint does not save it
    padding = 0 if flat is None else sum(b.shard_numel - sum(p.end - p.start for p in b.pieces(rank))
                                         for b in flat.buffers)
    per_element = 4 * 3  # fp32 master, exp_avg, exp_avg_sq
    planned = cost.state_bytes + cost.master_bytes - padding * per_element
    return {"bytes": sum(t.nbytes for t in pieces) + sum(scalars.values()), "planned": planned,
            "copies": sum(t.untyped_storage().data_ptr() not in own for t in pieces)}


def killed_save(rank: int, world_size: int, load_from: str, save_to: str) -> str:
    """Resume from ``load_from``, take a step, and save to ``save_to`` while rank 1 dies writing."""
    import os

    import torch.distributed.checkpoint as dcp

    model, opt = build("flat", False)
    checkpoint.load(load_from, model, opt)
    train(model, opt, range(4, 5))

    class Dying(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            if rank == 1:
                os._exit(1)
            return super().write_data(plan, planner)

    try:  # zero's own save, with a writer that kills rank 1 while it writes
        checkpoint.save(None, model, opt, storage_writer=Dying(save_to))
    except Exception as e:  # the survivor learns of it from the collective after the writes
        return type(e).__name__
    return "saved"


def killed_save_over(rank: int, world_size: int, path: str) -> str:
    """Resume from ``path``, take a step, and save over ``path`` while rank 1 dies writing."""
    import os

    import torch.distributed.checkpoint as dcp

    model, opt = build("flat", False)
    checkpoint.load(path, model, opt)
    train(model, opt, range(4, 5))
    write = dcp.FileSystemWriter.write_data

    def dying(self, plan, planner):
        if rank == 1:
            os._exit(1)
        return write(self, plan, planner)

    dcp.FileSystemWriter.write_data = dying  # DCP's own writer, made from the path zero gives it
    try:
        checkpoint.save(path, model, opt)
    except Exception as e:  # the survivor learns of it from the collective after the writes
        return type(e).__name__
    return "saved"


def _batch(step: int) -> torch.Tensor:
    """Every rank's batch at ``step`` is the same: averaged over 2 or 4 ranks, the gradient is
    exactly one process's, so legs at different world sizes chain to one process's numbers."""
    return torch.randn(6, 7, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def mode_leg(rank: int, world_size: int, mode: str, load_from: str | None, save_to: str | None,
             start: int, steps: int) -> dict:
    """Train with backward passes in ``mode`` ("reduce_scatter": flat, gradients reduce-scattered,
    no DDP; "overlap": DDP with the step in its comm hook), resuming from and saving to sharded
    checkpoints."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero.backends import hook_with_zero_step

    model = make_model("plan")
    if mode == "reduce_scatter":
        opt = Zero(groups_of(model), torch.optim.AdamW, strategy="flat", reduce_scatter_grads=True,
                   lr=1e-2, weight_decay=0.1)
        forward = model
    else:
        forward = DDP(model, bucket_cap_mb=0.004)
        opt = Zero(groups_of(model), torch.optim.AdamW, overlap_with_ddp=True, lr=1e-2, weight_decay=0.1)
        forward.register_comm_hook(None, hook_with_zero_step(allreduce_hook, forward, opt))
    if load_from:
        checkpoint.load(load_from, model, opt)
    for step in range(start, start + steps):
        forward(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if save_to:
        checkpoint.save(save_to, model, opt)
    return {"params": [p.detach().double().numpy().copy() for p in model.parameters()]}


def single_process_batches(steps: int) -> list[torch.Tensor]:
    model = make_model("plan")
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        model(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def one_process(rule: str, steps: int) -> list[torch.Tensor]:
    """``rule`` over all params in one process, on `dcp_leg`'s gradients."""
    model = make_model("plan")
    optimizer_class, kwargs, _ = RULES[rule]
    if isinstance(optimizer_class, type):
        opt = optimizer_class(groups_of(model), **kwargs)
    else:
        opt = zf.Optimizer(groups_of(model, False), optimizer_class)
    train(model, opt, range(steps))
    return [p.detach().clone() for p in model.parameters()]


def local_sgd_leg(rank: int, world_size: int, load_from: str | None, save_to: str | None, start: int,
                  steps: int) -> dict:
    """`PostLocalSGDOptimizer` around ZeRO (flat plan over every rank), averaging every 2 steps
    after 2 of warm-up: its averager's step travels in the checkpoint."""
    from zero.backends import PeriodicModelAverager, PostLocalSGDOptimizer

    model, inner = build("flat", False)
    opt = PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=2, warmup_steps=2))
    if load_from:
        checkpoint.load(load_from, model, opt)
    resumed_at = opt.averager.step
    train(model, opt, range(start, start + steps))
    if save_to:
        checkpoint.save(save_to, model, opt)
    return {"params": [p.detach().double().numpy().copy() for p in model.parameters()], "resumed_at": resumed_at,
            "averager_step": opt.averager.step}


def join_leg(rank: int, world_size: int, path: str, resume: bool) -> dict:
    """DDP + ZeRO (whole plan) under ``Join`` with uneven inputs (rank r: 3 + r batches), a save,
    then 2 even steps. ``resume``: a fresh run loads the save and takes those 2 steps instead."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model("plan")
    ddp = DDP(model)
    opt = Zero(groups_of(model), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    if resume:
        checkpoint.load(path, ddp, opt)
    else:
        with Join([ddp, opt]):
            for step in range(3 + rank):
                ddp(_batch(100 * rank + step)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        checkpoint.save(path, ddp, opt)
    for step in range(10, 12):
        ddp(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().double().numpy().copy() for p in model.parameters()]}


# Every mode, with and without masters: (options of ZeroRedundancyOptimizer, how gradients arrive).
# "fixed": `fixed_grads` set as DDP would leave them; "backward": a backward pass (the optimizer
# reduce-scatters); "ddp": DDP's backward with the step in its comm hook.
MODES = {
    "whole": (dict(strategy="sorted_greedy"), "fixed"),
    "whole+masters": (dict(strategy="sorted_greedy", master_dtype=torch.float32), "fixed"),
    "flat": (dict(strategy="flat"), "fixed"),
    "flat+masters": (dict(strategy="flat", master_dtype=torch.float32), "fixed"),
    "reduce_scattered": (dict(strategy="flat", reduce_scatter_grads=True), "backward"),
    "reduce_scattered+masters": (dict(strategy="flat", reduce_scatter_grads=True, master_dtype=torch.float32,
                                      reduce_dtype=torch.float32), "backward"),
    "hybrid": (dict(whole=True), "fixed"),
    "hybrid+reduce_scattered": (dict(whole=True, reduce_scatter_grads=True), "backward"),
    "ddp_overlap": (dict(overlap_with_ddp=True), "ddp"),
}


def _built(mode: str, world_size: int):
    """A model (bf16 with masters) and AdamW under ``mode``, and how to run one step of it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero
    from zero.backends import hook_with_zero_step

    options, grads = MODES[mode]
    options = dict(options)
    masters = "master_dtype" in options
    model = make_model("plan", dtype=torch.bfloat16 if masters else None)
    groups = groups_of(model)
    if options.pop("whole", False):
        options["plan"] = zero.make_plan(zero.param_metas(groups), world_size, "flat", optimizer="adamw",
                                         whole=lambda m: len(m.shape) == 2 and m.numel > 200)
    opt = Zero(groups, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, **options)
    forward = model
    if grads == "ddp":
        forward = DDP(model, bucket_cap_mb=0.004)
        forward.register_comm_hook(None, hook_with_zero_step(allreduce_hook, forward, opt))

    def step(k: int) -> None:
        if grads == "fixed":
            side_by_side([(model, opt)], lambda k: fixed_grads(list(model.parameters()), k), [k])
            return
        forward(_batch(k).to(next(model.parameters()).dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def _local_state(opt) -> dict:
    """What this rank's local optimizer holds, by local index and key (masters included)."""
    return {j: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for j, st in opt.rank_state.state_dict()["state"].items()}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys() or any(a[j].keys() != b[j].keys() for j in a):
        return False
    return all(torch.equal(a[j][k], b[j][k]) if isinstance(a[j][k], torch.Tensor) else a[j][k] == b[j][k]
               for j in a for k in a[j])


def _consolidated(opt, rank: int) -> dict:
    from helpers import broadcast

    opt.consolidate_state_dict(to=0)
    return broadcast(opt.state_dict() if rank == 0 else None)


def formats_round_trip(rank: int, world_size: int, folder: str, modes: list[str]) -> dict:
    """Per mode: 3 steps, then the state through torch's consolidated dict and through DCP into
    fresh optimizers of the same mode. Both must give back this rank's local state exactly (the
    masters too), and the DCP-loaded optimizer must consolidate to the same global dict: the two
    formats read the same holdings."""
    out = {}
    for mode in modes:
        model, opt, step = _built(mode, world_size)
        for k in range(3):
            step(k)
        want, saved = _local_state(opt), _consolidated(opt, rank)
        checkpoint.save(f"{folder}/{mode}", model, opt)
        via_dict_m, via_dict, _ = _built(mode, world_size)
        via_dict_m.load_state_dict(model.state_dict())
        via_dict.load_state_dict(saved)
        via_dcp_m, via_dcp, _ = _built(mode, world_size)
        checkpoint.load(f"{folder}/{mode}", via_dcp_m, via_dcp)
        again = _consolidated(via_dcp, rank)
        agree = again["param_groups"] == saved["param_groups"] and _same(again["state"], saved["state"])
        out[mode] = {"consolidated": _same(_local_state(via_dict), want), "dcp": _same(_local_state(via_dcp), want),
                     "formats_agree": agree, "pieces": len(opt.rank_state.holdings.held),
                     "mode": mode_name(opt)}
    return out


def load_or_error(rank: int, world_size: int, path: str, strategy: str = "sorted_greedy") -> dict:
    """Load ``path`` into a fresh run; the error if it is refused, and whether anything moved."""
    import warnings

    model, opt = build(strategy, False)
    train(model, opt, range(1))
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for st in opt.optim.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
    error, said = None, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            checkpoint.load(path, model, opt)
        except ValueError as e:
            error = str(e)
    said = [f"{w.category.__name__}: {w.message}" for w in caught if "checksum" in str(w.message)]
    after = {k: v for st in opt.optim.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
    unchanged = all(torch.equal(a, b) for a, b in zip(model.parameters(), before)) and \
        all(torch.equal(state[k], after[k]) for k in state)
    return {"error": error, "unchanged": unchanged, "warnings": said}


# The random-layout sweep's model (#65): an embedding, Linears of uneven widths, a LayerNorm
def sweep_model() -> torch.nn.Module:
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 24), nn.Linear(24, 29), nn.Linear(29, 16), nn.Linear(16, 41),
                         nn.LayerNorm(41)).double()


def _sweep_run(rule, strategy: str, path: str | None, first: int, steps: int, load: str | None):
    """Build, load ``load``, step ``first .. first + steps`` on fixed gradients, save to ``path``."""
    from fsdp2_workers import make_rule

    model = sweep_model()
    opt = Zero(model.parameters(), make_rule(rule), strategy=strategy)
    if load:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the load must put every param back
        checkpoint.load(load, model, opt)
    for k in range(first, first + steps):
        gen = torch.Generator().manual_seed(700 + k)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
    if path:
        checkpoint.save(path, model, opt)
    return [p.detach().clone() for p in model.parameters()]


def resume_sweep(rank: int, world_size: int, root: str, rules: dict, strategies: tuple[str, ...],
                 saved_at: int | None = None) -> dict[str, float]:
    """Per rule and plan: 3 steps, saved (at ``saved_at`` ranks, by an earlier call, when given),
    loaded into a new optimizer, 3 more; the largest difference from 6 steps uninterrupted at
    this world size (0.0: bitwise)."""
    out = {}
    for name, rule in rules.items():
        for strategy in strategies:
            path = f"{root}/{name}-{strategy}"
            whole = _sweep_run(rule, strategy, None, 0, 6, None)
            if saved_at is None:
                _sweep_run(rule, strategy, path, 0, 3, None)
            resumed = _sweep_run(rule, strategy, None, 3, 3, path)
            out[f"{name} {strategy}"] = max(float((a - b).abs().max()) for a, b in zip(whole, resumed))
    return out
