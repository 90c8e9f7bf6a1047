"""Nothing silent in the functional layer: group settings drive every rule that can take them,
the rest fail at construction; Optax objects, torch state dicts and mismatched trees are named;
every state dict loads under torch.load's default (weights_only=True)."""

import io

import pytest
import torch

import zero.functional as F

optax = pytest.importorskip("optax", reason="the Optax cases need the zero[jax] extra")


def one_step(opt, p, grad=1.0):
    p.grad = torch.full_like(p, grad)
    opt.step()
    return p.detach().clone()


@pytest.mark.parametrize("make", [
    lambda: F.sgd(0.1), lambda: F.inject_hyperparams(F.sgd)(learning_rate=0.1),
    lambda: F.from_torch(torch.optim.SGD, lr=0.1),
    lambda: F.from_optax(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
], ids=["alias", "injected", "from_torch", "from_optax_injected"])
def test_a_group_lr_drives_the_step_and_schedulers_work(make):
    p = torch.nn.Parameter(torch.ones(2))
    opt = F.Optimizer([{"params": [p], "lr": 100.0}], make())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    assert torch.equal(one_step(opt, p), torch.full((2,), -99.0)), "the group's lr, not the factory's"
    sched.step()
    assert opt.param_groups[0]["lr"] == 50.0
    assert torch.equal(one_step(opt, p), torch.full((2,), -149.0))


@pytest.mark.parametrize("group, make, words", [
    ({"lr": 100.0}, lambda: F.from_optax(optax.sgd(0.1)), "sets ['lr'], which its transformation would ignore"),
    ({"momentum": 0.9}, lambda: F.adam(0.1), "sets ['momentum']"),
    ({"learning_rate": 0.5}, lambda: F.adam(0.1), "sets ['learning_rate']"),
    ({"lr": 1.0}, lambda: F.chain(F.scale_by_adam(), F.scale(-0.1)), "it keeps none in its state"),
])
def test_a_group_setting_that_would_be_ignored_is_an_error(group, make, words):
    with pytest.raises(ValueError) as info:
        F.Optimizer([{"params": [torch.nn.Parameter(torch.ones(2))], **group}], make())
    assert words in str(info.value)


def test_other_group_keys_are_left_alone():
    F.Optimizer([{"params": [torch.nn.Parameter(torch.ones(2))], "name": "decoder"}], F.adam(0.1))


@pytest.mark.parametrize("tx", [optax.adamw, optax.adamw(1e-3)], ids=["factory", "transformation"])
def test_optax_objects_are_named_with_the_way_to_wrap_them(tx):
    with pytest.raises(TypeError, match="from_optax"):
        F.Optimizer([torch.nn.Parameter(torch.ones(2))], tx)


def test_to_optax_state_rejects_a_torch_state_dict():
    sd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).state_dict()
    with pytest.raises(TypeError, match="not a torch optimizer state_dict"):
        F.to_optax_state(sd)
    with pytest.raises(TypeError, match="not a torch optimizer state_dict"):
        F.from_optax_state(sd)


@pytest.mark.parametrize("make", [lambda: F.adam(0.1), lambda: F.sgd(0.1, momentum=0.9), lambda: F.rmsprop(0.1)])
def test_gradients_with_a_missing_key_name_it_and_dump_no_tensors(make):
    params = {"w": torch.ones(2), "b": torch.ones(3)}
    tx = make()
    with pytest.raises(ValueError) as info:
        tx.update({"w": torch.ones(2)}, tx.init(params), params)
    assert "missing ['b']" in str(info.value) and "tensor(" not in str(info.value), str(info.value)
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        F.apply_updates(params, {"w": torch.ones(2)})


STATEFUL = {
    "adam": lambda: F.adam(0.1),
    "sgd_momentum": lambda: F.sgd(0.1, momentum=0.9),
    "from_torch_adamw_amsgrad": lambda: F.from_torch(torch.optim.AdamW, lr=0.1, amsgrad=True),
    "from_torch_sgd": lambda: F.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9),
    "from_torch_nadam": lambda: F.from_torch(torch.optim.NAdam),
    "masked": lambda: F.masked(F.adam(0.1), [True, False]),
    "multi_transform": lambda: F.multi_transform({"a": F.adam(0.1), "s": F.sgd(0.1)}, ["a", "s"]),
    "multi_steps": lambda: F.MultiSteps(F.adam(0.1), 2).gradient_transformation(),
    "apply_if_finite": lambda: F.apply_if_finite(F.adam(0.1), 2),
    "from_optax": lambda: F.from_optax(optax.inject_hyperparams(optax.adam)(learning_rate=0.1)),
}


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_state_dicts_load_with_weights_only(name):
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    opt = F.Optimizer(params, STATEFUL[name]())
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True is torch's default
    again = F.Optimizer([torch.nn.Parameter(p.detach().clone()) for p in params], STATEFUL[name]())
    again.load_state_dict(loaded)
    for o in (opt, again):
        for p in o.param_groups[0]["params"]:
            p.grad = torch.full_like(p, 0.5)
        o.step()
    for a, b in zip(params, again.param_groups[0]["params"]):
        assert torch.equal(a, b), name


def test_a_saved_state_of_another_kind_of_transformation_is_named():
    p = torch.nn.Parameter(torch.ones(2))
    bare = F.Optimizer([p], F.chain(F.scale_by_adam(), F.scale(-0.1)))
    one_step(bare, p)
    with pytest.raises(ValueError, match="does not fit its transformation"):
        F.Optimizer([p], F.adam(0.1)).load_state_dict(bare.state_dict())
