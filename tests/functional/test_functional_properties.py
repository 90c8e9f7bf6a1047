"""Properties every alias keeps, over the shared alias table (as Optax's alias tests do)."""

import inspect

import pytest
import torch
from alias_cases import ALIASES, build

import zero.functional as F


def trajectory(tx, params, steps=8, inplace=False, seed=0):
    """Params after each of ``steps`` steps of random gradients (pure update, or the in-place path)."""
    gen = torch.Generator().manual_seed(seed)
    params = [p.clone() for p in params]
    state, out = tx.init(params), []
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]
        if inplace:
            state = F.base.inplace_step(tx, params, grads, state)
        else:
            updates, state = tx.update(grads, state, params)
            params = F.apply_updates(params, updates)
        out.append([p.clone() for p in params])
    return out, state


def start(dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in [(5, 3), (7,), ()]]


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_inject_hyperparams_steps_as_the_alias_itself(name):
    plain, _ = trajectory(build(F, name), start())
    injected_tx = F.inject_hyperparams(getattr(F, name))(**ALIASES[name])
    for inplace in (False, True):
        injected, _ = trajectory(injected_tx, start(), inplace=inplace)
        for a, b in zip(plain, injected):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(ALIASES))
@pytest.mark.parametrize("inplace", [False, True], ids=["update", "inplace"])
def test_bf16_params_stay_bf16_and_mu_dtype_is_honoured(name, inplace):
    has_mu_dtype = "mu_dtype" in inspect.signature(getattr(F, name)).parameters
    tx = build(F, name, **({"mu_dtype": torch.float32} if has_mu_dtype else {}))
    steps, state = trajectory(tx, start(torch.bfloat16), inplace=inplace)
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in steps[-1])
    assert steps[-1][0].ne(start(torch.bfloat16)[0]).any(), "the params moved"
    if has_mu_dtype:  # kept, and accumulated, in float32: equal to the exact EMA of the bf16 gradients
        mus = _first_moments(state)
        assert mus and all(m.dtype == torch.float32 for m in mus), [m.dtype for m in mus]
        decay = 0.99 if name == "lion" else 0.9
        for m, exact in zip(mus, _exact_ema(start(torch.bfloat16), decay, len(steps))):
            torch.testing.assert_close(m.double(), exact, rtol=1e-6, atol=1e-7)


def _exact_ema(params, decay, steps, seed=0):
    """The EMA of `trajectory`'s gradients (rounded to the params' dtype), in float64."""
    gen = torch.Generator().manual_seed(seed)
    ema = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype).double() for p in params]
        ema = [decay * e + (1 - decay) * g for e, g in zip(ema, grads)]
    return ema


def _first_moments(state):
    """The ``mu`` leaves of a chain's state (Adam's and Lion's first moment)."""
    return [m for part in state if hasattr(part, "mu") for m in F.base.tree_leaves(part.mu)]
