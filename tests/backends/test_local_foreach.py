"""The local optimizer takes torch's foreach step on the CPU where the user left ``foreach`` to torch:
only for the classes whose foreach step is bitwise their for-loop step (proven here, every option),
invisibly (the optimizer's groups and its state dict keep the user's ``None``)."""

import itertools

import pytest
import torch
import zero_workers as w
from helpers import run_ranks

from zero.backends.local_optimizer import FOREACH_ON_CPU, choose_foreach

OPTIONS = {
    "Adam": [dict(lr=1e-2, **o) for o in ({}, {"weight_decay": 0.1}, {"amsgrad": True}, {"maximize": True},
                                         {"weight_decay": 0.1, "decoupled_weight_decay": True, "amsgrad": True},
                                         {"betas": (0.8, 0.95), "eps": 1e-6})],
    "AdamW": [dict(lr=1e-2, **o) for o in ({}, {"weight_decay": 0.0}, {"amsgrad": True, "maximize": True})],
    "SGD": [dict(lr=1e-2, **o) for o in ({}, {"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.1},
                                        {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
                                        {"momentum": 0.9, "maximize": True})],
}


def _trained(name, options, foreach, dtype, steps=12):
    torch.manual_seed(0)
    shapes = [(17, 5), (64,), (3, 4, 5), (1,)]
    params = [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]
    opt = getattr(torch.optim, name)(params, foreach=foreach, **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
        opt.step()
    return params, opt.state_dict()["state"]


@pytest.mark.parametrize("name,dtype", list(itertools.product(sorted(FOREACH_ON_CPU), [torch.float32, torch.float64])))
def test_foreach_step_is_the_for_loop_step_bit_for_bit(name, dtype):
    assert set(OPTIONS) == FOREACH_ON_CPU, "every class zero runs foreach is proven here"
    for options in OPTIONS[name]:
        loop, loop_state = _trained(name, options, False, dtype)
        each, each_state = _trained(name, options, True, dtype)
        for a, b in zip(loop, each):
            assert torch.equal(a, b), f"{name}({options}) {dtype}: foreach differs from the for-loop"
        for i in loop_state:
            for k, v in loop_state[i].items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, each_state[i][k]), f"{name}({options}) {dtype}: state {k!r} differs"


def test_bfloat16_keeps_the_for_loop():
    """In bfloat16 the foreach step differs from the for-loop in the last bit (SGD with momentum), so
    a bfloat16 group keeps torch's choice."""
    loop, _ = _trained("SGD", {"lr": 1e-2, "momentum": 0.9}, False, torch.bfloat16)
    each, _ = _trained("SGD", {"lr": 1e-2, "momentum": 0.9}, True, torch.bfloat16)
    assert not all(torch.equal(a, b) for a, b in zip(loop, each)), "bfloat16 became bitwise: widen FOREACH_ON_CPU"
    opt = torch.optim.SGD([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)], lr=1e-2, momentum=0.9)
    assert not choose_foreach(opt) and opt.param_groups[0]["foreach"] is None
    opt = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=1e-2, momentum=0.9)
    assert choose_foreach(opt) and opt.param_groups[0]["foreach"] is True


def test_zero_takes_foreach_invisibly():
    """Run on 2 ranks (`zero_workers.local_foreach`): the local groups step foreach, the outer groups
    and the state dict keep the user's None, the user's False and other classes are left alone, and
    the params equal torch's ZeroRedundancyOptimizer's (the for-loop) bit for bit."""
    for r in run_ranks(w.local_foreach, 2):
        assert r["local"] == [True, True], "the local groups take torch's foreach step"
        assert r["outer"] == [None, None] and r["saved"] == [None, None], "the user's groups keep None"
        assert r["user_false"] == [False], "foreach=False given by the user stays"
        assert r["tensor_lr"] == [None], "a tensor lr (for-loop only in torch) is left to torch"
        assert r["other_class"] == [None], "a class not proven bitwise keeps torch's choice"
        assert r["equal_to_torch"], "bitwise torch's ZeroRedundancyOptimizer's params"
