"""A step reads its group's settings and its state's hyperparameters again only when they changed:
a value replaced (a scheduler's new ``lr``), a tensor or list written in place, a state loaded. Each
habit below is stepped beside torch's class (or the same run with the value replaced), which reads
its group at every step."""

import pytest
import torch
from test_torch_contract import grads_at, make_model

import zero.functional as F
from zero.functional.base import inplace_step

STEPS = 6


def stepped(model, opt, between):
    for k in range(STEPS):
        between(k, opt)
        grads_at(model, k)
        opt.step()


def beside_torch(cls, group, between, **kw):
    """zero's ``from_torch(cls)`` and torch's ``cls`` over the same steps, ``between(k, opt)``
    run on each before step ``k``; their params must agree."""
    model, ref_model = make_model(), make_model()
    opt = F.Optimizer([{"params": list(model.parameters()), **group}], F.from_torch(cls, **kw))
    ref = cls([{"params": list(ref_model.parameters()), **group}], **kw)
    stepped(model, opt, between)
    stepped(ref_model, ref, between)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_an_lr_tensor_written_in_place_steps_at_the_next_step():
    """A group's ``lr`` held as a float32 tensor (the state keeps a float64 copy) and filled in
    place, so it changes without being replaced: each step reads it, as torch's SGD does."""
    def between(k, opt):
        opt.param_groups[0]["lr"].fill_(0.1 / (k + 1))

    beside_torch(torch.optim.SGD, {"lr": torch.tensor(0.1)}, between, lr=0.1, momentum=0.9)


def test_an_lr_float_replaced_by_a_tensor_then_written_in_place_steps_with_each_value():
    """``lr`` a float for a step, then a tensor (a moved value that can now change in place),
    then that tensor filled in place at each step: each value is stepped with, as by torch's SGD."""
    def between(k, opt):
        if k == 1:
            opt.param_groups[0]["lr"] = torch.tensor(0.05)
        elif k > 1:
            opt.param_groups[0]["lr"].fill_(0.05 / k)

    beside_torch(torch.optim.SGD, {}, between, lr=0.1, momentum=0.9)


def test_torchs_step_lr_scheduler_steps_as_on_torchs_class():
    """torch's ``StepLR`` (every 2 steps): between its boundaries it writes the group's very
    ``lr`` back, at them a new one; each is stepped with, as by torch's SGD under the same scheduler."""
    schedulers = {}

    def between(k, opt):  # made before the first step, stepped after each (torch's order)
        if k == 0:
            schedulers[id(opt)] = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        else:
            schedulers[id(opt)].step()

    beside_torch(torch.optim.SGD, {}, between, lr=0.1, momentum=0.9)


def test_betas_held_as_a_list_and_written_in_place_step_at_the_next_step():
    """``betas`` as a list, its first item set in place between steps: torch's Adam reads the
    list at each step, and so does the step here."""
    def between(k, opt):
        opt.param_groups[0]["betas"][0] = 0.9 - 0.1 * k

    beside_torch(torch.optim.Adam, {"betas": [0.9, 0.999]}, between, lr=1e-2)


def test_a_state_dict_loaded_between_steps_is_read_at_the_next_step():
    """torch's habit: another run's state dict (another ``lr``, other momenta) loaded into an
    optimizer that has stepped, then stepping on: the loaded numbers are the ones stepped with."""
    donor_model = make_model()
    donor = torch.optim.SGD(donor_model.parameters(), lr=0.03, momentum=0.5)
    stepped(donor_model, donor, lambda k, o: None)

    def between(k, opt):
        if k == 3:
            opt.load_state_dict(donor.state_dict())

    beside_torch(torch.optim.SGD, {}, between, lr=0.1, momentum=0.5)


@pytest.mark.parametrize("write", ["in place", "replaced"])
def test_a_hyperparameter_tensor_of_the_state_changed_is_read_at_the_next_step(write):
    """The pure in-place step (`zero.functional.inplace_step`) on an injected state whose
    learning rate is written in place (``fill_``) or replaced between steps steps with the new
    rate: the same bits as a state that held the new rate from the start of that step."""
    tx, twin_tx = (F.inject_hyperparams(F.sgd)(learning_rate=0.1, momentum=0.9) for _ in range(2))
    params = [torch.randn(7, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    twin = [p.clone() for p in params]
    state, twin_state = tx.init(params), twin_tx.init(twin)
    for k in range(STEPS):
        grads = [torch.full_like(p, 0.1 * (k + 1)) + p for p in params]
        rate = 0.1 / (k + 1)
        if write == "in place":
            state.hyperparams["learning_rate"].fill_(rate)
        else:
            state.hyperparams["learning_rate"] = torch.tensor(rate, dtype=torch.float64)
        twin_state = twin_state._replace(hyperparams={**twin_state.hyperparams,
                                                      "learning_rate": torch.tensor(rate, dtype=torch.float64)})
        state = inplace_step(tx, params, grads, state)
        twin_state = inplace_step(twin_tx, twin, [g.clone() for g in grads], twin_state)
    assert all(torch.equal(a, b) for a, b in zip(params, twin))
    assert F.explain(tx, params).kernel == "_fused_sgd_"  # (the kernel's step, whose build is chosen again)


def test_a_state_emptied_by_loading_its_own_groups_starts_with_the_groups_lr():
    """torch's reset habit: ``lr`` set to a new value and stepped with, then a dict of the
    optimizer's own groups and no state loaded. The group's ``lr`` is the very float it held, while
    each set's state starts afresh from the rule (built with another ``lr``): the step reads the
    group's, as torch's SGD does."""
    def between(k, opt):
        if k == 1:
            opt.param_groups[0]["lr"] = 0.05
        if k == 3:
            opt.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"]})

    beside_torch(torch.optim.SGD, {}, between, lr=0.1, momentum=0.5)
