"""The matrix rules at today's granularity: per-head Muon against Optax's Muon on the weight
reshaped to (H, d, D); per-head SOAP and Shampoo against the same rule on each head as a param
of its own; Gram Newton-Schulz against the standard iteration and against the gram-newton-schulz
package's own code; 8-bit Muon's codes and state bytes."""

import math
import types

import numpy as np
import optax
import pytest
import torch
from helpers import assert_trees_close
from optax_parity import to_jax, to_torch

import zero.functional as F
from zero.functional import quantize as Q
from zero.functional.contrib import MuonDimensionNumbers as Dims
from zero.functional.contrib import newton_schulz as ns
from zero.functional.contrib._muon import NS_COEFFS_PRESETS

H, HEAD, MODEL = 4, 6, 10  # heads, rows a head, model width: a torch (H * HEAD, MODEL) projection


def _run_optax_reshaped(ours_dims, theirs_dims, shapes, reshape, steps=25, **opts):
    """zero's Muon on torch-shaped weights and Optax's on the same weights reshaped by
    ``reshape`` (name -> shape), from the same start on the same gradients; both final params,
    Optax's back in the torch shapes."""
    import jax

    rng = np.random.default_rng(7)
    draw = lambda: {k: rng.standard_normal(s) for k, s in shapes.items()}  # noqa: E731
    start = draw()
    ours = F.contrib.muon(0.02, muon_weight_dimension_numbers=ours_dims, **opts)
    theirs = optax.contrib.muon(0.02, muon_weight_dimension_numbers=theirs_dims, **opts)
    tp = to_torch(start)
    jp = to_jax({k: v.reshape(reshape.get(k, v.shape)) for k, v in start.items()})
    ts, js, step = ours.init(tp), theirs.init(jp), jax.jit(theirs.update)
    for _ in range(steps):
        g = draw()
        tu, ts = ours.update(to_torch(g), ts, tp)
        ju, js = step(to_jax({k: v.reshape(reshape.get(k, v.shape)) for k, v in g.items()}), js, jp)
        tp, jp = F.apply_updates(tp, tu), optax.apply_updates(jp, ju)
    return tp, {k: np.asarray(v).reshape(shapes[k]) for k, v in jp.items()}


@pytest.mark.parametrize("opts", [{}, {"consistent_rms": 0.2}, {"adaptive": True, "nesterov": False}],
                         ids=["defaults", "consistent_rms", "adaptive"])
def test_per_head_muon_is_optaxs_muon_on_heads(opts):
    """Q, K, V (H heads each) and a fused QKV (3H heads) in torch's (out, in) layout equal Optax's
    Muon on (heads, rows, in) with the head axis a batch axis, to 1e-10 in float64: the shape
    scaling too is a head's."""
    shapes = {"q": (H * HEAD, MODEL), "k": (H * HEAD, MODEL), "v": (H * HEAD, MODEL), "qkv": (3 * H * HEAD, MODEL),
              "b": (MODEL,)}
    ours = {"q": Dims(1, 0, heads=H), "k": Dims(1, 0, heads=H), "v": Dims(1, 0, heads=H),
            "qkv": Dims(1, 0, heads=3 * H), "b": None}
    od = optax.contrib.MuonDimensionNumbers(2, 1)
    theirs = {"q": od, "k": od, "v": od, "qkv": od, "b": None}
    reshape = {"q": (H, HEAD, MODEL), "k": (H, HEAD, MODEL), "v": (H, HEAD, MODEL), "qkv": (3 * H, HEAD, MODEL)}
    tp, jp = _run_optax_reshaped(ours, theirs, shapes, reshape, **opts)
    assert_trees_close(tp, jp, rtol=1e-10, atol=1e-12)


def test_heads_on_optaxs_layout_and_a_batch_axis():
    """Heads cut the output axis wherever it is: an Optax-layout (in, H * d) weight, and a stack of
    such weights with a batch axis in front."""
    shapes = {"w": (MODEL, H * HEAD), "stack": (2, MODEL, H * HEAD)}
    ours = {"w": Dims(0, 1, heads=H), "stack": Dims(1, 2, heads=H)}
    theirs = {"w": optax.contrib.MuonDimensionNumbers(0, 2), "stack": optax.contrib.MuonDimensionNumbers(1, 3)}
    reshape = {"w": (MODEL, H, HEAD), "stack": (2, MODEL, H, HEAD)}
    # Optax reads the head axis (1 / 2 here) as a batch axis: the same matrices as zero's heads
    tp, jp = _run_optax_reshaped(ours, theirs, shapes, reshape, steps=10)
    assert_trees_close(tp, jp, rtol=1e-10, atol=1e-12)


def test_one_head_is_the_whole_matrix_and_heads_are_not_the_whole():
    """heads=1 is the whole-matrix rule bit for bit; heads=H differs from it (the test above
    cannot pass by orthogonalising whole matrices)."""
    x = torch.randn(H * HEAD, MODEL, dtype=torch.float64)
    whole = ns.orthogonalize_via_newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, dimension_numbers=Dims(1, 0))
    one = ns.orthogonalize_via_newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, dimension_numbers=Dims(1, 0, heads=1))
    per = ns.orthogonalize_via_newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, dimension_numbers=Dims(1, 0, heads=H))
    assert torch.equal(whole, one)
    assert (whole - per).abs().max() > 1e-2
    for h in range(H):  # each head's rows orthogonalised alone
        rows = slice(h * HEAD, (h + 1) * HEAD)
        alone = ns.orthogonalize_via_newton_schulz(x[rows], (3.4445, -4.7750, 2.0315), 5, dimension_numbers=Dims(1, 0))
        torch.testing.assert_close(per[rows], alone, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bad, match", [(Dims(1, 0, heads=5), "does not divide"), (Dims(1, 0, heads=0), "positive int"),
                                        (Dims(1, 0, heads=True), "positive int")])
def test_heads_that_do_not_fit_are_named(bad, match):
    tx = F.contrib.muon(0.02, muon_weight_dimension_numbers={"w": bad})
    params = {"w": torch.zeros(H * HEAD, MODEL)}
    with pytest.raises(ValueError, match=match):
        tx.update({"w": torch.ones(H * HEAD, MODEL)}, tx.init(params), params)


def _run(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        u, state = tx.update(g, state, params)
        params = F.apply_updates(params, u)
    return params, state


def _heads_apart(w):
    return {f"h{i}": w[i * HEAD:(i + 1) * HEAD] for i in range(H)}


@pytest.mark.parametrize("rule", ["soap", "shampoo"])
def test_per_head_kronecker_rules_are_the_rule_on_each_head(rule):
    """Per-head SOAP and Shampoo equal the same rule given each head as a param of its own (its
    factors, their refreshes and roots, Shampoo's graft norm), to 1e-12 over 30 steps; the
    factors are the per-head params' factors, stacked by head."""
    def make(dims):
        if rule == "soap":
            return F.contrib.soap(0.01, precondition_frequency=3, weight_dimension_numbers=dims)
        return F.contrib.shampoo(0.01, start_preconditioning_step=2, preconditioning_compute_steps=3, block_size=8,
                                 graft_type="rmsprop", weight_dimension_numbers=dims)

    torch.manual_seed(3)
    w = torch.randn(H * HEAD, MODEL, dtype=torch.float64)
    grads = [torch.randn_like(w) for _ in range(30)]
    headed, hs = _run(make({"w": Dims(1, 0, heads=H)}), {"w": w}, [{"w": g} for g in grads])
    apart, as_ = _run(make({f"h{i}": Dims(1, 0) for i in range(H)}), _heads_apart(w), [_heads_apart(g) for g in grads])
    torch.testing.assert_close(headed["w"], torch.cat([apart[f"h{i}"] for i in range(H)]), rtol=1e-12, atol=1e-13)
    whole, _ = _run(make({"w": Dims(1, 0)}), {"w": w}, [{"w": g} for g in grads])
    assert (whole["w"] - headed["w"]).abs().max() > 1e-4  # heads are not the whole matrix
    if rule == "soap":
        gg = hs[0].gg["w"]
        assert [tuple(f.shape) for f in gg] == [(H, HEAD, HEAD), (H, MODEL, MODEL)]
        torch.testing.assert_close(gg[0][2], as_[0].gg["h2"][0], rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# Gram Newton-Schulz

COEFFS = [("standard", (3.4445, -4.7750, 2.0315)), ("polar_express", NS_COEFFS_PRESETS["polar_express"]),
          ("dion", NS_COEFFS_PRESETS["dion"])]


@pytest.mark.parametrize("name, coeffs", COEFFS, ids=[c[0] for c in COEFFS])
@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (3, 8, 40), (24, 24)], ids=str)
@pytest.mark.parametrize("restarts", [None, (), (1, 3)], ids=["default", "none", "1,3"])
def test_gram_is_the_standard_polynomial(name, coeffs, shape, restarts):
    """In float64 the Gram iteration is the standard one to 1e-8 (the same polynomial, another
    association), with or without restarts, wide, tall and batched; square matrices take the
    standard path exactly."""
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    dims = Dims(-2, -1)
    standard = ns.orthogonalize_via_newton_schulz(x, coeffs, 5, dimension_numbers=dims)
    gram = ns.orthogonalize_via_newton_schulz(x, coeffs, 5, dimension_numbers=dims, ns_method="gram",
                                              ns_restarts=restarts)
    rel = (gram - standard).norm() / standard.norm()
    assert rel <= 1e-8
    if shape[-1] == shape[-2]:
        assert torch.equal(gram, standard)


def _their_code_in_float64():
    """The gram-newton-schulz package's own functions with its float16 and float32 read as float64
    (its module's ``torch`` swapped for a namespace that differs in those two names only), so its
    algorithm, not its precision, is compared."""
    gns = pytest.importorskip("gram_newton_schulz.gram_newton_schulz")
    wide = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    wide.float16 = wide.float32 = torch.float64
    return gns, wide


def test_gram_equals_the_gram_packages_iteration():
    """zero's Gram iteration is the package's (v0.1.6, its pure-torch path, Polar Express
    coefficients, a restart before the third step): to 1e-12 with its code run in float64, and
    within its float16 precision (1e-2 relative) as it ships."""
    gns, wide = _their_code_in_float64()
    from gram_newton_schulz import POLAR_EXPRESS_COEFFICIENTS

    assert NS_COEFFS_PRESETS["polar_express"] == tuple(POLAR_EXPRESS_COEFFICIENTS)
    torch.manual_seed(1)
    for shape in [(2, 32, 96), (2, 96, 32)]:
        x = torch.randn(*shape, dtype=torch.float64)
        ours = ns.orthogonalize_via_newton_schulz(x, NS_COEFFS_PRESETS["polar_express"], 5,
                                                  eps=1e-7, dimension_numbers=Dims(-2, -1), ns_method="gram")
        theirs_f16 = gns.GramNewtonSchulz(ns_use_kernels=False, compile_kwargs=None)(x.float()).double()
        assert (theirs_f16 - ours).norm() / ours.norm() < 1e-2
        real = gns.torch
        gns.torch = wide
        try:
            fn = gns._make_compiled_gram(gns._TORCH_BACKEND, POLAR_EXPRESS_COEFFICIENTS, [2], 1e-7, None)
            theirs = fn(x)
        finally:
            gns.torch = real
        assert theirs.dtype == torch.float64
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-13)


def test_gram_muon_and_its_errors():
    """muon(ns_method="gram") steps as standard Muon to float64 rounding; restarts given to the
    standard iteration, an unknown method and a restart outside the steps are named."""
    shapes = {"w": (8, 20), "t": (20, 8), "b": (8,)}
    rng = np.random.default_rng(0)
    start = to_torch({k: rng.standard_normal(s) for k, s in shapes.items()})
    grads = [to_torch({k: rng.standard_normal(s) for k, s in shapes.items()}) for _ in range(10)]
    a, _ = _run(F.contrib.muon(0.02, ns_coeffs="polar_express"), start, grads)
    b, _ = _run(F.contrib.muon(0.02, ns_coeffs="polar_express", ns_method="gram", ns_restarts=(2, 4)), start, grads)
    assert_trees_close(a, b, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="applies to ns_method='gram' only"):
        F.contrib.muon(0.02, ns_restarts=(2,))
    with pytest.raises(ValueError, match="unknown ns_method 'fast'"):
        F.contrib.scale_by_muon(ns_method="fast")
    with pytest.raises(ValueError, match=r"1 \.\. ns_steps - 1 = 4, got 5"):
        F.contrib.muon(0.02, ns_method="gram", ns_restarts=(5,))


# ---------------------------------------------------------------------------------------------
# 8-bit Muon

def test_linear_codes_round_trip_and_blocks():
    """Each block's largest magnitude is its scale, codes are the nearest of 255 even steps (so
    an element is within half a step), a partial last block is a block of its own, and a block
    quantizes the same wherever it sits."""
    torch.manual_seed(0)
    x = torch.randn(5000) * torch.linspace(0.1, 10, 5000)
    q = Q.quantize_linear(x, 2048)
    assert q.codes.dtype == torch.int8 and q.scale.shape == (3,)
    assert torch.equal(q.scale, torch.stack([x[:2048].abs().max(), x[2048:4096].abs().max(), x[4096:].abs().max()]))
    back = Q.dequantize_linear(q, 2048)
    step = q.scale.repeat_interleave(2048)[:5000] / 127
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-6)).all())
    alone = Q.quantize_linear(x[2048:4096].clone(), 2048)
    assert torch.equal(alone.codes, q.codes[2048:4096]) and torch.equal(alone.scale, q.scale[1:2])
    with pytest.raises(ValueError, match="another block size"):
        Q.dequantize_linear(q, 1024)


def test_muon_8bit_state_bytes_and_steps():
    """8-bit Muon keeps each matrix's momentum in int8 codes (one byte an element, a float32 scale a
    2,048 elements: 1.002 bytes an element, 0.25 of float32's), the vectors' AdamW at full
    precision; its steps follow float32 Muon's closely (the codes' error is in the momentum only)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(64, 96), "t": torch.randn(96, 64), "b": torch.randn(96)}
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(20)]
    p8, s8 = _run(F.contrib.muon_8bit(0.02), params, grads)
    p32, s32 = _run(F.contrib.muon(0.02), params, grads)
    mu8, mu32 = s8.inner_states["muon"].inner_state[0].mu, s32.inner_states["muon"].inner_state[0].mu
    n = sum(params[k].numel() for k in ("w", "t"))
    bytes8 = sum(q.codes.nbytes + q.scale.nbytes for q in (mu8["w"], mu8["t"]))
    assert bytes8 == n + 4 * (math.ceil(64 * 96 / 2048) * 2)
    assert bytes8 / (4 * n) < 0.2506
    assert sum(mu32[k].nbytes for k in ("w", "t")) == 4 * n
    for k in ("w", "t"):
        rel = (p8[k] - p32[k]).norm() / (p32[k] - params[k]).norm()
        assert rel < 0.05, (k, rel)
        assert (p8[k] - p32[k]).abs().max() > 0  # the codes do change the steps a little
    torch.testing.assert_close(p8["b"], p32["b"], rtol=0, atol=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'mu_dtype'"):
        F.contrib.muon_8bit(0.02, mu_dtype="bfloat16")  # its momentum is int8 codes: no dtype to choose
