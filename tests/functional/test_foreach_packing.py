"""The pure path's layout: small CPU leaves packed into one flat tensor (`zero.functional.foreach`),
and a constant scale folded into the link before it (`chain`).

Optax parity (tests/functional/test_functional_optax_parity.py) runs with packing on, since its trees'
leaves are small; here the same rules also run with packing off and on mixed trees.
"""

import numpy as np
import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zero.functional as F
from zero.functional import foreach as packing

pytest.importorskip("optax", reason="parity with Optax needs the zero[jax] extra")

import optax  # noqa: E402
from alias_cases import ALIASES, LR, build  # noqa: E402
from helpers import assert_trees_close  # noqa: E402
from optax_parity import run_both  # noqa: E402

# The rules whose update runs through foreach_map, plus a few that reach it through chains.
UNPACKED_CASES = {
    **{name: (lambda m, name=name: build(m, name)) for name in ALIASES},
    "sgd_nesterov": lambda m: m.sgd(LR, momentum=0.9, nesterov=True),
    "rmsprop_bias_correction": lambda m: m.rmsprop(LR, bias_correction=True, initial_scale=0.1, eps_in_sqrt=False),
    "stddev": lambda m: m.chain(m.scale_by_stddev(bias_correction=True, initial_scale=1.0), m.scale(-LR)),
    "rss": lambda m: m.chain(m.scale_by_rss(0.0), m.scale(-LR)),
    "ema": lambda m: m.chain(m.ema(0.9), m.scale(-LR)),
    "adamw_schedule": lambda m: m.adamw(LR, weight_decay=m.exponential_decay(0.1, 5, 0.5)),
    "amsgrad": lambda m: build(m, "amsgrad"),
    "amsgrad_eps_root": lambda m: m.chain(m.scale_by_amsgrad(eps_root=1e-8, bias_correction_mu=False), m.scale(-LR)),
}


@pytest.fixture(autouse=True)
def x64():
    """Optax in float64 here, whatever the test modules run before (Optax's own suite) left set."""
    import jax

    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture
def unpacked(monkeypatch):
    monkeypatch.setattr(packing, "PACK_NUMEL", 0)


@pytest.mark.parametrize("name", sorted(UNPACKED_CASES))
def test_unpacked_lists_match_optax(name, unpacked):
    """Each leaf its own tensor in the foreach lists: the layout big leaves and accelerators get."""
    make = UNPACKED_CASES[name]
    for step, tp, jp in run_both(make(F), make(optax), steps=25, dtype=np.float64):
        assert_trees_close(tp, jp, rtol=1e-6 if name == "adamw_schedule" else 1e-9, atol=1e-12, what=f"{name} {step}")


BIG = packing.PACK_NUMEL + 5  # a leaf too big to pack


def _mixed_tree(seed=0):
    """Small leaves of several shapes (0-d, 2-d), one leaf too big to pack, float64."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3,), (2, 5), (), (7,), (BIG,), (4, 1, 2), (1,)]
    return {f"p{i}": torch.randn(shape, generator=gen, dtype=torch.float64) for i, shape in enumerate(shapes)}


def _run(tx, steps=6):
    params, state, outs = _mixed_tree(0), None, []
    state = tx.init(params)
    for step in range(steps):
        grads = _mixed_tree(step + 1)
        updates, state = tx.update(grads, state, params)
        params = F.apply_updates(params, updates)
        outs.append((updates, params, state))
    return outs


SAME_NUMBERS = {
    **{name: (lambda name=name: build(F, name)) for name in [*ALIASES, "amsgrad", "adabelief", "yogi"]},
    **{f"from_torch({cls.__name__})": (lambda cls=cls, kw=kw: F.from_torch(cls, **kw)) for cls, kw in [
        (torch.optim.NAdam, {"lr": LR}), (torch.optim.RAdam, {"lr": LR, "decoupled_weight_decay": True,
                                                            "weight_decay": 0.1}),
        (torch.optim.Rprop, {"lr": LR}), (torch.optim.Adagrad, {"lr": LR}), (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.SGD, {"lr": LR, "momentum": 0.9, "dampening": 0.1})]},
}


@pytest.mark.parametrize("name", sorted(SAME_NUMBERS))
def test_packed_and_unpacked_give_the_same_numbers(name, monkeypatch):
    packed = _run(SAME_NUMBERS[name]())
    monkeypatch.setattr(packing, "PACK_NUMEL", 0)
    unpacked = _run(SAME_NUMBERS[name]())
    for a, b in zip(packed, unpacked):
        for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
            assert x.shape == y.shape and x.dtype == y.dtype
            torch.testing.assert_close(x, y, rtol=1e-13, atol=0)


def test_outputs_are_views_of_one_buffer_and_pack_back_without_a_copy():
    tx = F.adam(LR)
    params = {f"p{i}": torch.randn(5 + i, dtype=torch.float64) for i in range(20)}
    state = tx.init(params)
    updates, state = tx.update(params, state, params)
    mu = state[0].mu
    bases = {t.untyped_storage().data_ptr() for t in optree.tree_leaves(mu)}
    assert len(bases) == 1, "the small leaves of one output share one buffer"
    lists = [optree.tree_leaves(mu)]
    layout = packing._Packing.of(lists[0])
    flat = layout.pack(lists)[0][0]
    assert flat.data_ptr() == lists[0][0].data_ptr() and flat.numel() == sum(t.numel() for t in lists[0])


def test_the_update_leaves_its_inputs_alone():
    """Zero-copy packing views the inputs; a rule must never write to them."""
    tx = F.chain(F.add_decayed_weights(0.1), F.sgd(LR, momentum=0.9, nesterov=True))
    params = {f"p{i}": torch.randn(4, dtype=torch.float64) for i in range(10)}
    state = tx.init(params)
    for _ in range(3):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        before = [t.clone() for t in optree.tree_leaves((grads, state, params))]
        updates, new_state = tx.update(grads, state, params)
        for a, b in zip(optree.tree_leaves((grads, state, params)), before):
            assert torch.equal(a, b)
        params, state = F.apply_updates(params, updates), new_state


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(tx, leaves):
    params = [torch.randn(8) for _ in range(leaves)]
    state = tx.init(params)
    updates, state = tx.update(params, state, params)  # packs the state into one buffer
    with _CountOps() as count:
        updates, state = tx.update(params, state, params)
        F.apply_updates(params, updates)
    return count.calls


@pytest.mark.parametrize("name", ["adam", "sgd", "rmsprop", "adagrad"])
def test_small_leaves_cost_a_fixed_number_of_ops(name):
    """Packed, an update dispatches the same ops for 10 leaves as for 200; unpacked, it grows."""
    assert _ops_per_step(build(F, name), 10) == _ops_per_step(build(F, name), 200)


def test_unpacked_ops_grow_with_the_leaves(unpacked):
    assert _ops_per_step(F.adam(LR), 200) > 10 * _ops_per_step(F.adam(LR), 10) / 2


@pytest.mark.parametrize("make", [lambda: F.adam(LR, eps_root=1e-8), lambda: F.adam(LR, nesterov=True),
                                  lambda: F.rmsprop(LR, centered=True, momentum=0.9), lambda: F.adagrad(LR),
                                  lambda: F.rmsprop(LR, eps_in_sqrt=False), lambda: F.adamw(LR),
                                  lambda: F.adamax(LR), lambda: F.amsgrad(LR, eps_root=1e-8),
                                  lambda: F.radam(LR, threshold=4.0)])
def test_an_update_can_be_differentiated(make):
    """Meta-learning differentiates through updates (Optax's eps_root): the rules' in-place
    passes touch only results that autograd has not kept, and such leaves are not packed."""
    params = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    grads = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    tx = make()
    updates, state = tx.update(grads, tx.init(params), params)
    updates, _ = tx.update(grads, state, params)  # a second step: moments that depend on grads
    total = sum((u * u).sum() for u in updates)
    derivatives = torch.autograd.grad(total, grads)
    assert all(torch.isfinite(d).all() and d.abs().sum() > 0 for d in derivatives)


def test_a_mixed_dtype_tree_is_not_packed():
    tree = [torch.ones(3), torch.ones(3, dtype=torch.float64), torch.ones(2)]
    assert packing._Packing.of(tree).pack([tree]) is None
    out = packing.foreach_map(lambda xs: torch._foreach_mul(xs, 2.0), tree)
    assert [t.dtype for t in out] == [t.dtype for t in tree] and all(torch.equal(o, 2 * t) for o, t in zip(out, tree))


def test_a_link_scaled_by_the_next_link_runs_as_one_update():
    """chain folds a constant scale into the link before it: same numbers, one pass fewer."""

    def unfolded(factor):  # the same scale without a spec: chain cannot fold it
        return F.GradientTransformation(F.scale(factor).init, F.scale(factor).update)

    params = [torch.randn(16, dtype=torch.float64) for _ in range(3)]
    for core in (F.scale_by_adam(), F.scale_by_adam(nesterov=True), F.trace(0.9), F.trace(0.9, nesterov=True),
                 F.scale_by_rms(), F.scale_by_stddev(), F.scale_by_rss(), F.add_decayed_weights(0.1)):
        folded_tx, plain_tx = F.chain(core, F.scale(-0.01)), F.chain(core, unfolded(-0.01))
        s1, s2 = folded_tx.init(params), plain_tx.init(params)
        for _ in range(5):
            grads = [torch.randn(16, dtype=torch.float64) for _ in range(3)]
            u1, s1 = folded_tx.update(grads, s1, params)
            u2, s2 = plain_tx.update(grads, s2, params)
            for a, b in zip(u1, u2):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=0)  # the factor folds into other roundings
        with _CountOps() as folded, torch.no_grad():
            folded_tx.update(grads, s1, params)
        with _CountOps() as plain, torch.no_grad():
            plain_tx.update(grads, s2, params)
        assert folded.calls < plain.calls, core


def test_only_constant_nonzero_scales_fold():
    from zero.functional.combine import _folded

    adam = F.scale_by_adam()
    steps, factors = _folded([adam, F.scale(-0.1)])
    assert steps[1] is None and steps[0] is not adam.update and factors == [-0.1, 1.0]
    assert _folded([adam, F.scale_by_learning_rate(0.1)])[0][1] is None
    for unfoldable in (F.scale(0.0), F.scale_by_learning_rate(lambda c: 0.1), F.scale(torch.tensor(0.5))):
        steps, factors = _folded([adam, unfoldable])
        assert steps == [adam.update, unfoldable.update] and factors == [1.0, 1.0]
    zeros, _ = F.chain(adam, F.scale(0.0)).update([torch.ones(2)], F.chain(adam, F.scale(0.0)).init([torch.ones(2)]))
    assert torch.equal(zeros[0], torch.zeros(2))


def test_leaves_that_are_neighbours_in_memory_but_strided_are_copied():
    """Transposed views lie back to back in their buffer, in another element order: packed by a
    copy, each comes back with its own values in its own shape."""
    buf = torch.arange(12.0)
    leaves = [buf[:6].view(2, 3).t(), buf[6:].view(2, 3).t()]
    out = packing.foreach_map(lambda xs: torch._foreach_mul(xs, 2.0), leaves)
    assert all(torch.equal(o, 2 * t) for o, t in zip(out, leaves))
