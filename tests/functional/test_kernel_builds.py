"""A learning rate read, not rebuilt (zero.functional.kernels.builds and .knobs): an injected
transformation builds its inner chain once for the in-place step, and its kernel reads each step's
hyperparameters when called, exactly as a chain built for those values would step."""

from __future__ import annotations

import pytest
import torch

import zero.functional as F
import zero.functional.kernels.chains as chains
from zero.functional.adapters.group_settings import with_group_hyperparams
from zero.functional.base import inplace_step


@pytest.fixture
def matches(monkeypatch):
    """How many times a kernel is matched to a chain (the kernel builder runs)."""
    count = [0]
    real = chains.match

    def counting(specs):
        count[0] += 1
        return real(specs)

    monkeypatch.setattr(chains, "match", counting)
    return count


def _params():
    torch.manual_seed(0)
    return [torch.randn(5, 3), torch.randn(7), torch.randn(4, 4)]


def _moved(initial: dict, k: int) -> dict:
    """Every float hyperparameter moved at step ``k`` (kept in its range: betas below 1)."""
    return {name: v * (1 - 0.03 * (k + 1)) for name, v in initial.items() if isinstance(v, float)}


def _steps_against_fresh_builds(tx, matches, steps: int = 5) -> int:
    """Step ``tx`` (in the form param groups set) with every hyperparameter moving each step,
    beside the inner factory built anew for each step's values; the two must be bitwise equal.
    Returns how many builds of the inner chain the injected steps made (its kernel matches over
    those of one build: a chain nested in a chain matches once per chain)."""
    injected = with_group_hyperparams(tx)
    factory, args = injected.spec.args["source"]
    initial = injected.spec.args["hyperparams"]
    params, reference = _params(), _params()
    before = matches[0]
    ref_state = factory(**args).init(reference)
    per_build, before = matches[0] - before, matches[0]
    state = injected.init(params)  # the in-place steps' build, made for these params
    built = matches[0] - before
    for k in range(steps):
        grads = [torch.randn_like(p) for p in params]
        kept = {n: torch.tensor(v, dtype=state.hyperparams[n].dtype) for n, v in _moved(initial, k).items()}
        values = {n: v.item() for n, v in kept.items()}  # as the state holds them (float32 for a user's inject)
        state = state._replace(hyperparams={**state.hyperparams, **kept})
        before = matches[0]
        state = inplace_step(injected, params, [g.clone() for g in grads], state)
        built += matches[0] - before
        ref_state = inplace_step(factory(**{**args, **values}), reference, grads, ref_state)
        for p, r in zip(params, reference):
            assert torch.equal(p, r), f"step {k}: {(p - r).abs().max()}"
    return built / per_build


KERNEL_RULES = {
    "adamw": lambda: F.adamw(1e-2, weight_decay=0.1),
    "adam": lambda: F.adam(1e-2),
    "sgd_nesterov": lambda: F.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: F.lion(1e-3, weight_decay=0.1),
    "adamax": lambda: F.adamax(1e-2),
    "adamw_8bit": lambda: F.contrib.adamw_8bit(1e-2, weight_decay=0.1),
    "clip_adamw": lambda: F.inject_hyperparams(
        lambda learning_rate, max_norm: F.chain(F.clip_by_global_norm(max_norm), F.adamw(learning_rate)))(
        learning_rate=1e-2, max_norm=0.5),
    "torch_adam_amsgrad": lambda: F.from_torch(torch.optim.Adam, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "torch_sgd": lambda: F.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "torch_adagrad": lambda: F.from_torch(torch.optim.Adagrad, lr=0.1, lr_decay=0.01, weight_decay=0.01),
    "torch_rmsprop": lambda: F.from_torch(torch.optim.RMSprop, lr=1e-2, momentum=0.5, weight_decay=0.01,
                                          centered=True),
    "torch_adadelta": lambda: F.from_torch(torch.optim.Adadelta, lr=1.0, weight_decay=0.01),
    "torch_nadam": lambda: F.from_torch(torch.optim.NAdam, lr=1e-2, weight_decay=0.01),
    "torch_radam": lambda: F.from_torch(torch.optim.RAdam, lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True),
    "torch_adamax": lambda: F.from_torch(torch.optim.Adamax, lr=1e-2, weight_decay=0.01),
    "torch_rprop": lambda: F.from_torch(torch.optim.Rprop, lr=1e-2),
}


@pytest.mark.parametrize("rule", sorted(KERNEL_RULES))
def test_a_kernel_reads_every_hyperparameter_when_called(rule, matches):
    tx = KERNEL_RULES[rule]()
    assert F.explain(with_group_hyperparams(tx), _params()).kernel is not None  # the kernel path is what is tested
    assert _steps_against_fresh_builds(tx, matches) == 1  # built once, then read five times


def test_a_factory_that_derives_a_number_from_a_hyperparameter_is_built_for_each_value(matches):
    tx = F.inject_hyperparams(lambda learning_rate: F.chain(F.scale_by_adam(), F.scale_by_learning_rate(
        2 * learning_rate)))(learning_rate=1e-2)
    assert _steps_against_fresh_builds(tx, matches) > 1  # its specs do not follow the knob: rebuilt


def test_a_kernel_chosen_on_a_hyperparameters_value_is_chosen_again_when_it_moves(matches):
    # scale(-1) before SGD is torch's maximize, a kernel flag: moving it to -0.97 must leave that kernel
    tx = F.inject_hyperparams(lambda step_size, learning_rate: F.chain(F.scale(step_size), F.sgd(learning_rate)))(
        step_size=-1.0, learning_rate=0.1)
    assert F.explain(tx, _params()).kernel == "_fused_sgd_"
    _steps_against_fresh_builds(tx, matches)


def test_the_kernel_is_built_once_per_param_group_over_five_scheduled_steps(matches):
    params = _params()
    for p in params:
        p.requires_grad_()
        p.grad = torch.randn_like(p)
    schedule = F.warmup_cosine_decay_schedule(1e-4, 1e-2, 2, 10)  # from 0, lr == 0 would be a case of its own
    opt = F.Optimizer([{"params": params[:2]}, {"params": params[2:]}], F.adamw(schedule, weight_decay=0.1))
    matches[0] = 0
    seen = set()
    for _ in range(5):
        opt.step()
        seen.add(opt.param_groups[0]["lr"])
    assert len(seen) == 5 and matches[0] == 2


def test_a_replaced_update_is_stepped_through_never_dropped():
    calls = []

    def update(updates, state, params=None):
        calls.append(len(updates))
        return [torch.zeros_like(u) for u in updates], state

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    replaced = F.sgd(0.1)._replace(update=update)
    assert replaced.spec is None and replaced.inplace is None
    F.Optimizer([p], replaced).step()
    F.Optimizer([p], F.chain(F.clip_by_global_norm(1.0), replaced)).step()
    assert calls == [1, 1] and torch.equal(p.detach(), torch.ones(3))
    kept = F.with_extra_args_support(F.sgd(0.1))  # the same rule with another signature keeps its kernel
    assert F.explain(kept, [p]).kernel == "_fused_sgd_"


def test_a_remembered_number_is_forgotten_when_its_tensor_is_written():
    """`zero.functional.scalars`: a tensor made from a number is read as that number until
    something writes into it (a checkpoint loaded in place, ``fill_``), then from the tensor."""
    from zero.functional.scalars import counter, same_number, scalar, value_of

    lr, count = scalar(0.1, torch.float64), counter(3)
    assert value_of(lr) == 0.1 and value_of(count) == 3 and same_number(lr, 0.1)
    assert not same_number(lr, 0.2) and not same_number(scalar(0.0, torch.float64), -0.0)
    lr.fill_(0.25)
    count.copy_(torch.tensor(9))
    assert value_of(lr) == 0.25 and value_of(count) == 9 and not same_number(lr, 0.1)
    rounded = scalar(0.1, torch.float32)  # holds 0.1 rounded: nothing remembered, read from the tensor
    assert value_of(rounded) == torch.tensor(0.1, dtype=torch.float32).item() and not same_number(rounded, 0.1)


def test_from_torch_sgds_step_makes_and_reads_no_hyperparameter_tensor_while_the_group_keeps_its_values():
    """The step's ops, counted: torch's fused kernel and the two step counts (Optax's layout), and a
    new lr tensor only in the step after the lr moved."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not str(func).startswith("profiler."):  # torch's own record_function around step
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    params = [p.requires_grad_() for p in _params()]
    opt = F.Optimizer(params, F.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9))
    reference = torch.optim.SGD([p.detach().clone().requires_grad_() for p in params], lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 3:
            opt.param_groups[0]["lr"] = reference.param_groups[0]["lr"] = 0.05
        for p, q in zip(params, reference.param_groups[0]["params"]):
            p.grad = q.grad = torch.full_like(p, step + 1.0)
        seen = []
        with Ops():
            opt.step()
        reference.step()
        if step >= 2:
            made = 2 + (step == 3)
            assert sorted(seen) == sorted(["aten._fused_sgd_.default"] + ["aten.lift_fresh.default"] * made), seen
    for p, q in zip(params, reference.param_groups[0]["params"]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
