"""Run a zero.functional transformation and its Optax twin side by side on the same gradients."""

import jax
import numpy as np
import optax
import optree
import pytest
import torch

import zero.functional as F

jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True, scope="module")
def x64():
    """JAX in float64 for a module's f64 cases, whatever ran before it in this process (a test that
    turned x64 off, on a worker of its own under -n 2); its setting back after."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)

SHAPES = {"w": (5, 7), "b": (7,), "nested": [(3,), (2, 2, 3)], "scalar": ()}


def random_tree(rng, dtype):
    return optree.tree_map(lambda s: rng.standard_normal(s).astype(dtype), SHAPES,
                           is_leaf=lambda x: isinstance(x, tuple))


def to_torch(tree):
    return optree.tree_map(lambda a: torch.from_numpy(np.array(a)), tree)


def to_jax(tree):
    return optree.tree_map(lambda a: jax.numpy.asarray(a), tree)


def run_both(tx, otx, *, steps=40, dtype=np.float64, seed=0, grad_fn=None):
    """Yield (step, torch params, optax params) after each step."""
    rng = np.random.default_rng(seed)
    params = random_tree(rng, dtype)
    tp, jp = to_torch(params), to_jax(params)
    ts, js = tx.init(tp), otx.init(jp)
    oupdate = jax.jit(otx.update)  # one compile per case instead of eager op-by-op dispatch
    for step in range(steps):
        grads = grad_fn(rng, step) if grad_fn else random_tree(rng, dtype)
        tu, ts = tx.update(to_torch(grads), ts, tp)
        ju, js = oupdate(to_jax(grads), js, jp)
        tp, jp = F.apply_updates(tp, tu), optax.apply_updates(jp, ju)
        yield step, tp, jp
