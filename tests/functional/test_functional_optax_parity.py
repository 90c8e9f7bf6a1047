"""Every alias and building block against Optax itself, over 40 steps of random gradients."""

import numpy as np
import pytest

pytest.importorskip("optax", reason="parity with Optax needs the zero[jax] extra")

import optax  # noqa: E402
from alias_cases import ALIASES, LR, MORE_ALIASES, SCHEDULES, build  # noqa: E402
from helpers import assert_trees_close  # noqa: E402
from optax_parity import random_tree, run_both, x64  # noqa: E402, F401 (x64: a module fixture)

import zero.functional as F  # noqa: E402

SCHED = dict(init_value=0.1, end_value=0.01, transition_steps=20)

# (name, zero factory call, optax factory call): the same arguments on both sides.
CASES = [(name, lambda m, name=name: build(m, name)) for name in ALIASES | MORE_ALIASES] + [
    ("fromage_schedule", lambda m: m.fromage(m.linear_schedule(0.1, 0.01, 20))),
    ("amsgrad_no_mu_correction", lambda m: m.amsgrad(LR, bias_correction_mu=False)),
    ("adafactor_unfactored", lambda m: m.adafactor(LR, factored=False, multiply_by_parameter_scale=False)),
    ("adafactor_defaults", lambda m: m.adafactor(LR)),
    ("lion_smooth", lambda m: m.chain(m.scale_by_lion(mode="smooth", smooth_beta=3.0), m.scale(-LR))),
    ("lion_refined", lambda m: m.chain(m.scale_by_lion(mode="refined"), m.scale(-LR))),
    ("sgd_plain", lambda m: m.sgd(LR)),
    ("sgd_momentum", lambda m: m.sgd(LR, momentum=0.9)),
    ("sgd_nesterov", lambda m: m.sgd(LR, momentum=0.9, nesterov=True)),
    ("sgd_schedule", lambda m: m.sgd(m.linear_schedule(**SCHED), momentum=0.5)),
    ("adam_eps_root", lambda m: m.adam(LR, b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-8)),
    ("adam_cosine", lambda m: m.adam(m.cosine_decay_schedule(0.1, 30, alpha=0.1))),
    ("adamw_schedule_decay", lambda m: m.adamw(LR, weight_decay=m.exponential_decay(0.1, 5, 0.5))),
    ("rmsprop_plain", lambda m: m.rmsprop(LR)),
    ("rmsprop_centered_momentum", lambda m: m.rmsprop(LR, centered=True, momentum=0.9, eps_in_sqrt=False)),
    ("rmsprop_bias_correction", lambda m: m.rmsprop(LR, bias_correction=True, initial_scale=0.1)),
    ("radam_nesterov", lambda m: m.radam(LR, nesterov=True, threshold=4.5)),
    ("amsgrad", lambda m: m.chain(m.scale_by_amsgrad(), m.scale(-LR))),
    ("belief", lambda m: m.chain(m.scale_by_belief(), m.scale(-LR))),
    ("belief_nesterov", lambda m: m.chain(m.scale_by_belief(nesterov=True), m.scale(-LR))),
    ("stddev", lambda m: m.chain(m.scale_by_stddev(bias_correction=True, initial_scale=1.0), m.scale(-LR))),
    ("rss", lambda m: m.chain(m.scale_by_rss(0.0), m.scale(-LR))),
    ("trust_ratio", lambda m: m.chain(m.scale_by_trust_ratio(min_norm=0.1, eps=1e-6), m.scale(-LR))),
    ("ema", lambda m: m.chain(m.ema(0.9), m.scale(-LR))),
    ("ema_nodebias", lambda m: m.chain(m.ema(0.9, debias=False), m.scale(-LR))),
    ("clip", lambda m: m.chain(m.clip(0.5), m.sgd(LR))),
    ("clip_by_global_norm", lambda m: m.chain(m.clip_by_global_norm(1.0), m.adam(LR))),
    ("scale_by_schedule", lambda m: m.chain(m.scale_by_schedule(m.piecewise_constant_schedule(
        0.1, {10: 0.5, 25: 0.1})), m.scale(-1.0))),
    ("warmup_cosine", lambda m: m.sgd(m.warmup_cosine_decay_schedule(0.0, 0.1, 10, 40, 0.01))),
    ("join_schedules", lambda m: m.sgd(m.join_schedules(
        [m.constant_schedule(0.1), m.linear_schedule(0.1, 0.0, 10)], [15]))),
    ("exponential_staircase", lambda m: m.sgd(m.exponential_decay(0.1, 4, 0.7, 3, True, 0.02))),
    ("masked", lambda m: m.chain(m.masked(m.adam(LR), {"w": True, "b": False, "nested": [True, False],
                                                        "scalar": True}), m.sgd(LR * 0.1))),
    ("multi_transform", lambda m: m.multi_transform(
        {"a": m.adam(LR), "s": m.sgd(LR, momentum=0.9)},
        {"w": "a", "b": "s", "nested": ["s", "a"], "scalar": "a"})),
    ("inject_hyperparams", lambda m: m.inject_hyperparams(m.adamw)(
        learning_rate=m.linear_schedule(**SCHED), weight_decay=0.02)),
    ("multi_steps", lambda m: _multi_steps(m)),
    ("identity", lambda m: m.chain(m.identity(), m.sgd(LR))),
]


def _multi_steps(m):
    import torch

    dtype = np.float64 if m is optax else torch.float64  # accumulate in f64 for the f64 run
    return m.MultiSteps(m.adam(LR), every_k_schedule=3, accumulator_dtype=dtype).gradient_transformation()


# Optax evaluates these schedules on its int32 step count in float32, so the hyperparameter
# itself differs from the exact value by float32 rounding (~1e-8 relative); see test_schedules.
FLOAT32_SCHEDULES = {"sgd_schedule", "adamw_schedule_decay", "scale_by_schedule", "warmup_cosine",
                     "join_schedules", "exponential_staircase", "inject_hyperparams", "fromage_schedule",
                     # Adafactor's decay 1 - (t + 1)^-0.8 is float32 in Optax; XLA's and torch's
                     # float32 pow differ in the last place at some t.
                     "adafactor", "adafactor_unfactored", "adafactor_defaults"}


# MultiSteps' float32 run accumulates in float32 on both sides: test_multi_steps_float32_accumulator_matches.
MATRIX = [pytest.param(name, make, dtype, rtol, id=f"{name}-{tag}")
          for name, make in CASES for dtype, rtol, tag in [(np.float64, 1e-9, "f64"), (np.float32, 1e-4, "f32")]
          if not (name == "multi_steps" and tag == "f32")]


@pytest.mark.parametrize("name, make, dtype, rtol", MATRIX)
def test_matches_optax(name, make, dtype, rtol):
    atol = 1e-12 if dtype == np.float64 else 1e-6
    if name in FLOAT32_SCHEDULES and dtype == np.float64:
        rtol, atol = 1e-6, 1e-7
    for step, tp, jp in run_both(make(F), make(optax), steps=40, dtype=dtype):
        assert_trees_close(tp, jp, rtol=rtol, atol=atol, what=f"{name} step {step}")


@pytest.mark.parametrize("variant", ["sps", "sps+"])
def test_polyak_sgd_matches_optax_given_the_value(variant):
    """polyak_sgd takes the objective's value as an extra arg: f(x) = sum((x - 1)^2) / 2 + f_gap."""
    import jax.numpy as jnp
    import torch

    tx, otx = F.polyak_sgd(0.5, f_min=0.3, eps=1e-3, variant=variant), optax.polyak_sgd(
        0.5, f_min=0.3, eps=1e-3, variant=variant)
    x = np.random.default_rng(0).standard_normal(6)
    tp, jp = torch.tensor(x), jnp.asarray(x)
    ts, js = tx.init(tp), otx.init(jp)
    for step in range(40):
        tv, jv = ((tp - 1) ** 2).sum() / 2 + 0.2, ((jp - 1) ** 2).sum() / 2 + 0.2
        tu, ts = tx.update(tp - 1, ts, tp, value=tv)
        ju, js = otx.update(jp - 1, js, jp, value=jv)
        tp, jp = F.apply_updates(tp, tu), optax.apply_updates(jp, ju)
        np.testing.assert_allclose(tp.numpy(), np.asarray(jp), rtol=1e-9, atol=1e-12, err_msg=f"step {step}")


def test_multi_steps_float32_accumulator_matches():
    import torch

    tx = F.MultiSteps(F.adam(LR), 4).gradient_transformation()
    otx = optax.MultiSteps(optax.adam(LR), 4).gradient_transformation()
    assert torch.float32 == tx.init({"x": torch.zeros(2, dtype=torch.float64)}).acc_grads["x"].dtype
    for step, tp, jp in run_both(tx, otx, steps=41, dtype=np.float32):
        assert_trees_close(tp, jp, rtol=1e-4, atol=1e-7, what=f"step {step}")


def test_apply_if_finite_with_injected_nans():
    def grads(rng, step):
        g = random_tree(rng, np.float64)
        if step in (3, 4, 10, 11, 12, 13):  # a run longer than max_consecutive_errors too
            g["w"][0, 0] = np.nan if step % 2 else np.inf
        return g

    tx, otx = F.apply_if_finite(F.adam(LR), 2), optax.apply_if_finite(optax.adam(LR), 2)
    seen_nan = False
    for step, tp, jp in run_both(tx, otx, steps=40, grad_fn=grads):
        w, jw = tp["w"].numpy(), np.asarray(jp["w"])
        np.testing.assert_array_equal(np.isnan(w), np.isnan(jw))
        seen_nan |= bool(np.isnan(w).any())
        assert_trees_close({"b": tp["b"]}, {"b": jp["b"]}, rtol=1e-9, what=f"step {step}")
    assert seen_nan, "the run of 4 bad steps should have let a NaN through after 2 skips"


def test_state_layout_field_names_match_optax():
    import torch

    p = {"x": torch.zeros(3)}
    pairs = [(F.adam(LR), optax.adam(LR)), (F.rmsprop(LR, momentum=0.9), optax.rmsprop(LR, momentum=0.9)),
             (F.lion(LR), optax.lion(LR)), (F.rprop(LR), optax.rprop(LR)), (F.adadelta(LR), optax.adadelta(LR)),
             (F.adan(LR), optax.adan(LR)), (F.novograd(LR), optax.novograd(LR)), (F.yogi(LR), optax.yogi(LR)),
             (F.optimistic_gradient_descent(LR), optax.optimistic_gradient_descent(LR)),
             (F.inject_hyperparams(F.sgd)(0.1), None)]
    import jax.numpy as jnp

    for tx, otx in pairs[:-1]:
        ours = tx.init(p)
        theirs = otx.init({"x": jnp.zeros(3)})
        assert [type(s).__name__ for s in ours] == [type(s).__name__ for s in theirs]
        assert [getattr(s, "_fields", ()) for s in ours] == [getattr(s, "_fields", ()) for s in theirs]
    assert pairs[-1][0].init(p)._fields == optax.InjectStatefulHyperparamsState._fields


@pytest.mark.parametrize("make", SCHEDULES)
def test_schedules(make):
    import jax.numpy as jnp

    ours, theirs = make(F), make(optax)
    for count in range(60):
        np.testing.assert_allclose(ours(count), float(theirs(jnp.asarray(count, jnp.int32))), rtol=1e-6, atol=1e-9)
        # Optax divides its int32 count in float32 even under x64; given a float64 count its
        # formula is float64 throughout, and zero's (Python floats) equals it to the last bit
        assert ours(count) == float(theirs(jnp.asarray(count, jnp.float64))), count


def _float64_count(schedule):
    """Optax's schedule evaluated on its int32 count cast to float64 (where Optax computes in float32)."""
    import jax.numpy as jnp

    return lambda count: schedule(jnp.asarray(count, jnp.float64))


@pytest.mark.parametrize("make", [
    lambda m, f: m.adamw(f(m.warmup_cosine_decay_schedule(0.0, 0.1, 10, 40, 0.01)), weight_decay=0.1),
    lambda m, f: m.chain(m.clip_by_global_norm(1.0), m.sgd(f(m.linear_schedule(0.1, 0.01, 20)), momentum=0.9)),
], ids=["adamw_warmup_cosine", "clip_sgd_linear"])
def test_float64_chains_with_schedules_equal_optax_to_float64_rounding(make):
    """A float64 chain with a schedule agrees with Optax (x64) to float64 rounding, as a constant
    rate does, once Optax's schedule sees its count in float64: the 1e-9 gap of the plain run is
    Optax's float32 schedule, not zero's."""
    for step, tp, jp in run_both(make(F, lambda s: s), make(optax, _float64_count), steps=40, dtype=np.float64):
        assert_trees_close(tp, jp, rtol=1e-13, atol=1e-15, what=f"step {step}")


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_sm3_matches_optax(momentum):
    """SM3 keeps one accumulator per axis, so params need an axis (the shared tree has a scalar)."""
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    shapes = {"w": (5, 7), "b": (7,), "t": (2, 3, 4)}
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    tx, otx = F.sm3(LR, momentum), optax.sm3(LR, momentum)
    tp, jp = {k: torch.tensor(v) for k, v in params.items()}, {k: jnp.asarray(v) for k, v in params.items()}
    ts, js = tx.init(tp), otx.init(jp)
    for step in range(40):
        g = {k: rng.standard_normal(s) for k, s in shapes.items()}
        tu, ts = tx.update({k: torch.tensor(v) for k, v in g.items()}, ts, tp)
        ju, js = otx.update({k: jnp.asarray(v) for k, v in g.items()}, js, jp)
        tp, jp = F.apply_updates(tp, tu), optax.apply_updates(jp, ju)
        for k in shapes:
            np.testing.assert_allclose(tp[k].numpy(), np.asarray(jp[k]), rtol=1e-9, atol=1e-12, err_msg=f"{k} {step}")
