"""Plans balanced by the work of each step (``weight="step_flops"``) and the "balanced" strategy.

Muon's cost is the Newton-Schulz matmuls of each matrix; Adam's its elements. Counts are exact.
"""

import dataclasses
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zero
from zero.plans.accounting import state_bytes, weights
from zero.plans.costs import cost_of
from zero.plans.partition import partition
from zero.plans.presets import preset

MUON = cost_of("muon")


def test_step_flops_count_newton_schulz_matmuls():
    """``X X^T``, its square and the product with ``X`` on the side whose Gram matrix is smaller,
    five steps, plus the elementwise work; the same for a matrix and its transpose."""
    m, n = 4096, 11008
    wide, tall = zero.ParamMeta("up", (m, n)), zero.ParamMeta("down", (n, m))
    expected = 5 * (2 * m * m * n + 2 * m**3 + 2 * m * m * n) + m * n
    assert MUON.step_flops(wide) == MUON.step_flops(tall) == expected
    assert MUON.step_flops(zero.ParamMeta("norm", (m,))) == m  # Adam's branch: its elements
    assert MUON.step_flops(zero.ParamMeta("frozen", (m, m), requires_grad=False)) == 0
    assert cost_of("adam").step_flops(wide) == m * n


def test_muon_state_bytes_per_param_kind():
    """A matrix holds its momentum; a vector AdamW's two moments; each a 4-byte step."""
    assert state_bytes(zero.ParamMeta("w", (8, 4)), "muon") == 8 * 4 * 4 + 4
    assert state_bytes(zero.ParamMeta("b", (8,)), "muon") == 2 * 8 * 4 + 4
    assert state_bytes(zero.ParamMeta("conv", (8, 4, 3, 3)), "muon") == 2 * 8 * 4 * 9 * 4 + 4  # not 2-D: Adam
    plan = zero.make_plan(preset("gpt2"), 4, "balanced", "step_flops", "muon")
    assert sum(r.state_bytes for r in plan.ranks) == sum(state_bytes(m, "muon") for m in plan.metas)


def test_flat_plans_for_muon_keep_its_matrices_whole():
    """A flat plan for Muon is a hybrid that keeps every matrix whole (`tests/backends/test_hybrid.py`)."""
    plan = zero.make_plan(preset("gpt2"), 4, "flat", optimizer="muon")
    assert plan.whole == tuple(i for i, m in enumerate(plan.metas) if len(m.shape) == 2)


@pytest.mark.parametrize("name", ["gpt2", "llama-7b"])
@pytest.mark.parametrize("world_size", [8, 16, 64])
def test_balanced_flops_plans_meet_the_goal(name, world_size):
    """Busiest rank / best possible <= 1.05, where whole matrices allow it (see the next test)."""
    plan = zero.make_plan(preset(name), world_size, "balanced", "step_flops", "muon")
    lpt = zero.make_plan(preset(name), world_size, "sorted_greedy", "step_flops", "muon")
    assert plan.max_over_bound <= lpt.max_over_bound
    if (name, world_size) != ("llama-7b", 64):
        assert plan.max_over_bound <= 1.05


def test_llama_on_64_ranks_reaches_the_whole_matrix_optimum():
    """LLaMA-7B's Muon work on 64 ranks: 2 embedding-sized matrices E (each over the mean), 96
    MLP matrices M and 128 attention matrices A, M ~ 2.13 A, E ~ 5.5 A. The embeddings take a
    rank each; the other 62 ranks hold 96 M + 128 A, and a rank under E's load holds at most
    2M + A, M + 3A or 5A: 118 A's worth of room for 128, so some rank holds more than E's load,
    at least 6A (6A < M + 4A < 2M + 2A). "balanced" reaches 6A (1.083 over E); LPT stops at
    M + 4A (1.105)."""
    metas = preset("llama-7b")
    ws = weights(metas, "step_flops", "muon")
    attention = ws[[m.name for m in metas].index("layers.0.self_attn.q_proj.weight")]
    plan = zero.make_plan(metas, 64, "balanced", "step_flops", "muon")
    assert max(r.load for r in plan.ranks) == 6 * attention
    assert zero.make_plan(metas, 64, "sorted_greedy", "step_flops", "muon").max_over_bound > 1.1


weights_lists = st.lists(st.integers(0, 1000), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(weights_lists, st.integers(1, 5))
def test_balanced_never_worse_than_lpt(ws, world_size):
    """Exchanges only ever lower the busiest rank: never above LPT (largest first over all
    params), every param placed once."""
    metas = [zero.ParamMeta(f"p{i}", (max(w, 1),)) for i, w in enumerate(ws)]
    fn = lambda m: ws[int(m.name[1:])]  # noqa: E731
    bal = partition(metas, world_size, "balanced", fn)
    lpt = partition([metas[i] for i in sorted(range(len(ws)), key=lambda i: -ws[i])], world_size, "greedy",
                    lambda m: ws[int(m.name[1:])])
    assert max(bal.loads) <= max(lpt.loads)
    assert sorted(i for o in bal.order for i in o) == list(range(len(ws)))
    assert all(list(o) == sorted(o) for o in bal.order)  # registration order on each rank


def test_cli_plans_by_flops():
    res = subprocess.run([sys.executable, "-m", "zero", "plan", "--preset", "llama-7b", "-w", "64", "--strategy",
                          "balanced", "--weight", "step_flops", "--optimizer", "muon", "--compare"],
                         capture_output=True, text=True, check=True)
    assert "step_flops" in res.stdout and "balanced" in res.stdout and "flat" not in res.stdout
    plan = zero.make_plan(preset("gpt2"), 8, "balanced", "step_flops", "muon")
    again = zero.Plan.from_json(plan.to_json())
    assert again.fingerprint == plan.fingerprint and json.loads(plan.to_json())["inputs"]["weight"] == "step_flops"


def test_a_weight_function_plans_but_does_not_round_trip_json():
    """Muon with the embeddings routed to AdamW: a cost only the user knows, as a function."""
    metas = preset("gpt2")
    fn = lambda m: MUON.step_flops(m) if m.name.startswith("h.") else m.numel  # noqa: E731
    plan = zero.make_plan(metas, 16, "balanced", fn, "muon")
    assert plan.weight == "custom" and plan.max_over_bound <= 1.05
    assert zero.make_plan(metas, 16, "sorted_greedy", fn, "muon").max_over_bound > 1.09  # LPT's 1.095
    with pytest.raises(ValueError, match="weighted by a function"):
        zero.Plan.from_json(plan.to_json())
    with pytest.raises(ValueError, match="takes no weight function"):
        zero.make_plan(metas, 16, "flat", fn)
    with pytest.raises(ValueError, match="'step_flops' or a function"):
        zero.make_plan(metas, 16, weight="flops")


@pytest.mark.parametrize("rule, by_work, by_elements", [("soap", 1.044, 1.086), ("shampoo", 1.013, 1.155)])
def test_kronecker_plans_balance_their_work(rule, by_work, by_elements):
    """GPT-2 at 8 ranks: balanced by the rule's step flops, the busiest rank's work is ``by_work``
    of the mean's, within 1.10 (the figures docs/muon-and-hybrid.md and BENCHMARKS state);
    balanced by elements, it is ``by_elements`` (the embedding's factor dominates)."""
    spec = cost_of(rule)

    def busiest_over_mean(plan):
        work = [sum(spec.step_flops(plan.metas[i]) for i in plan.partition.params_of(r)) for r in range(8)]
        return max(work) / (sum(work) / 8)

    plan = zero.make_plan(preset("gpt2"), 8, "balanced", "step_flops", rule)
    by_numel = zero.make_plan(preset("gpt2"), 8, "balanced", "numel", rule)
    assert busiest_over_mean(plan) == pytest.approx(plan.max_over_mean) and plan.max_over_mean <= 1.10
    assert plan.max_over_mean == pytest.approx(by_work, abs=5e-4)
    assert busiest_over_mean(by_numel) == pytest.approx(by_elements, abs=5e-4)


def test_kronecker_costs_count_their_factors():
    """SOAP: two moments and, per axis with a factor, the factor and its basis; Shampoo: its
    momenta and, per block and axis, the factor and its root (float32 for bf16 params)."""
    soap, shampoo = cost_of("soap"), cost_of("shampoo")
    w = zero.ParamMeta("w", (64, 96))
    assert soap.state_bytes(w, 4) == (2 * 64 * 96 + 2 * (64**2 + 96**2)) * 4 and soap.whole(w)
    assert soap.state_bytes(zero.ParamMeta("b", (96,)), 4) == 2 * 96 * 4  # no factor: Adam's moments
    emb = zero.ParamMeta("wte", (50257, 768))
    assert soap.state_bytes(emb, 2) == (2 * 50257 * 768 + 2 * 768**2) * 2  # the long axis keeps none
    blocked = cost_of("shampoo(block_size=32)")
    assert blocked.layout(w).shape == (1, 64, 96)  # read as Scalable Shampoo reads it: a leading axis of 1
    assert blocked.layout(w).factor_sizes() == [1, 32, 32] * 6  # 2 x 3 blocks of 32 x 32, a factor per axis
    assert blocked.state_bytes(zero.ParamMeta("w", (64, 96), "bfloat16"), 2) == \
        2 * 64 * 96 * 2 + 2 * 6 * (1 + 2 * 32**2) * 4
    assert not shampoo.whole(zero.ParamMeta("small", (8, 16)))  # merged into one axis: the graft alone
    assert cost_of("shampoo(graft_type='adagrad')").slots == 3


@pytest.mark.parametrize("name, match", [("shampoo(blocks=3)", "has no setting \\['blocks'\\]"),
                                         ("soap(3)", "settings are written name=value"),
                                         ("kron(block_size=3)", "unknown optimizer 'kron'")])
def test_cost_settings_by_name_are_checked(name, match):
    with pytest.raises(ValueError, match=match):
        cost_of(name)


@pytest.mark.parametrize("name, settings", [("soap(precondition_frequency=3)", {"precondition_frequency": 3}),
                                            ("soap(precondition_1d=True)", {"precondition_1d": True}),
                                            ("shampoo(shape_interpretation=False, preconditioner_type='input')",
                                             {"shape_interpretation": False, "preconditioner_type": "input"})])
def test_a_plan_names_a_cost_with_settings_and_reads_it_back(name, settings):
    """The plan keeps the name lowercased (``True`` as ``true``): it still reads back."""
    base = name.partition("(")[0]
    plan = zero.make_plan(preset("gpt2"), 4, "flat", optimizer=name)
    assert cost_of(plan.optimizer) == dataclasses.replace(cost_of(base), **settings)
    assert zero.Plan.from_json(plan.to_json()).optimizer == plan.optimizer


# ---------------------------------------------------------------------------------------------
# Muon's variants (#67): the Gram iteration, heads, 8-bit momentum

def _counted_flops(shape, **kwargs) -> int:
    """The matmul flops torch's own counter sees in one `orthogonalize_via_newton_schulz`."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from zero.functional.contrib import MuonDimensionNumbers, orthogonalize_via_newton_schulz

    x = torch.randn(*shape, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        orthogonalize_via_newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, dimension_numbers=MuonDimensionNumbers(-2, -1),
                                        **kwargs)
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", [(24, 80), (80, 24), (32, 32)], ids=str)
@pytest.mark.parametrize("method, restarts", [("standard", None), ("gram", None), ("gram", ()), ("gram", (1, 3))])
def test_newton_schulz_flops_are_the_kernels(shape, method, restarts):
    """`ns_flops` counts what the kernel multiplies, to the flop (torch's FlopCounterMode over
    the kernel), for the standard and the Gram iteration, wide, tall and square, any restarts."""
    from zero.plans.costs.newton_schulz import ns_flops

    kwargs = {"ns_method": method} | ({"ns_restarts": restarts} if method == "gram" else {})
    counted = _counted_flops(shape, **kwargs)
    m, n = sorted(shape)
    expected = ns_flops(m, n, 5, method, restarts if restarts is not None else ((2,) if method == "gram" else ()))
    # the Frobenius rescaling's norm is no matmul; the model counts matmuls only
    assert counted == expected


def test_per_head_and_gram_costs():
    """A 4096 x 4096 projection of 32 heads of 128 rows costs ~47x less per head than whole; Gram
    on a 4096 x 11008 matrix ~1.29x less than standard (1.5x at 1:4), as square: the same."""
    q = zero.ParamMeta("layers.0.q_proj.weight", (4096, 4096))
    up = zero.ParamMeta("up", (11008, 4096))
    per_head = cost_of("muon(heads={'layers.0.q_proj.weight': 32})")
    assert 47 < (MUON.step_flops(q) - q.numel) / (per_head.step_flops(q) - q.numel) < 48
    gram = cost_of("muon(ns_method='gram')")
    assert 1.28 < (MUON.step_flops(up) - up.numel) / (gram.step_flops(up) - up.numel) < 1.30
    assert gram.step_flops(q) == MUON.step_flops(q)  # square: the Gram iteration runs as standard
    with pytest.raises(ValueError, match="unknown ns_method 'fast'"):
        cost_of("muon(ns_method='fast')")


def test_a_3d_attention_kernel_named_by_heads_is_its_heads_matrices():
    """A JAX attention kernel (Flax's (in, heads, head_dim), or (heads, d, D)) named with its heads
    costs each head's matrix of its other two axes (as the 2-D (H * d, D) weight of the same heads
    does) and is kept whole; unnamed, or with a head count none of its axes has, it is element-wise."""
    flax, torch_like = zero.ParamMeta("attn", (512, 8, 64)), zero.ParamMeta("attn", (8 * 64, 512))
    per_head = cost_of("muon(heads={'attn': 8})")
    assert per_head.step_flops(flax) == per_head.step_flops(torch_like) > flax.numel
    assert per_head.step_flops(zero.ParamMeta("attn", (8, 64, 512))) == per_head.step_flops(torch_like)
    assert per_head.whole(flax) and not MUON.whole(flax) and MUON.step_flops(flax) == flax.numel
    assert not cost_of("muon(heads={'attn': 7})").whole(flax)
    assert per_head.head_block(flax) == 0  # no rows of it are heads: FSDP2 does not cut it at head edges


def test_8bit_muon_state_bytes():
    """8-bit Muon: a byte an element of each matrix and a float32 scale a 2,048 elements; AdamW's
    vectors as Muon's; the rule's own name and muon(mu_dtype='int8') give the same model."""
    import zero.functional as F
    from zero.backends.options import rule_cost_name

    w, b = zero.ParamMeta("w", (4096, 1000)), zero.ParamMeta("b", (1000,))
    assert state_bytes(w, "muon_8bit") == 4096 * 1000 + 4 * 2000 + 4
    assert state_bytes(b, "muon_8bit") == state_bytes(b, "muon")
    as_option = rule_cost_name(F.contrib.muon(0.1, mu_dtype="int8"))
    assert cost_of(as_option) == cost_of(rule_cost_name(F.contrib.muon_8bit(0.1)))


def test_llama_on_64_ranks_with_per_head_muon_reaches_the_bound():
    """LLaMA-7B's q, k and v read as 32 heads each: their Newton-Schulz work drops ~47x, the plan
    balances the real work and reaches the best possible (the embedding alone, 1.0; whole-matrix
    costs reach 1.083), asked of the rule itself as ZeroRedundancyOptimizer's default plan does."""
    import zero.functional as F
    from zero.backends.options import default_plan
    from zero.functional.contrib import MuonDimensionNumbers as Dims

    metas = preset("llama-7b")
    qkv = ("q_proj", "k_proj", "v_proj")
    rule = F.contrib.muon(0.02, muon_weight_dimension_numbers=lambda tree: {
        n: (Dims(1, 0, heads=32) if any(k in n for k in qkv) else Dims(1, 0)) if len(p.shape) == 2 else None
        for n, p in tree.items()})
    few = [m for m in metas if m.name.startswith(("layers.0.", "embed"))]  # the rule asked on a few params' shapes
    plan = default_plan(few, 4, "balanced", None, rule)
    assert "heads=" in plan.optimizer and "layers.0.self_attn.q_proj.weight" in plan.optimizer
    heads = {m.name: 32 for m in metas if any(k in m.name for k in qkv)}
    from zero.backends.options import with_heads

    per_head = zero.make_plan(metas, 64, "balanced", "step_flops", with_heads("muon", heads))
    assert per_head.max_over_bound <= 1.05
    assert zero.make_plan(metas, 64, "balanced", "step_flops", "muon").max_over_bound > 1.08


def test_per_head_soap_costs_are_each_heads():
    """Per-head SOAP: a factor per head for each of its block's axes, its refreshes per head; the
    rotations' flops (a product per element per side) shrink with the head's side."""
    q = zero.ParamMeta("q", (64, 96))
    whole, per = cost_of("soap"), cost_of("soap(heads={'q': 4})")
    assert whole.state_bytes(q, 4) == (2 * 64 * 96 + 2 * 64 * 64 + 2 * 96 * 96) * 4
    assert per.state_bytes(q, 4) == (2 * 64 * 96 + 4 * (2 * 16 * 16 + 2 * 96 * 96)) * 4
    assert per.step_flops(q) == 8 * q.numel * (16 + 96) + 4 * (13654 + 2949120) // 10 + q.numel


def test_per_head_shampoo_costs_are_each_heads_blocks():
    """Per-head Shampoo: each head's block laid out alone (axes not merged) and blocked at
    ``block_size``, its factors per head; the rule's own layout of the same weight agrees."""
    import optree
    import torch

    import zero.functional as F
    from zero.functional.contrib import MuonDimensionNumbers as Dims

    q = zero.ParamMeta("q", (64, 96))
    per = cost_of("shampoo(block_size=32, heads={'q': 4})")
    assert per.layout(q).splits == ((16,) * 4, (32, 32, 32))
    assert per.state_bytes(q, 4) == (2 * 64 * 96 + 2 * 12 * (16 * 16 + 32 * 32)) * 4 + per.scalar_bytes
    tx = F.contrib.shampoo(1e-2, block_size=32, weight_dimension_numbers={"q": Dims(1, 0, heads=4)})
    state = tx.init({"q": torch.zeros(64, 96)})
    factors = [x for x in optree.tree_leaves(state) if x.ndim == 2 and x.shape[0] == x.shape[1] in (16, 32)]
    assert sorted(f.shape[0] for f in factors) == sorted(2 * per.layout(q).factor_sizes())


def test_per_head_costs_are_asked_of_soap_and_shampoo():
    """The default plan names the heads per-head SOAP and Shampoo keep factors by, asked of the
    rule on meta tensors (as per-head Muon's), so owners balance each head's work; the rule's
    matrices stay whole (a flat plan's shards never hold their pieces)."""
    import zero.functional as F
    from zero.backends.options import default_plan
    from zero.functional.contrib import MuonDimensionNumbers as Dims

    metas = zero.param_metas({"q": (64, 96), "w": (32, 96), "b": (32,)})
    dims = {"q": Dims(1, 0, heads=4), "w": Dims(1, 0), "b": None}
    for name, rule in (("soap", F.contrib.soap(1e-2, weight_dimension_numbers=dims)),
                       ("shampoo", F.contrib.shampoo(1e-2, block_size=32, weight_dimension_numbers=dims))):
        plan = default_plan(metas, 2, "balanced", None, rule)
        assert plan.optimizer.startswith(name) and cost_of(plan.optimizer).heads == (("q", 4),), plan.optimizer
