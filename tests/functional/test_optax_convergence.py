"""Optax's ``AliasTest.test_optimization``, ported: every zero alias in Optax's table of
optimizers under test minimises Optax's parabola and Rosenbrock targets, in float32 and
complex64, within Optax's tolerance after Optax's 10,000 steps.

The case table, the skips and the tolerance are read from Optax's own test module; the targets
are Optax's, written in torch, with their gradients in closed form, checked against torch's
autograd at two points of each run (for a real loss of complex params torch's
gradient is the conjugate direction Optax's test builds by hand: 2 df/d(conj z)). Autograd at
every step would cost twice the steps themselves; through the JAX converter each case would run
10,000 eager JAX steps (minutes each).
``make test`` runs the parabola cases; ``make test-optax`` (``ZERO_OPTAX_FULL=1``) adds Rosenbrock.
"""

import os
import warnings

import pytest
import torch

import zero.functional as F

alias_test = pytest.importorskip("optax._src.alias_test", reason="Optax's test modules need the dev extra")

STEPS = 10_000
# As Optax's test: these have no complex support; sign methods need a schedule for Rosenbrock.
NO_COMPLEX = {"fromage", "noisy_sgd", "sm3", "optimistic_gradient_descent", "optimistic_adam", "lion", "rprop",
              "adadelta", "adan", "polyak_sgd", "sign_sgd", "signum"}


def _parabola(dtype):
    final = torch.tensor([1.0, -1.0, 1.0], dtype=dtype)
    if dtype.is_complex:
        final = final * (1 + 1j)
    objective = lambda p: ((p - final).abs() ** 2).sum()
    return torch.tensor([-1.0, 10.0, 1.0], dtype=dtype), final, objective, lambda p: 2 * (p - final)


def _rosenbrock(dtype):
    a, b = (1 + 1j if dtype.is_complex else 1.0), 100.0
    objective = lambda p: (a - p[0]).abs() ** 2 + b * (p[1] - p[0] ** 2).abs() ** 2

    def gradient(p):  # 2 df/d(conj p) of |a - p0|^2 + b |p1 - p0^2|^2
        w = p[1] - p[0] ** 2
        return torch.stack([-2 * (a - p[0]) - 4 * b * w * p[0].conj(), 2 * b * w])

    return torch.zeros(2, dtype=dtype), torch.tensor([a, a**2], dtype=dtype), objective, gradient


def _autograd(objective, params):
    p = params.detach().requires_grad_()
    objective(p).backward()
    return p.grad


def _cases():
    for case in alias_test._OPTIMIZERS_UNDER_TEST:
        name, kwargs = case["opt_name"], case["opt_kwargs"]
        for target in (_parabola, _rosenbrock):
            for dtype in (torch.float32, torch.complex64):
                tag = f"{name}-{'-'.join(f'{k}={v}' for k, v in kwargs.items())}-{target.__name__[1:]}-{dtype}"
                reason = _skip(name, kwargs, target, dtype)
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                yield pytest.param(name, kwargs, target, dtype, id=tag, marks=marks)


def _skip(name, kwargs, target, dtype):
    if target is _rosenbrock and not os.environ.get("ZERO_OPTAX_FULL"):
        return "Rosenbrock cases run in `make test-optax` (about 1 minute more on 2 cores)"
    if not hasattr(F, name):
        return f"zero has no {name} (Optax's own test runs it against Optax)"
    if name in NO_COMPLEX and dtype.is_complex:
        return f"{name} does not support complex parameters (in Optax either)"
    if name in ("sign_sgd", "signum") and target is _rosenbrock:
        return f"{name} needs a learning-rate schedule for Rosenbrock (Optax skips it too)"
    if name in ("adadelta", "adafactor") and kwargs.get("learning_rate") is None:
        return f"{name} without a learning rate is not numerically stable enough (Optax skips the check too)"
    return None


@pytest.mark.parametrize("name, kwargs, target, dtype", list(_cases()))
def test_optimization(name, kwargs, target, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # optimistic_adam is deprecated, as in Optax
        opt = getattr(F, name)(**kwargs)
    params, final, objective, gradient = target(dtype)
    for point in (params, 0.5 * params + 0.3):  # the closed form is autograd's, at the start and off it
        torch.testing.assert_close(gradient(point), _autograd(objective, point))
    state = opt.init(params)
    for _ in range(STEPS):
        extra = {"value": objective(params)} if name == "polyak_sgd" else {}
        updates, state = opt.update(gradient(params), state, params, **extra)
        params = F.apply_updates(params, updates)
    torch.testing.assert_close(params, final, rtol=3e-2, atol=3e-2)
