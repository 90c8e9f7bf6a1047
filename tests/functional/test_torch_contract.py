"""torch's optimizer contract on `zero.functional.Optimizer`, one process (the sharded executors:
tests/backends/test_face_contract.py). ``optimizer.state`` is torch's live mapping, ``state_dict``
and ``load_state_dict`` torch's form, and torch's ``get_state_dict`` takes the state without
stepping; a rule that mirrors a ``torch.optim`` class trades state dicts with that class both ways.
In the spirit of torch's generic optimizer tests (``test/test_optim.py``): state_dict
determinism, load-then-step equal to uninterrupted, deepcopy, hooks, ``param_groups`` changes,
printing; over every rule of the registry."""

import copy
import io

import alias_cases
import pytest
import torch

import zero.functional as F

TORCH_CASES = {
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": dict(lr=1e-2, amsgrad=True, weight_decay=0.1),
    "AdamW": dict(lr=1e-2, weight_decay=0.05),
    "Adagrad": dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "Adadelta": dict(lr=0.5, weight_decay=0.01),
    "RMSprop": dict(lr=1e-2, centered=True, momentum=0.9),
    "Rprop": dict(lr=0.05),
    "Adamax": dict(lr=1e-2, weight_decay=0.01),
    "NAdam": dict(lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True),
    "RAdam": dict(lr=1e-2, weight_decay=0.01),
    "Muon": dict(lr=1e-2),
}
RULES = {**{name: (name, kw) for name, kw in {**alias_cases.ALIASES, **alias_cases.MORE_ALIASES,
                                              **alias_cases.CONTRIB}.items()},
         **{f"from_torch({name})": ("from_torch", dict(optimizer_class=name, **kw))
            for name, kw in TORCH_CASES.items()},
         "clip_by_global_norm + adamw": ("chain", [("clip_by_global_norm", dict(max_norm=0.5)),
                                                   ("adamw", dict(learning_rate=1e-2, weight_decay=0.1))])}
MATRICES_ONLY = {"from_torch(Muon)"}  # torch.optim.Muon steps 2-D params only


def make_rule(spec):
    name, args = spec
    if name == "chain":
        return F.chain(*map(make_rule, args))
    if name == "from_torch":
        args = dict(args)
        return F.from_torch(getattr(torch.optim, args.pop("optimizer_class")), **args)
    return getattr(F.contrib, name)(**args) if hasattr(F.contrib, name) else getattr(F, name)(**args)


def make_model(matrices_only: bool = False) -> torch.nn.Module:
    """Uneven shapes (a 64 x 48 weight holds whole low-bit blocks), float64, two named groups' worth."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(48, 64, bias=not matrices_only), torch.nn.Tanh(),
              torch.nn.Linear(64, 5, bias=not matrices_only)]
    return torch.nn.Sequential(*layers).double()


def grads_at(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def build(name: str, model: torch.nn.Module) -> F.Optimizer:
    return F.Optimizer(model.named_parameters(), make_rule(RULES[name]))


def run(name: str, steps: range, model=None, opt=None, between=None):
    model = model if model is not None else make_model(name in MATRICES_ONLY)
    opt = opt if opt is not None else build(name, model)
    for k in steps:
        if between is not None and k == steps[len(steps) // 2]:
            between(model, opt)
        grads_at(model, k)
        opt.step()
    return model, opt


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def state_tensors(sd: dict) -> list[torch.Tensor]:
    return [v for st in sd["state"].values() for v in st.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(RULES))
def test_get_state_dict_mid_run_returns_the_state_and_steps_nothing(one_rank, name):
    """torch's ``get_state_dict`` (torchtitan's checkpointer calls it at every save) returns every
    state tensor and leaves the run bit for bit as it was: before, zero's empty ``state`` made it
    run a zero-gradient lr=0 step, which moved a 10-step AdamW run by 7.2e-4."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    got = {}

    def probe(model, opt):
        got["sd"] = get_state_dict(model, opt)[1]

    plain, _ = run(name, range(6))
    probed, opt = run(name, range(6), between=probe)
    assert same(plain, probed), "get_state_dict changed the run"
    tensors = state_tensors(got["sd"])
    assert tensors and len(got["sd"]["state"]) == len(list(probed.parameters()))
    mine = [v for st in opt.state_dict()["state"].values() for v in st.values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == len(mine)


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_saved_state_dict_resumes_exactly_and_is_deterministic(name):
    """``torch.save(opt.state_dict())`` after 3 steps, loaded into a fresh optimizer built after
    the model (torch's habit), 3 more steps: bit for bit the uninterrupted run. Two state dicts
    of the same state are the same bytes."""
    whole, _ = run(name, range(6))
    model, opt = run(name, range(3))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    again = io.BytesIO()
    torch.save(opt.state_dict(), again)
    assert buf.getvalue() == again.getvalue(), "state_dict is not deterministic"
    fresh_model = make_model(name in MATRICES_ONLY)
    fresh = build(name, fresh_model)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    resumed, _ = run(name, range(3, 6), fresh_model, fresh)
    assert same(resumed, whole)


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
@pytest.mark.parametrize("direction", ["torch -> zero", "zero -> torch"])
def test_torch_and_zero_trade_state_dicts(name, direction):
    """torch.optim.X's state dict loads into from_torch(X) and the reverse (the same names, group
    keys and forms): each goes on as the other would from its own state dict, to the parity
    tests' bound."""
    cls, kw = getattr(torch.optim, name), TORCH_CASES[name]
    matrices = name == "Muon"

    def torchs(model):
        return cls(model.named_parameters(), **kw)

    def zeros(model):
        return F.Optimizer(model.named_parameters(), F.from_torch(cls, **kw))

    first, second = (torchs, zeros) if direction == "torch -> zero" else (zeros, torchs)
    theirs = continued(name, first, second, matrices)
    own = continued(name, second, second, matrices)  # (torch's own reload casts NAdam's mu_product to float64)
    for a, b in zip(theirs.parameters(), own.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def continued(name, first, second, matrices):
    """3 steps of ``first``, its state dict loaded into ``second`` (built after the model), 3 more."""
    model = make_model(matrices)
    _, opt = run(name, range(3), model, first(model))
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    other_model = make_model(matrices)
    other = second(other_model)
    other_model.load_state_dict(weights)
    other.load_state_dict(saved)
    return run(name, range(3, 6), other_model, other)[0]


def test_state_is_torchs_live_mapping():
    model, opt = run("from_torch(AdamW)", range(2))
    assert len(opt.state) == 4 and all(p in opt.state for p in model.parameters())
    weight = model[0].weight
    assert sorted(opt.state[weight]) == ["exp_avg", "exp_avg_sq", "step"]
    exp_avg = opt.state[weight]["exp_avg"]
    grads_at(model, 2)
    opt.step()
    assert opt.state[weight]["exp_avg"] is exp_avg, "a view of what the step uses, not a copy"
    assert float(opt.state[weight]["step"]) == 3.0
    assert opt.state[torch.zeros(2)] == {}  # not one of its params: torch's defaultdict answers {} too
    with pytest.raises(TypeError, match="a view of the rule's state"):
        opt.state[weight] = {}


def test_state_before_the_first_step_starts_it_without_stepping():
    """Reading ``state`` starts it as the first step would (zeros, count 0), never steps; and
    torchtitan's ``init_optim_state`` (a zero-gradient, lr=0 step when ``state`` is empty) finds it
    not empty: it steps nothing."""
    model = make_model()
    opt = build("adamw", model)
    before = copy.deepcopy(model)
    assert len(opt.state) == 4 and bool(opt.state)
    entry = opt.state[model[0].weight]
    assert int(entry["count"]) == 0 and not entry["inner_state.0.mu"].any()
    init_optim_state(opt)
    assert same(model, before) and all(p.grad is None for p in model.parameters())


def init_optim_state(optim):
    """torchtitan 0.3.0's ``components/optimizer/utils.py`` ``init_optim_state``, as it behaves
    (torch's ``_init_optim_state`` is the same): when ``optim.state`` is empty and no gradient is
    set, a zero-gradient step at lr=0."""
    if optim.state:
        return
    if any(p.grad is not None for g in optim.param_groups for p in g["params"]):
        return
    for g in optim.param_groups:
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optim.param_groups if "lr" in g]
    for g in optim.param_groups:
        if "lr" in g:
            g["lr"] = 0.0
    optim.step()
    for g in optim.param_groups:
        if "lr" in g:
            g["lr"] = lrs.pop(0)
    optim.zero_grad(set_to_none=True)


def test_group_settings_are_torchs_and_a_change_steps_at_the_next_step():
    """from_torch(AdamW)'s groups hold torch's keys; an lr scheduler's ``lr`` and a changed
    ``betas`` step at the next step as torch's class does; ``amsgrad`` (another state) is refused."""
    model = make_model()
    opt = F.Optimizer(model.named_parameters(), F.from_torch(torch.optim.AdamW, lr=1e-2))
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.named_parameters(), lr=1e-2)
    assert set(opt.param_groups[0]) == set(ref.param_groups[0])
    for k in range(4):
        for o in (opt, ref):
            o.param_groups[0]["lr"] = 1e-2 / (k + 1)
            o.param_groups[0]["betas"] = (0.9 - 0.1 * k, 0.999)
        for m, o in ((model, opt), (ref_model, ref)):
            grads_at(m, k)
            o.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"param group 0's 'amsgrad' changed from False to True"):
        opt.step()


def test_hooks_deepcopy_and_printing():
    model, opt = run("adamw", range(2))
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "mine": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    grads_at(model, 2)
    opt.step()
    sd = opt.state_dict()
    assert sd["mine"] == 1
    opt.load_state_dict(sd)
    assert calls == ["pre", "post", "sd pre", "load pre", "load post"]
    twin = copy.deepcopy(opt)
    for p, q in zip(twin.all_params(), opt.all_params()):
        assert p is not q and torch.equal(p, q)
    for a, b in zip(twin.state.values(), opt.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "Optimizer (" in repr(opt) and "Parameter Group 0" in repr(opt)


def test_a_state_dict_of_other_params_or_another_rule_is_refused_by_name():
    model, opt = run("adamw", range(2))
    sd = opt.state_dict()
    other = build("sgd", make_model())
    with pytest.raises(ValueError, match=r"param group 0 sets \['b1', 'b2', 'eps', 'eps_root', 'weight_decay'\], "
                                         r"which this optimizer's group does not have \(its settings: \['lr', "
                                         r"'momentum'\]\)"):
        other.load_state_dict(sd)  # (adamw's settings in sgd's groups: they would be ignored)
    same_settings = F.Optimizer(make_model().named_parameters(),
                                F.inject_hyperparams(F.sgd)(learning_rate=0.1, momentum=0.9))
    sd["param_groups"][0] = {k: v for k, v in sd["param_groups"][0].items() if k in ("lr", "params", "param_names")}
    with pytest.raises(ValueError, match=r"has no 'inner_state\.0\.trace' for param 0 \('0\.weight'\) .*saved by "
                                         r"another rule or optimizer than zero\.functional\.sgd"):
        same_settings.load_state_dict(sd)
    keeps_less = F.Optimizer(make_model().named_parameters(), F.inject_hyperparams(F.sgd)(learning_rate=0.1))
    with pytest.raises(ValueError, match=r"the state dict's \['inner_state\.0\.count', 'inner_state\.0\.mu', "
                                         r"'inner_state\.0\.nu'\] for param 0 \('0\.weight'\), which "
                                         r"zero\.functional\.sgd does not keep"):
        keeps_less.load_state_dict(sd)
    one = F.Optimizer([torch.nn.Parameter(torch.zeros(2))], F.adamw(1e-2))
    with pytest.raises(ValueError, match=r"param groups hold \[4\] params and this optimizer's \[1\]"):
        one.load_state_dict(sd)


def test_a_state_read_before_the_first_step_leaves_that_steps_set_free():
    """Reading ``state`` (torch's ``get_state_dict`` at step 0) starts every trainable param's
    state; a first step whose gradients reach only some params (an unused layer) still steps them
    alone, as it would have without the read. A stepped or loaded state's set must repeat."""
    model = make_model()
    opt = build("adamw", model)
    assert len(opt.state) == 4 and int(opt.state[model[0].weight]["count"]) == 0  # started
    grads_at(model, 0)
    model[2].weight.grad = model[2].bias.grad = None  # the last layer unused at this step
    opt.step()
    assert list(opt.set_states(0)) == [(0, 1)]
    grads_at(model, 1)
    with pytest.raises(ValueError, match=r"params \[0, 1, 2, 3\] are stepped together, but some were stepped before "
                                         r"with \[\(0, 1\)\]"):
        opt.step()
