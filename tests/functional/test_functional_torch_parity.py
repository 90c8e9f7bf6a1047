"""from_torch(X) steps exactly as torch.optim.X, over X's option matrix, in float64."""

import copy

import pytest
import torch

import zero.functional as F

SHAPES = [(5, 7), (7,), (3, 2, 2), ()]

MATRIX = {
    "SGD": [dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.1, momentum=0.9, dampening=0.3),
            dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01), dict(lr=0.1, maximize=True, weight_decay=0.1),
            dict(lr=0.05, momentum=0.5, maximize=True, foreach=False)],
    "Adam": [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, amsgrad=True),
             dict(lr=1e-2, amsgrad=True, weight_decay=0.05, maximize=True), dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
             dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)],
    "AdamW": [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, amsgrad=True), dict(lr=1e-2, maximize=True)],
    "Adagrad": [dict(lr=0.1), dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
                dict(lr=0.1, maximize=True, eps=1e-6)],
    "Adadelta": [dict(), dict(lr=0.5, rho=0.8, weight_decay=0.01), dict(maximize=True)],
    "RMSprop": [dict(), dict(momentum=0.9), dict(centered=True), dict(centered=True, momentum=0.5, weight_decay=0.01),
                dict(alpha=0.9, eps=1e-6, maximize=True)],
    "Rprop": [dict(), dict(lr=0.05, etas=(0.3, 1.5), step_sizes=(1e-4, 1.0)), dict(maximize=True)],
    "Adamax": [dict(), dict(weight_decay=0.01, betas=(0.8, 0.99)), dict(maximize=True)],
    "NAdam": [dict(), dict(weight_decay=0.01), dict(weight_decay=0.01, decoupled_weight_decay=True),
              dict(momentum_decay=0.01, maximize=True)],
    "RAdam": [dict(), dict(weight_decay=0.01), dict(weight_decay=0.01, decoupled_weight_decay=True),
              dict(betas=(0.9, 0.99), maximize=True)],
}
CASES = [(name, opts) for name, optss in MATRIX.items() for opts in optss]


@pytest.mark.parametrize("name, opts", CASES, ids=[f"{n}-{i}" for n, o in MATRIX.items() for i in range(len(o))])
def test_matches_torch_optim(name, opts):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    ref_params = [p.clone().requires_grad_() for p in init]
    ref = getattr(torch.optim, name)(ref_params, **copy.deepcopy(opts))
    tx = F.from_torch(getattr(torch.optim, name), **copy.deepcopy(opts))
    params, state = [p.clone() for p in init], None
    state = tx.init(params)
    for step in range(40):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        ref.step()
        updates, state = tx.update(grads, state, params)
        params = F.apply_updates(params, updates)
        for ours, theirs in zip(params, ref_params):
            torch.testing.assert_close(ours, theirs.detach(), rtol=1e-9, atol=1e-12, msg=f"{name} {opts} step {step}")


@pytest.mark.parametrize("call, exc, words", [
    (lambda: F.from_torch(torch.optim.LBFGS), ValueError, "from_torch supports"),
    (lambda: F.from_torch(torch.optim.Adam, lr=1e-3, capturable=True), ValueError, "capturable=True"),
    (lambda: F.from_torch(torch.optim.Adam, lr=1e-3, momentum=0.9), TypeError, "['momentum']"),
    (lambda: F.from_torch(torch.optim.SGD, lr=0.1, nesterov=True), ValueError, "nesterov"),
    (lambda: F.from_torch(torch.optim.Adam, lr=-1.0), ValueError, "lr must be >= 0"),
    (lambda: F.from_torch(torch.optim.Adam, betas=(1.5, 0.9)), ValueError, "betas[0]"),
    (lambda: F.from_torch(torch.optim.Rprop, etas=(1.5, 1.2)), ValueError, "etas"),
])
def test_unsupported_options_raise(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)
