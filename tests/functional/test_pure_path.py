"""The pure path under torch.func and torch.compile, as Optax's under jax.grad, vmap and jit.

- Hypergradients: ``torch.func.grad`` of the loss after a few steps, with respect to the
  hyperparameters (plain tensors, or through ``inject_hyperparams``) and the initial params,
  against ``jax.grad`` of the same Optax program in float64.
- ``torch.func.vmap`` over learning rates (a sweep) and over stacked params (an ensemble) against
  the loop, and ``jacrev`` with respect to the gradients.
- ``torch.compile(tx.update, fullgraph=True)``: one compilation for 20 steps, equal to eager.
"""

import inspect

import numpy as np
import optree
import pytest
import torch

pytest.importorskip("optax", reason="parity with Optax needs the zero[jax] extra")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from alias_cases import ALIASES, MORE_ALIASES  # noqa: E402
from optax_parity import random_tree, to_jax, to_torch  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

import zero.functional as F  # noqa: E402

# L-BFGS steps eagerly only: its memory slot and inner products steer Python (the same rule on the
# pure path, eager, is tested against Optax in test_optax_catalogue); traced, it says so
# (test_lbfgs_refuses_tracing_by_name below).
EAGER_ONLY = {"lbfgs"}
CASES = {name: kw for name, kw in (ALIASES | MORE_ALIASES).items() if name not in EAGER_ONLY}
STEPS = 4
RNG = np.random.default_rng(0)
P0, CURVE, TILT = (random_tree(RNG, np.float64) for _ in range(3))
CURVE = optree.tree_map(lambda c: np.abs(c) + 0.5, CURVE)


def loss(p, module):
    """A separable quadratic of the params, for torch (``module`` torch) or JAX (``jnp``)."""
    leaves = optree.tree_leaves(p) if module is torch else jax.tree.leaves(p)
    convert = to_torch if module is torch else to_jax
    curve, tilt = (optree.tree_leaves(convert(t)) for t in (CURVE, TILT))
    return sum((0.5 * c * x**2 + t * x).sum() for x, c, t in zip(leaves, curve, tilt))


def unrolled(tx, p, module):
    """The loss after `STEPS` steps of ``tx`` from ``p`` (torch or JAX)."""
    grad, apply = (torch.func.grad, F.apply_updates) if module is torch else (jax.grad, optax.apply_updates)
    state = tx.init(p)
    for _ in range(STEPS):
        updates, state = tx.update(grad(lambda q: loss(q, module))(p), state, p)
        p = apply(p, updates)
    return loss(p, module)


def floats(name, *, every=False):
    """The float arguments of alias ``name``: the case's, or ``every`` one Optax's signature has."""
    case = CASES[name]
    if not every:
        return {k: v for k, v in case.items() if isinstance(v, float)}
    params = inspect.signature(getattr(optax, name)).parameters.items()
    return {k: case.get(k, p.default) for k, p in params if isinstance(case.get(k, p.default), float)}


def exact(name, module):
    """Arguments that keep Optax in float64: its Adafactor keeps momentum in float32 by default,
    which rounds the gradient flowing back through it (both sides then agree only to ~1e-8)."""
    return {"dtype_momentum": torch.float64 if module is F else jnp.float64} if name == "adafactor" else {}


def hypergradients(name, hp, inject):
    """d loss / d (hyperparameters, initial params) after `STEPS` steps, from torch and from JAX."""
    def torch_loss(h, p):
        factory = getattr(F, name)
        tx = (F.inject_hyperparams(factory) if inject else factory)(**CASES[name] | exact(name, F) | h)
        return unrolled(tx, p, torch)

    def jax_loss(h, p):
        factory = getattr(optax, name)
        tx = (optax.inject_hyperparams(factory) if inject else factory)(**CASES[name] | exact(name, optax) | h)
        return unrolled(tx, p, jnp)

    ours = torch.func.grad(torch_loss, argnums=(0, 1))({k: torch.tensor(v, dtype=torch.float64) for k, v in hp.items()},
                                                     to_torch(P0))
    theirs = jax.grad(jax_loss, argnums=(0, 1))({k: jnp.float64(v) for k, v in hp.items()}, to_jax(P0))
    return ours, theirs


def assert_leaves_close(ours, theirs, rtol, names):
    """Each leaf within ``rtol`` of its twin, relative to the twin's largest magnitude."""
    pairs = zip(optree.tree_leaves(ours), jax.tree.leaves(theirs), names)
    for a, b, name in pairs:
        b = np.asarray(b)
        err = np.abs(a.detach().numpy() - b).max() / max(np.abs(b).max(), 1e-300)
        assert err <= rtol, f"{name}: {a} vs {b} (rel {err:.1e})"


def _names(hp):
    return [f"d/d{k}" for k in sorted(hp)] + [f"d/dparam{i}" for i in range(len(optree.tree_leaves(P0)))]


# radam: JAX's gradient is NaN (its rectifier's root of a negative number, in the branch not
# taken); ours is finite and is checked against finite differences below.
JAX_NAN = {"radam"}


@pytest.mark.parametrize("name", sorted(set(CASES) - JAX_NAN))
def test_hypergradients_equal_jax_grad(name):
    hp = floats(name)
    (ours_hp, ours_p), (theirs_hp, theirs_p) = hypergradients(name, hp, inject=False)
    assert_leaves_close((ours_hp, ours_p), (theirs_hp, theirs_p), 1e-9, _names(hp))


# adafactor: optax.inject_hyperparams(optax.adafactor) fails in Optax itself (it hashes a traced
# hyperparameter); ours is covered by the test above and by the vmap and compile tests.
@pytest.mark.parametrize("name", sorted(set(CASES) - JAX_NAN - {"adafactor"}))
def test_inject_hyperparams_hypergradients_equal_jax_grad(name):
    """Every float hyperparameter Optax's signature has (b1, b2, eps, eps_root ...) at once."""
    hp = floats(name, every=True)
    (ours_hp, ours_p), (theirs_hp, theirs_p) = hypergradients(name, hp, inject=True)
    assert_leaves_close((ours_hp, ours_p), (theirs_hp, theirs_p), 1e-9, _names(hp))


def test_radam_hypergradient_equals_finite_differences():
    def at(lr):
        return unrolled(F.radam(**CASES["radam"] | {"learning_rate": lr}), to_torch(P0), torch)

    lr, h = torch.tensor(CASES["radam"]["learning_rate"], dtype=torch.float64), 1e-6
    ours = torch.func.grad(at)(lr)
    assert torch.isfinite(ours)
    assert torch.allclose(ours, (at(lr + h) - at(lr - h)) / (2 * h), rtol=1e-6)


CHAINS = {
    "clip_adam": lambda m, lr: m.chain(m.clip_by_global_norm(1.0), m.adam(lr)),
    "readme": lambda m, lr: m.chain(m.clip_by_global_norm(1.0), m.adamw(
        m.warmup_cosine_decay_schedule(0.0, lr, 2, 10), weight_decay=0.1,
        mask=lambda t: optree.tree_map(lambda x: x.ndim > 1, t))),
    "masked": lambda m, lr: m.masked(m.adam(lr), {"w": True, "b": False, "nested": [True, False], "scalar": False}),
    # a schedule of float64 maths: Optax's own schedules give float32 values under inject_hyperparams
    "inject_schedule": lambda m, lr: m.inject_hyperparams(m.adamw)(
        learning_rate=lambda count: 1e-3 + 3e-3 * (count.to(torch.float64) if m is F else count.astype(jnp.float64)),
        weight_decay=lr),
    "multisteps": lambda m, lr: m.MultiSteps(m.adam(lr), every_k_schedule=2).gradient_transformation(),
    "apply_if_finite": lambda m, lr: m.apply_if_finite(m.sgd(lr, momentum=0.9), 2),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_chain_hypergradients_equal_jax_grad(name):
    def torch_loss(lr):
        return unrolled(CHAINS[name](F, lr), to_torch(P0), torch)

    def jax_loss(lr):
        return unrolled(CHAINS[name](optax, lr), to_jax(P0), jnp)

    ours = torch.func.grad(torch_loss)(torch.tensor(0.05, dtype=torch.float64))
    theirs = jax.grad(jax_loss)(jnp.float64(0.05))
    assert_leaves_close(ours, theirs, 1e-9, ["d/dlr"])


@pytest.mark.parametrize("name", ["adam", "sgd", "rmsprop", "lion", "adafactor"])
def test_jacobian_with_respect_to_the_gradients_equals_jax(name):
    """d(third update of w) / d(third gradient), after two steps (a first Adam step is nearly
    sign(g), whose Jacobian is rounding noise)."""
    p = random_tree(np.random.default_rng(1), np.float64)
    g1, g2, g = (random_tree(np.random.default_rng(seed), np.float64) for seed in (2, 3, 4))
    tx, otx = getattr(F, name)(**CASES[name]), getattr(optax, name)(**CASES[name])
    state, ostate = tx.init(to_torch(p)), otx.init(to_jax(p))
    for earlier in (g1, g2):
        state, ostate = tx.update(to_torch(earlier), state, to_torch(p))[1], otx.update(to_jax(earlier), ostate,
                                                                                       to_jax(p))[1]
    ours = torch.func.jacrev(lambda g: tx.update(g, state, to_torch(p))[0]["w"])(to_torch(g))
    theirs = jax.jacrev(lambda g: otx.update(g, ostate, to_jax(p))[0]["w"])(to_jax(g))
    assert_leaves_close(ours, theirs, 1e-9, [f"dw/d{k}" for k in ("b", "nested0", "nested1", "scalar", "w")])


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_vmapped_learning_rate_sweep_equals_the_loop(name):
    def final(lr):
        return unrolled(getattr(F, name)(**CASES[name] | {"learning_rate": lr}), to_torch(P0), torch)

    lrs = CASES[name]["learning_rate"] * torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    swept = torch.func.vmap(final)(lrs)
    looped = torch.stack([final(lr) for lr in lrs])
    torch.testing.assert_close(swept, looped, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_vmapped_ensemble_equals_the_loop(name):
    """Three members' params stacked on a new first axis, each stepped by its own state."""
    tx = getattr(F, name)(**CASES[name])
    members = [to_torch(random_tree(np.random.default_rng(seed), np.float64)) for seed in range(3)]
    grads = [[to_torch(random_tree(np.random.default_rng(10 * s + m), np.float64)) for m in range(3)]
             for s in range(STEPS)]
    stack = lambda trees: optree.tree_map(lambda *xs: torch.stack(xs), *trees)  # noqa: E731
    params, states = stack(members), torch.func.vmap(tx.init)(stack(members))
    looped, loop_states = list(members), [tx.init(p) for p in members]
    step = torch.func.vmap(tx.update)
    for s in range(STEPS):
        updates, states = step(stack(grads[s]), states, params)
        params = F.apply_updates(params, updates)
        for m in range(3):
            u, loop_states[m] = tx.update(grads[s][m], loop_states[m], looped[m])
            looped[m] = F.apply_updates(looped[m], u)
    torch.testing.assert_close(params, stack(looped), rtol=1e-12, atol=0)


def compiled_against_eager(tx, steps=20, backend="aot_eager"):
    """``steps`` float32 steps of ``tx.update`` compiled (fullgraph) and eager from the same
    params and gradients: (worst relative difference of the params, compilations)."""
    rng = np.random.default_rng(0)
    params = to_torch(random_tree(rng, np.float32))
    counter = CompileCounterWithBackend(backend)
    update = torch.compile(tx.update, fullgraph=True, backend=counter)
    (p1, s1), (p2, s2) = (params, tx.init(params)), (params, tx.init(params))
    for _ in range(steps):
        grads = to_torch(random_tree(rng, np.float32))
        u1, s1 = tx.update(grads, s1, p1)
        u2, s2 = update(grads, s2, p2)
        p1, p2 = F.apply_updates(p1, u1), F.apply_updates(p2, u2)
    worst = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(optree.tree_leaves(p1),
                                                                             optree.tree_leaves(p2)))
    return worst, counter.frame_count


@pytest.fixture(autouse=True, scope="module")
def _x64():
    """JAX in float64 for every test here, whatever a module run before set (Optax's own test
    modules, run earlier in the suite, turn it off)."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test counts its own compilations
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_alias_compiles_once_and_equals_eager(name):
    """``aot_eager``: dynamo's graph and AOT autograd's, without inductor's C++ build (minutes
    for the matrix on 2 cores); inductor runs the README chain below and in bench/chain_bench.py."""
    worst, compilations = compiled_against_eager(getattr(F, name)(**CASES[name]))
    assert compilations == 1
    assert worst <= 1e-6


COMPILED_CHAINS = {
    "clip": lambda: F.chain(F.clip(0.5), F.sgd(0.1, momentum=0.9)),
    "masked": lambda: F.masked(F.adam(1e-2), {"w": True, "b": False, "nested": [True, False], "scalar": False}),
    "partition": lambda: F.partition({"a": F.adam(1e-2), "s": F.sgd(0.1)},
                                     {"w": "a", "b": "s", "nested": ["a", "s"], "scalar": "s"}),
    "inject_schedule": lambda: F.inject_hyperparams(F.adam)(
        learning_rate=F.warmup_cosine_decay_schedule(0, 1e-2, 5, 20)),
    "inject_constant": lambda: F.inject_hyperparams(F.adamw)(learning_rate=1e-2, weight_decay=0.1),
    "exponential_staircase": lambda: F.sgd(F.exponential_decay(1e-2, 5, 0.5, staircase=True)),
    "piecewise_constant": lambda: F.sgd(F.piecewise_constant_schedule(1e-2, {5: 0.5, 10: 0.1})),
    "onecycle": lambda: F.adam(F.cosine_onecycle_schedule(20, 1e-2)),
    "multisteps": lambda: F.MultiSteps(F.adam(1e-2), every_k_schedule=3).gradient_transformation(),
    "apply_if_finite": lambda: F.apply_if_finite(F.adam(1e-2), 3),
}


@pytest.mark.parametrize("name", sorted(COMPILED_CHAINS))
def test_common_chains_compile_once_and_equal_eager(name):
    worst, compilations = compiled_against_eager(COMPILED_CHAINS[name]())
    assert compilations == 1
    assert worst <= 1e-6


def test_the_readme_chain_compiles_once_with_inductor_and_equals_eager():
    schedule = F.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 100)
    tx = F.chain(F.clip_by_global_norm(1.0), F.adamw(schedule, weight_decay=0.1,
                                                     mask=lambda t: {k: k != "b" for k in t}))
    worst, compilations = compiled_against_eager(tx, backend="inductor")
    assert compilations == 1
    assert worst <= 1e-6


def test_apply_if_finite_compiled_skips_and_gives_up_as_eager():
    """NaN gradients at steps 2-4 with at most 1 skipped in a row: step 2 is skipped, step 3 is
    applied (two in a row), step 4 skipped again; the compiled update follows eager throughout."""
    tx = F.apply_if_finite(F.sgd(0.1, momentum=0.9), 1)
    counter = CompileCounterWithBackend("aot_eager")
    update = torch.compile(tx.update, fullgraph=True, backend=counter)
    rng = np.random.default_rng(0)
    params = to_torch(random_tree(rng, np.float32))
    eager, compiled = (params, tx.init(params)), (params, tx.init(params))
    for step in range(6):
        grads = to_torch(random_tree(rng, np.float32))
        if step in (2, 3, 4):
            grads["b"][0] = float("nan")
        u1, s1 = tx.update(grads, eager[1], eager[0])
        u2, s2 = update(grads, compiled[1], compiled[0])
        eager, compiled = (F.apply_updates(eager[0], u1), s1), (F.apply_updates(compiled[0], u2), s2)
        torch.testing.assert_close(compiled, eager, equal_nan=True, rtol=1e-6, atol=0)
    assert int(eager[1].total_notfinite) == 3 and counter.frame_count == 1


def test_a_count_saturates_at_the_int32_maximum_in_tensor_maths():
    from zero.functional.base import count_inc

    top = torch.tensor(2**31 - 1, dtype=torch.int32)
    assert count_inc(top) == top and count_inc(top - 1) == top and count_inc(top).dtype == torch.int32


def test_a_compiled_optimizer_step_runs_eagerly_and_equals_the_step():
    """``torch.compile(opt.step)`` does not compile `zero.functional.Optimizer`'s step (its fused
    kernels run as they are; compile ``tx.update`` for a compiled pure step), and steps as eager."""
    def train(compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        tx = F.chain(F.clip_by_global_norm(1.0), F.adamw(F.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 30),
                                                         mask=lambda t: {k: not k.endswith("bias") for k in t}))
        opt = F.Optimizer(model.named_parameters(), tx)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(16, 2)
        for _ in range(10):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            step()
        return [p.detach() for p in model.parameters()]

    torch.testing.assert_close(train(compiled=True), train(compiled=False), rtol=0, atol=0)


def test_muon_hypergradient_equals_jax_grad_and_compiles_once():
    """`contrib.muon` (Newton-Schulz on the matrices, Adam on the rest) as every alias above."""
    def torch_loss(lr):
        return unrolled(F.contrib.muon(lr), to_torch(P0), torch)

    def jax_loss(lr):
        return unrolled(optax.contrib.muon(lr), to_jax(P0), jnp)

    ours = torch.func.grad(torch_loss)(torch.tensor(0.02, dtype=torch.float64))
    theirs = jax.grad(jax_loss)(jnp.float64(0.02))
    assert_leaves_close(ours, theirs, 1e-9, ["d/dlr"])
    worst, compilations = compiled_against_eager(F.contrib.muon(0.02))
    assert compilations == 1 and worst <= 1e-6


def test_lbfgs_refuses_tracing_by_name():
    tx = F.lbfgs(**MORE_ALIASES["lbfgs"])
    params = {"x": torch.ones(3, dtype=torch.float64)}
    state = tx.init(params)
    with pytest.raises(RuntimeError, match="scale_by_lbfgs steps eagerly"):
        torch.func.grad(lambda p: sum(u.sum() for u in tx.update({"x": p["x"] * 2}, state, p)[0].values()))(params)
