"""Post-local SGD at the boundary: bad input, the DDP hook pairing, checkpoints (one gloo rank)."""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

from zero.backends import (
    HierarchicalModelAverager,
    PeriodicModelAverager,
    PostLocalSGDOptimizer,
    average_parameters,
    comm,
)

pytestmark = pytest.mark.usefixtures("one_rank")


def sgd():
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("make, error, match", [
    (lambda: PeriodicModelAverager(0), ValueError, "period must be >= 1, got 0"),
    (lambda: PeriodicModelAverager(2.5), TypeError, "period must be an int, got 2.5"),
    (lambda: PeriodicModelAverager(2, warmup_steps=-3), ValueError, "warmup_steps must be >= 0, got -3"),
    (lambda: HierarchicalModelAverager({2: 2}), ValueError, "last group size .* is 2, but the process group has 1"),
    (lambda: HierarchicalModelAverager({}), ValueError, "non-empty"),
    (lambda: average_parameters(torch.ones(2)), TypeError, "not a single tensor"),
    (lambda: average_parameters([torch.ones(2), "w"]), TypeError, r"params\[1\] is a str"),
    (lambda: PostLocalSGDOptimizer([torch.ones(2)], PeriodicModelAverager(2)), TypeError, "optim must be"),
    (lambda: PostLocalSGDOptimizer(sgd(), object()), TypeError, "averager must be a model averager"),
])
def test_bad_input_names_itself(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_period_one_warns_like_torch():
    with pytest.warns(UserWarning, match="period=1"):
        PeriodicModelAverager(1)


def test_hook_and_averager_must_agree_on_the_start_of_local_sgd():
    state = PostLocalSGDState(None, None, start_localSGD_iter=5)
    with pytest.raises(ValueError, match="starts local SGD at iteration 5 but the averager's warmup_steps is 10"):
        PostLocalSGDOptimizer(sgd(), PeriodicModelAverager(4, warmup_steps=10), hook_state=state)


def test_a_fresh_hook_after_resuming_is_caught_and_load_state_dict_moves_it():
    averager = PeriodicModelAverager(4, warmup_steps=3)
    averager.step = 8  # resumed past the warm-up, but DDP's hook state starts again at 0
    state = PostLocalSGDState(None, None, start_localSGD_iter=3)
    with pytest.raises(ValueError, match=r"past its warm-up \(step 8\) but post_localSGD_hook is still all-reducing"):
        PostLocalSGDOptimizer(sgd(), averager, hook_state=state)
    averager.step = 0
    opt = PostLocalSGDOptimizer(sgd(), averager, hook_state=state)
    sd = opt.state_dict()
    sd["step"] = 8
    opt.load_state_dict(sd)
    assert (averager.step, state.iter) == (8, 3)
    opt.step()  # agrees now


def test_a_hook_ahead_of_the_averager_is_caught():
    averager = PeriodicModelAverager(4, warmup_steps=10)
    state = PostLocalSGDState(None, None, start_localSGD_iter=10)
    opt = PostLocalSGDOptimizer(sgd(), averager, hook_state=state)
    state.iter = 10  # e.g. ten backward passes per optimizer step
    with pytest.raises(ValueError, match=r"has started local SGD \(iter 10\) but the averager is still warming up"):
        opt.step()


def test_state_dict_carries_the_step_and_a_missing_step_warns():
    opt = PostLocalSGDOptimizer(sgd(), PeriodicModelAverager(2, warmup_steps=1))
    for _ in range(3):
        opt.step()
    sd = opt.state_dict()
    assert sd["step"] == 3 and opt.averager.step == 3
    del sd["step"]
    with pytest.warns(UserWarning, match="no 'step' for the model averager"):
        opt.load_state_dict(sd)
    assert opt.averager.step == 0


def test_lr_schedulers_and_closures_reach_the_local_optimizer():
    local = sgd()
    opt = PostLocalSGDOptimizer(local, PeriodicModelAverager(2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert opt.step(lambda: torch.tensor(7.0)) == 7.0
    sched.step()
    assert local.param_groups[0]["lr"] == 0.05
    with pytest.raises(TypeError, match="SGD keeps its whole state"):
        opt.consolidate_state_dict()


def test_one_all_reduce_per_dtype_and_frozen_params_untouched(monkeypatch):
    calls = []
    monkeypatch.setattr(comm, "all_reduce_sum", lambda t, g: calls.append(t.dtype))
    params = [torch.ones(3, dtype=d, requires_grad=True) for d in (torch.float32, torch.bfloat16, torch.float64,
                                                                    torch.float32, torch.float16)]
    frozen = torch.ones(2, requires_grad=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    assert average_parameters(params + [frozen]) == 4
    assert calls == [torch.float32, torch.float32, torch.float64, torch.float32], "16-bit floats sum in float32"
    assert all(p.dtype == d for p, d in zip(params, (torch.float32, torch.bfloat16, torch.float64)))


def test_state_dict_with_a_functional_local_optimizer_loads_with_weights_only(tmp_path):
    import zero.functional as F

    def make():
        model = nn.Linear(3, 2)
        return model, PostLocalSGDOptimizer(F.Optimizer(model.parameters(), F.adam(0.1)), PeriodicModelAverager(2))

    model, opt = make()
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    _, again = make()
    again.load_state_dict(torch.load(tmp_path / "opt.pt"))  # weights_only=True, torch's default
    assert again.averager.step == 3
