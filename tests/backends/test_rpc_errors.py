"""DistributedOptimizer's boundary: bad optimizers and params fail on the client, before any RPC."""

import pytest
import torch

import zero.functional as zf
from zero.backends import DistributedOptimizer
from zero.backends.dist_optim.rpc import local_transformation


@pytest.mark.parametrize("cls, args, kwargs, error, match", [
    (torch.optim.LBFGS, (), {}, ValueError, "from_torch supports"),
    (torch.optim.SGD, (0.1,), {"lr": 0.2}, TypeError, "multiple values for argument 'lr'"),
    (torch.optim.Adam, (), {"betas": (0.9, 0.99), "bogus": 1}, TypeError, "bogus"),
    (torch.optim.SGD, (), {"lr": -1.0}, ValueError, "lr"),
    (zf.adam(1e-3), (), {}, TypeError, "cannot be sent to other workers"),
    (lambda: 3, (), {}, TypeError, "returned int, not a GradientTransformation"),
    ("adam", (), {}, TypeError, "optimizer_class must be"),
    (torch.nn.Linear, (), {}, TypeError, "optimizer_class must be"),
])
def test_bad_optimizers_name_themselves(cls, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedOptimizer(cls, [], *args, **kwargs)


@pytest.mark.parametrize("rrefs, error, match", [
    ([], ValueError, "empty params_rref"),
    ([torch.ones(2)], TypeError, r"params_rref\[0\] is a Tensor, not an RRef"),
    (torch.ones(2), TypeError, "must be a list of RRefs, got Tensor"),
    (None, TypeError, "must be a list of RRefs, got NoneType"),
])
def test_bad_params_name_themselves(rrefs, error, match):
    with pytest.raises(error, match=match):
        DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1)


def test_torch_classes_step_per_param_and_factories_together():
    tx, per_param = local_transformation(torch.optim.SGD, (0.1,), {"momentum": 0.9})
    assert per_param, "torch's rules step each param alone"
    ours, theirs = torch.ones(2), torch.ones(2, requires_grad=True)
    fo, ref = zf.FunctionalOptimizer([ours], tx, per_param=True), torch.optim.SGD([theirs], 0.1, momentum=0.9)
    for g in (torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])):
        fo.step([g])
        theirs.grad = g.clone()
        ref.step()
    assert torch.equal(ours, theirs.detach()), "the positional lr and the momentum reach the rule"
    assert local_transformation(zf.adamw, (), {"learning_rate": 1e-3})[1] is False
