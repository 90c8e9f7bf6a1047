"""Per-rank bodies of the per-head Muon tests over FSDP2 and HSDP: a model whose projections hold
heads of rows (one whose FSDP2 rows fall on head edges at 2 and 4 ranks, one whose rows never
do, a fused projection of many small heads, a plain matrix), against one process."""

from __future__ import annotations

import torch
from torch import nn

import zero
import zero.functional as F
from zero.backends import comm
from zero.functional.contrib import MuonDimensionNumbers as Dims
from zero.functional.contrib import newton_schulz

# (in, out, heads): 24 rows of 4 heads (rows at 2 ranks 12/12, at 4 ranks 6 each: whole heads);
# 18 rows of 3 heads of 6 (9/9 and 5/5/5/3: never whole heads); 24 rows of 12 heads of 2; a plain 24 -> 5
LAYERS = ((12, 24, 4), (24, 18, 3), (18, 24, 12), (24, 5, 0))
# for plans that cut heads (split_heads): three weights of heads of 72 elements in other shapes (6 x 12,
# 3 x 24, 6 x 12), so one head buffer holds all three, some of them at offsets inside a rank's shard
SPLIT_LAYERS = ((12, 24, 4), (24, 12, 4), (12, 18, 3), (18, 5, 0))


def make_model(dtype: torch.dtype = torch.float64, layers: tuple = LAYERS) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b, dtype=dtype) for a, b, _ in layers]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])


def dims(tree: dict, layers: tuple = LAYERS) -> dict:
    """Per name: the heads of each projection's rows (torch's (out, in) layout), the plain matrix
    whole, the biases on AdamW."""
    if not isinstance(tree, dict):  # a flat plan's shards: no names, none of them a matrix
        return [None] * len(tree)
    heads = {f"{2 * i}.weight": h for i, (_, _, h) in enumerate(layers)}
    return {n: (Dims(1, 0, heads=heads[n]) if heads[n] else Dims(1, 0)) if n in heads else None for n in tree}


def rule(dims_as_dict: bool = False, layers: tuple = LAYERS, **kwargs) -> F.GradientTransformation:
    """Per-head Muon, its dimension numbers a function of the params or (``dims_as_dict``) a dict
    by name (each rank's own params are picked from it by name)."""
    names = [f"{2 * i}.{kind}" for i in range(len(layers)) for kind in ("weight", "bias")]
    by_name = dims(dict.fromkeys(names), layers) if dims_as_dict else (lambda tree: dims(tree, layers))
    return F.contrib.muon(0.02, muon_weight_dimension_numbers=by_name, adam_learning_rate=0.01, **kwargs)


def _sharded(model: nn.Module, mesh=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _grads(model: nn.Module, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(500 + step)
    for p in model.parameters():
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g


def _backward(model: nn.Module, opt, step: int) -> None:
    """Gradients by backward (of the same inputs on every rank), for a ZeRO that makes its own,
    clipped by torch's ``clip_grad_norm_`` (the norm of the gradients a ZeRO-2 keeps in its shards)."""
    gen = torch.Generator().manual_seed(700 + step)
    opt.zero_grad()
    model(torch.randn(4, LAYERS[0][0], generator=gen, dtype=torch.float64)).square().sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # binds: the norms are 3 to 5


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def against_one_process(rank: int, world_size: int, replicas: int = 1, kwargs: dict | None = None,
                        steps: int = 8) -> dict:
    """FSDP2 (``replicas`` 1: `zero.functional.Optimizer`) or HSDP (``replicas x world_size /
    replicas``: ``zero.ZeroRedundancyOptimizer``, the step sharded over the replicas too)
    against one process: the worst difference after ``steps`` steps, which params an owner
    stepped whole and which the ranks stepped by whole heads, the bytes this rank sent in
    exchanges with owners and across replicas during
    the last step with the plan's figures, and the Newton-Schulz runs this rank made in it."""
    mesh = None
    if replicas > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
    one, two = make_model(), _sharded(make_model(), mesh)
    sharded_opt = F.Optimizer if replicas == 1 else zero.ZeroRedundancyOptimizer
    kwargs = kwargs or {}
    opts = [F.Optimizer(list(one.named_parameters()), rule(**kwargs)),
            sharded_opt(list(two.named_parameters()), rule(**kwargs))]
    runs, made = _beside(one, two, opts, steps, lambda model, opt, k: _grads(model, k))
    plan, me = opts[1].executor.plan, opts[1].executor.me
    sent = {"within": {}, "across": {}}
    for c in made:
        where = {"exchange": "within", "all_gather_into": "across", "broadcast_from": "across"}.get(c.kind)
        if where and c.dtype != "int64":  # (not the ranks' check-in)
            sent[where][c.dtype] = sent[where].get(c.dtype, 0) + (c.bus_bytes if where == "within" else c.bytes)
    planned = {"within": {d: a + b for d, (a, b) in plan.exchange_bytes(me).items() if a + b},
               "across": plan.gather_bytes(me)}
    worst = max(float((_full(a.detach()) - b.detach()).abs().max()) for a, b in zip(two.parameters(), one.parameters()))
    whole = sorted(plan.metas[i].name for i in plan.whole)
    by_heads = sorted(plan.metas[i].name for i in plan.by_heads)
    return {"worst": worst, "whole": whole, "by_heads": by_heads, "sent": sent, "planned": planned, "runs": runs}


def _beside(one: nn.Module, two: nn.Module, opts: list, steps: int, give) -> tuple[dict, list]:
    """``steps`` steps of both models (``opts``: theirs), each given its gradients by ``give(model,
    opt, k)``; the Newton-Schulz runs (`_count_newton_schulz`) and the collectives of ``two``'s last."""
    for k in range(steps):
        for model, opt in zip((one, two), opts):
            give(model, opt, k)
            if model is two and k == steps - 1:
                calls = _count_newton_schulz()
                with comm.recording() as made:
                    opt.step()
                runs = calls.pop()
            else:
                opt.step()
    return runs, made


def _count_newton_schulz() -> list:
    """Counts this rank's `newton_schulz` runs (matrices each) until popped: a list holding a
    counter, the patch removed when the counter is read."""
    real = newton_schulz.newton_schulz
    count = {"runs": 0, "matrices": 0}

    def counted(x, *args, **kwargs):
        count["runs"] += 1
        count["matrices"] += x.shape[0]
        return real(x, *args, **kwargs)

    newton_schulz.newton_schulz = counted

    class Popper(list):
        def pop(self, *_):
            newton_schulz.newton_schulz = real
            return count

    return Popper([count])


def zero_on_plain_params(rank: int, world_size: int, kwargs: dict, strategy: str | None = None,
                         steps: int = 8) -> float:
    """``zero.ZeroRedundancyOptimizer`` over plain params (its default whole-param plan, or
    ``strategy="flat"``: a hybrid plan, the matrices whole, the rest in flat shards) against one
    process: the worst difference after ``steps`` steps."""
    one, two = make_model(), make_model()
    opts = [F.Optimizer(list(one.named_parameters()), rule(**kwargs)),
            zero.ZeroRedundancyOptimizer(list(two.named_parameters()), rule(**kwargs), strategy=strategy)]
    for k in range(steps):
        for model, opt in zip((one, two), opts):
            _grads(model, k)
            opt.step()
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(two.parameters(), one.parameters()))


def flat_plan_refusal(rank: int, world_size: int) -> str:
    """ZeRO under a flat plan that cuts the matrices into its shards (not a hybrid plan): per-head
    Muon's pieces there are not the params' own leaves, so the step is refused by name (never
    stepped with AdamW, the shards' rule)."""
    model = make_model()
    named = list(model.named_parameters())
    plan = zero.make_plan(zero.param_metas(named), world_size, "flat", optimizer="adamw")
    opt = zero.ZeroRedundancyOptimizer(named, rule(), plan=plan)
    _grads(model, 0)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return "stepped"


def save_then_resume(rank: int, world_size: int, path: str, save: bool, first: int = 3, steps: int = 3
                     ) -> list[torch.Tensor]:
    """Per-head Muon over FSDP2 through torch's own ``get_state_dict`` / ``set_state_dict`` and
    DCP (torchtitan's checkpointer's path): ``save``: ``first`` steps, then a save at ``path``;
    else a load from it at this mesh size and ``steps`` more. The whole params after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _sharded(make_model())
    opt = F.Optimizer(list(model.named_parameters()), rule())
    model_sd, optim_sd = get_state_dict(model, opt)
    request = {"model": model_sd, "optim": optim_sd}
    if save:
        for k in range(first):
            _grads(model, k)
            opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:
        dcp.load(request, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=request["model"], optim_state_dict=request["optim"])
        for k in range(first, first + steps):
            _grads(model, k)
            opt.step()
    return [_full(p) for p in model.parameters()]


def one_process(rank: int, world_size: int, steps: int = 6, layers: tuple = LAYERS) -> list[torch.Tensor]:
    model = make_model(layers=layers)
    opt = F.Optimizer(list(model.named_parameters()), rule(layers=layers))
    for k in range(steps):
        _grads(model, k)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def masters_against_one_process(rank: int, world_size: int, steps: int = 6) -> tuple[float, int, int]:
    """bf16 params over FSDP2, ``zero.ZeroRedundancyOptimizer`` with fp32 masters (of the heads a
    rank steps, for the weight whose rows cut heads), against one process stepping fp32 params of
    the same bf16 gradients: the worst difference of the bf16 params, and the master elements held
    on this rank against the model's."""
    one, two = _fp32_of_bf16(), _sharded(make_model(torch.float32).to(torch.bfloat16))
    ref = F.Optimizer(list(one.named_parameters()), rule())
    opt = zero.ZeroRedundancyOptimizer(list(two.named_parameters()), rule(), master_dtype=torch.float32)
    worst = _masters_beside(one, two, ref, opt, steps)
    held = sum(m.numel() for m in opt.executor.masters.values())
    return worst, held, sum(p.numel() for p in one.parameters())


def _fp32_of_bf16(layers: tuple = LAYERS) -> nn.Module:
    """The float32 model whose params are the bf16 model's, exactly."""
    one = make_model(torch.float32, layers)
    with torch.no_grad():
        for p in one.parameters():
            p.copy_(p.to(torch.bfloat16))
    return one


def _masters_beside(one: nn.Module, two: nn.Module, ref, opt, steps: int) -> float:
    """``steps`` steps of float32 ``one`` (``ref``) and bf16 ``two`` (``opt``, with fp32 masters) on
    the same bf16 gradients: the worst difference of ``two``'s params from ``one``'s rounded."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for k in range(steps):
        gen = torch.Generator().manual_seed(900 + k)
        grads = [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in one.parameters()]
        for p, g in zip(one.parameters(), grads):
            p.grad = g.float()
        for p, g in zip(two.parameters(), grads):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) \
                if isinstance(p, DTensor) else g
        ref.step()
        opt.step()
    return max(float((_full(b).float() - a.detach().to(torch.bfloat16).float()).abs().max())
               for a, b in zip(one.parameters(), two.parameters()))


def zero_split_heads(rank: int, world_size: int, kwargs: dict | None = None, options: dict | None = None,
                     one_buffer: bool = False, steps: int = 8) -> dict:
    """``zero.ZeroRedundancyOptimizer(..., strategy="flat", split_heads=True)`` (``options``: its
    own, e.g. ZeRO-2's): a flat plan that cuts the matrices the rule steps by heads at head edges
    (every rank stepping whole heads of them where they lie in its shards, the plain matrix whole
    on an owner), against one process. ``one_buffer``: the plan given, its buffers uncapped, so
    the three weights share one head buffer (the default plan's cap gives each its own here)."""
    one, two = make_model(layers=SPLIT_LAYERS), make_model(layers=SPLIT_LAYERS)
    named = list(two.named_parameters())
    kwargs = {"layers": SPLIT_LAYERS, **(kwargs or {})}
    plan = {"plan": _split_plan(named, world_size)} if one_buffer else {"strategy": "flat", "split_heads": True}
    opts = [F.Optimizer(list(one.named_parameters()), rule(**kwargs)),
            zero.ZeroRedundancyOptimizer(named, rule(**kwargs), **plan, **(options or {}))]
    plan = opts[1].plan
    runs, _ = _beside(one, two, opts, steps, _backward if options else lambda model, opt, k: _grads(model, k))
    worst = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(two.parameters(), one.parameters()))
    held = {plan.metas[t.piece].name: t.shape for t in opts[1].executor.state.holdings.tensors if t.piece is not None}
    return {"worst": worst, "whole": [plan.metas[i].name for i in plan.whole], "held": held, "runs": runs,
            "state": opts[1].rank_state.optim.state_nbytes(), "planned_state": plan.ranks[rank].state_bytes,
            "cut": sorted(plan.metas[i].name for i in plan.cut_at_heads),
            "head_buffers": sum(1 for b in plan.flat.buffers if b.head)}


def _split_plan(named: list, world_size: int, **extra):
    heads = {f"{2 * i}.weight": h for i, (_, _, h) in enumerate(SPLIT_LAYERS) if h}
    return zero.make_plan(zero.param_metas(named), world_size, "flat", optimizer=f"muon(heads={heads!r})",
                          split_heads=True, **extra)


def split_heads_resume(rank: int, world_size: int, path: str, save: bool, split: bool = True,
                       first: int = 3, steps: int = 3) -> dict:
    """Per-head Muon under a flat plan that cuts heads (``split_heads``; ``split=False``: the
    hybrid plan keeping them whole on owners): ``save``: ``first`` steps, then three checkpoints
    of it: zero's DCP one at ``path``, torch's consolidated state dict (from rank 0) and torch's
    own ``get_state_dict`` saved by DCP (torchtitan's checkpointer's path); else each loaded at
    this world size into an optimizer of its own, and ``steps`` more steps with each. The params
    after, by route."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from zero.backends import checkpoint

    def made():
        model = make_model(layers=SPLIT_LAYERS)
        named = list(model.named_parameters())
        plan = _split_plan(named, world_size) if split else zero.make_plan(
            zero.param_metas(named), world_size, "flat", optimizer=_split_plan(named, world_size).optimizer)
        return model, zero.ZeroRedundancyOptimizer(named, rule(layers=SPLIT_LAYERS), plan=plan)

    if save:
        model, opt = made()
        for k in range(first):
            _grads(model, k)
            opt.step()
        checkpoint.save(path, model, opt)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}_torch_dcp")
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{path}.pt")
        return {}
    runs = {route: made() for route in ("dcp", "torch", "torch_dcp")}
    checkpoint.load(path, *runs["dcp"])
    saved = torch.load(f"{path}.pt", weights_only=False)
    runs["torch"][0].load_state_dict(saved["model"])
    runs["torch"][1].load_state_dict(saved["optim"])
    model_sd, optim_sd = get_state_dict(*runs["torch_dcp"])
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}_torch_dcp")
    set_state_dict(*runs["torch_dcp"], model_state_dict=model_sd, optim_state_dict=optim_sd)
    for k in range(first, first + steps):
        for m, o in runs.values():
            _grads(m, k)
            o.step()
    return {route: [p.detach().clone() for p in m.parameters()] for route, (m, _) in runs.items()}


def split_heads_masters(rank: int, world_size: int, options: dict | None = None, steps: int = 6) -> float:
    """bf16 params, ``zero.ZeroRedundancyOptimizer`` with fp32 masters under a ``split_heads``
    plan (each rank's heads' masters the rows of its heads), against one process stepping fp32
    params of the same bf16 gradients: the worst difference of the bf16 params."""
    one, two = _fp32_of_bf16(SPLIT_LAYERS), make_model(torch.float32, SPLIT_LAYERS).to(torch.bfloat16)
    named = list(two.named_parameters())
    plan = _split_plan(named, world_size, master_dtype="float32")
    ref = F.Optimizer(list(one.named_parameters()), rule(layers=SPLIT_LAYERS))
    opt = zero.ZeroRedundancyOptimizer(named, rule(layers=SPLIT_LAYERS), plan=plan, master_dtype=torch.float32,
                                       **(options or {}))
    return _masters_beside(one, two, ref, opt, steps)


def split_against_owners(rank: int, world_size: int, options: dict, steps: int = 5) -> float:
    """bf16 params with fp32 masters under ZeRO-2 (``options``: e.g. float32 reductions), trained
    by backward, under the plan that cuts heads (``split_heads``) and the one that keeps them whole
    on owners: the worst difference of their params (the same sums, the same heads' blocks)."""
    params = []
    for split in (False, True):
        model = make_model(torch.float32, SPLIT_LAYERS).to(torch.bfloat16)
        opt = zero.ZeroRedundancyOptimizer(list(model.named_parameters()), rule(layers=SPLIT_LAYERS),
                                           strategy="flat", split_heads=split, master_dtype=torch.float32, **options)
        for k in range(steps):
            gen = torch.Generator().manual_seed(700 + k)
            opt.zero_grad()
            x = torch.randn(4, SPLIT_LAYERS[0][0], generator=gen).to(torch.bfloat16)
            model(x).float().square().sum().backward()
            opt.step()
        params.append([p.detach().float() for p in model.parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*params))
