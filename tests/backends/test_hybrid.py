"""Hybrid plans: a flat plan that keeps some params whole (`zero.plans.hybrid`), executed by
`zero.backends.modes.FlatShards` under a hybrid plan, for the rules that need tensors whole."""

import hybrid_workers as hw
import numpy as np
import plan_workers as pw
import pytest
import torch
from helpers import fixed_grads, groups_of, make_model, mode_name, run_ranks
from torch import nn

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends.local_optimizer import state_nbytes
from zero.plans.accounting import state_bytes
from zero.plans.costs import cost_of
from zero.plans.diff import placement

# -- the plan (metadata only) ---------------------------------------------------------------------


def _covered_once(plan):
    """Every trainable param's elements are held exactly once: whole by one owner, or in flat segments."""
    for i, m in enumerate(plan.metas):
        ranges = placement(plan, i)
        if not m.requires_grad:
            continue
        held = sorted((s, e) for _, s, e in ranges)
        assert held[0][0] == 0 and held[-1][1] == m.numel, (m.name, ranges)
        assert all(a[1] == b[0] for a, b in zip(held, held[1:])), (m.name, ranges)


@pytest.mark.parametrize("world_size", [8, 64])
def test_a_muon_flat_plan_keeps_every_matrix_whole(world_size):
    metas = zero.preset("gpt2")
    plan = zero.make_plan(metas, world_size, "flat", "step_flops", "muon")
    matrices = [i for i, m in enumerate(metas) if len(m.shape) == 2 and m.requires_grad]
    assert plan.hybrid and plan.whole == tuple(matrices)
    assert all(plan.partition.owner[i] >= 0 for i in matrices)
    assert all(plan.flat.segments(i) == () for i in matrices)  # none of them in a flat buffer
    assert all(plan.partition.owner[i] == -1 for i in range(len(metas)) if i not in matrices)
    _covered_once(plan)
    # state: Muon's matrices hold their momentum on their owner, the rest AdamW's in padded shards
    spec = cost_of("muon")
    whole = sum(state_bytes(metas[i], spec) for i in matrices)
    flat = sum(2 * b.padded_numel * 4 + world_size * spec.scalar_bytes for b in plan.flat.buffers)
    assert sum(r.state_bytes for r in plan.ranks) == whole + flat
    assert plan.max_over_bound <= 1.05  # the whole matrices by flops, the flat part even
    assert f"flat + {len(matrices)} whole" in str(plan)


def test_a_hybrid_plan_spreads_adamws_embeddings_that_a_whole_plan_gives_one_rank():
    """Moonlight's routing (embeddings on AdamW): GPT-2 on 8 ranks. The hybrid's state per rank is
    the mean to 1%; a whole-param plan's busiest rank holds the 38.6M-element token embedding
    whole (the hybrid's accounting counts AdamW's two moments for the flat params)."""
    metas = zero.preset("gpt2")
    muons = lambda m: len(m.shape) == 2 and "wte" not in m.name and "wpe" not in m.name  # noqa: E731
    plan = zero.make_plan(metas, 8, "flat", "step_flops", "muon", whole=muons)
    states = [r.state_bytes for r in plan.ranks]
    assert max(states) <= 1.01 * sum(states) / 8
    wte = next(m for m in metas if m.name == "wte.weight")
    whole = zero.make_plan(metas, 8, "balanced", "step_flops", "muon")
    assert max(r.state_bytes for r in whole.ranks) >= wte.nbytes > 1.8 * max(states)


def test_a_hybrid_plan_round_trips_through_json_and_its_fingerprint_says_what_is_whole():
    metas = zero.preset("gpt2")
    plan = zero.make_plan(metas, 4, "flat", optimizer="muon")
    assert zero.Plan.from_json(plan.to_json()) == plan
    plain = zero.make_plan(metas, 4, "flat")
    assert not plain.hybrid and plain.partition is None
    other = zero.make_plan(metas, 4, "flat", whole=lambda m: len(m.shape) >= 2 and m.numel > 10**6)
    assert len({plan.fingerprint, plain.fingerprint, other.fingerprint}) == 3
    moved = zero.diff_plans(plain, plan)  # element by element: a matrix gathered whole moves its pieces
    assert moved.changed and moved.moved_bytes > 0
    assert placement(plan, plan.whole[0]) == ((plan.partition.owner[plan.whole[0]], 0, metas[plan.whole[0]].numel),)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(strategy="balanced", whole=["h.0.attn.c_attn.weight"]), ValueError, "whole= picks the params a flat"),
    (dict(whole="wte.weight"), TypeError, "whole must be param names"),
    (dict(whole=["no.such.param"]), ValueError, r"whole names params \['no.such.param'\]"),
    (dict(whole=lambda m: 1), TypeError, "returned a int; it must return a bool"),
    (dict(weight=lambda m: m.numel), ValueError, "takes no weight function"),
])
def test_bad_whole_arguments_are_named(kwargs, error, match):
    kwargs = {"strategy": "flat", **kwargs}
    with pytest.raises(error, match=match):
        zero.make_plan(zero.preset("gpt2"), 4, **kwargs)


def test_whole_by_name_refuses_frozen_and_ambiguous_params():
    metas = [zero.ParamMeta("a", (4, 4)), zero.ParamMeta("b", (4,), requires_grad=False)]
    with pytest.raises(ValueError, match=r"whole names frozen params \['b'\]"):
        zero.make_plan(metas, 2, "flat", whole=["b"])
    with pytest.raises(ValueError, match="two params are named 'a'"):
        zero.make_plan(metas + [zero.ParamMeta("a", (3,))], 2, "flat", whole=["a"])


# -- execution on gloo ranks ----------------------------------------------------------------------

RULES = ["muon", "adafactor", "sm3", "novograd", "axis_rules"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, rules", [(2, ["muon", "adafactor"]), (3, RULES + ["muon_by_name"]),
                                               (4, ["muon"])])
def test_whole_tensor_rules_under_hybrid_plans_equal_one_process(world_size, rules):
    """Muon, Adafactor (factored matrices whole, its vectors and a 3x40 matrix in shards), SM3,
    NovoGrad (every param whole: its state is per tensor) and the axis rules, 20 steps, float64,
    two param groups and a frozen bias; each matrix orthogonalised once across the group. (Every
    rule at 3 ranks; Muon and Adafactor at 2; Muon at 4.) ``muon_by_name``:
    Moonlight's routing (an 'embedding' and the biases to AdamW) by a function of the named
    params, which is asked about the whole params by name while the shards hold AdamW's pieces."""
    results = run_ranks(hw.rules_vs_one_process, world_size, rules, 20)
    if "muon_by_name" in rules:
        assert max(r.pop("muon_by_name") for r in results) <= 1e-9
    for rule in rules:
        if rule == "muon_by_name":
            continue
        per_rank = [r[rule] for r in results]
        assert all(r["mode"] == "FlatShards hybrid" for r in per_rank)
        assert max(r["worst"] for r in per_rank) <= 1e-9, (rule, [r["worst"] for r in per_rank])
        assert all(r["same"] for r in per_rank), rule
        assert per_rank[0]["whole"] > 0 and (rule == "novograd") == (per_rank[0]["buffers"] == 0), rule
    muon = [r["muon"] for r in results]
    assert all(r["calls"] == 20 * r["owned_matrices"] for r in muon)
    assert sum(muon[0]["all_calls"]) == 20 * 5  # make_model's five matrices, each once a step


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("rule, whole, match", [
    ("novograd", hw.matrices, r"scale_by_novograd needs each tensor whole.*param (\d+) \(\1\) of shape \(\d+,\)"),
    ("sm3", hw.first_weight, r"scale_by_sm3 needs each tensor whole.*param (\d+) \(\1\) of shape \(\d+, \d+\)"),
    ("muon", hw.first_weight, r"muon's routing of matrices needs each tensor whole.*of shape \(\d+, \d+\)"),
])
def test_a_rule_given_pieces_of_a_tensor_it_needs_whole_names_it(rule, whole, match):
    """A hybrid plan that leaves in the flat buffers a tensor the rule needs whole: a ValueError
    naming the param, not a rule stepped over a shard (Muon would have sent the matrix's pieces
    to AdamW)."""
    plan_of = {"muon": "sgd"}  # a plan made for another optimizer, so make_plan lets the matrix through
    model = make_model("plan")
    groups = groups_of(model, False)
    plan = zero.make_plan(zero.param_metas(groups), 1, "flat", optimizer=plan_of.get(rule, "sgd"), whole=whole)
    opt = Zero(groups, hw.RULES[rule][0](), plan=plan)
    for p, g in zip(model.parameters(), fixed_grads(list(model.parameters()), 0)):
        p.grad = g
    with pytest.raises(ValueError, match=match):
        opt.step()


def _named_step(tx, whole):
    model = make_model("plan")
    plan = zero.make_plan(zero.param_metas(model), 1, "flat", optimizer="sgd", whole=whole)
    opt = Zero(model.named_parameters(), tx, plan=plan)
    for p, g in zip(model.parameters(), fixed_grads(list(model.parameters()), 0)):
        p.grad = g
    opt.step()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("dims, whole, match", [
    (hw.by_name, hw.first_weight, r"makes param 2 \(1.weight\) a Muon weight, but this step holds it in pieces: "
     r"keep it whole \(zero.make_plan\(..., 'flat', whole=...\): a hybrid plan\)"),
    (lambda tree: {n: zf.contrib.MuonDimensionNumbers(1, 0) if n != "0.weight" and "bias" not in n else None
                   for n in tree},
     lambda m: m.name != "0.weight" and m.name != "0.bias" and m.requires_grad,
     r"labels a shard \(pieces of params 0 \(0.weight\), 1 \(0.bias\)\) as a Muon weight"),
    (zf.contrib.MuonDimensionNumbers(1, 0), hw.matrices, "as a tree labels leaves by position"),
])
def test_muon_routed_by_name_refuses_a_shard_it_would_route_to_newton_schulz(dims, whole, match):
    with pytest.raises(ValueError, match=match):
        _named_step(zf.contrib.muon(0.02, muon_weight_dimension_numbers=dims), whole)


@pytest.mark.timeout(120)
def test_a_rank_without_the_cut_tensor_refuses_with_the_others():
    """What users meet at 4 ranks: the 3x40 matrix left in the shards lies on ranks 1-3, none of it
    on rank 0. Every rank decides together (one small all-reduce of the cut tensors), so rank 0
    raises the same ValueError naming it, instead of stepping on into a collective the others
    never join (it once did, and failed there after the group's timeout)."""
    errors = run_ranks(hw.refused, 4, "muon", hw.all_but_last_weight, pg_timeout=30)
    for rank, error in enumerate(errors):
        assert error.startswith("ValueError: muon's routing of matrices needs each tensor whole") and \
            "of shape (3, 40)" in error, f"rank {rank}: {error}"


@pytest.mark.usefixtures("one_rank")
def test_hybrid_plans_refuse_what_they_cannot_run():
    model = make_model("plan")
    plan = zero.make_plan(zero.param_metas(model.parameters()), 1, "flat", whole=hw.matrices)
    with pytest.raises(ValueError, match="Adafactor needs whole tensors"):
        Zero(model.parameters(), torch.optim.Adafactor, plan=plan)
    opt = Zero(model.parameters(), torch.optim.AdamW, plan=plan)
    with pytest.raises(ValueError, match="cannot extend a flat plan"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2, dtype=torch.float64))]})


@pytest.mark.timeout(300)
def test_hybrid_state_moves_through_torch_and_sharded_checkpoints(tmp_path):
    """torch's AdamW: hybrid on 2 ranks -> torch state dict (loaded by plain AdamW too) -> hybrid on
    3 -> sharded checkpoint -> hybrid on 2 (each plan its own owners and shards): 15 steps equal
    one process, with exactly the plan's state bytes on every rank."""
    a = run_ranks(hw.adamw_leg, 2, None, str(tmp_path / "a.pt"), 0, 5)
    saved = torch.load(tmp_path / "a.pt", weights_only=True)
    torch.optim.AdamW(groups_of(make_model("plan")), lr=1e-2, weight_decay=0.1).load_state_dict(saved["optim"])
    b = run_ranks(hw.adamw_leg, 3, str(tmp_path / "a.pt"), str(tmp_path / "b"), 5, 5)
    c = run_ranks(hw.adamw_leg, 2, str(tmp_path / "b"), str(tmp_path / "c.pt"), 10, 5)
    assert all(r["state_bytes"] == r["planned"] for r in a + b + c)
    for got, want in zip(c[0]["params"], pw.single_process(15)):
        np.testing.assert_allclose(got, want.double().numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.timeout(300)
def test_reduce_scattered_gradients_under_hybrid_plans_equal_ddp():
    """ZeRO-2 with whole params: no DDP; the shards' gradients reduce-scattered and each whole
    param's reduced into its owner during backward (one reduce per whole param and step, all
    started before backward ends), only the owner keeping it. Against DDP + one optimizer over all params, 3 ranks
    on their own data, 2 micro-batches a step."""
    rules = ["muon", "adafactor", "sm3", "novograd"]
    results = run_ranks(hw.reduce_scattered_vs_ddp, 3, rules, 6, 2)
    for rule in rules:
        per_rank = [r[rule] for r in results]
        assert all(r["mode"] == "FlatShards hybrid reduced" for r in per_rank)
        assert max(r["worst"] for r in per_rank) <= 1e-9, (rule, [r["worst"] for r in per_rank])
        assert all(r["only_owners_keep_whole_grads"] for r in per_rank), rule
        assert all(r["reduces"] == [r["whole"]] * 6 for r in per_rank), rule


@pytest.mark.timeout(240)
def test_reduce_scattered_whole_grads_go_to_fp32_masters_as_the_shards_do():
    """bf16 params, fp32 masters, gradients reduced in fp32: a whole param's reduced gradient
    reaches its master unrounded, so the hybrid steps exactly as a flat plan (AdamW is element-wise)."""
    hybrid, flat = run_ranks(hw.masters_reduced, 2)[0]
    assert all(np.array_equal(a, b) for a, b in zip(hybrid, flat))


@pytest.mark.timeout(240)
def test_muon_state_reloads_onto_the_same_hybrid_plan():
    assert run_ranks(hw.functional_resume, 2, 10) == [0.0, 0.0]


@pytest.mark.timeout(240)
def test_a_flat_shard_holding_one_whole_tensor_takes_the_same_collectives():
    """Rank 0's shard is exactly one 2x2 matrix and rank 1's two vectors. Before the fix rank 0
    took the whole-param shortcut (no all-reduce, the shard read as a vector) and rank 1 waited in
    the all-reduce until the timeout."""
    assert run_ranks(hw.one_tensor_shard, 2, 5, pg_timeout=30) == [0.0, 0.0]


@pytest.mark.usefixtures("one_rank")
def test_bf16_params_step_on_fp32_masters_under_a_hybrid_plan():
    """bf16 params, fp32 masters of what the rank steps (whole matrices, flat shards): the plan's
    master and state bytes exactly, and the same bf16 params as a whole-param plan's (AdamW is
    element-wise, so where a param sits does not change its step)."""
    def run(strategy, **whole):
        model = make_model("plan", dtype=torch.bfloat16)
        groups = groups_of(model)
        plan = zero.make_plan(zero.param_metas(groups), 1, strategy, optimizer="adamw", master_dtype="float32",
                              **whole)
        opt = Zero(groups, torch.optim.AdamW, plan=plan, master_dtype=torch.float32, lr=1e-2, weight_decay=0.1)
        for step in range(5):
            for p, g in zip(model.parameters(), fixed_grads(list(model.parameters()), step)):
                p.grad = g
            opt.step()
        assert (opt.masters.nbytes(), state_nbytes(opt.optim)) == (plan.ranks[0].master_bytes,
                                                                   plan.ranks[0].state_bytes)
        return [p.detach().clone() for p in model.parameters()], mode_name(opt)

    hybrid, mode = run("flat", whole=hw.matrices)
    whole, _ = run("balanced")
    assert mode == "FlatShards hybrid"
    assert all(torch.equal(a, b) for a, b in zip(hybrid, whole))
