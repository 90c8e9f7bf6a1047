"""Per-rank bodies of the backend tests (run by `distributed.run_ranks` in fresh processes).

Every body trains several copies of one model on the same gradients, the way DDP leaves them
(each rank's own gradients, all-reduced and averaged), and compares them step by step:
ours, torch's own `ZeroRedundancyOptimizer`, and a single-process optimizer over all params.
"""

from __future__ import annotations

import copy
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import comm

TORCH_CONFIGS = {
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, maximize=True)),
}


def make_model(seed: int = 0, dtypes=(torch.float32,)) -> nn.Module:
    """Uneven layer sizes (231, 33, 165, 5, 320, 64, 192, 3 elements); ``dtypes`` cycle over layers."""
    torch.manual_seed(seed)
    layers = [nn.Linear(7, 33), nn.Linear(33, 5), nn.Linear(5, 64), nn.Linear(64, 3)]
    return nn.Sequential(*[lay.to(dtypes[i % len(dtypes)]) for i, lay in enumerate(layers)])


def groups_of(model: nn.Module, lr_scale: float | None = 0.5) -> list[dict]:
    first = [*model[0].parameters(), *model[1].parameters()]
    rest = [*model[2].parameters(), *model[3].parameters()]
    second = {"params": rest} if lr_scale is None else {"params": rest, "lr": 1e-2 * lr_scale}
    return [{"params": first}, second]


def ddp_grads(params: list[torch.Tensor], step: int, rank: int, world_size: int, group=None) -> list:
    """This rank's random gradients, averaged over the group as DDP would (None where frozen)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    grads = []
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        dist.all_reduce(g, group=group)
        grads.append(g / world_size if p.requires_grad else None)
    return grads


def set_grads(model: nn.Module, grads: list) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else g.clone()


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to(torch.float64).numpy().tobytes())
    return h.hexdigest()


def same_on_every_rank(model: nn.Module, group=None) -> bool:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, digest(model), group=group)
    return len(set(out)) == 1


def assert_params(a: nn.Module, b: nn.Module, exact: bool, what: str) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(x, y), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {name}: {m}")


def state_bytes_of(optim) -> int:
    return sum(v.nbytes for st in optim.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class CountingGather:
    """Counts the all-gathers the sync issues (patched over `comm.all_gather_rows`)."""

    def __init__(self):
        self.calls, self._orig = 0, comm.all_gather_rows

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)
        comm.all_gather_rows = counted
        return self

    def __exit__(self, *exc):
        comm.all_gather_rows = self._orig


def torch_parity_matrix(rank: int, world_size: int) -> dict:
    """`torch_parity` for every torch config, bucket views off and on, in one set of processes."""
    return {(name, bv): torch_parity(rank, world_size, name, bv) for name in TORCH_CONFIGS for bv in (False, True)}


def torch_parity(rank: int, world_size: int, name: str, bucket_view: bool, steps: int = 24) -> dict:
    """Ours vs torch's ZeRO (exact) vs one process (rel 1e-6), trainability flipped mid-run."""
    cls, kw = TORCH_CONFIGS[name]
    ours_m, theirs_m, ref_m = make_model(), make_model(), make_model()
    ours = Zero(groups_of(ours_m), cls, parameters_as_bucket_view=bucket_view, **kw)
    theirs = TorchZero(groups_of(theirs_m), cls, parameters_as_bucket_view=bucket_view, **kw)
    ref = cls(groups_of(ref_m), **kw)
    frozen = [m[1].weight for m in (ours_m, theirs_m, ref_m)]
    gathers = []
    for step in range(steps):
        if step in (8, 16):
            for p in frozen:
                p.requires_grad_(step == 16)
        grads = ddp_grads(list(ours_m.parameters()), step, rank, world_size)
        for m in (ours_m, theirs_m, ref_m):
            set_grads(m, grads)
        with CountingGather() as count:
            ours.step()
        gathers.append(count.calls)
        theirs.step()
        ref.step()
        assert_params(ours_m, theirs_m, exact=True, what=f"step {step} vs torch ZeRO")
        assert_params(ours_m, ref_m, exact=False, what=f"step {step} vs single process")
        assert same_on_every_rank(ours_m), f"step {step}: replicas differ across ranks"
    plan = zero.make_plan(zero.param_metas(ours.param_groups), world_size, optimizer=name)
    return {"gathers": gathers, "state_bytes": state_bytes_of(ours.optim),
            "plan_state_bytes": plan.ranks[rank].state_bytes,
            **_checkpoint_parity(rank, ours, ours_m, theirs, ref, ref_m, cls, kw, bucket_view)}


def _checkpoint_parity(rank, ours, ours_m, theirs, ref, ref_m, cls, kw, bucket_view) -> dict:
    """Consolidated state equals torch's; each loads into the other and into a plain optimizer."""
    ours.consolidate_state_dict(to=0)
    theirs.consolidate_state_dict(to=0)
    ours_sd = theirs_sd = None
    if rank == 0:
        ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
        assert ours_sd["param_groups"] == theirs_sd["param_groups"]
        assert ours_sd["state"].keys() == theirs_sd["state"].keys() == ref.state_dict()["state"].keys()
        for i, st in ours_sd["state"].items():
            for k, v in st.items():
                assert torch.equal(v, theirs_sd["state"][i][k]), f"state {i}.{k} differs from torch's"
                torch.testing.assert_close(v, ref.state_dict()["state"][i][k], rtol=1e-6, atol=1e-9)
    theirs_sd = broadcast(theirs_sd)
    ours_sd = broadcast(ours_sd)
    # torch's checkpoint into a fresh one of ours, ours into a plain optimizer: all continue alike.
    fresh_m, plain_m = copy.deepcopy(ours_m), copy.deepcopy(ours_m)
    fresh = Zero(groups_of(fresh_m), cls, parameters_as_bucket_view=bucket_view, **kw)
    fresh.load_state_dict(theirs_sd)
    plain = cls(groups_of(plain_m), **kw)
    plain.load_state_dict(ours_sd)
    for step in range(100, 103):
        grads = ddp_grads(list(ours_m.parameters()), step, 0, 1)  # same on every rank
        for m, opt in ((ours_m, ours), (fresh_m, fresh), (plain_m, plain)):
            set_grads(m, grads)
            opt.step()
        assert_params(fresh_m, ours_m, exact=True, what=f"reloaded from torch's state, step {step}")
        assert_params(plain_m, ours_m, exact=False, what=f"plain optimizer from our state, step {step}")
    return {"consolidated": rank == 0}


def functional_parity(rank: int, world_size: int, steps: int = 20) -> dict:
    """A zero.functional factory and a chain as the local optimizer, vs one process, chunked sync."""
    out = {}
    ours_m, ref_m = make_model(), make_model()
    ours = Zero(groups_of(ours_m), zf.adamw, learning_rate=1e-2, weight_decay=0.1, sync_chunk_mb=2**-10)
    ref = zf.Optimizer(groups_of(ref_m), zf.inject_hyperparams(zf.adamw)(learning_rate=1e-2, weight_decay=0.1))
    out["factory_groups_lr"] = [g["lr"] for g in ours.param_groups]
    out["chunked_gathers"] = ours._sync.collectives_per_step
    tx = zf.chain(zf.add_decayed_weights(1e-3), zf.scale_by_adam(), zf.scale_by_learning_rate(1e-2))
    chain_m, chain_ref_m = make_model(), make_model()
    chain = Zero(groups_of(chain_m, lr_scale=None), tx, parameters_as_bucket_view=True)
    chain_ref = zf.Optimizer(groups_of(chain_ref_m, lr_scale=None), tx)
    for step in range(steps):
        grads = ddp_grads(list(ours_m.parameters()), step, rank, world_size)
        for m, opt in ((ours_m, ours), (ref_m, ref), (chain_m, chain), (chain_ref_m, chain_ref)):
            set_grads(m, grads)
            opt.step()
        assert_params(ours_m, ref_m, exact=False, what=f"factory, step {step}")
        assert_params(chain_m, chain_ref_m, exact=False, what=f"chain, step {step}")
        assert same_on_every_rank(ours_m) and same_on_every_rank(chain_m)
    ours.consolidate_state_dict(to=0)
    sd = broadcast(ours.state_dict() if rank == 0 else None)
    again_m = copy.deepcopy(ours_m)
    again = Zero(groups_of(again_m), zf.adamw, learning_rate=1e-2, weight_decay=0.1)
    again.load_state_dict(sd)
    for step in range(50, 53):
        grads = ddp_grads(list(ours_m.parameters()), step, 0, 1)
        for m, opt in ((ours_m, ours), (again_m, again)):
            set_grads(m, grads)
            opt.step()
        assert_params(again_m, ours_m, exact=True, what=f"functional state reloaded, step {step}")
    return out
