"""from_optax runs Optax on torch tensors; states move between the frameworks mid-run."""

import numpy as np
import pytest

pytest.importorskip("optax", reason="the Optax bridge needs the zero[jax] extra")

import jax  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from helpers import assert_trees_close  # noqa: E402
from optax_parity import random_tree, run_both, to_jax, to_torch, x64  # noqa: E402, F401 (x64: a module fixture)

import zero.functional as F  # noqa: E402


def test_from_optax_runs_a_chain_torch_does_not_have():
    make = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(1e-2))
    for step, tp, jp in run_both(F.from_optax(make()), make(), steps=40):
        assert_trees_close(tp, jp, rtol=1e-9, atol=1e-12, what=f"step {step}")
        assert isinstance(tp["w"], torch.Tensor)


def test_state_moves_torch_to_optax_and_back():
    rng = np.random.default_rng(0)
    params = random_tree(rng, np.float64)
    grads = [random_tree(rng, np.float64) for _ in range(30)]
    tx, otx = F.adamw(0.01, weight_decay=0.1), optax.adamw(0.01, weight_decay=0.1)

    def torch_steps(p, s, gs):
        for g in gs:
            u, s = tx.update(to_torch(g), s, p)
            p = F.apply_updates(p, u)
        return p, s

    reference, _ = torch_steps(to_torch(params), tx.init(to_torch(params)), grads)
    p, s = torch_steps(to_torch(params), tx.init(to_torch(params)), grads[:10])
    jp, js = to_jax(p), F.to_optax_state(s)
    assert type(js[0]) is optax.ScaleByAdamState
    for g in grads[10:20]:
        u, js = otx.update(to_jax(g), js, jp)
        jp = optax.apply_updates(jp, u)
    p, s = torch_steps(to_torch(jp), F.from_optax_state(js), grads[20:])
    assert type(s[0]) is F.ScaleByAdamState and int(s[0].count) == 30
    assert_trees_close(p, jax.tree.map(np.asarray, reference), rtol=1e-9, atol=1e-12)


def test_from_optax_rejects_non_transformations():
    with pytest.raises(TypeError, match="from_optax needs an Optax GradientTransformation"):
        F.from_optax(torch.optim.Adam)
