"""Per-rank bodies of the FSDP2 tests: `zero.functional.Optimizer` over ``fully_shard``'s DTensor
params against the same rule on one process's plain params."""

from __future__ import annotations

import torch
from torch import nn

import zero.functional as F
from zero.backends import comm

# Uneven dims on purpose: 37 rows split 19/18, 13/13/11, 10/10/10/7; the 64 x 96 weight (6,144
# elements, quantized by the low-bit rules) has its 256-element blocks cut between 3 ranks.
WIDTHS = (7, 37, 96, 64, 5)


def make_model(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b, dtype=dtype) for a, b in zip(WIDTHS, WIDTHS[1:])]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])


def sharded(model: nn.Module, dim: int = 0) -> nn.Module:
    """Each Linear and the root under ``fully_shard``; ``dim`` 1: a ``shard_placement_fn`` puts
    the weights whose columns divide by the ranks (FSDP2 shards dims past the first only evenly) on
    ``Shard(1)``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def on_columns(p):
        return Shard(1) if p.dim() > 1 and p.shape[1] % dist.get_world_size() == 0 else Shard(0)

    placement = None if dim == 0 else on_columns
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, shard_placement_fn=placement)
    return fully_shard(model, shard_placement_fn=placement)


def groups(model: nn.Module) -> list[dict]:
    """Two groups: the weights, and the biases at half the rate where the rule has a rate."""
    named = list(model.named_parameters())
    weights = [(n, p) for n, p in named if n.endswith("weight")]
    biases = [(n, p) for n, p in named if n.endswith("bias")]
    return [{"params": weights}, {"params": biases}]


def fixed_grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in model.parameters()]


def set_grads(model: nn.Module, full: list[torch.Tensor]) -> None:
    """Each param's gradient from the whole one every rank made alike (`fixed_grads`): a rank cuts
    its own piece (``src_data_rank=None``), with no scatter from rank 0."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, g in zip(model.parameters(), full):
        p.grad = (distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor)
                  else g.clone())


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def make_rule(spec):
    """A rule from picklable words: ``(name, kwargs)`` of zero.functional or its contrib, or
    ``("chain", [spec, ...])``."""
    name, args = spec
    if name == "chain":
        return F.chain(*map(make_rule, args))
    if name == "from_torch":
        return F.from_torch(**args)
    if name == "from_optax":
        import optax

        args = dict(args)
        per_tensor = args.pop("per_tensor", True)
        return F.from_optax(getattr(optax, args.pop("name"))(**args), per_tensor=per_tensor)
    return getattr(F.contrib, name, None)(**args) if hasattr(F.contrib, name) else getattr(F, name)(**args)


def build(spec, model):
    return F.Optimizer(groups(model), make_rule(spec))


def compare_rule(rank: int, world_size: int, spec, steps: int = 10, dim: int = 0) -> float:
    """Worst difference between the FSDP2 run and one process's after ``steps`` steps with fixed
    gradients, on rank 0; the one process runs there only (the other ranks return nan: read rank 0's)."""
    two = sharded(make_model(), dim)
    one = make_model() if rank == 0 else None
    runs = [(two, build(spec, two))] + ([(one, build(spec, one))] if one is not None else [])
    for k in range(steps):
        grads = fixed_grads(two, k)
        for model, opt in runs:
            set_grads(model, grads)
            opt.step()
    whole = [full(a.detach()) for a in two.parameters()]  # a collective: every rank takes part
    return max(float((a - b.detach()).abs().max()) for a, b in zip(whole, one.parameters())) if one else float("nan")


def recorded_exchange(rank: int, world_size: int, spec) -> tuple[dict, dict]:
    """Bytes this rank sent in its exchanges in one step, per dtype, and what the plan says."""
    model = sharded(make_model())
    opt = build(spec, model)
    set_grads(model, fixed_grads(model, 0))
    with comm.recording() as made:
        opt.step()
    sent: dict[str, int] = {}
    for c in made:
        if c.kind == "exchange":
            sent[c.dtype] = sent.get(c.dtype, 0) + c.bus_bytes
    planned = {d: a + b for d, (a, b) in opt.executor.plan.exchange_bytes(rank).items()}
    return sent, planned


def compare_rules(rank: int, world_size: int, specs: dict, steps: int = 10, dim: int = 0) -> dict[str, float]:
    """`compare_rule` for each of ``specs`` (by name) in one run of the ranks (JAX in float64 for
    Optax's rules, as the float64 params need)."""
    optax_rules = any(spec[0] == "from_optax" for spec in specs.values())
    if optax_rules:
        import jax

        before = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
    try:
        return {name: compare_rule(rank, world_size, spec, steps, dim) for name, spec in specs.items()}
    finally:
        if optax_rules:
            jax.config.update("jax_enable_x64", before)


def low_bit_params(rank: int, world_size: int, spec, steps: int = 6) -> list[torch.Tensor]:
    """The whole params after ``steps`` steps of a low-bit rule over FSDP2 (plain params on one rank)."""
    model = make_model(torch.float32)
    if world_size > 1:
        sharded(model)
    opt = build(spec, model)
    for k in range(steps):
        set_grads(model, [g.float() for g in fixed_grads(model, k)])
        opt.step()
    return [full(p.detach()) for p in model.parameters()]


def backward_against_one_process(rank: int, world_size: int, spec, steps: int = 10) -> float:
    """A real forward and backward through FSDP2 (each rank its slice of one batch, FSDP2 averaging
    the gradients) against one process on the whole batch."""
    one, two = make_model(), sharded(make_model())
    opts = [build(spec, one), build(spec, two)]
    for k in range(steps):
        gen = torch.Generator().manual_seed(k)
        x, y = torch.randn(12, WIDTHS[0], generator=gen, dtype=torch.float64), torch.randn(12, WIDTHS[-1],
                                                                                            generator=gen,
                                                                                            dtype=torch.float64)
        ((one(x) - y) ** 2).mean().backward()
        mine = slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)
        # each rank's loss is its slice's share of the whole batch's mean, times the ranks FSDP2 averages over
        (((two(x[mine]) - y[mine]) ** 2).sum() * world_size / y.numel()).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return max(float((full(a.detach()) - b.detach()).abs().max()) for a, b in zip(two.parameters(), one.parameters()))


def newton_schulz_runs(rank: int, world_size: int) -> tuple[int, int]:
    """How many matrices this rank orthogonalised in its second Muon step (the first also asks the
    rule on meta tensors which params it needs whole), and how many it owns by the plan."""
    from muon_workers import CountingNewtonSchulz

    model = sharded(make_model())
    opt = build(("muon", dict(learning_rate=1e-2)), model)
    for k in range(2):
        set_grads(model, fixed_grads(model, k))
        with CountingNewtonSchulz() as counted:
            opt.step()
    return counted.calls, len(opt.executor.plan.owned(rank))


def mixed_precision_against_torch(rank: int, world_size: int, steps: int = 5) -> float:
    """FSDP2's mixed precision (bf16 compute, fp32 reduce, fp32 sharded params): zero's AdamW
    against ``torch.optim.AdamW`` on the same model and batches; the worst relative difference."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for _ in range(2):
        model = make_model(torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mp_policy=policy)
        models.append(fully_shard(model, mp_policy=policy))
    opts = [F.Optimizer(models[0].parameters(), F.adamw(1e-2, weight_decay=0.01)),
            torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.01, foreach=True)]
    for k in range(steps):
        gen = torch.Generator().manual_seed(100 * k + rank)
        x, y = torch.randn(6, WIDTHS[0], generator=gen), torch.randn(6, WIDTHS[-1], generator=gen)
        for model, opt in zip(models, opts):
            ((model(x).float() - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    pairs = [(a.detach().to_local(), b.detach().to_local()) for a, b in zip(*(m.parameters() for m in models))]
    return max(float(((a - b).abs() / b.abs().clamp(min=1e-3)).max()) for a, b in pairs)


def state_dict_round_trip(rank: int, world_size: int, spec) -> float:
    """Save after 3 steps, load into a fresh optimizer, step on: as the one that went on."""
    models = [sharded(make_model()), sharded(make_model())]
    opts = [build(spec, m) for m in models]
    for k in range(3):
        set_grads(models[0], fixed_grads(models[0], k))
        opts[0].step()
    saved = opts[0].state_dict()
    models[1].load_state_dict(models[0].state_dict())
    opts[1].load_state_dict(saved)
    for k in range(3, 6):
        for model, opt in zip(models, opts):
            set_grads(model, fixed_grads(model, k))
            opt.step()
    return max(float((a.detach().to_local() - b.detach().to_local()).abs().max())
               for a, b in zip(*(m.parameters() for m in models)))


def load_elsewhere(rank: int, world_size: int, saved: dict | None = None) -> str:
    """Load rank 0's state_dict on every rank: the others refuse it, naming both layouts."""
    import torch.distributed as dist

    model = sharded(make_model())
    opt = build(("muon", dict(learning_rate=1e-2)), model)
    set_grads(model, fixed_grads(model, 0))
    opt.step()
    box = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    try:
        opt.load_state_dict(box[0])
    except ValueError as e:
        return str(e)
    return "loaded"


def _checkpoint_io(model, opt, path, save: bool) -> None:
    import torch.distributed.checkpoint as dcp

    from zero.backends import checkpoint

    model_sd, optim_sd = checkpoint.get_state_dict(model, opt)
    request = {"model": model_sd, "optim": optim_sd}
    if save:
        dcp.save(request, checkpoint_id=path)
        return
    dcp.load(request, checkpoint_id=path)
    checkpoint.set_state_dict(model, opt, model_state_dict=request["model"], optim_state_dict=request["optim"])


def train_and_save(rank: int, world_size: int, spec, path: str, steps: int = 3) -> None:
    """``steps`` steps of fixed gradients over FSDP2 (``spec`` None: torch.optim.AdamW), then a DCP save."""
    model = sharded(make_model())
    opt = build(spec, model) if spec is not None else torch_adamw(model)
    for k in range(steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    _checkpoint_io(model, opt, path, save=True)


def torch_adamw(model):
    return torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.05, foreach=True)


def resume_and_train(rank: int, world_size: int, spec, path: str, first: int = 3, steps: int = 3,
                     torch_side: bool = False) -> list[torch.Tensor]:
    """Load the DCP checkpoint at ``path`` (zero's rule ``spec``; ``torch_side``: into
    torch.optim.AdamW through torch's own state dict functions), step on, return the whole params."""
    model = sharded(make_model())
    if torch_side:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        opt = torch_adamw(model)
        model_sd, optim_sd = get_state_dict(model, opt)
        request = {"model": model_sd, "optim": optim_sd}
        dcp.load(request, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=request["model"], optim_state_dict=request["optim"])
    else:
        opt = build(spec, model)
        _checkpoint_io(model, opt, path, save=False)
    for k in range(first, first + steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    return [full(p.detach()) for p in model.parameters()]


def one_process(rank: int, world_size: int, spec, steps: int = 6) -> list[torch.Tensor]:
    model = make_model()
    opt = build(spec, model) if spec is not None else torch_adamw(model)
    for k in range(steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def torch_saves_fsdp2(rank: int, world_size: int, path: str, steps: int = 3) -> None:
    """torch.optim.AdamW over FSDP2, saved as FSDP2 users save: torch's get_state_dict and dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = sharded(make_model())
    opt = torch_adamw(model)
    for k in range(steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def zero_flat_saves(rank: int, world_size: int, spec, path: str, steps: int = 3) -> None:
    """zero's ZeRO (a flat plan: each rank a shard of every param's state) over plain params, saved."""
    from zero.backends import ZeroRedundancyOptimizer, checkpoint

    model = make_model()
    opt = ZeroRedundancyOptimizer(model.named_parameters(), make_rule(spec), strategy="flat")
    for k in range(steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    checkpoint.save(path, model, opt)


def zero_loads_on_fsdp2(rank: int, world_size: int, spec, path: str, first: int = 3, steps: int = 3
                        ) -> list[torch.Tensor]:
    """zero's rule over FSDP2's params resuming from the checkpoint at ``path`` (zero's `load`)."""
    from zero.backends import checkpoint

    model = sharded(make_model())
    opt = build(spec, model)
    checkpoint.load(path, model, opt)
    for k in range(first, first + steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    return [full(p.detach()) for p in model.parameters()]


def zero_saves_fsdp2(rank: int, world_size: int, spec, path: str, steps: int = 3) -> None:
    """zero's rule over FSDP2, saved by zero's `save`."""
    from zero.backends import checkpoint

    model = sharded(make_model())
    opt = build(spec, model)
    for k in range(steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    checkpoint.save(path, model, opt)


def torch_loads_on_fsdp2(rank: int, world_size: int, path: str, first: int = 3, steps: int = 3
                         ) -> list[torch.Tensor]:
    """torch.optim.AdamW over FSDP2 (built with another rate) continuing zero's checkpoint by zero's `load`."""
    from zero.backends import checkpoint

    model = sharded(make_model())
    opt = torch.optim.AdamW(groups(model), lr=5e-2, weight_decay=0.05, foreach=True)
    checkpoint.load(path, model, opt)
    for k in range(first, first + steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    return [full(p.detach()) for p in model.parameters()]


def torch_refuses(rank: int, world_size: int, path: str) -> str:
    from zero.backends import checkpoint

    model = sharded(make_model())
    try:
        checkpoint.load(path, model, torch.optim.AdamW(groups(model), lr=1e-2))
    except ValueError as e:
        return str(e)
    return "loaded"


def _regression_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return (torch.randn(8, WIDTHS[0], generator=gen, dtype=torch.float64),
            torch.randn(8, WIDTHS[-1], generator=gen, dtype=torch.float64))


def zero2_then_fixed(rank: int, world_size: int, spec, path: str | None, steps: int = 3) -> list[torch.Tensor]:
    """ZeRO-2 (gradients reduce-scattered as backward makes them) for ``steps`` steps of the same
    batch on every rank, saved to ``path``; with ``path`` None, one process doing the same and
    then the fixed gradients `zero_loads_on_fsdp2` continues with."""
    from zero.backends import ZeroRedundancyOptimizer, checkpoint

    model = make_model()
    opt = ZeroRedundancyOptimizer(model.named_parameters(), make_rule(spec), strategy="flat",
                                  reduce_scatter_grads=True) if path else build(spec, model)
    for k in range(steps):
        x, y = _regression_batch(k)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    if path:
        checkpoint.save(path, model, opt)
        return []
    for k in range(steps, 2 * steps):
        set_grads(model, fixed_grads(model, k))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def first_step_error(rank: int, world_size: int, spec) -> str:
    """The ValueError building the optimizer over FSDP2 (which plans it) or its first step raises
    with ``spec`` (a spec per rank when a list), or ``"stepped"``."""
    model = sharded(make_model())
    try:
        opt = build(spec[rank] if isinstance(spec, list) else spec, model)
        set_grads(model, fixed_grads(model, 0))
        opt.step()
    except ValueError as e:
        return str(e)
    return "stepped"


def label_weights_and_a_bias(params: dict) -> dict:
    """Muon's dimension numbers for every weight and, wrongly, the vector ``4.bias``."""
    from zero.functional.contrib import MuonDimensionNumbers

    return {n: MuonDimensionNumbers() if n.endswith("weight") or n == "4.bias" else None for n in params}


def muon_label_error(rank: int, world_size: int, fsdp2: bool = True, zero_flat: bool = False) -> str:
    """The ValueError of Muon whose dimension numbers label a vector, built over FSDP2's params (or
    one process's, or under ZeRO's hybrid plan: ``zero_flat``) in one group and stepped once."""
    import zero
    from zero.functional import contrib

    model = sharded(make_model()) if fsdp2 and not zero_flat else make_model()
    try:
        rule = contrib.muon(1e-2, muon_weight_dimension_numbers=label_weights_and_a_bias)
        opt = zero.ZeroRedundancyOptimizer(model.named_parameters(), rule, strategy="flat") if zero_flat else \
            F.Optimizer(model.named_parameters(), rule)
        set_grads(model, fixed_grads(model, 0))
        opt.step()
    except ValueError as e:
        return str(e)
    return "stepped"
