"""One rule, one answer, by every route: the built transformation (``F.adamw(1e-2)``), Optax's
injected form (``F.inject_hyperparams(F.adamw)(learning_rate=1e-2)``), and the drop-in's own
factory-with-keywords form (``ZeroRedundancyOptimizer(params, F.adamw, learning_rate=1e-2)``)
step every alias and contrib rule to the same bits."""

import alias_cases
import helpers
import pytest
import torch

import zero.functional as F
from zero.backends import ZeroRedundancyOptimizer as Zero

pytestmark = pytest.mark.timeout(300)

CONTRIB = alias_cases.CONTRIB
RULES = {**alias_cases.ALIASES, **alias_cases.MORE_ALIASES, **CONTRIB}


def _factory(name: str):
    return getattr(F.contrib, name) if name in CONTRIB else getattr(F, name)


def _model(dtype: torch.dtype) -> torch.nn.Module:
    """A matrix big enough to quantize (4,096 elements), a small one and vectors."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3)).to(dtype)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 5) -> list[torch.Tensor]:
    for k in range(steps):
        gen = torch.Generator().manual_seed(k)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _routes(name: str, dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    factory, kwargs = _factory(name), RULES[name]
    models = {route: _model(dtype) for route in ("built", "injected", "zero factory", "zero built")}
    opts = {"built": F.Optimizer(models["built"].parameters(), factory(**kwargs)),
            "zero factory": Zero(models["zero factory"].parameters(), factory, **kwargs),
            "zero built": Zero(models["zero built"].parameters(), factory(**kwargs))}
    if dtype == torch.float64:  # Optax's own form keeps float hyperparameters in the params' dtype
        opts["injected"] = F.Optimizer(models["injected"].parameters(), F.inject_hyperparams(factory)(**kwargs))
    return {route: _train(models[route], opt) for route, opt in opts.items()}


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_steps_to_the_same_bits_by_every_route(one_rank, name):
    got = _routes(name, torch.float64)
    for route, params in got.items():
        for j, (a, b) in enumerate(zip(params, got["built"])):
            assert torch.equal(a, b), f"{name}: {route} differs from the built transformation at param {j}"


@pytest.mark.parametrize("name", ["adamw", "lion", "adamw_8bit", "muon"])
def test_bf16_params_step_alike_by_either_form_of_the_drop_in(one_rank, name):
    """Kept in the params' dtype, bf16 hyperparameters would round (``b2=0.999`` to 1.0): the
    factory form once did, and crashed or stepped other numbers than the built form."""
    got = _routes(name, torch.bfloat16)
    for j, (a, b) in enumerate(zip(got["zero factory"], got["zero built"])):
        assert torch.equal(a, b), f"{name}: the factory form differs from the built one at param {j}"
    for a, b in zip(got["zero built"], got["built"]):
        assert torch.equal(a, b), name


def test_the_factory_forms_groups_keep_a_block_size_as_an_int(one_rank):
    opt = Zero(_model(torch.float32).parameters(), F.contrib.adamw_8bit, learning_rate=1e-2, weight_decay=0.01)
    assert "block_size" not in opt.param_groups[0], "a block size shapes the state: not a group setting"
    assert opt.param_groups[0]["lr"] == 1e-2 and type(opt.param_groups[0]["lr"]) is float


def test_the_8bit_factory_form_equals_torchaos_adamw8bit(one_rank, dtype=torch.bfloat16, rtol=1e-3):
    """The drop-in's own form of the 8-bit rule against torchao's class, 12 steps on one rank,
    bf16 params (where the factory form rounded ``b2=0.999`` to 1.0 and refused to build): within
    bf16's rounding (measured 2.2e-4, relative to each param's norm)."""
    torchao_optim = helpers.torchao_optim()
    ours, theirs = _model(dtype), _model(dtype)
    opts = (Zero(ours.parameters(), F.contrib.adamw_8bit, learning_rate=1e-2, weight_decay=0.01),
            torchao_optim.AdamW8bit(theirs.parameters(), lr=1e-2, weight_decay=0.01))
    got = [_train(m, opt, steps=12) for m, opt in zip((ours, theirs), opts)]
    for a, b in zip(*got):
        assert float((a.double() - b.double()).norm() / b.double().norm()) <= rtol
