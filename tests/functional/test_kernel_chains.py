"""Chains on torch's kernels: each fused chain takes the pure path's step (float64, rel 1e-12),
makes the kernel calls `explain` says, and names reach masks through `zero.functional.Optimizer`."""

import math

import pytest
import torch
from torch import nn

import zero.functional as F
from zero.functional.base import add_updates


def named_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    return model


def decays(tree):
    """The mask researchers write most: no decay on biases and norms."""
    return {n: not (n.endswith("bias") or n.startswith("1.")) for n in tree}


def warmup_cosine():
    return F.warmup_cosine_decay_schedule(0.0, 0.05, 3, 12, 0.005)


CHAINS = {
    "readme: clip + adamw(schedule, mask by name)": (
        lambda: F.chain(F.clip_by_global_norm(0.5), F.adamw(warmup_cosine(), weight_decay=0.1, mask=decays)),
        "_fused_adamw_", 2),
    "clip + masked decay + sgd nesterov": (
        lambda: F.chain(F.clip_by_global_norm(0.5), F.add_decayed_weights(0.01, decays),
                        F.sgd(0.05, momentum=0.9, nesterov=True)),
        "_fused_sgd_", 2),
    "clip + lion(schedule, mask by name)": (
        lambda: F.chain(F.clip_by_global_norm(0.5), F.lion(warmup_cosine(), weight_decay=0.1, mask=decays)),
        "torch._foreach_* (Lion in place)", 2),
    "partition: adamw / adam": (
        lambda: F.partition({"decay": F.adamw(0.01, weight_decay=0.1), "none": F.adam(0.02)},
                            lambda tree: {n: "decay" if ok else "none" for n, ok in decays(tree).items()}),
        "_fused_adamw_ + _fused_adam_", 2),
    "masked(adam): the others take their updates as they are": (
        lambda: F.masked(F.adam(0.01), decays), "_fused_adam_", 1),
    "apply_if_finite(clip + adamw)": (
        lambda: F.apply_if_finite(F.chain(F.clip_by_global_norm(0.5), F.adamw(0.01, weight_decay=0.1)), 2),
        "_fused_adamw_", 1),
    "MultiSteps(adam, 3)": (lambda: F.MultiSteps(F.adam(0.01), 3).gradient_transformation(), "_fused_adam_", 1),
    "clip + inject_hyperparams(adamw)": (
        lambda: F.chain(F.clip_by_global_norm(0.5),
                        F.inject_hyperparams(F.adamw, static_args="mask")(learning_rate=0.01, mask=decays)),
        "_fused_adamw_", 2),
    "clip + from_torch(AdamW, amsgrad)": (
        lambda: F.chain(F.clip_by_global_norm(0.5), F.from_torch(torch.optim.AdamW, lr=0.01, amsgrad=True)),
        "_fused_adamw_", 1),
    "clip + rmsprop (multi-tensor, pre-scaled)": (
        lambda: F.chain(F.clip_by_global_norm(0.5), F.from_torch(torch.optim.RMSprop, lr=0.01, momentum=0.5)),
        "torch.optim.rmsprop.rmsprop(foreach=True)", 1),
}


def grads_at(model, step, nan_at=None):
    gen = torch.Generator().manual_seed(100 + step)
    out = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in model.named_parameters()}
    if step == nan_at:
        out["0.weight"][0, 0] = math.nan  # a non-finite step: apply_if_finite skips it on both paths
    return out


def pure_run(tx, model, steps, nan_at=None, grads=grads_at):
    """The definition: ``update`` link by link on the dict by name, then the params += updates
    (``grads(model, step, nan_at)``: the gradients by name)."""
    params = dict(model.named_parameters())
    state = tx.init(params)
    with torch.no_grad():
        for step in range(steps):
            updates, state = tx.update(grads(model, step, nan_at), state, params)
            add_updates(params, updates)
    return {n: p.detach().clone() for n, p in params.items()}


def fused_run(tx, model, steps, nan_at=None):
    opt = F.Optimizer(model.named_parameters(), tx)
    for step in range(steps):
        for n, p in model.named_parameters():
            p.grad = grads_at(model, step, nan_at)[n]
        if step == nan_at:  # apply_if_finite says it skipped
            with pytest.warns(RuntimeWarning, match=rf"step {step + 1}: apply_if_finite found NaN or inf in the "
                                                    r"updates and skipped it \(1 in a row, 1 in all"):
                opt.step()
            assert opt.skipped_steps == 1
        else:
            opt.step()
    return opt, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CHAINS))
def test_fused_chain_takes_the_pure_paths_step(case):
    make, kernel, calls = CHAINS[case]
    steps, nan_at = 12, 4 if case.startswith("apply_if_finite") else None
    want = pure_run(make(), named_model(), steps, nan_at)
    opt, got = fused_run(make(), named_model(), steps, nan_at)
    path = opt.path[0]
    assert path.fused and path.kernel == kernel and path.calls == calls, str(path)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=f"{case}: {name}")
    moved = sum(float((got[n] - p).abs().sum()) for n, p in named_model().named_parameters())
    assert moved > 0.1, "the run moved the params"


def test_clip_as_grad_scale_in_float32():
    """In float32 the clip is the fused kernels' grad_scale (float64 grads are scaled beforehand)."""
    make = CHAINS["readme: clip + adamw(schedule, mask by name)"][0]
    want = pure_run(make(), named_model(dtype=torch.float32), 12)
    _, got = fused_run(make(), named_model(dtype=torch.float32), 12)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=2e-6, atol=2e-7, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_fused_clip_leaves_the_grads_clipped_as_clip_grad_norm_does(dtype):
    """The kernel's grad_scale writes the clipped grads back (float32), and float64 grads are
    clipped in place before the kernel: either way the grads end as clip_grad_norm_ leaves them."""
    model = named_model(dtype=dtype)
    grads = grads_at(model, 0)
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    F.Optimizer(model.named_parameters(), CHAINS["readme: clip + adamw(schedule, mask by name)"][0]()).step()
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert norm > 0.5
    for n, p in model.named_parameters():
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        torch.testing.assert_close(p.grad, grads[n] / norm * 0.5, rtol=tol, atol=tol, msg=n)


def test_kernel_calls_per_step_are_counted(monkeypatch):
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))[1])
    make = CHAINS["readme: clip + adamw(schedule, mask by name)"][0]
    opt, _ = fused_run(make(), named_model(), 3)
    assert calls == [4, 2] * 3, "per step: the 4 params with decay, the 2 without (one call per decay)"
    assert opt.path[0].calls == 2


def test_named_params_reach_masks_and_groups_keep_their_names():
    model = named_model()
    groups = [{"params": list(model[0].named_parameters(prefix="0")), "lr": 0.01},
              {"params": list(model[3].named_parameters(prefix="3"))}]
    opt = F.Optimizer(groups, F.adamw(0.02, weight_decay=0.1, mask=decays))
    assert [g["param_names"] for g in opt.param_groups] == [["0.weight", "0.bias"], ["3.weight", "3.bias"]]
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.set_states(0)[(0, 1)]
    assert set(state.inner_state[0].mu) == {"0.weight", "0.bias"}, "the state is a dict by name"
    with pytest.raises(ValueError, match=r"names \['w'\] more than once"):
        F.Optimizer([("w", torch.zeros(2, requires_grad=True)), ("w", torch.ones(2, requires_grad=True))], F.sgd(0.1))


def test_explain_names_what_keeps_a_chain_on_the_pure_path():
    params = dict(named_model().named_parameters())
    cases = [
        (F.adam(0.01, nesterov=True), "scale_by_adam(nesterov=True)"),
        (F.adamw(0.01, weight_decay=lambda count: 0.1), "a scheduled weight decay"),
        (F.chain(F.scale_by_adam(), F.clip_by_global_norm(1.0), F.scale_by_learning_rate(0.1)),
         "only as the chain's first link"),
        (F.chain(F.stateless(lambda u, p: u), F.adam(0.01)), "a link without a spec"),
        (F.lamb(0.01), "a link without a spec (scale_by_trust_ratio)"),
    ]
    for tx, why in cases:
        path = F.explain(tx, params)
        assert not path.fused and why in path.why, str(path)
    assert str(F.explain(F.adamw(0.01), params)).startswith("fused: _fused_adamw_, 1 call per step")


@pytest.mark.parametrize("make_tx, make_torch", [
    (lambda: F.adam(1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False)),
    (lambda: F.from_torch(torch.optim.AdamW, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)),
    (lambda: F.sgd(1e-2, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9,
                                                                    foreach=False)),
    (lambda: F.from_torch(torch.optim.Adagrad, lr=1e-2), lambda ps: torch.optim.Adagrad(ps, lr=1e-2, foreach=False)),
], ids=["adam", "adamw_torch", "sgd_momentum", "adagrad_torch"])
def test_a_transposed_param_given_a_contiguous_gradient_steps_right(make_tx, make_torch):
    """``nn.Parameter(w.t())`` with ``p.grad = g`` set by hand (contiguous), as functional loops,
    RPC and DLPack users do, or a transposed gradient for a contiguous param: the fused kernels
    pair elements by memory order, so the step takes the pure path and equals torch's per-tensor
    loop; `explain` says why."""
    torch.manual_seed(0)
    w, b = torch.randn(6, 4), torch.randn(5)
    cases = {"transposed param": ([w.t(), b], lambda p: torch.randn(p.shape)),
             "transposed gradient": ([w, b], lambda p: torch.randn(p.shape[::-1]).t())}
    for case, (values, gradient) in cases.items():
        ends = []
        for make in (lambda ps: F.Optimizer(ps, make_tx()), make_torch):
            params = [nn.Parameter(v.clone()) for v in values]  # clone keeps a transposed layout
            opt = make(params)
            for step in range(5):
                torch.manual_seed(step)
                for p in params:
                    p.grad = gradient(p)
                opt.step()
            ends.append([p.detach().clone() for p in params])
        for ours, theirs in zip(*ends):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=lambda m, case=case: f"{case}: {m}")
    path = F.explain(make_tx(), [w.t(), b])
    assert not path.fused and "leaf 0 is not contiguous" in path.why
