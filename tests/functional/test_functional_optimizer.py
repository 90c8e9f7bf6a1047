"""zero.functional.Optimizer and FunctionalOptimizer: torch's optimizer protocol over transformations."""

import importlib
import io

import pytest
import torch
from helpers import assert_params_close, train
from torch import nn

import zero.functional as F


def model_and_data(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    data = [(torch.randn(8, 6, dtype=dtype), torch.randn(8, 3, dtype=dtype)) for _ in range(25)]
    return model, data


def fit(model, opt, data, scheduler=None):
    """The shared training loop (`tests.helpers.train`) on the regression data, one run; its params after."""
    return train(model, opt, range(len(data)), scheduler=scheduler,
                 loss=lambda m, k: nn.functional.mse_loss(m(data[k][0]), data[k][1]))


@pytest.mark.parametrize("name, opts", [
    ("Adam", dict(lr=0.01, weight_decay=0.1)), ("SGD", dict(lr=0.1, momentum=0.9)),
    ("AdamW", dict(lr=0.01, amsgrad=True)), ("RMSprop", dict(lr=0.01, centered=True))])
def test_optimizer_equals_torch_optim(name, opts):
    m1, data = model_and_data()
    m2, _ = model_and_data()
    ref = fit(m1, getattr(torch.optim, name)(m1.parameters(), **opts), data)
    ours = fit(m2, F.Optimizer(m2.parameters(), F.from_torch(getattr(torch.optim, name), **opts)), data)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


FUSED_CASES = {
    "adam": (lambda: F.adam(0.01), lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False), None),
    "adamw": (lambda: F.adamw(0.01, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False), None),
    "adam-schedule": (lambda: F.adam(lambda count: 0.01 * 0.9 ** int(count)),
                      lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False), lambda step: 0.9**step),
    "injected-adam": (lambda: F.inject_hyperparams(F.adam)(learning_rate=0.01),
                      lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False), None),
    "torch-adam-l2-maximize": (lambda: F.from_torch(torch.optim.Adam, lr=0.01, weight_decay=0.1, maximize=True),
                               lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, maximize=True,
                                                           foreach=False), None),
    "torch-adamw-amsgrad": (lambda: F.from_torch(torch.optim.AdamW, lr=0.01, amsgrad=True),
                            lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, foreach=False), None),
    "sgd": (lambda: F.sgd(0.05), lambda ps: torch.optim.SGD(ps, lr=0.05, foreach=False), None),
    "sgd-trace-nesterov": (lambda: F.sgd(0.05, momentum=0.9, nesterov=True),
                           lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=False), None),
    "torch-sgd-nesterov-l2": (lambda: F.from_torch(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True,
                                                   weight_decay=0.1),
                              lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1,
                                                         foreach=False), None),
    "torch-sgd-dampening-maximize": (lambda: F.from_torch(torch.optim.SGD, lr=0.05, momentum=0.5, dampening=0.3,
                                                          maximize=True),
                                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, dampening=0.3,
                                                                maximize=True, foreach=False), None),
    "torch-adagrad": (lambda: F.from_torch(torch.optim.Adagrad, lr=0.05),
                      lambda ps: torch.optim.Adagrad(ps, lr=0.05, foreach=False), None),
    "torch-adagrad-decays-maximize": (lambda: F.from_torch(torch.optim.Adagrad, lr=0.05, lr_decay=0.1, weight_decay=0.1,
                                                           initial_accumulator_value=0.2, maximize=True),
                                      lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.1, weight_decay=0.1,
                                                                     initial_accumulator_value=0.2, maximize=True,
                                                                     foreach=False), None),
    "torch-rmsprop": (lambda: F.from_torch(torch.optim.RMSprop, lr=0.01),
                      lambda ps: torch.optim.RMSprop(ps, lr=0.01, foreach=False), None),
    "torch-rmsprop-centered-momentum-l2-maximize": (
        lambda: F.from_torch(torch.optim.RMSprop, lr=0.01, alpha=0.9, centered=True, momentum=0.8, weight_decay=0.1,
                             maximize=True),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, centered=True, momentum=0.8, weight_decay=0.1,
                                       maximize=True, foreach=False), None),
    "torch-adamax-l2-maximize": (lambda: F.from_torch(torch.optim.Adamax, lr=0.05, weight_decay=0.1, maximize=True),
                                 lambda ps: torch.optim.Adamax(ps, lr=0.05, weight_decay=0.1, maximize=True,
                                                               foreach=False), None),
    "adamax": (lambda: F.adamax(0.05), lambda ps: torch.optim.Adamax(ps, lr=0.05, foreach=False), None),
    "torch-adadelta-l2-maximize": (lambda: F.from_torch(torch.optim.Adadelta, lr=0.5, weight_decay=0.1,
                                                        maximize=True),
                                   lambda ps: torch.optim.Adadelta(ps, lr=0.5, weight_decay=0.1, maximize=True,
                                                                   foreach=False), None),
    "torch-nadam": (lambda: F.from_torch(torch.optim.NAdam, lr=0.02),
                    lambda ps: torch.optim.NAdam(ps, lr=0.02, foreach=False), None),
    "torch-nadam-decoupled-maximize": (
        lambda: F.from_torch(torch.optim.NAdam, lr=0.02, weight_decay=0.1, decoupled_weight_decay=True,
                             momentum_decay=0.01, maximize=True),
        lambda ps: torch.optim.NAdam(ps, lr=0.02, weight_decay=0.1, decoupled_weight_decay=True, momentum_decay=0.01,
                                     maximize=True, foreach=False), None),
    "torch-radam-l2": (lambda: F.from_torch(torch.optim.RAdam, lr=0.02, weight_decay=0.1, betas=(0.8, 0.99)),
                       lambda ps: torch.optim.RAdam(ps, lr=0.02, weight_decay=0.1, betas=(0.8, 0.99), foreach=False),
                       None),
    "torch-radam-decoupled-maximize": (
        lambda: F.from_torch(torch.optim.RAdam, lr=0.02, weight_decay=0.1, decoupled_weight_decay=True, maximize=True),
        lambda ps: torch.optim.RAdam(ps, lr=0.02, weight_decay=0.1, decoupled_weight_decay=True, maximize=True,
                                     foreach=False), None),
    "torch-rprop": (lambda: F.from_torch(torch.optim.Rprop, lr=0.01),
                    lambda ps: torch.optim.Rprop(ps, lr=0.01, foreach=False), None),
    "torch-rprop-maximize": (lambda: F.from_torch(torch.optim.Rprop, lr=0.02, etas=(0.3, 1.5), step_sizes=(1e-4, 1.0),
                                                  maximize=True),
                             lambda ps: torch.optim.Rprop(ps, lr=0.02, etas=(0.3, 1.5), step_sizes=(1e-4, 1.0),
                                                          maximize=True, foreach=False), None),
}


@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_kernel_path_equals_torch_single_tensor_rule(case, monkeypatch):
    """The in-place path (torch's fused or multi-tensor kernel) against torch's own for-loop rule:
    independent code."""
    make, make_ref, lr_lambda = FUSED_CASES[case]
    calls = []
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
        kernel = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, kernel=kernel, **k: calls.append(1) or kernel(*a, **k))
    for name in ("rmsprop", "adamax", "adadelta", "rprop", "nadam", "radam"):  # torch's reference: foreach=False
        module = importlib.import_module(f"torch.optim.{name}")
        multi_tensor = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, f=multi_tensor, **k: (calls.append(1) if k["foreach"] else None)
                            or f(*a, **k))
    m1, data = model_and_data()
    m2, _ = model_and_data()
    ref_opt = make_ref(list(m1.parameters()))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lr_lambda) if lr_lambda else None
    ref = fit(m1, ref_opt, data, ref_sched)
    ours = fit(m2, F.Optimizer(m2.parameters(), make()), data)
    assert len(calls) == len(data), "the fused kernel ran once per step"
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_chains_without_a_kernel_step_by_their_update():
    assert F.nadam(0.01).inplace is None and F.adam(0.01, eps_root=1e-8).inplace is None
    bf16_trace = F.sgd(0.01, momentum=0.9, accumulator_dtype=torch.bfloat16)
    assert bf16_trace.inplace is None, "a buffer of another dtype than its param: no kernel"
    assert F.adamw(0.01, weight_decay=lambda count: 0.01).inplace is None, "a scheduled decay: no kernel"
    assert F.chain(F.scale_by_adam(), F.scale(-0.01)).inplace is None, "scale is not scale_by_learning_rate"


def test_lr_scheduler_drives_group_lr():
    m1, data = model_and_data()
    m2, _ = model_and_data()
    ref_opt = torch.optim.Adam(m1.parameters(), lr=0.05)
    ref = fit(m1, ref_opt, data, torch.optim.lr_scheduler.StepLR(ref_opt, 5, gamma=0.5))
    opt = F.Optimizer(m2.parameters(), F.from_torch(torch.optim.Adam, lr=0.05))
    assert opt.param_groups[0]["lr"] == 0.05
    ours = fit(m2, opt, data, torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**5)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_param_groups_frozen_params_and_closure():
    m1, data = model_and_data()
    m2, _ = model_and_data()
    for m in (m1, m2):
        m[0].bias.requires_grad_(False)
    ref_opt = torch.optim.SGD([{"params": [m1[0].weight, m1[0].bias]}, {"params": m1[2].parameters(), "lr": 0.01}],
                              lr=0.1, momentum=0.9)
    opt = F.Optimizer([{"params": [m2[0].weight, m2[0].bias]},
                       {"params": m2[2].parameters(), "tx": F.from_torch("SGD", lr=0.01, momentum=0.9)}],
                      F.from_torch("SGD", lr=0.1, momentum=0.9))
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    for (x, y) in data:
        for model, o in ((m1, ref_opt), (m2, opt)):
            def closure(model=model, o=o, x=x, y=y):
                o.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            loss = o.step(closure)
            assert loss is not None
    for a, b in zip(m2.parameters(), m1.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_state_dict_round_trip_mid_run_continues_identically():
    m1, data = model_and_data()
    m2, _ = model_and_data()
    opt1 = F.Optimizer(m1.parameters(), F.inject_hyperparams(F.adam)(learning_rate=0.02))
    fit(m1, opt1, data[:10])
    buf = io.BytesIO()
    torch.save(opt1.state_dict(), buf)
    with torch.no_grad():
        for p, q in zip(m2.parameters(), m1.parameters()):
            p.copy_(q)
    opt2 = F.Optimizer(m2.parameters(), F.inject_hyperparams(F.adam)(learning_rate=0.5))
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    assert opt2.param_groups[0]["lr"] == 0.02
    a, b = fit(m1, opt1, data[10:]), fit(m2, opt2, data[10:])
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_changing_the_set_of_params_with_gradients_is_an_error():
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = F.Optimizer([a, b], F.adam(0.1))
    a.grad = torch.ones(3)
    opt.step()
    b.grad = torch.ones(3)
    with pytest.raises(ValueError, match="must repeat every step"):
        opt.step()


def step_both(fo, ref, ref_params, grads):
    """The functional optimizer and torch's take the same gradients (None: no gradient)."""
    fo.step(grads)
    for p, g in zip(ref_params, grads):
        p.grad = None if g is None else g.clone()
    ref.step()


def test_functional_optimizer_steps_buckets_like_torch_adam():
    torch.manual_seed(0)
    params = [torch.randn(4, dtype=torch.float64) for _ in range(5)]
    ref_params = [p.clone().requires_grad_() for p in params]
    ref = torch.optim.Adam(ref_params, lr=0.01)
    fo = F.FunctionalOptimizer(params, F.from_torch("Adam", lr=0.01))
    buckets = [[0, 1], [2, 3, 4]]
    for _ in range(12):
        for bucket in buckets:
            grads = [torch.randn(4, dtype=torch.float64) if i in bucket else None for i in range(5)]
            step_both(fo, ref, ref_params, grads)
    assert_params_close(params, ref_params, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="empty parameter list"):
        F.FunctionalOptimizer([], F.adam(0.1))
    assert F.FunctionalOptimizer([], F.adam(0.1), _allow_empty_param_list=True).param_groups[0]["params"] == []
    with pytest.raises(ValueError, match="2 gradients for 5 params"):
        fo.step([None, None])


@pytest.mark.parametrize("name, opts", [("Adam", dict(lr=0.01, weight_decay=0.1)),
                                        ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
                                        ("RMSprop", dict(lr=0.01, centered=True, momentum=0.5))])
def test_per_param_steps_any_subset_like_torch(name, opts):
    """Params miss gradients in changing patterns: the sets' states split, each param stays torch's."""
    torch.manual_seed(1)
    params = [torch.randn(n, dtype=torch.float64) for n in (4, 1, 7, 3, 5)]
    ref_params = [p.clone().requires_grad_() for p in params]
    ref = getattr(torch.optim, name)(ref_params, **opts)
    fo = F.FunctionalOptimizer(params, F.from_torch(name, **opts), per_param=True)
    patterns = [{0, 1, 2, 3, 4}, {0, 2, 4}, {1, 2}, {0, 1, 2, 3, 4}, {3}, set(), {0, 3, 4}, {1, 2, 3}]
    for step in range(24):
        grads = [torch.randn(p.shape, dtype=p.dtype) if i in patterns[step % 8] else None for i, p in enumerate(params)]
        step_both(fo, ref, ref_params, grads)
    assert_params_close(params, ref_params, rtol=1e-9, atol=1e-12)


def test_split_state_cuts_per_param_lists_and_copies_the_rest():
    tx = F.adam(0.01)
    params = [torch.ones(2), torch.ones(3), torch.ones(1)]
    state = tx.init(params)  # (ScaleByAdamState(count, mu, nu), EmptyState()), as Optax's
    first, second = F.split_state(state, 3, [[0, 2], [1]])
    assert [t.shape for t in first[0].mu] == [(2,), (1,)]
    assert [t.shape for t in second[0].nu] == [(3,)]
    assert first[0].mu[0] is state[0].mu[0], "per-param tensors move, not copied"
    assert first[0].count is not second[0].count and first[0].count == state[0].count, "counters are copied apart"


def test_the_kernel_path_notices_tensors_that_changed_dtype_between_steps():
    """The kernels remember which tensors they checked; a param cast in place (``.data = ...``)
    or a grad of another dtype must send the step down the update path, not into the kernel."""
    torch.manual_seed(0)
    ours = [torch.randn(5, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt, ref_opt = F.Optimizer(ours, F.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)), \
        torch.optim.SGD(ref, lr=0.1, momentum=0.9, foreach=False)
    for step in range(4):
        if step == 2:
            for p in (ours[1], ref[1]):
                p.data = p.data.float()
        for a, b in zip(ours, ref):
            a.grad = torch.ones_like(a) * (step + 1)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
        for a, b in zip(ours, ref):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [lambda: F.adam(0.1), lambda: F.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9),
                                  lambda: F.from_torch(torch.optim.Adagrad, lr=0.1)])
def test_a_kernel_step_is_seen_by_autograd_as_an_inplace_change(make):
    """As with torch.optim's for-loop step: a graph that saved a param before the step refuses
    to run backward after it, rather than mixing old and new values."""
    w = torch.randn(3, requires_grad=True)
    opt = F.Optimizer([w], make())
    w.grad = torch.ones(3)
    opt.step()  # creates the state: from here on the kernel runs
    saved = (w * w).sum()  # saves w for backward
    w.grad = torch.ones(3)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


@pytest.mark.parametrize("make", [lambda: F.from_torch(torch.optim.Adam, lr=0.05),
                                  lambda: F.from_torch(torch.optim.RMSprop, lr=0.01, momentum=0.9)])
def test_a_scheduler_keeps_the_kernels_checked_placement(make, monkeypatch):
    """An lr that changes every step builds the inner chain for the new value; its kernel takes
    over the tensors the last one checked instead of checking every dtype and device again."""
    from zero.functional.kernels import steps

    checks = []
    groups = steps._groups
    monkeypatch.setattr(steps, "_groups", lambda lists: checks.append(1) or groups(lists))
    model, data = model_and_data()
    opt = F.Optimizer(model.parameters(), make())
    fit(model, opt, data[:10], torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step)))
    assert len(checks) == 1, "the tensors' dtypes and devices were checked once, at the first step"


@pytest.mark.parametrize("scheduled", [False, True])
def test_param_groups_sharing_a_rule_at_two_lrs_keep_a_placement_each(scheduled, monkeypatch):
    from zero.functional.kernels import steps

    checks = []
    groups = steps._groups
    monkeypatch.setattr(steps, "_groups", lambda lists: checks.append(1) or groups(lists))
    model, data = model_and_data()
    opt = F.Optimizer([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}],
                      F.from_torch(torch.optim.Adam, lr=0.05))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step)) if scheduled else None
    fit(model, opt, data[:10], scheduler)
    assert len(checks) == 2, "one check per param group, at its first step"


def test_apply_if_finite_says_when_it_skips_and_when_it_gives_up():
    """Its skips are counted on the optimizer and warned of, and so is the step it takes anyway
    once more than ``max_consecutive_errors`` in a row held NaN or inf."""
    import math
    import warnings

    p = torch.ones(3, requires_grad=True)
    opt = F.Optimizer([p], F.apply_if_finite(F.sgd(0.1), 1))
    said = []
    for bad in [False, True, True, False]:
        p.grad = torch.full((3,), math.nan if bad else 1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        said.append([str(w.message) for w in caught])
    assert said[0] == said[3] == []
    assert said[1] == ["step 2: apply_if_finite found NaN or inf in the updates and skipped it (1 in a row, 1 in all; "
                       "optimizer.skipped_steps counts them)"]
    assert said[2] == ["step 3: apply_if_finite found NaN or inf in the updates and stepped anyway: 2 steps in a row "
                       "held them, more than its max_consecutive_errors allows"]
    assert opt.skipped_steps == 1
