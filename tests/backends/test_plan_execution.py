"""`ZeroRedundancyOptimizer` executes the `zero.Plan` it is given: every strategy, flat shards,
whole-tensor rules over shards, and checkpoints that move between plans and world sizes."""

import copy
import math
import re

import plan_workers as w
import pytest
import torch
from helpers import run_ranks
from torch import nn

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero

TORCH_RULES = ("adamw", "sgd_nesterov")
# all-reduces per step: one per group (2) for the global norm; two per group for LAMB's norms; per
# group, two for adaptive_grad_clip's unit norms (grads, params), one each for centralize's row
# means and clip_by_block_rms's mean squares
REDUCES = {"adamw": 0, "sgd_nesterov": 0, "clip_adamw": 2, "lamb": 4, "whole_tensor_rules": 8}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_flat_plans_match_one_process(world_size):
    """20 steps of AdamW, SGD(Nesterov), clip_by_global_norm + AdamW, LAMB, and adaptive_grad_clip +
    centralize + clip_by_block_rms + SGD (whole tensors' units and rows out of pieces cut across
    rows) on float64 params of uneven sizes (one larger than total / W), two groups and a frozen bias."""
    results = run_ranks(w.flat_matrix, world_size, timeout=240)
    for rank, by_rule in enumerate(results):
        for name, r in by_rule.items():
            assert r["worst"] <= 1e-9, f"{name} rank {rank}: relative difference {r['worst']}"
            assert r["counts"] == [(r["buffers"], REDUCES[name])] * 20, f"{name}: collectives per step"
            if name in TORCH_RULES:
                assert r["state_bytes"] == r["plan_state_bytes"], f"{name} rank {rank}: state differs from the plan"
    sizes = [by_rule["adamw"]["state_bytes"] for by_rule in results]
    assert len(set(sizes)) == 1, f"flat state is the same on every rank: {sizes}"


def test_flat_plans_with_bf16_and_float64_params():
    results = run_ranks(w.flat_mixed, 3, timeout=180)
    for rank, by_rule in enumerate(results):
        for name, r in by_rule.items():
            assert r["bf16_equal"] and r["worst"] <= 1e-9, f"{name} rank {rank}: {r['worst']}"
            assert r["buffers"] == 4, "one buffer per (group, dtype)"


def test_every_strategy_and_weight_runs_from_a_reloaded_plan():
    results = run_ranks(w.every_strategy, 3, timeout=240)
    for rank, by_case in enumerate(results):
        for case, r in by_case.items():
            assert r["worst"] <= 1e-9, f"{case} rank {rank}: {r['worst']}"
            if case != "clip_whole":
                assert r["state_bytes"] == r["plan_state_bytes"], f"{case} rank {rank}"
        # Clipping by the global norm inside a whole-param ZeRO: one all-reduce per group and step.
        assert by_case["clip_whole"]["counts"][0] == (1, 2)
    loads = {case: [by_case[case]["state_bytes"] for by_case in results] for case in results[0]}
    assert max(loads["flat", "numel"]) < max(loads["sorted_greedy", "numel"]), "flat balances what whole params cannot"


def test_ranks_executing_different_plans_fail_in_the_first_step():
    results = run_ranks(w.different_plans, 2, pg_timeout=20, timeout=90)
    for r in results:
        assert r["message"] and "in plan (params, groups, placement): " in r["message"], r
        assert "the plan's strategy is" in r["message"] and "'flat'" in r["message"], r["message"]
        assert not re.search(r"\d{7,}", r["message"]), "no checksum or fingerprint in the message"


def test_reshard_flat_3_to_whole_2_to_flat_4_continues_bit_identically(tmp_path):
    """Checkpoints are plain torch.optim state dicts (each leg loads one into torch.optim.AdamW)."""
    legs = [(3, "flat"), (2, "sorted_greedy"), (4, "flat")]
    load = None
    for k, (world_size, strategy) in enumerate(legs):
        save = str(tmp_path / f"leg{k}.pt")
        results = run_ranks(w.reshard_leg, world_size, strategy, load, save, 4 * k, 4, timeout=120)
        load = save
    expected = w.single_process(12)
    for r in results:
        for got, want in zip(r["params"], expected):
            assert torch.equal(torch.from_numpy(got), want)


# -- errors at the boundary (one gloo rank, in process) ------------------------------------------

def _params():
    torch.manual_seed(0)
    return list(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).parameters())


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("make, error, match", [
    (lambda ps: dict(plan="flat"), TypeError, "plan must be a zero.Plan"),
    (lambda ps: dict(plan=zero.make_plan(zero.param_metas(ps), 1), strategy="flat"), ValueError, "not both"),
    (lambda ps: dict(plan=zero.make_plan(zero.param_metas(ps), 2)), ValueError, "for 2 ranks"),
    (lambda ps: dict(plan=zero.make_plan(zero.param_metas(ps[:3]), 1)), ValueError, "for 3 params"),
    (lambda ps: dict(plan=zero.make_plan(zero.param_metas([ps[0], ps[2], ps[1], ps[3]]), 1)), ValueError,
     r"param 1 \('1' in the plan\) has shape \(2, 4\) in the plan but \(4,\) here"),
    (lambda ps: dict(plan=zero.make_plan(zero.param_metas([{"params": ps[:2]}, {"params": ps[2:]}]), 1)),
     ValueError, "param 2 .* has group 1 in the plan but 0"),
])
def test_a_plan_for_other_params_is_refused(make, error, match):
    ps = _params()
    with pytest.raises(error, match=match):
        Zero(ps, torch.optim.SGD, lr=0.1, **make(ps))


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("rule, match", [
    (torch.optim.LBFGS, "LBFGS needs whole tensors"),
    (torch.optim.SparseAdam, "SparseAdam needs whole tensors"),
])
def test_flat_plans_refuse_rules_that_need_whole_tensors(rule, match):
    with pytest.raises(ValueError, match=match):
        Zero(_params(), rule, strategy="flat")


@pytest.mark.usefixtures("one_rank")
def test_flat_plans_refuse_optax_code():
    optax = pytest.importorskip("optax")
    tx = zf.chain(zf.clip(1.0), zf.from_optax(optax.adam(1e-2)))
    with pytest.raises(ValueError, match="from_optax transformation runs Optax's own code"):
        Zero(_params(), tx, strategy="flat")


@pytest.mark.usefixtures("one_rank")
def test_flat_plan_errors_after_construction():
    ps = _params()
    # one buffer for every param (a model this small gets a buffer per param by default)
    opt = Zero(ps, torch.optim.AdamW, plan=zero.make_plan(zero.param_metas(ps), 1, "flat"), lr=0.1)
    with pytest.raises(ValueError, match="cannot extend a flat plan"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    for p in ps:
        p.grad = torch.ones_like(p)
    ps[3].grad = None
    with pytest.raises(ValueError, match=r"param 3 has no gradient but others in its flat buffer"):
        opt.step()
    ps[3].grad = torch.ones_like(ps[3])
    opt.step()
    ps[1].requires_grad_(False)
    with pytest.raises(ValueError, match="frozen or unfrozen after building a flat plan"):
        opt.step()


@pytest.mark.usefixtures("one_rank")
def test_flat_params_are_views_of_the_buffers_and_a_step_writes_them():
    ps = _params()
    before = [p.detach().clone() for p in ps]
    opt = Zero(ps, torch.optim.SGD, strategy="flat", lr=0.5)
    assert all(torch.equal(p, b) for p, b in zip(ps, before)), "packing keeps the values"
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(torch.equal(p, b - 0.5) for p, b in zip(ps, before))


@pytest.mark.usefixtures("one_rank")
def test_functional_state_saved_under_a_flat_plan_reloads_under_any_plan():
    """torch's consolidated format holds a `zero.functional` rule's state per param (each leaf
    under its path, put together from the flat shards): it reloads under a whole-param plan as
    under the flat one, and both continue as the run that saved it."""
    ps = _params()
    opt = Zero(ps, zf.adam(1e-2), strategy="flat")
    for k in range(2):
        for p in ps:
            p.grad = torch.full_like(p, 0.5 + k)
        opt.step()
    opt.consolidate_state_dict()
    saved = opt.state_dict()
    assert {"count", "inner_state.0.mu", "inner_state.0.nu"} <= set(saved["state"][2])
    assert saved["state"][2]["inner_state.0.mu"].shape == ps[2].shape
    runs = [(ps, opt)]
    for strategy in ("flat", "sorted_greedy"):
        again = [p.detach().clone().requires_grad_() for p in ps]
        runs.append((again, Zero(again, zf.adam(1e-2), strategy=strategy)))
        runs[-1][1].load_state_dict(saved)
    for params, o in runs:
        for p in params:
            p.grad = torch.ones_like(p)
        o.step()
    for params, _ in runs[1:]:
        for p, q in zip(params, ps):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# -- gradients reduce-scattered into the shards, in place of DDP -------------------------------

@pytest.mark.parametrize("world_size, name", [(2, "adamw"), (3, "lamb"), (3, "sgd_nesterov")])
def test_reduce_scattered_gradients_match_ddp(world_size, name):
    """Each rank on its own data, two micro-batches per step (the first under no_sync), several
    flat buffers: params equal DDP + one optimizer, and an iteration moves 2x the model: each rank
    puts the padded model's bytes into the reduce-scatters and into the all-gathers, nothing else.
    Every reduce-scatter starts during backward (each buffer as soon as its gradients are in)."""
    results = run_ranks(w.reduce_scatter_vs_ddp, world_size, name, 6, 2, timeout=180)
    for rank, r in enumerate(results):
        assert r["worst"] <= 1e-9, f"rank {rank}: {r['worst']}"
        assert r["buffers"] >= 4
        assert r["moved"] == [(r["padded_bytes"], r["padded_bytes"], r["padded_bytes"])] * 6, r["moved"]
        assert r["padded_bytes"] - r["model_bytes"] < r["buffers"] * world_size * 8, "padding only"


def test_each_backward_reduces_and_the_shards_accumulate_as_ddp_grads_do():
    """Two micro-batches a step without no_sync: each backward reduce-scatters its gradients and
    the shards accumulate them, as DDP's .grad does over backward passes: params equal DDP + one
    optimizer, and each step moves the padded model twice in reduce-scatters."""
    results = run_ranks(w.reduce_scatter_vs_ddp, 3, "adamw", 4, 2, 700, False, timeout=180)
    for rank, r in enumerate(results):
        assert r["worst"] <= 1e-9, f"rank {rank}: {r['worst']}"
        assert r["moved"] == [(2 * r["padded_bytes"], r["padded_bytes"], 2 * r["padded_bytes"])] * 4, r["moved"]


@pytest.mark.parametrize("no_sync", [False, True])
def test_a_rank_keeps_only_its_shards_and_a_few_buckets_of_the_gradient(no_sync):
    """ZeRO-2's memory, at 2 gloo ranks: after a backward no param holds its gradient and a rank
    holds at most IN_FLIGHT whole-size buckets being reduced (1 MiB each here, 64 in the model),
    each with a shard-sized output while the shard already holds a sum. Under no_sync (the opt-in
    trade) the buckets hold the whole gradient until the reducing backward."""
    for r in run_ranks(w.gradient_memory, 2, no_sync, timeout=180):
        bound = r["in_flight"] * r["bucket_bytes"] * 1.5
        assert r["held"][1] <= bound < r["param_bytes"] / 10, r
        assert r["held"][0] >= r["param_bytes"] if no_sync else r["held"][0] <= bound, r
        assert r["shard_bytes"] * 2 >= r["param_bytes"] > r["shard_bytes"] * 2 - 2 * 4 * 32, r


@pytest.mark.parametrize("how,norm_type,max_norm,hybrid,world_size", [
    ("method", 2.0, 0.1, False, 2), ("torch", 2.0, 0.1, True, 3), ("method", math.inf, 0.02, False, 4),
    ("torch", 1.0, 1.0, False, 2), ("value", None, None, True, 2)])
def test_clipping_reduce_scattered_gradients_equals_ddp_and_torchs_clip(how, norm_type, max_norm, hybrid, world_size):
    """Gradient clipping under reduce_scatter_grads, where the params hold no .grad: the optimizer's
    clip_grad_norm_, and torch's clip_grad_norm_ / clip_grad_value_ on model.parameters(), return
    DDP + torch's total norm and leave the params where DDP + the same clip does, every step
    clipped (norms above max_norm), over flat and hybrid plans, at 2, 3 and 4 gloo ranks."""
    results = run_ranks(w.clip_vs_ddp, world_size, how, norm_type or 2.0, hybrid, max_norm or 0.0, timeout=180)
    for rank, r in enumerate(results):
        assert r["worst"] <= 1e-9, f"rank {rank}: {r['worst']}"
        for ours, ddp in r["norms"]:
            assert (ours is None and ddp is None) if how == "value" else ours == pytest.approx(ddp, rel=1e-12)
            assert how == "value" or ddp > max_norm
        assert r["norms"] == results[0]["norms"]


@pytest.mark.usefixtures("one_rank")
def test_clipping_refuses_what_it_cannot_do_right():
    """Torch's clip over part of the params, a backward after the clip, and clipping a step that
    ran inside backward (overlap_with_ddp) are ValueErrors; other params are torch's business,
    and without reduce_scatter_grads the optimizer's clip_grad_norm_ is torch's on the params."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero.backends import hook_with_zero_step

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = Zero(model.parameters(), torch.optim.SGD, strategy="flat", reduce_scatter_grads=True, lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match=r"misses 2 of its trainable params \(first: param 2\)"):
        torch.nn.utils.clip_grad_norm_(model[0].parameters(), 1.0)
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.full((3,), 4.0)
    with pytest.raises(ValueError, match="adds 1 params with gradients it does not step"):
        torch.nn.utils.clip_grad_norm_([*model.parameters(), other], 1.0)
    assert float(torch.nn.utils.clip_grad_norm_([other], 1.0)) == pytest.approx(48**0.5)  # torch's own
    assert float(other.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    opt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="after the gradients were clipped or unscaled"):
        model(torch.randn(3, 4)).sum().backward()
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()  # zero_grad starts a new iteration
    opt.step()
    ddp_model = torch.nn.Linear(4, 4)
    ref = copy.deepcopy(ddp_model)  # without reduce_scatter_grads the params' .grad are clipped, as torch's call does
    ddp_model.weight.grad, ref.weight.grad = torch.full((4, 4), 2.0), torch.full((4, 4), 2.0)
    flat = Zero(ddp_model.parameters(), torch.optim.SGD, strategy="flat", lr=0.1)
    assert float(flat.clip_grad_norm_(1.0)) == float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)) == 8.0
    assert torch.equal(ddp_model.weight.grad, ref.weight.grad) and float(ref.weight.grad.norm()) < 1.0
    del flat
    ddp_model.weight.grad = None
    ddp = DDP(ddp_model)
    overlap = Zero(ddp_model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, overlap))
    ddp(torch.randn(2, 4)).sum().backward()
    with pytest.raises(ValueError, match="overlap_with_ddp=True steps each DDP bucket inside backward"):
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)


def test_the_collectives_recorded_in_a_step_are_the_plans_and_one_check_in():
    """zero.backends.comm.recording at 3 gloo ranks, every mode (whole params by rows or bucket
    views, flat, ZeRO-2, hybrid, hybrid ZeRO-2): a step's collectives, kind and bytes, are the
    plan's footprint's and the ranks' check-in (56 bytes per rank), nothing else."""
    for rank, r in enumerate(run_ranks(w.recorded_vs_plan, 3, timeout=180)):
        for mode, (made, predicted) in r.items():
            assert [tuple(c) for c in made] == sorted([*map(tuple, predicted), ("all_gather_into", 56 * 3)]), \
                (rank, mode)
        assert len(r["hybrid_zero2"][0]) > len(r["zero2"][0]) > len(r["flat"][0]) > len(r["whole_rows"][0])


def _trained(opt, ps, backward_twice=False, use_last_bias=True):
    x = torch.randn(5, 3)
    out = ps[2] @ torch.tanh(ps[0] @ x.T + ps[1][:, None])
    loss = (out + ps[3][:, None] if use_last_bias else out).square().mean()
    loss.backward(retain_graph=backward_twice)
    if backward_twice:
        loss.backward()
    opt.step()


@pytest.mark.usefixtures("one_rank")
def test_reduce_scattered_gradients_errors():
    with pytest.raises(ValueError, match="reduce_scatter_grads=True needs a flat plan"):
        Zero(_params(), torch.optim.SGD, reduce_scatter_grads=True, lr=0.1)
    ps, plain_ps = _params(), _params()
    opt = Zero(ps, torch.optim.SGD, strategy="flat", reduce_scatter_grads=True, lr=0.1)
    plain = torch.optim.SGD(plain_ps, lr=0.1)
    for params, optimizer in ((ps, opt), (plain_ps, plain)):
        torch.manual_seed(0)
        _trained(optimizer, params)  # one iteration is fine
        optimizer.zero_grad()
        _trained(optimizer, params, backward_twice=True)  # two backward passes accumulate, as torch's .grad
    assert all(torch.equal(a, b) for a, b in zip(ps, plain_ps))
    opt.zero_grad()
    with pytest.raises(ValueError, match="param 3 got no gradient in this iteration"):
        _trained(opt, ps, use_last_bias=False)
    opt.zero_grad()
    _trained(opt, ps)  # and the next iteration is fine again
    with pytest.raises(NotImplementedError, match="Join with reduce_scatter_grads"):
        opt.join_hook()
    with pytest.raises(RuntimeError, match="no_sync.. is for reduce_scatter_grads"):
        with Zero(_params(), torch.optim.SGD, lr=0.1).no_sync():
            pass


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size, experts, hybrid, micro, bucket_numel", [
    (2, 2, False, 2, 200), (3, 4, True, 1, 40)],
    ids=["flat-2ranks-each-expert-on-one-rank-shared-buckets", "hybrid-3ranks-one-expert-idle"])
def test_find_unused_parameters_equals_ddps(world_size, experts, hybrid, micro, bucket_numel):
    """Conditional compute: each rank's backward skips some experts (and, with 4 experts on 3
    ranks, one expert is idle everywhere). With find_unused_parameters=True, equal to
    DDP(find_unused_parameters=True) + AdamW: the idle expert, kept whole, is not stepped."""
    rows = run_ranks(w.unused_vs_ddp, world_size, experts, hybrid, micro, 5, True, bucket_numel, timeout=150)
    for r in rows:
        assert "error" not in r, r
        assert r["worst"] < 1e-6 and r["told"] == [], r


@pytest.mark.timeout(180)
def test_unused_params_without_the_option_are_named_and_idle_ones_in_flat_shards_said():
    rows = run_ranks(w.unused_vs_ddp, 2, 2, False, 1, 2, False, timeout=150, fresh=True)  # the ranks stop apart
    assert all("param experts." in r["error"] and "find_unused_parameters=True" in r["error"] for r in rows), rows
    rows = run_ranks(w.unused_vs_ddp, 2, 3, False, 1, 2, timeout=150)  # 3 experts on 2 ranks: one idle
    assert all(len(r["told"]) == 1 and "(experts." in r["told"][0] for r in rows), rows
