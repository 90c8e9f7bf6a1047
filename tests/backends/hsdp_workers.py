"""Per-rank bodies of the HSDP tests: `zero.ZeroRedundancyOptimizer` over ``fully_shard``'s params on
a ``replicas x shards`` mesh (the state sharded over the replicas too) against one process."""

from __future__ import annotations

import torch
from fsdp2_workers import WIDTHS, fixed_grads, full, groups, make_model, make_rule, set_grads
from torch import nn

import zero
import zero.functional as F
from zero.backends import comm


def mesh(world_size: int, replicas: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


def hsdp(model: nn.Module, world_size: int, replicas: int) -> nn.Module:
    """Each Linear and the root under ``fully_shard`` on a ``replicas x shards`` mesh (a 1-D mesh
    at one replica, FSDP2's own)."""
    from torch.distributed.fsdp import fully_shard

    on = mesh(world_size, replicas) if replicas > 1 else None
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=on)
    return fully_shard(model, mesh=on)


def zero_over(model: nn.Module, spec, **options):
    """``zero.ZeroRedundancyOptimizer`` over ``model``'s two groups: ``spec`` a rule's words, or
    ``("torch", {"optimizer_class": name, ...})`` for a torch class with its keywords."""
    name, args = spec
    if name == "torch":
        args = dict(args)
        return zero.ZeroRedundancyOptimizer(groups(model), getattr(torch.optim, args.pop("optimizer_class")),
                                            **args, **options)
    if name == "factory":  # zero's factory with its keywords, as ZeRO takes torch's classes
        args = dict(args)
        return zero.ZeroRedundancyOptimizer(groups(model), getattr(F, args.pop("name")), **args, **options)
    return zero.ZeroRedundancyOptimizer(groups(model), make_rule(spec), **options)


def one_process_opt(model: nn.Module, spec):
    name, args = spec
    if name == "torch":
        args = dict(args)
        return getattr(torch.optim, args.pop("optimizer_class"))(groups(model), **args, foreach=False)
    if name == "factory":  # one process: the built transformation
        args = dict(args)
        return F.Optimizer(groups(model), getattr(F, args.pop("name"))(**args))
    return F.Optimizer(groups(model), make_rule(spec))


def against_one_process(rank: int, world_size: int, replicas: int, specs: dict, steps: int = 8,
                        clip: float | None = None) -> dict[str, tuple[float, int, int, int]]:
    """Per rule: the worst difference from one process after ``steps`` fixed-gradient steps (with
    ``clip``: torch's ``clip_grad_norm_`` before each, the user's habit), this rank's state bytes,
    the plan's for it, and one process's."""
    out = {}
    for name, spec in specs.items():
        one, two = make_model(), hsdp(make_model(), world_size, replicas)
        opts = [one_process_opt(one, spec), zero_over(two, spec)]
        for k in range(steps):
            grads = fixed_grads(one, k)
            for model, opt in zip((one, two), opts):
                set_grads(model, grads)
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
        worst = max(float((full(b.detach()) - a.detach()).abs().max()) for a, b in zip(one.parameters(),
                                                                                       two.parameters()))
        ex = opts[1].executor
        alone = _state_bytes(opts[0])
        out[name] = (worst, opts[1].state_nbytes(), ex.plan.state_bytes(ex.me), alone)
    return out


def _state_bytes(opt) -> int:
    if isinstance(opt, F.Optimizer):
        return opt.state_nbytes()
    return sum(t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.ndim)


def backward_against_one_process(rank: int, world_size: int, replicas: int, spec, steps: int = 6) -> float:
    """A real forward and backward through HSDP (each rank its slice of one batch, FSDP2 averaging
    the gradients over the mesh) against one process on the whole batch."""
    one, two = make_model(), hsdp(make_model(), world_size, replicas)
    opts = [one_process_opt(one, spec), zero_over(two, spec)]
    for k in range(steps):
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(12, WIDTHS[0], generator=gen, dtype=torch.float64)
        y = torch.randn(12, WIDTHS[-1], generator=gen, dtype=torch.float64)
        ((one(x) - y) ** 2).mean().backward()
        mine = slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)
        (((two(x[mine]) - y[mine]) ** 2).sum() * world_size / y.numel()).backward()
        for model, opt in zip((one, two), opts):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    return max(float((full(b.detach()) - a.detach()).abs().max()) for a, b in zip(one.parameters(), two.parameters()))


def masters_against_one_process(rank: int, world_size: int, replicas: int, steps: int = 6) -> tuple[float, int, int]:
    """bf16 params over HSDP, zero's AdamW with fp32 masters, against one process stepping fp32
    masters of the same bf16 gradients (then rounded): the worst difference of the bf16 params, and
    this rank's master elements against one process's."""
    spec = ("adamw", dict(learning_rate=1e-2, weight_decay=0.1))
    masters = make_model(torch.float32)
    with torch.no_grad():  # both start from the bf16 params
        for p in masters.parameters():
            p.copy_(p.to(torch.bfloat16))
    two = hsdp(make_model(torch.float32).to(torch.bfloat16), world_size, replicas)
    ref = F.Optimizer(groups(masters), make_rule(spec))
    opt = zero_over(two, spec, master_dtype=torch.float32)
    for k in range(steps):
        grads = [g.to(torch.bfloat16) for g in fixed_grads(masters, k)]
        set_grads(masters, [g.float() for g in grads])
        ref.step()
        set_grads(two, grads)
        opt.step()
    worst = max(float((full(b.detach()).float() - a.detach().to(torch.bfloat16).float()).abs().max())
                for a, b in zip(masters.parameters(), two.parameters()))
    held = sum(m.numel() for m in opt.executor.masters.values())
    return worst, held, sum(p.numel() for p in masters.parameters())


def newton_schulz_runs(rank: int, world_size: int, replicas: int) -> tuple[int, int]:
    """Matrices this rank orthogonalised in its second Muon step, and those the plan gives it."""
    from muon_workers import CountingNewtonSchulz

    model = hsdp(make_model(), world_size, replicas)
    opt = zero_over(model, ("muon", dict(learning_rate=1e-2)))
    for k in range(2):
        set_grads(model, fixed_grads(model, k))
        with CountingNewtonSchulz() as counted:
            opt.step()
    return counted.calls, len(opt.executor.plan.owned(opt.executor.me))


def recorded_traffic(rank: int, world_size: int, replicas: int, spec) -> tuple[dict, dict]:
    """Bytes this rank moved in zero's collectives in one step, within a replica (the exchanges
    with owners) and across replicas (the all-gathers), per dtype, and the plan's."""
    model = hsdp(make_model(), world_size, replicas)
    opt = zero_over(model, spec)
    set_grads(model, fixed_grads(model, 0))
    with comm.recording() as made:
        opt.step()
    sent = {"within": {}, "across": {}}
    for c in made:
        where = {"exchange": "within", "all_gather_into": "across", "broadcast_from": "across"}.get(c.kind)
        if where and c.dtype != "int64":  # (not the ranks' check-in: a few ints each step, no plan's traffic)
            size = c.bus_bytes if where == "within" else c.bytes
            sent[where][c.dtype] = sent[where].get(c.dtype, 0) + size
    plan, me = opt.executor.plan, opt.executor.me
    planned = {"within": {d: a + b for d, (a, b) in plan.exchange_bytes(me).items() if a + b},
               "across": plan.gather_bytes(me)}
    return sent, planned


ADAMW = ("adamw", dict(learning_rate=1e-2, weight_decay=0.05))  # torch.optim.AdamW(lr=1e-2, weight_decay=0.05)


def leg(rank: int, world_size: int, where: tuple, load: str | None, save: str | None, first: int, steps: int,
        spec=ADAMW) -> list[torch.Tensor]:
    """One leg of a run across layouts: build on ``where`` (``("zero", replicas)``: zero over HSDP;
    ``("torch", replicas)``: ``torch.optim.AdamW`` over HSDP, saved by torch's own functions;
    ``("zero_torch", replicas)``: ``zero.ZeroRedundancyOptimizer(params, torch.optim.AdamW)`` over HSDP,
    built at another rate (the checkpoint's is loaded); ``("zero2",)``: zero's ZeRO-2 over plain
    params, on real backwards), load ``load``, step
    ``first .. first + steps``, save to ``save``; the whole params after."""
    import torch.distributed.checkpoint as dcp

    from zero.backends import checkpoint

    if where[0] == "zero2":
        model = make_model()
        opt = zero.ZeroRedundancyOptimizer(groups(model), make_rule(spec), strategy="flat",
                                           reduce_scatter_grads=True)
    else:
        model = hsdp(make_model(), world_size, where[1])
        if where[0] == "zero_torch":
            opt = zero_over(model, ("torch", {"optimizer_class": "AdamW", "lr": 3e-2, "weight_decay": 0.05}))
        else:
            opt = zero_over(model, spec) if where[0] == "zero" else \
                torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.05, foreach=True)
    if load:
        checkpoint.load(load, model, opt)
    for k in range(first, first + steps):
        _step(model, opt, k, backward=where[0] == "zero2")
    if save and where[0] == "torch":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save)
    elif save:
        checkpoint.save(save, model, opt)
    return [full(p.detach()) for p in model.parameters()]


def _step(model: nn.Module, opt, k: int, backward: bool) -> None:
    if backward:  # the same batch on every rank: the mean gradient is one process's
        gen = torch.Generator().manual_seed(500 + k)
        x = torch.randn(8, WIDTHS[0], generator=gen, dtype=torch.float64)
        y = torch.randn(8, WIDTHS[-1], generator=gen, dtype=torch.float64)
        ((model(x) - y) ** 2).mean().backward()
    else:
        set_grads(model, fixed_grads(model, k))
    opt.step()
    opt.zero_grad()


def one_process_legs(rank: int, world_size: int, fixed: int, batches: int = 0, spec=ADAMW) -> list[torch.Tensor]:
    """One process: ``fixed`` steps of the fixed gradients, then ``batches`` of the backward batches."""
    model = make_model()
    opt = F.Optimizer(groups(model), make_rule(spec))
    for k in range(fixed + batches):
        _step(model, opt, k, backward=k >= fixed)
    return [p.detach().clone() for p in model.parameters()]


def masters_across_layouts(rank: int, world_size: int, path: str) -> tuple[float, float]:
    """bf16 params with fp32 masters: 3 steps at 2x2 saved by DCP, 3 more at 1 x world_size loaded
    from it; and, at 2x2, 3 steps, ``opt.state_dict()`` into a fresh optimizer, 3 more. The worst
    difference of each from one process stepping fp32 masters."""
    from zero.backends import checkpoint

    spec, bf16 = ("adamw", dict(learning_rate=1e-2, weight_decay=0.1)), torch.bfloat16
    out = []
    for how in ("dcp", "state_dict"):
        model = hsdp(make_model(torch.float32).to(bf16), world_size, 2)
        opt = zero_over(model, spec, master_dtype=torch.float32)
        for k in range(3):
            set_grads(model, [g.to(bf16) for g in fixed_grads(model, k)])
            opt.step()
        if how == "dcp":
            checkpoint.save(path, model, opt)
            model = hsdp(make_model(torch.float32).to(bf16), world_size, 1)
            opt = zero_over(model, spec, master_dtype=torch.float32)
            checkpoint.load(path, model, opt)
        else:
            saved, again = opt.state_dict(), zero_over(model, spec, master_dtype=torch.float32)
            again.load_state_dict(saved)
            opt = again
        for k in range(3, 6):
            set_grads(model, [g.to(bf16) for g in fixed_grads(model, k)])
            opt.step()
        out.append(_against_masters([full(p.detach()) for p in model.parameters()], spec, 6))
    return tuple(out)


def _against_masters(got: list[torch.Tensor], spec, steps: int) -> float:
    masters = make_model(torch.float32)
    with torch.no_grad():
        for p in masters.parameters():
            p.copy_(p.to(torch.bfloat16))
    ref = F.Optimizer(groups(masters), make_rule(spec))
    for k in range(steps):
        set_grads(masters, [g.to(torch.bfloat16).float() for g in fixed_grads(masters, k)])
        ref.step()
    return max(float((b.float() - a.detach().to(torch.bfloat16).float()).abs().max())
               for a, b in zip(masters.parameters(), got))


def params_loaded_after_building(rank: int, world_size: int) -> tuple[float, list[str]]:
    """The torch habit: build the optimizer (bf16 params, fp32 masters), step, then load other
    weights into the model (``model.load_state_dict``) and step on. The masters follow the loaded
    params (one truth): the worst difference from one process started from those weights, and the
    warnings said."""
    import warnings

    spec, bf16 = ("adamw", dict(learning_rate=1e-2, weight_decay=0.1)), torch.bfloat16
    model = hsdp(make_model(torch.float32).to(bf16), world_size, 2)
    opt = zero_over(model, spec, master_dtype=torch.float32)
    set_grads(model, [g.to(bf16) for g in fixed_grads(model, 0)])
    opt.step()
    torch.manual_seed(7)
    other = make_model(torch.float32).to(bf16)  # pretrained weights, say
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():  # into the DTensors in place, as load_state_dict of sharded weights writes them
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(distribute_tensor(q.mul(0.5), p.device_mesh, p.placements))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for k in range(1, 4):
            set_grads(model, [g.to(bf16) for g in fixed_grads(model, k)])
            opt.step()
    ref_model = make_model(torch.float32)
    with torch.no_grad():
        for p, q in zip(ref_model.parameters(), other.parameters()):
            p.copy_(q.mul(0.5).float())
    ref = F.Optimizer(groups(ref_model), make_rule(spec))
    set_grads(ref_model, [g.to(bf16).float() for g in fixed_grads(ref_model, 0)])
    ref.step()  # the first step's moments, as zero's state holds them
    with torch.no_grad():
        for p, q in zip(ref_model.parameters(), other.parameters()):
            p.copy_(q.mul(0.5).float())
    for k in range(1, 4):
        set_grads(ref_model, [g.to(bf16).float() for g in fixed_grads(ref_model, k)])
        ref.step()
    worst = max(float((full(b.detach()).float() - a.detach().to(bf16).float()).abs().max())
                for a, b in zip(ref_model.parameters(), model.parameters()))
    return worst, [str(w.message) for w in said]


def functional_optimizer_on_hsdp(rank: int, world_size: int, spec, steps: int = 6) -> tuple[float, int, int]:
    """`zero.functional.Optimizer` over HSDP: each replica steps alone (its state replicated, as
    torch.optim's): the worst difference from one process, this rank's state bytes, one process's."""
    one, two = make_model(), hsdp(make_model(), world_size, 2)
    opts = [F.Optimizer(groups(one), make_rule(spec)), F.Optimizer(groups(two), make_rule(spec))]
    for k in range(steps):
        grads = fixed_grads(one, k)
        for model, opt in zip((one, two), opts):
            set_grads(model, grads)
            opt.step()
    worst = max(float((full(b.detach()) - a.detach()).abs().max()) for a, b in zip(one.parameters(), two.parameters()))
    return worst, opts[1].state_nbytes(), opts[0].state_nbytes()


def refused(rank: int, world_size: int, case: str) -> str:
    """The error building (or first stepping) zero over HSDP with a bad ``case`` says."""
    model = hsdp(make_model(), world_size, 2)
    try:
        if case == "strategy":
            zero_over(model, ADAMW, strategy="flat")
        elif case == "reduce_scatter_grads":
            zero_over(model, ADAMW, reduce_scatter_grads=True)
        elif case == "custom class":
            class Mine(torch.optim.SGD):
                pass
            zero.ZeroRedundancyOptimizer(model.parameters(), Mine, lr=0.1)
        elif case == "rule with keywords":
            zero.ZeroRedundancyOptimizer(model.parameters(), F.adamw(1e-2), lr=0.1)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "built"


def nonfinite_steps(rank: int, world_size: int, policy: str) -> tuple[str, int, float]:
    """A NaN in one gradient row of one rank's piece at the second step: what ``nonfinite=policy``
    says (the warning's or the error's text, or ``"silent"``), the steps skipped, and how far the
    params moved in the second step (0.0: skipped or raised before anything was stepped)."""
    import warnings

    model = hsdp(make_model(), world_size, 2)
    opt = zero_over(model, ADAMW, nonfinite=policy)
    set_grads(model, fixed_grads(model, 0))
    opt.step()
    before = [full(p.detach()) for p in model.parameters()]
    grads = fixed_grads(model, 1)
    grads[2][3, 5] = float("nan")  # 2.weight, row 3: shard 0's rows, so ranks 0 and 2 hold it
    set_grads(model, grads)
    said = "silent"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt.step()
        except FloatingPointError as e:
            said = f"raised: {e}"
    said = next((str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)), said)
    moved = max(float((full(p.detach()) - b).abs().max()) for p, b in zip(model.parameters(), before))
    return said, opt.skipped_steps, moved
