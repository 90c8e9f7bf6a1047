"""Per-rank bodies of the backend tests (run by `helpers.run_ranks` in fresh processes).

Every body trains several copies of one model on the same gradients, the way DDP leaves them
(each rank's own gradients, all-reduced and averaged), and compares them step by step:
ours, torch's own `ZeroRedundancyOptimizer`, and a single-process optimizer over all params.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os

import torch
import torch.distributed as dist
from helpers import (
    CommCounter,
    assert_params_close,
    broadcast,
    ddp_grads,
    fixed_grads,
    groups_of,
    make_model,
    patched,
    same_on_every_rank,
    set_grads,
    side_by_side,
)
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import zero
import zero.backends.sync
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends.local_optimizer import state_nbytes

TORCH_CONFIGS = {
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, maximize=True)),
}


def torch_parity_matrix(rank: int, world_size: int) -> dict:
    """`torch_parity` for every torch config and every ``parameters_as_bucket_view``, in one set of
    processes. For None (ours only) params of 150 elements or more go direct whenever the rows
    would pad at all: the tiny model's 1013 elements never split evenly over 2, 3 or 4 ranks, so
    it mixes the default path's row views and direct broadcasts."""
    out = {}
    sync = zero.backends.sync
    for name in TORCH_CONFIGS:
        for bv in (None, False, True):
            direct, limit = (150, 0.0) if bv is None else (sync.DIRECT_NUMEL, sync.PAD_LIMIT)
            with patched(sync, "DIRECT_NUMEL", direct), patched(sync, "PAD_LIMIT", limit):
                out[name, bv] = torch_parity(rank, world_size, name, bv)
    return out


def storage_of(ours: Zero) -> list[str]:
    """Per trainable param: "row" if it is a view into the optimizer's sync rows, else "own"."""
    rows = [r for r in ours.mode.sync._rows if r is not None]

    def inside(p):
        return any(r.data_ptr() <= p.data_ptr() < r.data_ptr() + r.numel() * r.element_size() for r in rows)
    return ["row" if inside(p) else "own" for p in ours.rank_state.params if p.requires_grad]


def torch_parity(rank: int, world_size: int, name: str, bucket_view: bool, steps: int = 24) -> dict:
    """Ours vs torch's ZeRO (exact) vs one process (rel 1e-6), trainability flipped mid-run."""
    cls, kw = TORCH_CONFIGS[name]
    ours_m, theirs_m, ref_m = make_model("small"), make_model("small"), make_model("small")
    ours = Zero(groups_of(ours_m), cls, parameters_as_bucket_view=bucket_view, **kw)
    theirs = TorchZero(groups_of(theirs_m), cls, parameters_as_bucket_view=bool(bucket_view), **kw)
    ref = cls(groups_of(ref_m), **kw)
    storage = storage_of(ours)
    frozen = [m[1].weight for m in (ours_m, theirs_m, ref_m)]
    gathers = []
    for step in range(steps):
        if step in (8, 16):
            for p in frozen:
                p.requires_grad_(step == 16)
        grads = ddp_grads(list(ours_m.parameters()), step, rank, world_size)
        for m in (ours_m, theirs_m, ref_m):
            set_grads(m, grads)
        with CommCounter() as count:
            ours.step()
        gathers.append(count.calls("all_gather_rows"))
        theirs.step()
        ref.step()
        assert_params_close(ours_m, theirs_m, exact=True, what=f"step {step} vs torch ZeRO")
        assert_params_close(ours_m, ref_m, exact=False, what=f"step {step} vs single process")
        assert same_on_every_rank(ours_m), f"step {step}: replicas differ across ranks"
    plan = zero.make_plan(zero.param_metas(ours.param_groups), world_size, optimizer=name)
    return {"gathers": gathers, "state_bytes": state_nbytes(ours.optim), "storage": storage,
            "numels": [p.numel() for p in ours.rank_state.params],
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

    def check(step: int) -> None:
        assert_params_close(fresh_m, ours_m, exact=True, what=f"reloaded from torch's state, step {step}")
        assert_params_close(plain_m, ours_m, exact=False, what=f"plain optimizer from our state, step {step}")

    grads = lambda k: ddp_grads(list(ours_m.parameters()), k, 0, 1)  # noqa: E731 (the same on every rank)
    side_by_side([(ours_m, ours), (fresh_m, fresh), (plain_m, plain)], grads, range(100, 103), each_step=check)
    return {"consolidated": rank == 0}


def functional_parity(rank: int, world_size: int, steps: int = 20) -> dict:
    """A zero.functional factory and a chain as the local optimizer, vs one process, chunked sync."""
    out = {}
    ours_m, ref_m = make_model("small"), make_model("small")
    ours = Zero(groups_of(ours_m), zf.adamw, learning_rate=1e-2, weight_decay=0.1, parameters_as_bucket_view=False,
                sync_chunk_mb=2**-10)
    ref = zf.Optimizer(groups_of(ref_m), zf.inject_hyperparams(zf.adamw)(learning_rate=1e-2, weight_decay=0.1))
    out["factory_groups_lr"] = [g["lr"] for g in ours.param_groups]
    tx = zf.chain(zf.add_decayed_weights(1e-3), zf.scale_by_adam(), zf.scale_by_learning_rate(1e-2))
    chain_m, chain_ref_m = make_model("small"), make_model("small")
    chain = Zero(groups_of(chain_m, False), tx, parameters_as_bucket_view=True)
    chain_ref = zf.Optimizer(groups_of(chain_ref_m, False), tx)
    for step in range(steps):
        grads = ddp_grads(list(ours_m.parameters()), step, rank, world_size)
        for m, opt in ((ours_m, ours), (ref_m, ref), (chain_m, chain), (chain_ref_m, chain_ref)):
            set_grads(m, grads)
            with CommCounter() as count:
                opt.step()
            if opt is ours:
                out["chunked_gathers"] = count.calls("all_gather_rows")
        assert_params_close(ours_m, ref_m, exact=False, what=f"factory, step {step}")
        assert_params_close(chain_m, chain_ref_m, exact=False, what=f"chain, step {step}")
        assert same_on_every_rank(ours_m) and same_on_every_rank(chain_m)
    ours.consolidate_state_dict(to=0)
    sd = broadcast(ours.state_dict() if rank == 0 else None)
    again_m = copy.deepcopy(ours_m)
    again = Zero(groups_of(again_m), zf.adamw, learning_rate=1e-2, weight_decay=0.1)
    again.load_state_dict(sd)
    side_by_side([(ours_m, ours), (again_m, again)], lambda k: ddp_grads(list(ours_m.parameters()), k, 0, 1),
                 range(50, 53), each_step=lambda k: assert_params_close(again_m, ours_m, exact=True,
                                                                        what=f"functional state reloaded, step {k}"))
    return out


def aliases_sharded(rank: int, world_size: int, names: list[str], steps: int = 6) -> list[str]:
    """Each alias as ZeRO's local optimizer (by factory) vs the same alias in one process."""
    from alias_cases import ALIASES

    for name in names:
        ours_m, ref_m = make_model("small"), make_model("small")
        ours = Zero(ours_m.parameters(), getattr(zf, name), **ALIASES[name])
        ref = zf.Optimizer(ref_m.parameters(), zf.inject_hyperparams(getattr(zf, name))(**ALIASES[name]))
        params = list(ours_m.parameters())
        side_by_side([(ours_m, ours), (ref_m, ref)], lambda k, ps=params: ddp_grads(ps, k, rank, world_size),
                     range(steps), each_step=lambda k, name=name, ours_m=ours_m, ref_m=ref_m: assert_params_close(
                         ours_m, ref_m, what=f"{name}, step {k}"))
        assert same_on_every_rank(ours_m), name
    return names


def train_leg(rank: int, world_size: int, load_from: str | None, save_to: str, start: int, steps: int) -> dict:
    """Resume (model + consolidated optimizer state) on this world size, train, save again."""
    model = make_model("small")
    opt = Zero(groups_of(model), torch.optim.Adam, lr=1e-2, weight_decay=0.01)
    if load_from is not None:
        saved = torch.load(load_from, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    for step in range(start, start + steps):
        set_grads(model, fixed_grads(list(model.parameters()), step))
        opt.step()
    opt.consolidate_state_dict(to=world_size - 1)
    if rank == world_size - 1:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, save_to)
    return {"state_bytes": state_nbytes(opt.optim)}


def mixed_dtypes(rank: int, world_size: int, steps: int = 12) -> dict:
    """fp32 + bf16 + fp64 layers in one optimizer (torch's raises) vs one process."""
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    ours_m, ref_m = make_model("small", dtypes=dtypes), make_model("small", dtypes=dtypes)
    try:
        TorchZero(ours_m.parameters(), torch.optim.Adam, lr=1e-2)
        torch_error = None
    except ValueError as e:
        torch_error = str(e)
    for bucket_view in (False, True):
        ours = Zero(groups_of(ours_m), torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=1e-2)
        ref = torch.optim.Adam(groups_of(ref_m), lr=1e-2)
        for step in range(steps):
            grads = ddp_grads(list(ours_m.parameters()), step, rank, world_size)
            set_grads(ours_m, grads)
            set_grads(ref_m, grads)
            with CommCounter() as count:
                ours.step()
            ref.step()
            assert_params_close(ours_m, ref_m, exact=True, what=f"mixed dtypes, step {step}")
            assert same_on_every_rank(ours_m)
    return {"torch_error": torch_error, "gathers": count.calls("all_gather_rows"),
            "dtypes": sorted({str(p.dtype) for p in ours_m.parameters()})}


def join_uneven(rank: int, world_size: int) -> dict:
    """DDP + ZeRO under Join with 3 + 2 * rank batches: ours ends where torch's does."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    finals = []
    for cls in (Zero, TorchZero):
        model = DDP(make_model("small"))
        opt = cls(model.parameters(), torch.optim.Adam, lr=1e-2)
        gen = torch.Generator().manual_seed(rank)
        with Join([model, opt]):
            for _ in range(3 + 2 * rank):
                opt.zero_grad()
                model(torch.randn(4, 7, generator=gen)).square().mean().backward()
                opt.step()
        finals.append(model.module)
        assert same_on_every_rank(model.module), f"{cls.__module__}: replicas differ after Join"
    assert_params_close(finals[0], finals[1], exact=True, what="Join with uneven inputs vs torch")
    return {}


def _shadow_grads(params: list, k: int) -> list:
    return fixed_grads(params, 100 + k)


class _GradSetter:
    """torch's ZeRO test's helper, as drop-in code writes it: once its rank has run out of
    inputs, its join hook sets every param's gradient through the optimizer's ``_all_params``
    (torch's list of every param, in order) before the optimizer's hook steps."""

    def __init__(self, opt, grads):
        from torch.distributed.algorithms.join import Joinable, JoinHook

        setter = self

        class Hook(JoinHook):
            def main_hook(self):
                for p, g in zip(setter.opt._all_params, setter.grads(setter.shadowed)):
                    p.grad = g.clone()
                setter.shadowed += 1

        class Setter(Joinable):
            def __init__(self):
                super().__init__()

            def join_hook(self, **kwargs):
                return Hook()

            @property
            def join_device(self):
                return torch.device("cpu")

            @property
            def join_process_group(self):
                return dist.group.WORLD

        self.opt, self.grads, self.shadowed, self.joinable = opt, grads, 0, Setter()


def join_sets_grads_through_all_params(rank: int, world_size: int) -> dict:
    """Uneven inputs (2 + 2 * rank batches) under Join([setter, DDP, ZeRO]), a joined rank's
    gradients set through ``opt._all_params``: ours ends where torch's does, bit for bit."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    finals, seen = [], []
    for cls in (Zero, TorchZero):
        model = DDP(make_model("small"))
        opt = cls(groups_of(model.module), torch.optim.Adam, lr=1e-2)
        params = list(model.parameters())
        setter = _GradSetter(opt, functools.partial(_shadow_grads, params))
        gen = torch.Generator().manual_seed(rank)
        with Join([setter.joinable, model, opt]):
            for _ in range(2 + 2 * rank):
                Join.notify_join_context(setter.joinable)
                opt.zero_grad()
                model(torch.randn(4, 7, generator=gen)).square().mean().backward()
                opt.step()
        finals.append(model.module)
        seen.append(setter.shadowed)
    assert_params_close(finals[0], finals[1], exact=True, what="Join, grads set through _all_params, vs torch")
    return {"shadowed": seen, "all_params": [tuple(p.shape) for p in opt._all_params]}


def torch_names(rank: int, world_size: int) -> dict:
    """torch's attributes that code in the wild reads, on torch's class and ours over the same
    params and partition (ours executes torch's sorted-greedy partition exactly)."""
    from zero.backends.torch_names import TORCH_NAMES

    ours_m, ref_m = make_model("plan"), make_model("plan")
    ours = Zero(groups_of(ours_m), torch.optim.Adam, lr=1e-2)
    ref = TorchZero(groups_of(ref_m), torch.optim.Adam, lr=1e-2)
    missing = {"ours": [n for n in TORCH_NAMES if not hasattr(ours, n)],
               "torch": [n for n in TORCH_NAMES if not hasattr(ref, n)]}
    index = {id(p): i for i, p in enumerate(ours_m.parameters())}
    ref_index = {id(p): i for i, p in enumerate(ref_m.parameters())}

    def by_index(opt, idx):
        return {idx[id(p)]: r for p, r in opt._param_to_rank.items()}

    def partition(opt, idx):
        return [[sorted(idx[id(p)] for p in g["params"]) for g in groups] for groups in opt._partition_parameters()]

    flat = Zero(make_model("plan").parameters(), torch.optim.Adam, strategy="flat", lr=1e-2)
    try:
        flat_error = f"no error: {len(flat._param_to_rank)} owners"
    except RuntimeError as e:
        flat_error = str(e)
    return {"missing": missing, "flat_error": flat_error,
            "same": {"_param_to_rank": by_index(ours, index) == by_index(ref, ref_index),
                     "_partition_parameters": partition(ours, index) == partition(ref, ref_index),
                     "_all_params": [tuple(p.shape) for p in ours._all_params] ==
                                    [tuple(p.shape) for p in ref._all_params],
                     "_index_to_param": [index[id(p)] for p in ours._index_to_param] ==
                                        [ref_index[id(p)] for p in ref._index_to_param],
                     "_param_to_index": {index[id(p)]: i for p, i in ours._param_to_index.items()} ==
                                        {ref_index[id(p)]: i for p, i in ref._param_to_index.items()},
                     "scalars": [(o.global_rank, o.initialized, o._overlap_with_ddp, o.world_size, o.rank,
                                  type(o.optim)) for o in (ours, ref)]},
            "read_only": isinstance(ours._all_params, tuple)}


def subgroups(rank: int, world_size: int, steps: int = 10) -> dict:
    """Two ZeRO optimizers on disjoint halves of the world; consolidation addresses group ranks."""
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, members = halves[rank // 2], [[0, 1], [2, 3]][rank // 2]
    ours_m, ref_m = make_model("small"), make_model("small")
    ours = Zero(groups_of(ours_m), torch.optim.Adam, process_group=group, lr=1e-2)
    ref = torch.optim.Adam(groups_of(ref_m), lr=1e-2)
    for step in range(steps):
        grads = ddp_grads(list(ours_m.parameters()), step, rank, 2, group=group)
        set_grads(ours_m, grads)
        set_grads(ref_m, grads)
        ours.step()
        ref.step()
        assert_params_close(ours_m, ref_m, exact=True, what=f"subgroup {members}, step {step}")
        assert same_on_every_rank(ours_m, group=group)
    ours.consolidate_state_dict(to=1)
    if ours.rank == 1:
        sd = ours.state_dict()
        for i, st in ref.state_dict()["state"].items():
            assert torch.equal(sd["state"][i]["exp_avg"], st["exp_avg"])
    return {"group_rank": ours.rank, "world_size": ours.world_size}


def rank_dies(rank: int, world_size: int) -> dict:
    """The last rank exits after construction; the others' step must fail, not hang, and name it."""
    import os
    import time

    model = make_model("small")
    opt = Zero(model.parameters(), torch.optim.Adam, lr=1e-2)
    dist.barrier()
    if rank == world_size - 1:
        os._exit(0)
    time.sleep(1.0)
    set_grads(model, fixed_grads(list(model.parameters()), 0))
    start = time.monotonic()
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def add_group_on_some_ranks(rank: int, world_size: int) -> dict:
    """Rank 0 adds a param group, the others step: every rank must get an error."""
    import time

    model, extra = make_model("small"), nn.Linear(3, 3)
    opt = Zero(model.parameters(), torch.optim.Adam, lr=1e-2)
    set_grads(model, fixed_grads(list(model.parameters()), 0))
    start = time.monotonic()
    try:
        if rank == 0:
            opt.add_param_group({"params": list(extra.parameters())})
        else:
            opt.step()
    except Exception as e:  # noqa: BLE001
        return {"error": type(e).__name__, "message": str(e)[:300], "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def diverged(rank: int, world_size: int, case: str) -> dict:
    """Ranks that were given, or did, different things: every rank must get a ValueError in time.

    ``groups``: rank 0 splits the params into two groups, the others keep one (same lr);
    ``lr``: rank 0 uses another lr; ``skipped_step``: rank 1 skips step 2, then all consolidate;
    ``consolidate_to``: the ranks name different targets; ``model``: rank 0's last param has
    another shape.
    """
    model = make_model("small")
    params = list(model.parameters())
    if case == "model" and rank == 0:
        params[-1] = torch.nn.Parameter(torch.zeros(params[-1].numel() + 1))
    if case == "groups" and rank == 0:
        opt = Zero([{"params": params[:2]}, {"params": params[2:]}], torch.optim.Adam, lr=1e-2)
    else:
        opt = Zero(params, torch.optim.Adam, lr=2e-2 if case == "lr" and rank == 0 else 1e-2)
    try:
        for step in range(4):
            for p, g in zip(params, fixed_grads(params, step)):
                p.grad = g
            if not (case == "skipped_step" and rank == 1 and step == 2):
                opt.step()
        opt.consolidate_state_dict(to=rank if case == "consolidate_to" else 0)
    except ValueError as e:
        return {"message": str(e), "step": step}
    return {"message": None}


def training_tools(rank: int, world_size: int, steps: int = 12) -> dict:
    """DDP + GradScaler (inf on one rank at step 5) + clip_grad_norm_ + StepLR, vs one process."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours_m, ref_m = make_model("small"), make_model("small")
    ddp = DDP(ours_m)
    ours = Zero(groups_of(ours_m), torch.optim.Adam, lr=1e-2)
    ref = torch.optim.Adam(groups_of(ref_m), lr=1e-2)
    runs = []
    for model, opt in ((ddp, ours), (ref_m, ref)):
        runs.append((model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**8),
                     torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)))
    skipped = []
    for step in range(steps):
        xs = [torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world_size)]
        if step == 5:
            xs[world_size - 1][0, 0] = float("inf")
        for model, opt, scaler, sched in runs:
            opt.zero_grad()
            losses = [model(x).square().mean() for x in ([xs[rank]] if model is ddp else xs)]
            scaler.scale(sum(losses) / len(losses)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if model is ddp:
                skipped.append(scaler.get_scale() < before)
        assert_params_close(ours_m, ref_m, exact=False, what=f"amp + clip + StepLR, step {step}")
        assert same_on_every_rank(ours_m)
        assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in ref.param_groups]
    return {"skipped": skipped, "lr": ours.param_groups[1]["lr"]}


def add_param_group(rank: int, world_size: int, steps: int = 10) -> dict:
    """A group added mid-run (on every rank): old owners kept, as torch's, and as one process."""
    models = [make_model("small") for _ in range(3)]
    extras = [nn.Linear(9, 11) for _ in range(3)]
    for e in extras[1:]:
        e.load_state_dict(extras[0].state_dict())
    opts = [Zero(models[0].parameters(), torch.optim.Adam, lr=1e-2),
            TorchZero(models[1].parameters(), torch.optim.Adam, lr=1e-2),
            torch.optim.Adam(models[2].parameters(), lr=1e-2)]
    owner_before = opts[0].partition.owner
    for step in range(steps):
        if step == 4:
            for opt, extra in zip(opts, extras):
                opt.add_param_group({"params": list(extra.parameters()), "lr": 3e-2})
        n_extra = 2 if step >= 4 else 0
        grads = ddp_grads(list(models[0].parameters()) + list(extras[0].parameters())[:n_extra], step, rank,
                          world_size)
        for m, e in zip(models, extras):
            set_grads(m, grads[:8])
            for p, g in zip(e.parameters(), grads[8:]):
                p.grad = g.clone()
        for opt in opts:
            opt.step()
        assert_params_close(models[0], models[1], exact=True, what=f"step {step} vs torch ZeRO")
        assert_params_close(extras[0], extras[1], exact=True, what=f"added group, step {step} vs torch ZeRO")
        assert_params_close(models[0], models[2], exact=False, what=f"step {step} vs one process")
    assert opts[0].partition.owner[:8] == owner_before
    return {"lr": [g["lr"] for g in opts[0].param_groups]}


def nccl_parity(rank: int, world_size: int, steps: int = 10) -> dict:
    """On one GPU per rank: ours vs torch's ZeRO (exact), fused Adam, bucket views off and on."""
    device = torch.device("cuda", rank)
    for bucket_view in (False, True):
        ours_m, theirs_m = make_model("small").to(device), make_model("small").to(device)
        ours = Zero(ours_m.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=1e-2, fused=True)
        theirs = TorchZero(theirs_m.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=1e-2,
                           fused=True)
        for step in range(steps):
            grads = [g.to(device) for g in fixed_grads(list(ours_m.parameters()), step)]
            set_grads(ours_m, grads)
            set_grads(theirs_m, grads)
            ours.step()
            theirs.step()
            assert_params_close(ours_m, theirs_m, exact=True, what=f"nccl step {step}")
        ours.consolidate_state_dict(to=0)
        sd = broadcast(ours.state_dict() if rank == 0 else None)
        again = Zero(copy.deepcopy(ours_m).parameters(), torch.optim.Adam, lr=1e-2, fused=True)
        again.load_state_dict(sd)  # fused Adam needs its step on the GPU: torch's load rules put it there
        for st in again.optim.state.values():
            assert st["step"].device == device
    return {}


def skips_a_step(rank: int, world_size: int, mode: str, skipper: int = 1, skip_at: int = 2) -> dict:
    """An ordinary loop (zero_grad, forward, backward, step) in which rank ``skipper`` skips
    ``step()`` at iteration ``skip_at``: ``mode`` "ddp" (DDP + ZeRO) or "rs" (a flat plan with
    reduce_scatter_grads, no DDP). Every rank must raise, in bounded time, naming the skipper."""
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model("small")
    if mode == "ddp":
        net = DDP(model)
        opt = Zero(model.parameters(), torch.optim.Adam, lr=1e-2)
    else:
        net = model
        opt = Zero(model.parameters(), torch.optim.Adam, lr=1e-2, strategy="flat", reduce_scatter_grads=True)
    start = None
    try:
        for it in range(6):
            opt.zero_grad()
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * it + rank))
            net(x).square().sum().backward()
            if start is None and it >= skip_at:
                start = time.monotonic()
            if not (rank == skipper and it == skip_at):
                opt.step()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - (start or time.monotonic()),
                "iteration": it}
    return {"error": None}


def stops_before_a_step(rank: int, world_size: int, stopped_s: float) -> dict:
    """Rank 1 is SIGSTOP-ed before its third step: the others must name it within about
    ``stopped_s`` (the process group's timeout being much longer)."""
    import signal
    import time

    import zero.backends.consistency

    zero.backends.consistency.STOPPED_S = stopped_s
    model = make_model("small")
    opt = Zero(model.parameters(), torch.optim.Adam, lr=1e-2)
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    start = None
    try:
        for it in range(4):
            opt.zero_grad()
            model(torch.randn(4, 7, generator=torch.Generator().manual_seed(it))).square().sum().backward()
            if it == 2:
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGSTOP)
                start = time.monotonic()
            opt.step()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        seconds = time.monotonic() - start
        os.kill(pids[1], signal.SIGKILL)  # the stopped rank: the launcher need not wait out its grace for it
        return {"error": type(e).__name__, "message": str(e), "seconds": seconds}
    return {"error": None}


def dies_in_backward(rank: int, world_size: int) -> dict:
    """A flat plan with reduce_scatter_grads (zero owns the gradient collectives): the last rank
    exits in the middle of its third backward pass. The others must raise one error naming it."""
    import time

    model = make_model("small")
    opt = Zero(model.parameters(), torch.optim.Adam, lr=1e-2, strategy="flat", reduce_scatter_grads=True)
    if rank == world_size - 1:
        model[1].weight.register_hook(lambda g: os._exit(0) if opt.rank_state.steps == 2 else g)
    start = None
    try:
        for it in range(4):
            opt.zero_grad()
            start = time.monotonic()
            model(torch.randn(4, 7, generator=torch.Generator().manual_seed(it))).square().sum().backward()
            opt.step()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start, "iteration": it}
    return {"error": None}


def accumulates_under_ddp(rank: int, world_size: int, micro: int = 3, steps: int = 3) -> float:
    """DDP + ZeRO with gradient accumulation (all micro-batches but the last under ``no_sync``):
    the backward passes that start with no step since the last meet the other ranks and go on.
    Returns the largest difference from DDP + Adam run beside it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours_m, ref_m = make_model("small"), make_model("small")
    ours, ref = DDP(ours_m), DDP(ref_m)
    opt, ref_opt = Zero(ours_m.parameters(), torch.optim.Adam, lr=1e-2), torch.optim.Adam(ref_m.parameters(), lr=1e-2)
    for step in range(steps):
        for net, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            for m in range(micro):
                x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1000 * step + 10 * m + rank))
                with net.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    net(x).square().sum().backward()
            o.step()
    return max((a - b).abs().max().item() for a, b in zip(ours_m.parameters(), ref_m.parameters()))


def named_masks(rank: int, world_size: int, steps: int = 10) -> dict:
    """Named params through ZeRO (whole plan): a decay mask by name and a leading clip (the sharded
    global norm) on the fused kernel, vs one process stepping the same chain by name."""
    tx = zf.chain(zf.clip_by_global_norm(0.5),
                  zf.adamw(1e-2, weight_decay=0.1, mask=lambda tree: {n: not n.endswith("bias") for n in tree}))
    ours_m, ref_m = make_model("small"), make_model("small")
    ours = Zero(ours_m.named_parameters(), tx)
    ref = zf.Optimizer(ref_m.named_parameters(), tx)
    side_by_side([(ours_m, ours), (ref_m, ref)], lambda k: ddp_grads(list(ours_m.parameters()), k, rank, world_size),
                 range(steps), each_step=lambda k: assert_params_close(ours_m, ref_m, what=f"named masks, step {k}"))
    assert same_on_every_rank(ours_m)
    out = {"path": str(ours.path[0]), "names": ours.optim.param_groups[0]["param_names"]}
    for key, make in (("flat", lambda: Zero(make_model("small").named_parameters(), tx, strategy="flat")),
                      ("flat_factory", lambda: Zero(make_model("small").parameters(), zf.adamw, learning_rate=1e-2,
                                                    mask=lambda tree: [True] * len(tree), strategy="flat"))):
        try:
            make()
        except ValueError as e:
            out[key] = str(e)
    return out


def from_optax_on_ranks(rank: int, world_size: int, per_tensor: bool | None) -> object:
    """ZeRO with an Optax rule: ``None``, Optax's global-norm clipping undeclared (refused at 2+
    ranks, with the error's words returned); else optax.adam declared per tensor or not, the params after
    3 steps."""
    import jax
    import optax
    import torch
    from torch import nn

    import zero.functional as zf
    from zero.backends import ZeroRedundancyOptimizer

    jax.config.update("jax_enable_x64", True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, dtype=torch.float64), nn.Linear(8, 3, dtype=torch.float64))
    if per_tensor is None:
        tx = zf.from_optax(optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1.0)))
    else:
        tx = zf.from_optax(optax.adam(1e-2), per_tensor=per_tensor)
    try:
        opt = ZeroRedundancyOptimizer(model.parameters(), tx)
    except ValueError as e:
        return str(e)
    for k in range(3):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1.0 + k)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def local_foreach(rank, world_size):
    """See test_local_foreach.test_zero_takes_foreach_invisibly."""
    def build(cls=torch.optim.Adam, impl=Zero, **kw):
        model = make_model("small")
        groups = groups_of(model)
        return model, impl(groups, cls, lr=1e-2, **kw)

    model, opt = build()
    twin, ref = build(impl=TorchZero)
    for step in range(5):
        for m in (model, twin):
            set_grads(m, fixed_grads(list(m.parameters()), step))
        opt.step()
        ref.step()
    equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    saved = opt.state_dict()["param_groups"]
    _, user = build(foreach=False)
    user.step()
    _, tensor_lr = build(torch.optim.SGD, momentum=0.9)
    for g in tensor_lr.param_groups:
        g["lr"] = torch.tensor(1e-2)
    _, other = build(torch.optim.RMSprop)
    for o in (tensor_lr, other):
        o.step()
    return {"local": [g["foreach"] for g in opt.optim.param_groups], "outer": [g["foreach"] for g in opt.param_groups],
            "saved": [g["foreach"] for g in saved], "user_false": [user.optim.param_groups[0]["foreach"]],
            "tensor_lr": [tensor_lr.optim.param_groups[0]["foreach"]],
            "other_class": [other.optim.param_groups[0]["foreach"]], "equal_to_torch": equal}
