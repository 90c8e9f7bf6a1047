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


def make_model(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b, dtype=dtype) for a, b, _ in LAYERS]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])


def dims(tree: dict) -> dict:
    """Per name: the heads of each projection's rows (torch's (out, in) layout), the plain matrix
    whole, the biases on AdamW."""
    if not isinstance(tree, dict):  # a flat plan's shards: no names, none of them a matrix
        return [None] * len(tree)
    heads = {f"{2 * i}.weight": h for i, (_, _, h) in enumerate(LAYERS)}
    return {n: (Dims(1, 0, heads=heads[n]) if heads[n] else Dims(1, 0)) if n in heads else None for n in tree}


def rule(dims_as_dict: bool = False, **kwargs) -> F.GradientTransformation:
    """Per-head Muon, its dimension numbers a function of the params or (``dims_as_dict``) a dict
    by name (each rank's own params are picked from it by name)."""
    names = [f"{2 * i}.{kind}" for i in range(len(LAYERS)) for kind in ("weight", "bias")]
    by_name = dims(dict.fromkeys(names)) if dims_as_dict else dims
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
    for k in range(steps):
        for model, opt in zip((one, two), opts):
            _grads(model, k)
            if model is two and k == steps - 1:
                calls = _count_newton_schulz()
                with comm.recording() as made:
                    opt.step()
                runs = calls.pop()
            else:
                opt.step()
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


def one_process(rank: int, world_size: int, steps: int = 6) -> list[torch.Tensor]:
    model = make_model()
    opt = F.Optimizer(list(model.named_parameters()), rule())
    for k in range(steps):
        _grads(model, k)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def masters_against_one_process(rank: int, world_size: int, steps: int = 6) -> tuple[float, int, int]:
    """bf16 params over FSDP2, ``zero.ZeroRedundancyOptimizer`` with fp32 masters (of the heads a
    rank steps, for the weight whose rows cut heads), against one process stepping fp32 params of
    the same bf16 gradients: the worst difference of the bf16 params, and the master elements held
    on this rank against the model's."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    one = make_model(torch.float32)
    with torch.no_grad():  # both start from the bf16 params
        for p in one.parameters():
            p.copy_(p.to(torch.bfloat16))
    two = _sharded(make_model(torch.float32).to(torch.bfloat16))
    ref = F.Optimizer(list(one.named_parameters()), rule())
    opt = zero.ZeroRedundancyOptimizer(list(two.named_parameters()), rule(), master_dtype=torch.float32)
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
    worst = max(float((_full(b).float() - a.detach().to(torch.bfloat16).float()).abs().max())
                for a, b in zip(one.parameters(), two.parameters()))
    held = sum(m.numel() for m in opt.executor.masters.values())
    return worst, held, sum(p.numel() for p in one.parameters())
