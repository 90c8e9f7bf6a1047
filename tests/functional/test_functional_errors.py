"""Nothing silent in the functional layer: group settings drive every rule that can take them,
the rest fail at construction; Optax objects, torch state dicts and mismatched trees are named;
every state dict loads under torch.load's default (weights_only=True)."""

import io
import re

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
    with pytest.raises(ValueError, match=r"the state dict has no 'count' for param 0 \(it has \['0\.count', "
                                         r"'0\.mu', '0\.nu'\]\): it was saved by another rule or optimizer than "
                                         r"zero\.functional\.adam"):
        F.Optimizer([p], F.adam(0.1)).load_state_dict(bare.state_dict())


@pytest.mark.parametrize("make, name", [
    (lambda: F.novograd(0.1), "scale_by_novograd"), (lambda: F.sm3(0.1), "scale_by_sm3"),
    (lambda: F.adafactor(0.1, min_dim_size_to_factor=2), "scale_by_factored_rms"),
    (lambda: F.contrib.scale_by_muon(), "scale_by_muon"),
])
def test_per_tensor_rules_refuse_pieces_of_tensors(make, name):
    """A rank stepping half of a tensor (a flat plan) cannot keep per-tensor state of it, nor
    orthogonalise it."""
    from zero.functional import sharding

    whole, half = torch.ones(2, 3), torch.ones(3)
    pieces = {id(whole): sharding.Pieces((0,), (6,), (0,)), id(half): sharding.Pieces((1,), (3,), (0,))}
    rules = sharding.Sharding(pieces, (torch.float32, torch.float32), lambda t: t, numels=(6, 6),
                              shapes=((2, 3), (2, 3)))
    tx = make()
    with sharding.installed(rules), sharding.stepping([whole]):
        tx.update([whole], tx.init([whole]), [whole])  # a whole tensor steps
    with sharding.installed(rules), sharding.stepping([half]), pytest.raises(ValueError, match=name):
        tx.update([half], tx.init([half]), [half])


@pytest.mark.parametrize("make", [
    lambda: F.centralize(), lambda: F.clip_by_block_rms(0.05), lambda: F.adaptive_grad_clip(0.1),
    lambda: F.chain(F.adaptive_grad_clip(0.1), F.centralize(), F.clip_by_block_rms(0.05)),
])
def test_axis_rules_over_pieces_equal_the_whole_tensors(make):
    """Rows, units and mean squares summed out of pieces cut anywhere (mid-row, mid-unit, several
    tensors in one leaf, padding) equal the whole tensors' (here one process holds every piece:
    the ranks' sum is the identity)."""
    from zero.functional import sharding

    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 5), (3, 2, 2), (2, 3, 2, 3), (7,)]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    flat_g, flat_p = torch.cat([g.reshape(-1) for g in grads]), torch.cat([p.reshape(-1) for p in params])
    cuts, numels = [0, 7, 23, 40, len(flat_g)], [g.numel() for g in grads]
    starts = [sum(numels[:t]) for t in range(len(shapes))]
    leaves, pieces = [], {}
    for lo, hi in zip(cuts, cuts[1:]):  # each leaf: a run of the concatenated tensors, then 2 of padding
        ts = [t for t in range(len(shapes)) if starts[t] < hi and starts[t] + numels[t] > lo]
        spans = [(max(lo, starts[t]), min(hi, starts[t] + numels[t])) for t in ts]
        leaf_g = torch.cat([flat_g[lo:hi], torch.zeros(2, dtype=torch.float64)])
        leaf_p = torch.cat([flat_p[lo:hi], torch.zeros(2, dtype=torch.float64)])
        piece = sharding.Pieces(tuple(ts), tuple(b - a for a, b in spans), tuple(a - starts[t] for t, (a, _) in
                                                                                zip(ts, spans)))
        pieces[id(leaf_p)] = piece
        leaves.append((leaf_g, leaf_p))
    rules = sharding.Sharding(pieces, (torch.float64,) * len(shapes), lambda t: t, numels=tuple(numels),
                              shapes=tuple(shapes))
    tx = make()
    expected, _ = tx.update(grads, tx.init(params), params)
    lp = [p for _, p in leaves]
    with sharding.installed(rules), sharding.stepping(lp):
        out, _ = tx.update([g for g, _ in leaves], tx.init(lp), lp)
    got = torch.cat([o[:-2] for o in out])
    torch.testing.assert_close(got, torch.cat([e.reshape(-1) for e in expected]), rtol=1e-12, atol=1e-14)
    assert all(torch.equal(o[-2:], torch.zeros(2, dtype=torch.float64)) for o in out)  # padding stays 0


@pytest.mark.parametrize("make", [lambda: F.lamb(1e-2), lambda: F.contrib.shampoo(1e-2, start_preconditioning_step=1)],
                         ids=["lamb", "shampoo's graft"])
def test_per_tensor_norms_over_pieces_and_a_leaf_of_padding_only(make):
    """Per-tensor norms (LAMB's trust ratio, Shampoo's graft: these small tensors take no factor)
    out of pieces equal the whole tensors'; a leaf holding padding only (a rank's shard past the
    last param) steps to zeros. Its empty piece list once made a float ``lengths`` tensor, which
    ``repeat_interleave`` refused."""
    from zero.functional import sharding

    gen = torch.Generator().manual_seed(1)
    shapes = [(4, 5), (3, 2, 2), (7,)]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    flat_g, flat_p = torch.cat([g.reshape(-1) for g in grads]), torch.cat([p.reshape(-1) for p in params])
    half = 19  # the first leaf: all of the matrix but its last element; the second: the rest
    leaves_g = [flat_g[:half].clone(), flat_g[half:].clone(), torch.zeros(4, dtype=torch.float64)]
    leaves_p = [flat_p[:half].clone(), flat_p[half:].clone(), torch.zeros(4, dtype=torch.float64)]
    pieces = {id(leaves_p[0]): sharding.Pieces((0,), (19,), (0,)),
              id(leaves_p[1]): sharding.Pieces((0, 1, 2), (1, 12, 7), (19, 0, 0)),
              id(leaves_p[2]): sharding.Pieces((), (), ())}  # padding only
    rules = sharding.Sharding(pieces, (torch.float64,) * 3, lambda t: t, numels=(20, 12, 7), shapes=tuple(shapes))
    tx = make()
    expected, _ = tx.update(grads, tx.init(params), params)
    with sharding.installed(rules), sharding.stepping(leaves_p):
        out, _ = tx.update(leaves_g, tx.init(leaves_p), leaves_p)
    torch.testing.assert_close(torch.cat(out[:2]), torch.cat([e.reshape(-1) for e in expected]), rtol=1e-12,
                               atol=1e-14)
    assert torch.equal(out[2], torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("make, words", [
    (lambda: F.scale_by_lion(mode="sharp"), "mode must be one of"),
    (lambda: F.polyak_sgd(variant="sps-"), "variant must be 'sps' or 'sps+'"),
    (lambda: F.apply_every(0), "k >= 1"),
    (lambda: F.named_chain(("a", F.sgd(0.1)), ("a", F.adam(0.1))), "unique names"),
    (lambda: F.piecewise_interpolate_schedule("cubic", 1.0), "'cosine' or 'linear'"),
    (lambda: F.linear_onecycle_schedule(0, 1.0), "transition_steps > 0"),
    (lambda: F.adam(0.1, mu_dtype="float99"), "mu_dtype must be a torch.dtype or a dtype name"),
])
def test_new_rules_name_bad_arguments_when_built(make, words):
    with pytest.raises((ValueError, TypeError), match=re.escape(words)):
        make()


def test_extra_args_reach_the_links_that_take_them_and_no_others():
    seen = []

    def update(updates, state, params=None, *, loss, **extra_args):
        seen.append(loss)
        return updates, state

    needs_loss = F.GradientTransformation(lambda p: (), update)
    tx = F.chain(F.adam(0.1), needs_loss, F.scale(2.0))  # adam and scale take no extra args
    p = torch.ones(2)
    tx.update(p, tx.init(p), p, loss=3.0, ignored="x")
    assert seen == [3.0]
    with pytest.raises(TypeError, match="loss"):
        needs_loss.update(p, (), p)  # the link itself still requires it


@pytest.mark.parametrize("make, match", [
    (lambda: F.adamw(lr=1e-3), r"adamw\(\): missing a required argument: 'learning_rate' "
                               r"\(Optax's name is learning_rate; got lr"),
    (lambda: F.adam(1e-3, betas=(0.9, 0.99)), r"Optax's name is b1 and b2; got betas"),
    (lambda: F.rmsprop(1e-3, alpha=0.9), r"Optax's name is decay; got alpha"),
    (lambda: F.adamw("1e-3"), r"learning_rate must be a number or a schedule, got str"),
    (lambda: F.adam(1e-3, b1="0.9"), r"b1 must be a number, got str '0.9'"),
    (lambda: F.from_torch(torch.optim.AdamW, lr="1e-3"), r"lr must be a number, got str '1e-3'"),
    (lambda: F.from_torch(torch.optim.AdamW, lr=1e-3, eps=None), r"eps must be a number, got NoneType"),
])
def test_torch_habits_get_a_message_naming_the_setting(make, match):
    with pytest.raises(TypeError, match=match):
        make()


CHAINS_WITH_ONE_RATE = {
    "readme chain": lambda lr: F.chain(F.clip_by_global_norm(100.0), F.adamw(lr, weight_decay=0.1)),
    "injected link": lambda lr: F.chain(F.clip_by_global_norm(100.0),
                                        F.inject_hyperparams(F.adamw)(learning_rate=lr, weight_decay=0.1)),
    "from_torch link": lambda lr: F.chain(F.clip_by_global_norm(100.0),
                                          F.from_torch(torch.optim.AdamW, lr=lr, weight_decay=0.1)),
    "nested chain": lambda lr: F.chain(F.clip_by_global_norm(100.0), F.chain(F.identity(),
                                                                             F.adamw(lr, weight_decay=0.1))),
}


@pytest.mark.parametrize("name", sorted(CHAINS_WITH_ONE_RATE))
@pytest.mark.parametrize("where", ["Optimizer", "ZeroRedundancyOptimizer"])
def test_an_lr_scheduler_drives_a_chain_with_one_learning_rate(name, where, one_rank):
    """The README's chain under torch's LambdaLR steps as torch's AdamW under the same schedule
    (the clip's bound is not reached): the chain's one learning rate is the group's ``lr``."""
    from zero.backends import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    start = [torch.randn(5, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    ends = []
    for kind in (where, "torch"):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        if kind == "torch":
            opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)
        elif kind == "Optimizer":
            opt = F.Optimizer(params, CHAINS_WITH_ONE_RATE[name](0.1))
        else:
            opt = ZeroRedundancyOptimizer(params, CHAINS_WITH_ONE_RATE[name](0.1))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        for step in range(5):
            torch.manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**5)
        ends.append(params)
    for ours, theirs in zip(*ends):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


def test_a_chain_with_two_learning_rates_says_how_to_choose():
    tx = F.chain(F.adam(1e-3), F.sgd(0.1))
    with pytest.raises(ValueError, match=r"learning rate in more than one link \(link 0 \(adam\), link 1 \(sgd\)\)"
                                         r".*inject_hyperparams\(lambda learning_rate"):
        F.Optimizer([torch.nn.Parameter(torch.ones(2))], tx)


@pytest.mark.parametrize("make", [lambda s: F.adamw(s), lambda s: F.chain(F.clip_by_global_norm(1.0), F.adamw(s))],
                         ids=["alias", "chain"])
def test_a_scheduled_learning_rate_shows_in_the_group_and_refuses_a_torch_scheduler(make):
    """The group's lr is the schedule's value at the last step; a torch scheduler setting it
    would be ignored (the schedule decides), so the next step says so."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = F.Optimizer([p], make(F.linear_schedule(0.1, 0.0, 10)))
    seen = []
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.1, 0.09, 0.08])
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"'lr' was set to 0\.04.*follows the transformation's own schedule"):
        opt.step()


def test_a_gradient_that_is_none_where_the_params_hold_a_tensor_is_named():
    """Same leaf paths, one of them None (a param without a gradient): the error names where, not
    'missing nothing; unexpected nothing'."""
    tx = F.adam(1e-3)
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"None where the other holds a tensor at \['b'\]"):
        tx.update({"a": torch.zeros(2), "b": None}, tx.init(params), params)
