"""The Optax names #66 brings (``optax.contrib``'s and ``optax``'s), each against Optax itself
over 30 steps of random gradients, in float64 (to float64 rounding) and float32, with Optax's
state layout (its NamedTuples' names and fields, so Optax's state-reading code reads zero's)."""

import numpy as np
import optree
import pytest

pytest.importorskip("optax", reason="parity with Optax needs the zero[jax] extra")

import optax  # noqa: E402
from helpers import assert_trees_close  # noqa: E402
from optax_parity import run_both, x64  # noqa: E402, F401 (x64: a module fixture)

import zero.functional as F  # noqa: E402

LR = 1e-2


def _c(m):
    return m.contrib


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
}
SCHEDULED = {"ademamix_schedules", "schedule_free_adamw"}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_optax(name, dtype):
    rtol, atol = (1e-9, 1e-12) if dtype == np.float64 else (1e-4, 1e-6)
    if name in SCHEDULED and dtype == np.float64:  # Optax evaluates schedules in float32
        rtol, atol = 1e-6, 1e-7
    for step, tp, jp in run_both(CASES[name](F), CASES[name](optax), steps=30, dtype=dtype):
        assert_trees_close(tp, jp, rtol=rtol, atol=atol, what=f"{name} step {step}")


def _layout(state):
    nodes = optree.tree_flatten(state, is_leaf=lambda x: hasattr(x, "_fields"))[0]
    return [(type(n).__name__, n._fields) for n in nodes if hasattr(n, "_fields")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_layout_is_optaxs(name):
    import jax.numpy as jnp
    import torch

    ours = CASES[name](F).init({"x": torch.zeros(3, dtype=torch.float64)})
    theirs = CASES[name](optax).init({"x": jnp.zeros(3)})
    assert _layout(ours) == _layout(theirs)
