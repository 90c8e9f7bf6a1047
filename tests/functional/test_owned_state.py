"""A rule stepped with the state its optimizer owns writes the new state into the old one's tensors
(`GradientTransformation.owned`): the same bits as the pure update, over many steps, through every
combinator that has an in-place step; and never under a combinator that keeps the state it passed."""

import math

import pytest
import torch
from test_kernel_chains import pure_run
from torch import nn

import zero.functional as F
from zero.functional.contrib import MuonDimensionNumbers as Dims

STEPS = 9
EVERY = dict(start_preconditioning_step=2, preconditioning_compute_steps=3)


def shampoo(**opts):
    return F.contrib.shampoo(0.05, **{"block_size": 6, **EVERY, **opts})


CASES = {
    "rmsprop graft, nesterov": lambda: shampoo(graft_type="rmsprop"),
    "adagrad graft, moving-average momentum, coupled decay": lambda: shampoo(
        graft_type="adagrad", moving_average_for_momentum=True, weight_decay=0.01),
    "sgd graft, no nesterov, decoupled decay, factors every 2 steps": lambda: shampoo(
        nesterov=False, weight_decay=0.01, decoupled_weight_decay=True, statistics_compute_steps=2),
    "per-head blocks": lambda: shampoo(graft_type="rmsprop", weight_dimension_numbers=lambda tree: {
        n: Dims(1, 0, heads=2) if n == "0.weight" else None for n in tree}),
    "clip + shampoo": lambda: F.chain(F.clip_by_global_norm(0.5), shampoo(graft_type="rmsprop")),
    "apply_if_finite(shampoo), a NaN step skipped": lambda: F.apply_if_finite(shampoo(graft_type="rmsprop"), 2),
    "MultiSteps(shampoo, 2)": lambda: F.MultiSteps(shampoo(graft_type="sqrtn"), 2).gradient_transformation(),
    "partition: shampoo / lamb": lambda: F.partition(
        {"kron": shampoo(graft_type="rmsprop"), "lamb": F.lamb(0.01)},
        lambda tree: {n: "kron" if n.endswith("weight") else "lamb" for n in tree}),
    "masked(shampoo), the biases as they are": lambda: F.masked(
        shampoo(graft_type="adagrad"), lambda tree: {n: n.endswith("weight") for n in tree}),
    "soap, its learning rate folded, decay after the update": lambda: F.contrib.soap(
        0.05, weight_decay=0.01, precondition_frequency=3),
    "soap, per-head blocks": lambda: F.contrib.soap(0.05, precondition_frequency=3, weight_dimension_numbers=lambda t: {
        n: Dims(1, 0, heads=2) if n == "0.weight" else Dims(1, 0) if n.endswith("weight") else None for n in t}),
}


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 7), nn.Linear(7, 3, bias=False)).to(dtype)


def grads_at(net, step, nan_at):
    gen = torch.Generator().manual_seed(50 + step)
    out = {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in net.named_parameters()}
    if step == nan_at:
        out["2.weight"][1, 1] = math.nan
    return out


def owned_run(tx, net, nan_at):
    opt = F.Optimizer(net.named_parameters(), tx)
    for step in range(STEPS):
        for n, p in net.named_parameters():
            p.grad = grads_at(net, step, nan_at)[n]
        if step == nan_at:
            with pytest.warns(RuntimeWarning, match="skipped"):
                opt.step()
        else:
            opt.step()
    return opt, {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_an_owned_step_is_the_pure_update_bit_for_bit(case):
    """Bit for bit in float32; MultiSteps in float64 at 1e-12, as its own in-place accumulation
    rounds otherwise than its update whatever the inner rule (tests/functional/test_kernel_chains.py)."""
    nan_at = 4 if case.startswith("apply_if_finite") else None
    dtype = torch.float64 if case.startswith("MultiSteps") else torch.float32
    want = pure_run(CASES[case](), model(dtype), STEPS, nan_at, grads=grads_at)
    opt, got = owned_run(CASES[case](), model(dtype), nan_at)
    assert "writes its new state into the old one's tensors" in str(opt.path[0]), str(opt.path[0])
    for name in want:
        if dtype == torch.float64:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-14, msg=f"{case}: {name}")
        else:
            assert torch.equal(got[name], want[name]), f"{case}: {name} differs"
    moved = sum(float((got[n] - p).abs().sum()) for n, p in model(dtype).named_parameters())
    assert moved > 0.1, "the run moved the params"


def state_tensors(state):
    return [t for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor) and t.ndim]


def test_the_owned_step_writes_into_the_states_tensors_and_the_pure_update_never_does():
    """Leaves above `foreach_map`'s packing size (small ones are stepped in a packed copy, whose
    new state replaces theirs): every moment and factor statistic is the old tensor, written."""
    tx = shampoo(graft_type="rmsprop", block_size=128)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(130, 140, generator=gen), "v": torch.randn(20000, generator=gen)}
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
    state = tx.init(params)
    before = [t.clone() for t in state_tensors(state)]
    _, fresh = tx.update(grads, state, params)
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(state), before)), "update wrote its input state"
    owned = tx.inplace(params, grads, state)
    olds, news = state_tensors(state), state_tensors(owned)
    factors = sum(map(len, owned[0].statistics.values()))
    assert factors > 2 and len(olds) == len(news) == 6 + 2 * factors  # 3 moments a leaf, statistics and roots
    assert all(a is b for a, b in zip(olds, news))  # step 1 refreshes no root: they are kept too
    assert all(torch.equal(a, b) for a, b in zip(news, state_tensors(fresh)))
    moved = [not torch.equal(a, b) for a, b in zip(news, before)]
    assert sum(moved) == 6 + factors, "every moment and factor statistic was written"


def test_a_combinator_built_by_hand_keeps_the_state_it_passed():
    """A wrapper zero cannot see into (no ``owned``) gets the pure update: the state it kept is
    as it was, while the optimizer steps."""
    inner, kept = shampoo(graft_type="rmsprop"), []

    def update(updates, state, params=None):
        kept.append(state)
        return inner.update(updates, state, params)

    net = model()
    opt = F.Optimizer(net.named_parameters(), F.GradientTransformation(inner.init, update))
    for step in range(3):
        for n, p in net.named_parameters():
            p.grad = grads_at(net, step, None)[n]
        opt.step()
    first = state_tensors(kept[0])
    assert all(not t.any() or torch.equal(t, torch.eye(t.shape[0]) * t[0, 0]) for t in first), \
        "the first state (zeros and scaled identities) was written"


def test_soaps_owned_step_writes_its_first_moments_into_their_tensors():
    """SOAP's matrices above the batching size step alone: their first moment is the old tensor,
    written (the first step only gathers the factors)."""
    tx = F.contrib.soap(0.05, weight_decay=0.01, precondition_frequency=3)
    gen = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(130, 140, generator=gen), "b": torch.randn(130, generator=gen)}
    state = tx.init(params)
    for step in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        want, _ = tx.update(grads, state, params)
        before = {n: m.clone() for n, m in state[0].exp_avg.items()}
        moved = {n: p.clone() for n, p in params.items()}
        new = tx.inplace(params, grads, state)
        for n in params:
            assert new[0].exp_avg[n] is state[0].exp_avg[n]
            assert step == 0 or not torch.equal(new[0].exp_avg[n], before[n])
            assert torch.equal(params[n], moved[n] + want[n])
        state = new


def test_a_state_loaded_into_another_optimizer_is_its_own_copy():
    """torch's habit: one optimizer's ``state_dict()`` (its live tensors) loaded into a second,
    built beforehand. The second's owned steps write into its own copy: the first optimizer's
    state, and so the dict, stay as they were, and both continue alike from there."""
    first, second = model(), model()
    opts = [F.Optimizer(net.named_parameters(), shampoo(graft_type="rmsprop")) for net in (first, second)]
    for step in range(3):
        for n, p in first.named_parameters():
            p.grad = grads_at(first, step, None)[n]
        opts[0].step()
    second.load_state_dict(first.state_dict())
    saved = opts[0].state_dict()
    opts[1].load_state_dict(saved)
    kept = [t.clone() for t in state_tensors(saved["state"])]
    for step in range(3, 6):
        for n, p in second.named_parameters():
            p.grad = grads_at(second, step, None)[n]
        opts[1].step()
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(saved["state"]), kept)), "the loaded dict was written"
    for step in range(3, 6):
        for n, p in first.named_parameters():
            p.grad = grads_at(first, step, None)[n]
        opts[0].step()
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
