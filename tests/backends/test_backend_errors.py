"""Bad input to zero.ZeroRedundancyOptimizer: a specific error at the boundary (one gloo rank, in process)."""


import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero

pytestmark = pytest.mark.usefixtures("one_rank")


def params():
    return list(nn.Linear(3, 2).parameters())


@pytest.mark.parametrize("bad, error, match", [
    ([], ValueError, "empty parameter list"),
    ((p for p in []), ValueError, "empty parameter list"),
    (torch.ones(2, requires_grad=True), TypeError, "not a single tensor"),
    ([torch.ones(2), "w"], TypeError, r"params\[1\] is a str"),
    ([torch.ones(2).to_sparse()], ValueError, "sparse"),
    (42, TypeError, "got int"),
    ([{"lr": 1.0}], ValueError, "group 0 has no 'params'"),
    ([torch.ones(2), {"params": [torch.ones(2)]}], TypeError, "mixes tensors and param-group dicts"),
    ([torch.ones(4, 3).t().requires_grad_()], ValueError, "not contiguous"),
])
def test_bad_params(bad, error, match):
    with pytest.raises(error, match=match):
        Zero(bad, torch.optim.SGD, lr=0.1)


def test_fsdp2s_dtensor_params_beside_plain_ones_are_named():
    """FSDP2's params are DTensors, which ZeRO steps over FSDP2's mesh (`zero.backends.fsdp2`): a
    plain param beside them is a ValueError naming both, at construction, not DTensor's 'got mixed
    torch.Tensor and DTensor' from inside a step."""
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(model[1])
    with pytest.raises(ValueError, match=r"plain param '0.weight' beside sharded param '1.weight'"):
        Zero(model, torch.optim.AdamW, lr=0.1)
    fully_shard(model)
    opt = Zero(model, torch.optim.AdamW, lr=0.1)
    assert isinstance(opt, Zero) and opt.executor.plan.replicas == 1


@pytest.mark.parametrize("make", [lambda m: Zero(m, torch.optim.AdamW, lr=0.1),
                                  lambda m: Zero(m, zf.adamw(0.1, weight_decay=0.01)),
                                  lambda m: zf.Optimizer(m, zf.adamw(0.1, weight_decay=0.01))])
def test_a_module_is_its_named_params(make):
    """``Optimizer(model, ...)`` takes the model's named params, as ``model.named_parameters()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    twin = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    twin.load_state_dict(model.state_dict())
    opts = [make(model), torch.optim.AdamW(twin.named_parameters(), lr=0.1)]
    assert opts[0].param_groups[0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    x = torch.randn(4, 3)
    for _ in range(3):
        for m, opt in zip((model, twin), opts):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_param_repeated_across_groups():
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"params\[1\] is the same tensor as params\[0\]"):
        Zero([{"params": [w]}, {"params": [w]}], torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(optimizer_class=3), TypeError, "optimizer_class must be"),
    (dict(optimizer_class=zf.sgd(0.1), lr=0.1), TypeError, "takes no keyword hyperparameters"),
    (dict(optimizer_class=torch.optim.SGD, lr=0.1, strategy="random"), ValueError, "unknown strategy 'random'"),
    (dict(optimizer_class=torch.optim.SGD, lr=0.1, overlap_with_ddp=True, strategy="flat"), ValueError,
     "overlap_with_ddp=True steps whole params"),
    (dict(optimizer_class=torch.optim.SGD, lr=0.1, sync_chunk_mb=0, parameters_as_bucket_view=False), ValueError,
     "sync_chunk_mb must be a positive number, got 0"),
    (dict(optimizer_class=torch.optim.SGD, lr=0.1, sync_chunk_mb=4), ValueError,
     "sync_chunk_mb=4 sizes the scratch rows of parameters_as_bucket_view=False"),
    (dict(optimizer_class=torch.optim.SGD, lr=0.1, parameters_as_bucket_view=1), TypeError,
     "parameters_as_bucket_view must be None, True or False, got 1"),
])
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        Zero(params(), **kwargs)


def test_needs_a_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        Zero(params(), torch.optim.SGD, lr=0.1)


def test_state_dict_without_consolidating_is_this_ranks_part_and_a_bad_target_is_named():
    """torch's ZeRO raises at ``state_dict()`` before ``consolidate_state_dict``; zero's is this
    rank's part in torch's form (what torch's ``get_state_dict`` saves), naming its layout."""
    opt = Zero(params(), torch.optim.Adam, lr=0.1)
    sd = opt.state_dict()
    assert sd["sharded_layout"].startswith("rank 0 of ZeRO plan ") and len(sd["state"]) == len(opt.all_params())
    with pytest.raises(ValueError, match=r"to must be in \[0, 1\), got 3"):
        opt.consolidate_state_dict(to=3)


def test_state_dict_from_a_different_model():
    small, other = nn.Linear(3, 2), nn.Linear(4, 2)
    opt = Zero(small.parameters(), torch.optim.Adam, lr=0.1)
    foreign = torch.optim.Adam(other.parameters(), lr=0.1)
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    foreign.step()
    with pytest.raises(ValueError, match=r"'exp_avg' for param 0 has shape \(2, 4\) but the param has shape \(2, 3\)"):
        opt.load_state_dict(foreign.state_dict())
    three = torch.optim.Adam([*other.parameters(), nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"param groups of sizes \[3\] but this optimizer has \[2\]"):
        opt.load_state_dict(three.state_dict())
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"params": []})


def test_functional_state_of_the_earlier_form_reloads_only_onto_its_plan():
    """A consolidated state dict of a `zero.functional` rule saved by an earlier zero (its local
    states as they were, ``tx_states``, with the owners they reload onto) loads onto the same
    placement, and elsewhere is an error that says so; today's per-param form loads anywhere,
    and into a torch class it is an error naming what each keeps."""
    model = nn.Linear(3, 2)
    opt = Zero(model.parameters(), zf.adam, learning_rate=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.consolidate_state_dict()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    local = [dict(opt.optim.set_states(k)) for k in range(len(opt.optim.param_groups))]
    earlier = {"state": {}, "param_groups": sd["param_groups"], "tx_states": [local], "owner": [0, 0]}
    opt.load_state_dict(earlier)  # the same owners: fine
    with pytest.raises(ValueError, match="same plan and world size"):
        opt.load_state_dict({**earlier, "owner": [1, 0]})
    with pytest.raises(ValueError, match=r"has \['count', .*'inner_state.0.mu', 'inner_state.0.nu'\] but Adam keeps"):
        Zero(nn.Linear(3, 2).parameters(), torch.optim.Adam, lr=0.1).load_state_dict(sd)


def test_one_rank_steps_like_the_local_optimizer_and_exposes_its_keys():
    a, b = nn.Linear(5, 4), nn.Linear(5, 4)
    b.load_state_dict(a.state_dict())
    ours = Zero(a.parameters(), torch.optim.Adam, lr=0.1, parameters_as_bucket_view=True)
    ref = torch.optim.Adam(b.parameters(), lr=0.1)
    assert ours.param_groups[0]["betas"] == (0.9, 0.999) and "amsgrad" in ours.param_groups[0]
    for _ in range(3):
        for m in (a, b):
            m.zero_grad()
            m(torch.ones(2, 5)).sum().backward()
        ours.step()
        ref.step()
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    assert isinstance(zero.ZeroRedundancyOptimizer, type)


def test_closure_and_kwargs_reach_the_local_optimizer():
    model = nn.Linear(2, 1)
    opt = Zero(model.parameters(), torch.optim.LBFGS, lr=0.5)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(3, 2)).square().sum()
        loss.backward()
        return loss

    first = opt.step(closure)
    assert isinstance(first, torch.Tensor) and opt.step(closure) < first


def test_fused_adam_state_reloads_where_the_kernel_needs_it():
    a = nn.Linear(4, 3)
    opt = Zero(a.parameters(), torch.optim.Adam, lr=0.1, fused=True)
    for p in a.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.consolidate_state_dict()
    b = nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    again = Zero(b.parameters(), torch.optim.Adam, lr=0.1, fused=True)
    again.load_state_dict(opt.state_dict())
    for m, o in ((a, opt), (b, again)):
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.5)
        o.step()
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    assert all(st["step"].device == p.device for p, st in again.optim.state.items())


@pytest.mark.parametrize("bucket_view, expected", [(False, {"all_gather_rows": 1, "broadcast_from": 1}),
                                                    (True, {"all_gather_rows": 1}), (None, {"all_gather_rows": 1})])
def test_collectives_per_step(bucket_view, expected, monkeypatch):
    """Without bucket views the large weight is broadcast on its own and the rest packed into one
    row collective; with them, and by default while the rows do not pad (one rank: never),
    everything is one row collective. Counted as the step runs."""
    from zero.backends import comm

    calls = []
    for name in ("all_gather_rows", "broadcast_from"):
        real = getattr(comm, name)
        monkeypatch.setattr(comm, name, lambda *a, name=name, real=real, **k: calls.append(name) or real(*a, **k))
    model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 4))
    opt = Zero(model.parameters(), torch.optim.SGD, lr=0.1, parameters_as_bucket_view=bucket_view)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert {n: calls.count(n) for n in set(calls)} == expected


def test_process_group_must_be_a_process_group():
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup .* got 'world'"):
        Zero(params(), torch.optim.SGD, process_group="world", lr=0.1)


def test_a_state_dict_of_another_optimizer_is_rejected_at_load_naming_it():
    model = nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sgd.step()
    opt = Zero(model.parameters(), torch.optim.AdamW, lr=0.1)
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(sgd.state_dict())
    words = "missing ['exp_avg', 'exp_avg_sq', 'step']"
    assert words in str(info.value) and "torch.optim.SGD" in str(info.value), str(info.value)


@pytest.mark.parametrize("saved_by, decoupled, named", [
    (torch.optim.AdamW, True, "by another optimizer, torch.optim.AdamW judging"),
    (torch.optim.Adam, False, "by another optimizer, torch.optim.Adam judging"),
    (torch.optim.AdamW, None, "by another optimizer, torch.optim.Adam or torch.optim.AdamW judging"),
])
def test_adam_and_adamw_state_loaded_into_sgd_is_named_by_its_settings(saved_by, decoupled, named):
    model = nn.Linear(3, 2)
    theirs = saved_by(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    theirs.step()
    saved = theirs.state_dict()
    if decoupled is None:  # as torch before 2.6 saved it
        del saved["param_groups"][0]["decoupled_weight_decay"]
    opt = Zero(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=named):
        opt.load_state_dict(saved)


def test_an_lr_scheduler_drives_a_from_optax_local_optimizer():
    optax = pytest.importorskip("optax", reason="needs the zero[jax] extra")
    w = nn.Parameter(torch.ones(2))
    opt = Zero([w], zf.from_optax(optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for expected in (0.0, -0.5):
        w.grad = torch.ones(2)
        opt.step()
        sched.step()
        assert torch.equal(w.detach(), torch.full((2,), expected))


@pytest.mark.parametrize("optimizer_class, kwargs", [(torch.optim.Adam, {"lr": 0.1}),
                                                     (zf.adamw, {"learning_rate": 0.1})])
def test_consolidated_state_dicts_load_with_weights_only(optimizer_class, kwargs, tmp_path):
    model = nn.Linear(3, 2)
    opt = Zero(model.parameters(), optimizer_class, **kwargs)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.consolidate_state_dict()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    again = Zero(nn.Linear(3, 2).parameters(), optimizer_class, **kwargs)
    again.load_state_dict(torch.load(tmp_path / "opt.pt"))  # weights_only=True, torch's default
    assert again.param_groups[0]["lr"] == 0.1


def test_optax_factories_say_to_wrap_them():
    optax = pytest.importorskip("optax", reason="needs the zero[jax] extra")
    with pytest.raises(TypeError, match=r"from_optax\(optax.adamw"):
        Zero(params(), optax.adamw, learning_rate=1e-3)


@pytest.mark.parametrize("options", [{}, {"parameters_as_bucket_view": True}, {"strategy": "flat"}])
@pytest.mark.parametrize("move", ["data", "to"])
def test_params_given_new_storage_after_construction_are_named(options, move):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = Zero(model.parameters(), torch.optim.SGD, lr=0.1, **options)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the views are intact: no error
    if move == "data":
        model[1].weight.data = model[1].weight.data.clone()
        culprit = 2
    else:
        model.to(torch.float64).to(torch.float32)
        culprit = 0
    with pytest.raises(ValueError, match=rf"params\[{culprit}\] was given new storage after the optimizer was built"):
        opt.step()


def test_own_storage_params_may_be_replaced():
    model = nn.Linear(3, 2)
    opt = Zero(model.parameters(), torch.optim.SGD, lr=0.1, parameters_as_bucket_view=False)
    model.weight.data = model.weight.data.clone()
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()


@pytest.mark.parametrize("kw", [{}, {"strategy": "flat"}, {"strategy": "flat", "master_dtype": torch.float32}],
                         ids=["whole", "flat", "flat+masters"])
def test_path_counts_the_kernel_calls_of_what_the_rank_steps(kw):
    """Flat shards and masters have no requires_grad of their own: the path still counts them."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2)).bfloat16()
    opt = Zero(model, zf.adamw(1e-3), **kw)
    assert opt.path[0].kernel == "_fused_adamw_" and opt.path[0].calls == 1, opt.path


@pytest.mark.parametrize("make, whole", [
    (lambda: zf.contrib.muon(0.02), ["0.weight", "2.weight"]),  # Muon's matrices
    (lambda: zf.adafactor(0.02, min_dim_size_to_factor=10), ["2.weight"]),  # Adafactor's factored matrix only
    (lambda: zf.sm3(0.02), ["0.weight", "2.weight"]),
    (lambda: zf.chain(zf.clip_by_global_norm(1.0), zf.contrib.muon(0.02)), ["0.weight", "2.weight"]),
    (lambda: zf.adamw(0.02), []),
], ids=["muon", "adafactor", "sm3", "clip+muon", "adamw"])
def test_a_flat_strategy_keeps_whole_what_the_rule_needs_whole(make, whole):
    """``strategy="flat"`` with a rule that needs whole tensors makes the hybrid plan itself, asking
    the rule (not a table of names); the step equals the rule run in one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 20))
    twin = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 20))
    twin.load_state_dict(model.state_dict())
    opt, ref = Zero(model, make(), strategy="flat"), zf.Optimizer(twin, make())
    assert [opt.plan.metas[i].name for i in opt.plan.whole] == whole
    assert (f"flat + {len(whole)} whole" in str(opt.plan)) == bool(whole)
    x = torch.randn(5, 8)
    for _ in range(3):
        for m, o in ((model, opt), (twin, ref)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
