"""Muon (`zero.functional.contrib`) against ``optax.contrib.muon`` and ``torch.optim.Muon``.

Optax's own Muon test module runs through the converter in `test_optax_suite`.
"""

import numpy as np
import optax
import pytest
import torch
from helpers import assert_trees_close
from optax_parity import to_jax, to_torch

import zero.functional as F
from zero.functional.contrib import MuonDimensionNumbers as Dims
from zero.functional.contrib import newton_schulz as ns

SHAPES = {"w": (5, 7), "tall": (9, 4), "b": (7,), "s": ()}
CONV = {"conv": (6, 3, 2, 2), "stack": (3, 4, 5), "w": (5, 7), "b": (7,)}


def conv_dims(cls):
    return {"conv": cls(reduction_axis=(1, 2, 3), output_axis=0), "stack": cls(1, 2), "w": cls(), "b": None}


def run_both(shapes, ours, theirs, dtype, steps=40):
    """Both rules from the same params on the same gradients; the params after ``steps``."""
    import jax

    rng = np.random.default_rng(0)
    draw = lambda: {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}  # noqa: E731
    start = draw()
    tp, jp = to_torch(start), to_jax(start)
    ts, js, step = ours.init(tp), theirs.init(jp), jax.jit(theirs.update)
    for _ in range(steps):
        g = draw()
        tu, ts = ours.update(to_torch(g), ts, tp)
        ju, js = step(to_jax(g), js, jp)
        tp, jp = F.apply_updates(tp, tu), optax.apply_updates(jp, ju)
    return tp, jp


OPTIONS = [{}, {"nesterov": False}, {"adaptive": True}, {"consistent_rms": 0.2}, {"ns_coeffs": "dion"},
           {"weight_decay": 0.1, "adam_weight_decay": 0.01}, {"preconditioning": "aol"},
           {"preconditioning": "schatten"}, {"preconditioning": "spectral"},
           {"ns_coeffs": ((3.4, -4.7, 2.0), (3.0, -3.2, 1.2)), "ns_steps": 2, "beta": 0.9},
           {"adam_learning_rate": 0.003, "adam_b1": 0.8, "eps": 1e-6}]


@pytest.mark.parametrize("opts", OPTIONS, ids=[",".join(o) or "defaults" for o in OPTIONS])
def test_muon_matches_optax_float64(opts):
    tp, jp = run_both(SHAPES, F.contrib.muon(0.02, **opts), optax.contrib.muon(0.02, **opts), np.float64)
    assert_trees_close(tp, jp, rtol=1e-9, atol=0)


@pytest.mark.parametrize("opts", [{}, {"adaptive": True, "nesterov": False}])
def test_muon_matches_optax_float32(opts):
    tp, jp = run_both(SHAPES, F.contrib.muon(0.02, **opts), optax.contrib.muon(0.02, **opts), np.float32)
    assert_trees_close(tp, jp, rtol=1e-4, atol=1e-5)


def test_muon_momentum_dtype_matches_optax():
    """A float32 momentum of float64 params: equal at the momentum's precision, kept in float32."""
    ours, theirs = F.contrib.muon(0.02, mu_dtype="float32"), optax.contrib.muon(0.02, mu_dtype="float32")
    tp, jp = run_both(SHAPES, ours, theirs, np.float64, steps=10)
    assert_trees_close(tp, jp, rtol=1e-6, atol=0)
    state = ours.init(tp)
    assert state.inner_states["muon"].inner_state[0].mu["w"].dtype == torch.float32


@pytest.mark.parametrize("dtype, rtol, atol", [(np.float64, 1e-9, 0), (np.float32, 1e-4, 1e-5)])
def test_muon_dimension_numbers_match_optax(dtype, rtol, atol):
    """Conv-shaped and stacked weights read as matrices by dimension numbers, a leaf marked None
    on Adam; Optax's own MuonDimensionNumbers are taken as they are."""
    ours = F.contrib.muon(0.02, muon_weight_dimension_numbers=conv_dims(Dims))
    theirs = optax.contrib.muon(0.02, muon_weight_dimension_numbers=conv_dims(optax.contrib.MuonDimensionNumbers))
    assert_trees_close(*run_both(CONV, ours, theirs, dtype), rtol=rtol, atol=atol)
    optax_dims = F.contrib.muon(0.02, muon_weight_dimension_numbers=conv_dims(optax.contrib.MuonDimensionNumbers))
    assert_trees_close(*run_both(CONV, optax_dims, theirs, dtype, steps=3), rtol=rtol, atol=atol)


def test_muon_state_has_optax_layout():
    params = to_torch({"w": np.ones((3, 4)), "b": np.ones(4)})
    state = F.contrib.muon(0.1).init(params)
    muon_state = state.inner_states["muon"].inner_state[0]
    assert isinstance(muon_state, F.contrib.MuonState)
    assert isinstance(muon_state.mu["b"], F.MaskedNode) and muon_state.mu["w"].shape == (3, 4)
    assert muon_state.ns_coeffs.dtype == torch.float64 and muon_state.ns_coeffs.shape == (3,)
    assert isinstance(state.inner_states["adam"].inner_state[0].mu["w"], F.MaskedNode)


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_from_torch_muon_matches_torch(adjust_lr_fn, nesterov):
    """torch's Muon (bfloat16 Newton-Schulz on every device) step for step, float64 params."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 4), (3, 8), (5, 5)]
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    opts = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref_params = [p.clone().requires_grad_() for p in init]
    ref = torch.optim.Muon(ref_params, **opts)
    ours = [p.clone().requires_grad_() for p in init]
    opt = F.Optimizer(ours, F.from_torch(torch.optim.Muon, **opts))
    for step in range(40):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        for p, q, g in zip(ref_params, ours, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
        for a, b in zip(ours, ref_params):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=f"step {step}")


def test_newton_schulz_orthogonalises():
    """Enough steps of a convergent quintic give orthonormal columns (tall) or rows (wide)."""
    gen = torch.Generator().manual_seed(0)
    coeffs = torch.tensor([2.0, -1.5, 0.5], dtype=torch.float64)
    for shape in [(6, 3), (3, 6)]:
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        q = F.contrib.orthogonalize_via_newton_schulz(x, coeffs, ns_steps=30, eps=1e-12)
        gram = q.T @ q if shape[0] > shape[1] else q @ q.T
        torch.testing.assert_close(gram, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-8)


def test_optimizer_param_groups_set_muon_hyperparameters():
    """Under zero.functional.Optimizer the alias's numbers are group keys; callables stay fixed."""
    w = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(3))
    # The function also sees the trees muon masks for its matrices (the other leaves as empty tensors).
    tx = F.contrib.muon(0.1, muon_weight_dimension_numbers=lambda tree: [Dims(1, 0) if p.ndim == 2 else None
                                                                         for p in tree])
    opt = F.Optimizer([w, b], tx)
    assert {"lr", "ns_steps", "beta", "weight_decay", "adam_b1"} <= opt.param_groups[0].keys()
    opt.param_groups[0]["lr"] = 0.0
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    before = w.detach().clone()
    opt.step()
    torch.testing.assert_close(w.detach(), before)  # lr 0 (also Adam's: adam_learning_rate=None follows lr)
    opt.param_groups[0]["lr"] = 0.1
    opt.step()
    assert not torch.equal(w.detach(), before)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: F.contrib.muon(0.1, ns_coeffs="fast"), ValueError, "'fast'"),
    (lambda: F.contrib.scale_by_muon(ns_coeffs=(1.0, 2.0)), ValueError, "shape (3,) or (n, 3)"),
    (lambda: F.contrib.scale_by_muon(ns_coeffs=((1.0, 2.0, 3.0),) * 6, ns_steps=5), ValueError, "6 rows"),
    (lambda: F.contrib.scale_by_muon(preconditioning="polar"), ValueError, "'polar'"),
    (lambda: F.contrib.scale_by_muon(beta=1.0), ValueError, "beta"),
    (lambda: F.from_torch(torch.optim.Muon, adjust_lr_fn="rms"), ValueError, "'rms'"),
    (lambda: F.from_torch(torch.optim.Muon).init([torch.ones(3)]), ValueError, "shape (3,)"),
    (lambda: F.contrib.orthogonalize_via_newton_schulz(torch.ones(2, 2, 2), (1.0, 0.0, 0.0)), ValueError,
     "needs dimension_numbers"),
    (lambda: F.contrib.orthogonalize_via_newton_schulz(torch.ones(2, 3, 4), (1.0, 0.0, 0.0),
                                                      dimension_numbers=Dims(1, -2)), ValueError, "overlap"),
    (lambda: F.contrib.scale_by_muon().update([torch.ones(3)], F.contrib.scale_by_muon().init([torch.ones(3)])),
     ValueError, "rank < 2"),
])
def test_bad_input_is_named(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


def test_newton_schulz_dtype_is_bfloat16_only_on_cuda():
    assert ns.ns_dtype(torch.ones(2, 2)) == torch.float32
    assert ns.ns_dtype(torch.ones(2, 2, dtype=torch.float64)) == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_muon_on_cuda_runs_newton_schulz_in_bfloat16():
    """On CUDA the orthogonalisation runs in bfloat16 (as torch's and Keller Jordan's do): close
    to the float32 CPU result at bfloat16's precision, not equal to it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=gen)
    cpu = F.contrib.orthogonalize_via_newton_schulz(x, (3.4445, -4.7750, 2.0315))
    gpu = F.contrib.orthogonalize_via_newton_schulz(x.cuda(), (3.4445, -4.7750, 2.0315)).cpu()
    assert ns.ns_dtype(x.cuda()) == torch.bfloat16
    torch.testing.assert_close(gpu, cpu, rtol=0, atol=5e-2)
    assert not torch.equal(gpu, cpu)
