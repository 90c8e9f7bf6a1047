"""The Optax names #66 brings (``optax.contrib``'s and ``optax``'s), each against Optax itself
over 30 steps of random gradients, in float64 (to float64 rounding) and float32, with Optax's
state layout (its NamedTuples' names and fields, so Optax's state-reading code reads zero's)."""

import numpy as np
import optree
import pytest

pytest.importorskip("optax", reason="parity with Optax needs the zero[jax] extra")

import optax  # noqa: E402
from helpers import assert_trees_close  # noqa: E402
from optax_parity import random_tree, run_both, to_jax, to_torch, x64  # noqa: E402, F401 (x64: a module fixture)

import zero.functional as F  # noqa: E402

LR = 1e-2


def _c(m):
    return m.contrib


def _tree_map(m):
    import jax

    return jax.tree.map if m is optax else optree.tree_map


def _galore_dims(m):
    """The 3-D leaf as (rows: axis 0, columns: axes 1 and 2), the matrix as default, the rest as they are."""
    dims = _c(m).GaLoreDimensionNumbers
    return lambda tree: _tree_map(m)(lambda p: dims(0, (1, 2)) if p.ndim == 3 else dims() if p.ndim == 2 else None,
                                     tree)


def _norm(m):
    return F.global_norm if m is F else optax.tree.norm


# name -> (zero or optax module -> the transformation); Optax's float32 schedules: ``SCHEDULED``
CASES = {
    "adopt": lambda m: _c(m).adopt(LR),
    "adopt_nesterov_unclipped": lambda m: _c(m).adopt(LR, nesterov=True, use_clipping=False),
    "ademamix": lambda m: _c(m).ademamix(LR, weight_decay=0.01),
    "ademamix_schedules": lambda m: _c(m).ademamix(LR, b3=m.linear_schedule(0.9, 0.999, 10),
                                                   alpha=m.linear_schedule(0.0, 5.0, 10)),
    "simplified_ademamix": lambda m: _c(m).simplified_ademamix(LR, alpha=2.0, weight_decay=0.01),
    "schedule_free_adamw": lambda m: _c(m).schedule_free_adamw(LR, warmup_steps=5, weight_decay=0.01),
    "schedule_free_sgd": lambda m: _c(m).schedule_free_sgd(LR, weight_decay=0.01),
    "schedule_free_adam_base": lambda m: _c(m).schedule_free(m.adam(LR, b1=0.0), LR, b1=0.8),
    "prodigy": lambda m: _c(m).prodigy(),
    "prodigy_safeguarded": lambda m: _c(m).prodigy(0.5, weight_decay=0.01, safeguard_warmup=True, beta3=0.9),
    "dog": lambda m: _c(m).dog(),
    "dog_distance_decay": lambda m: _c(m).dog(0.5, init_step=("distance", 0.1), weight_decay=0.01),
    "dog_learning_rate": lambda m: _c(m).dog(init_step=("learning_rate", 1e-3)),
    "dowg": lambda m: _c(m).dowg(weight_decay=0.01),
    "madgrad": lambda m: _c(m).madgrad(LR, weight_decay=0.01),
    "madgrad_schedule": lambda m: _c(m).madgrad(m.linear_schedule(0.02, 0.005, 10), momentum=0.5),
    "cocob": lambda m: _c(m).cocob(weight_decay=0.01),
    "acprop": lambda m: _c(m).acprop(LR, weight_decay=0.01),
    "dadapt_adamw": lambda m: _c(m).dadapt_adamw(0.5, weight_decay=0.01),
    "mechanize_sgd": lambda m: _c(m).mechanize(m.sgd(0.1)),
    "mechanize_adam": lambda m: _c(m).mechanize(m.adam(0.1), weight_decay=0.0, num_betas=3),
    "sam_transparent": lambda m: _c(m).sam(m.adam(LR), m.chain(_c(m).normalize(), m.sgd(0.05)), sync_period=3),
    "sam_keep_adv_state": lambda m: _c(m).sam(m.sgd(LR, momentum=0.9), m.chain(_c(m).normalize(), m.adam(0.05)),
                                              reset_state=False),
    "galore": lambda m: _c(m).galore(LR, rank=2, update_proj_gap=3, weight_decay=0.01),
    "galore_sgd_3d": lambda m: _c(m).galore(LR, rank=2, base_optimizer=m.sgd(1.0, momentum=0.9),
                                            weight_dimension_numbers=_galore_dims(m)),
    "sophia_gauss_newton": lambda m: _c(m).sophia(LR, update_interval=2, hessian_diagonal_fn=m.stateless(
        lambda u, p: _tree_map(m)(lambda g: g * g, u))),
    "freeze": lambda m: m.chain(m.freeze(MASK), m.sgd(LR)),
    "selective_transform": lambda m: m.selective_transform(m.adam(LR), freeze_mask=MASK),
    "keep_params_nonnegative": lambda m: m.chain(m.sgd(0.3), m.keep_params_nonnegative()),
    "normalize_by_update_norm": lambda m: m.chain(m.normalize_by_update_norm(2.0), m.sgd(LR)),
    "scale_by_param_block_norm": lambda m: m.chain(m.scale_by_param_block_norm(0.5), m.scale(-LR)),
    "scale_by_distance_over_gradients": lambda m: m.chain(m.scale_by_distance_over_gradients(reps_rel=1e-2),
                                                          m.scale(-1.0)),
    "flatten": lambda m: m.flatten(m.adam(LR)),
    "monitor": lambda m: m.chain(m.monitor({"norm": _norm(m), "ema": m.measure_with_ema(_norm(m), 0.9)}), m.sgd(LR)),
    "snapshot": lambda m: m.chain(m.snapshot("norm", _norm(m)), m.sgd(LR)),
}
# Optax evaluates schedules in float32, and MADGRAD's weight (lr + eps) sqrt(count + 1) too (jnp.sqrt of its
# int32 count is float32): in float64 these agree to float32's rounding; zero keeps the weight in float64
SCHEDULED = {"ademamix_schedules", "schedule_free_adamw", "madgrad_schedule", "madgrad",
             # GaLore's SVD runs in float32 on both sides (LAPACK's and XLA's differ in float32's last places)
             "galore", "galore_sgd_3d"}
# frozen where True: the matrix and the deeper nested leaf
MASK = {"w": True, "b": False, "nested": [False, True], "scalar": False}
# scale_by_distance_over_gradients: Optax keeps each param's gradient sum as shape (1,), which turns a 0-d
# param's update into shape (1,); zero keeps it 0-d (the same numbers): the harness's scalar is compared as numbers


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_optax(name, dtype):
    rtol, atol = (1e-9, 1e-12) if dtype == np.float64 else (1e-4, 1e-6)
    if name in SCHEDULED and dtype == np.float64:  # Optax evaluates schedules in float32
        rtol, atol = 1e-6, 1e-7
    for step, tp, jp in run_both(CASES[name](F), CASES[name](optax), steps=30, dtype=dtype):
        assert_trees_close(tp, jp, rtol=rtol, atol=atol, what=f"{name} step {step}")


VALUED = {  # rules that read the loss: the harness's loss is the params' squared norm
    "reduce_on_plateau": lambda m: m.chain(m.adam(LR), _c(m).reduce_on_plateau(0.5, patience=2, cooldown=1,
                                                                                 accumulation_size=2, rtol=0.2)),
    "momo": lambda m: _c(m).momo(0.5, weight_decay=0.01),
    "momo_adaptive": lambda m: _c(m).momo(0.5, lower_bound=-1.0, adapt_lower_bound=True),
    "momo_adam": lambda m: _c(m).momo_adam(weight_decay=0.01),
    "momo_adam_adaptive": lambda m: _c(m).momo_adam(lower_bound=-1.0, adapt_lower_bound=True),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", sorted(VALUED))
def test_rules_reading_the_loss_match_optax(name, dtype):
    import jax
    import torch

    rtol, atol = (1e-9, 1e-12) if dtype == np.float64 else (1e-4, 1e-6)
    rng = np.random.default_rng(3)
    params = random_tree(rng, dtype)
    tx, otx = VALUED[name](F), VALUED[name](optax)
    tp, jp = to_torch(params), to_jax(params)
    ts, js = tx.init(tp), otx.init(jp)
    for step in range(25):
        grads = random_tree(rng, dtype)
        loss = sum(float((x.astype(np.float64) ** 2).sum()) for x in optree.tree_leaves(
            optree.tree_map(np.asarray, optree.tree_map(lambda t: t.numpy(), tp))))
        tu, ts = tx.update(to_torch(grads), ts, tp, value=torch.tensor(loss, dtype=torch.float64))
        ju, js = otx.update(to_jax(grads), js, jp, value=jax.numpy.asarray(loss))
        tp, jp = F.apply_updates(tp, tu), optax.apply_updates(jp, ju)
        assert_trees_close(tp, jp, rtol=rtol, atol=atol, what=f"{name} step {step}")


def _layout(state):
    nodes = optree.tree_flatten(state, is_leaf=lambda x: hasattr(x, "_fields"))[0]
    return [(type(n).__name__, n._fields) for n in nodes if hasattr(n, "_fields")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_layout_is_optaxs(name):
    params = random_tree(np.random.default_rng(0), np.float64)
    ours, theirs = CASES[name](F).init(to_torch(params)), CASES[name](optax).init(to_jax(params))
    assert _layout(ours) == _layout(theirs)


def test_monitor_and_snapshot_measure_as_optax_and_the_optimizer_reads_them():
    """The measurements in the state equal Optax's each step, and ``Optimizer.measurements()``
    reads them by name."""
    import torch

    rng = np.random.default_rng(1)
    params = random_tree(rng, np.float64)
    make = lambda m: m.chain(m.monitor({"norm": _norm(m), "ema": m.measure_with_ema(_norm(m), 0.9)}),  # noqa: E731
                             m.snapshot("last", _norm(m)), m.sgd(LR))
    tx, otx = make(F), make(optax)
    ts, js = tx.init(to_torch(params)), otx.init(to_jax(params))
    leaves = [torch.nn.Parameter(t) for t in optree.tree_leaves(to_torch(params))]
    opt = F.Optimizer(leaves, make(F))
    for _ in range(5):
        grads = random_tree(rng, np.float64)
        _, ts = tx.update(to_torch(grads), ts, to_torch(params))
        _, js = otx.update(to_jax(grads), js, to_jax(params))
        for p, g in zip(leaves, optree.tree_leaves(to_torch(grads))):
            p.grad = g
        opt.step()
        for name in ("norm", "ema"):
            np.testing.assert_allclose(float(ts[0].measurements[name]), float(js[0].measurements[name]), rtol=1e-12)
        np.testing.assert_allclose(float(ts[1].measurement["last"]), float(js[1].measurement["last"]), rtol=1e-12)
        got = opt.measurements()
        assert set(got) == {"norm", "ema", "last"}
        np.testing.assert_allclose(float(got["norm"]), float(js[0].measurements["norm"]), rtol=1e-12)


def test_per_example_layer_norm_clip_matches_optax():
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    grads = {"w": rng.standard_normal((6, 3, 2)), "b": rng.standard_normal((6, 4))}
    for uniform in (True, False):
        ours = F.per_example_layer_norm_clip(to_torch(grads), 1.5, uniform)
        theirs = optax.per_example_layer_norm_clip(optree.tree_map(jnp.asarray, grads), 1.5, uniform)
        assert_trees_close(ours[0], theirs[0], rtol=1e-12, what=f"sums, uniform={uniform}")
        assert_trees_close(ours[1], theirs[1], rtol=0, what=f"clipped counts, uniform={uniform}")
    with pytest.raises(ValueError, match="batch dimension"):
        F.per_example_layer_norm_clip({"s": to_torch(np.float64(1.0))}, 1.0)


@pytest.mark.parametrize("factor", [0.0, 0.25, 1.0])
def test_scale_gradient_scales_the_backward_as_optaxs(factor):
    import jax
    import torch

    x = np.array([1.0, -2.0, 3.0])
    tx = torch.tensor(x, requires_grad=True)
    (F.scale_gradient({"a": tx}, factor)["a"] ** 2 + tx).sum().backward()  # (+ x: a graph at factor 0 too)
    theirs = jax.grad(lambda v: (optax.scale_gradient({"a": v}, factor)["a"] ** 2 + v).sum())(jax.numpy.asarray(x))
    np.testing.assert_allclose(tx.grad.numpy(), np.asarray(theirs), rtol=1e-15)


def test_inject_stateful_hyperparams_warns_and_injects():
    with pytest.warns(DeprecationWarning, match="inject_hyperparams"):
        factory = F.inject_stateful_hyperparams(F.adam)
    tx = factory(learning_rate=0.1)
    import torch

    state = tx.init({"x": torch.zeros(2)})
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.1)


@pytest.mark.parametrize("reset_state", [False, True])
def test_lookahead_matches_optax(reset_state):
    """Over LookaheadParams (Optax's form): fast and slow params after 10 steps of random gradients."""
    rng = np.random.default_rng(4)
    params = random_tree(rng, np.float64)
    make = lambda m: m.lookahead(m.adam(0.1), sync_period=3, slow_step_size=0.4, reset_state=reset_state)  # noqa
    tx, otx = make(F), make(optax)
    tp, jp = F.LookaheadParams.init_synced(to_torch(params)), optax.LookaheadParams.init_synced(to_jax(params))
    ts, js = tx.init(tp), otx.init(jp)
    for step in range(10):
        grads = random_tree(rng, np.float64)
        tu, ts = tx.update(to_torch(grads), ts, tp)
        ju, js = otx.update(to_jax(grads), js, jp)
        tp, jp = F.apply_updates(tp, tu), optax.apply_updates(jp, ju)
        assert_trees_close(tuple(tp), tuple(jp), rtol=1e-12, atol=1e-14, what=f"step {step}")
    with pytest.raises(TypeError, match="LookaheadParams"):
        tx.update(to_torch(grads), ts, to_torch(params))


def test_sam_opaque_takes_its_adversarial_gradients_from_grad_fn():
    """Opaque SAM against Optax's, both asking a quadratic's gradient at the adversarial points."""
    import torch

    rng = np.random.default_rng(5)
    params = random_tree(rng, np.float64)
    make = lambda m: _c(m).sam(m.sgd(LR), m.chain(_c(m).normalize(), m.sgd(0.05)), sync_period=3,  # noqa: E731
                               opaque_mode=True)
    tx, otx = make(F), make(optax)
    tp, jp = to_torch(params), to_jax(params)
    ts, js = tx.init(tp), otx.init(jp)
    for step in range(6):
        grads = random_tree(rng, np.float64)
        tu, ts = tx.update(to_torch(grads), ts, tp, grad_fn=lambda p, i: optree.tree_map(lambda x: 2 * x, p))
        ju, js = otx.update(to_jax(grads), js, jp, grad_fn=lambda p, i: optree.tree_map(lambda x: 2 * x, p))
        tp, jp = F.apply_updates(tp, tu), optax.apply_updates(jp, ju)
        assert_trees_close(tp, jp, rtol=1e-12, atol=1e-14, what=f"step {step}")
    with pytest.raises(ValueError, match="grad_fn"):
        tx.update(to_torch(grads), ts, tp)
    assert isinstance(ts.steps_since_sync, torch.Tensor)


def test_dpsgd_without_noise_is_optaxs_and_its_noise_has_the_stated_spread():
    """Noise-free, DP-SGD equals Optax's on per-example gradients; with noise, the noise's spread is
    ``l2_norm_clip * noise_multiplier / batch`` (torch's generator, not JAX's keys: the law, not the
    draws); gradients shaped like the params are refused by name."""
    import torch

    rng = np.random.default_rng(6)
    params = {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2)}
    per_example = {k: rng.standard_normal((8,) + v.shape) for k, v in params.items()}
    tx = F.contrib.dpsgd(0.1, l2_norm_clip=0.5, noise_multiplier=0.0, seed=1, momentum=0.9)
    otx = optax.contrib.dpsgd(0.1, l2_norm_clip=0.5, noise_multiplier=0.0, seed=1, momentum=0.9)
    ts, js = tx.init(to_torch(params)), otx.init(to_jax(params))
    for step in range(3):
        tu, ts = tx.update(to_torch(per_example), ts, to_torch(params))
        ju, js = otx.update(to_jax(per_example), js, to_jax(params))
        assert_trees_close(tu, ju, rtol=1e-12, atol=1e-15, what=f"step {step}")
    big = {"w": torch.zeros(4, 20000, dtype=torch.float64)}
    noisy = F.contrib.differentially_private_aggregate(1.0, 2.0, key=3)
    out, state = noisy.update(big, noisy.init({"w": torch.zeros(20000)}), {"w": torch.zeros(20000)})
    assert abs(float(out["w"].std()) - 2.0 / 4) < 0.01 and int(state.rng_key) == 4
    with pytest.raises(ValueError, match="per-example"):
        noisy.update({"w": torch.zeros(20000)}, state, {"w": torch.zeros(20000)})


def test_linear_algebra_matches_optax_and_the_truth():
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(7)
    a = rng.standard_normal((6, 6))
    sym = a @ a.T + np.eye(6)
    eig, vec = F.power_iteration(torch.tensor(sym), num_iters=500, error_tolerance=1e-12)
    true = np.linalg.eigvalsh(sym)[-1]
    assert abs(float(eig) - true) <= 1e-9 * true
    np.testing.assert_allclose(np.abs(sym @ vec.numpy()), np.abs(true * vec.numpy()), rtol=1e-6)
    w, u = np.linalg.eigh(sym)
    for p in (1, 2, 4, 8):
        ours, err = F.matrix_inverse_pth_root(torch.tensor(sym), p, ridge_epsilon=0.0)
        theirs, _ = optax.matrix_inverse_pth_root(jnp.asarray(sym), p, ridge_epsilon=0.0)
        exact = (u * w ** (-1.0 / p)) @ u.T
        # both iterate in float32: each within float32's reach of the exact root and of the other
        assert np.abs(ours.numpy() - exact).max() <= 1e-5 * np.abs(exact).max(), p
        assert np.abs(ours.numpy() - np.asarray(theirs)).max() <= 1e-5 * np.abs(exact).max(), p
    b, y = rng.standard_normal((9, 4)), rng.standard_normal(9)
    x = F.nnls(torch.tensor(b), torch.tensor(y), 300)
    np.testing.assert_allclose(x.numpy(), np.asarray(optax.nnls(jnp.asarray(b), jnp.asarray(y), 300)), rtol=1e-10,
                               atol=1e-12)
    assert (x >= 0).all()


def _rosenbrock(m):
    return lambda p: sum((1.0 - x[:-1]) ** 2 + 100.0 * (x[1:] - x[:-1] ** 2) ** 2 for x in [p["x"]]).sum() + \
        (p["y"] ** 2).sum() * 0.5


LINESEARCH_CASES = {
    "lbfgs_zoom": lambda m: m.lbfgs(),
    "lbfgs_memory_3_keep": lambda m: m.lbfgs(memory_size=3, linesearch=m.scale_by_zoom_linesearch(
        15, initial_guess_strategy="keep", max_learning_rate=2.0)),
    "lbfgs_backtracking": lambda m: m.lbfgs(linesearch=m.scale_by_backtracking_linesearch(20, store_grad=True)),
    "sgd_backtracking": lambda m: m.chain(m.sgd(1e-3), m.scale_by_backtracking_linesearch(15, max_learning_rate=10.0,
                                                                                           store_grad=True)),
}


@pytest.mark.parametrize("name", sorted(LINESEARCH_CASES))
def test_line_searches_follow_optaxs_trajectory(name):
    """12 steps on a Rosenbrock valley (and a quadratic leaf), float64: the same trials, the same
    step sizes, the same params as Optax's."""
    import jax.numpy as jnp
    import torch

    start = {"x": np.array([-1.2, 1.0, -0.5, 0.8]), "y": np.array([0.3, -2.0])}
    tx, otx = LINESEARCH_CASES[name](F), LINESEARCH_CASES[name](optax)
    f, of = _rosenbrock(torch), _rosenbrock(jnp)
    tp, jp = to_torch(start), to_jax(start)
    ts, js = tx.init(tp), otx.init(jp)
    ovg = optax.value_and_grad_from_state(of)
    import jax

    oupdate = jax.jit(otx.update, static_argnames=("value_fn",))  # one compile: Optax's loops run in XLA
    for step in range(12):
        value, grad = F.value_and_grad_from_state(f)(tp, state=ts)
        tu, ts = tx.update(grad, ts, tp, value=value, grad=grad, value_fn=f)
        jvalue, jgrad = ovg(jp, state=js)
        ju, js = oupdate(jgrad, js, jp, value=jvalue, grad=jgrad, value_fn=of)
        tp, jp = F.apply_updates(tp, tu), optax.apply_updates(jp, ju)
        assert_trees_close(tp, jp, rtol=1e-8, atol=1e-10, what=f"{name} step {step}")
    assert float(f(tp)) < float(f(to_torch(start))) * 0.5


def test_lbfgs_by_step_closure_is_the_pure_path_and_converges_as_torchs():
    """``Optimizer.step(closure)`` (torch.optim.LBFGS's idiom) runs the same trials as the pure
    update given ``value_fn``: the same params, bit for bit; and it reaches torch's LBFGS's loss."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 5, generator=gen, dtype=torch.float64), torch.randn(5, 1, generator=gen, dtype=torch.float64)
    y = x @ w + 0.01 * torch.randn(64, 1, generator=gen, dtype=torch.float64)

    def model():
        torch.manual_seed(1)
        return torch.nn.Linear(5, 1).double()

    def loss_of(p):
        return ((x @ p["weight"].T + p["bias"] - y) ** 2).mean()

    ours, torchs = model(), model()
    opts = [F.Optimizer(ours.named_parameters(), F.lbfgs()),
            torch.optim.LBFGS(torchs.parameters(), line_search_fn="strong_wolfe", max_iter=1)]
    tx, params = F.lbfgs(), {n: p.detach().clone() for n, p in model().named_parameters()}
    state = tx.init(params)
    for _ in range(6):
        for m, opt in zip((ours, torchs), opts):
            def closure(m=m, opt=opt):
                opt.zero_grad()
                loss = ((m(x) - y) ** 2).mean()
                loss.backward()
                return loss
            opt.step(closure)
        value, grad = F.value_and_grad_from_state(loss_of)(params, state=state)
        u, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=loss_of)
        params = F.apply_updates(params, u)
    for n, p in ours.named_parameters():
        assert torch.allclose(p, params[n], rtol=1e-12, atol=1e-14), n
    final = [float(((m(x) - y) ** 2).mean()) for m in (ours, torchs)]
    assert final[0] <= final[1] * 1.01, final


def test_sophias_hutchinson_estimate_is_exact_on_a_diagonal_quadratic_and_reaches_the_optimizer():
    """Every Rademacher draw gives z (H z) = diag(H) when H is diagonal; ``Optimizer.step(obj_fn=...)``
    hands the loss function to the estimator as the pure update's ``obj_fn`` does."""
    import torch

    c = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    loss = lambda p: (c * p["x"] ** 2).sum()  # noqa: E731
    est = F.contrib.hutchinson_estimator_diag_hessian(random_seed=5)
    p = {"x": torch.ones(3, dtype=torch.float64)}
    state = est.init(p)
    for _ in range(3):
        diag, state = est.update(None, state, p, obj_fn=loss)
        assert torch.equal(diag["x"], 2 * c)
    x = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = F.Optimizer([("x", x)], F.contrib.sophia(0.1, update_interval=1))
    tx, q = F.contrib.sophia(0.1, update_interval=1), {"x": torch.ones(3, dtype=torch.float64)}
    s = tx.init(q)
    for _ in range(4):
        x.grad = 2 * c * x.detach()
        opt.step(obj_fn=loss)
        u, s = tx.update({"x": 2 * c * q["x"]}, s, q, obj_fn=loss)
        q = F.apply_updates(q, u)
    assert torch.equal(x.detach(), q["x"])
    with pytest.raises(ValueError, match="obj_fn"):
        x.grad = torch.ones(3, dtype=torch.float64)
        F.Optimizer([("x", x)], F.contrib.sophia(0.1)).step()
