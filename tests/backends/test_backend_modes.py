"""`ZeroRedundancyOptimizer` holds one mode (`zero.backends.modes`), chosen once from the plan and the
options; what each mode refuses, it refuses by name (one gloo rank, in process)."""

import pytest
import torch
from torch import nn

from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import modes

pytestmark = pytest.mark.usefixtures("one_rank")


def params():
    return list(nn.Linear(3, 2).parameters())


@pytest.mark.parametrize("options, mode", [
    ({}, modes.WholeParams),
    ({"strategy": "greedy", "parameters_as_bucket_view": False}, modes.WholeParams),
    ({"strategy": "flat"}, modes.FlatShards),
    ({"strategy": "flat", "reduce_scatter_grads": True}, modes.ReduceScatteredShards),
    ({"overlap_with_ddp": True}, modes.DDPOverlap),
])
def test_the_plan_and_the_options_choose_one_mode(options, mode):
    opt = Zero(params(), torch.optim.SGD, lr=0.1, **options)
    assert type(opt.mode) is mode
    assert opt.plan is opt.mode.plan


def test_add_param_group_under_overlap_is_refused_by_name():
    # The local optimizer of overlap_with_ddp steps stand-ins for the params DDP's buckets give
    # this rank: a new group would need new buckets, so it is a clear error, not a silent half-step.
    opt = Zero(params(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    with pytest.raises(ValueError, match="add_param_group with overlap_with_ddp=True"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    assert len(opt.param_groups) == 1 and len(opt.optim.param_groups) == 1


def test_a_whole_param_mode_grows_with_a_group_and_steps_it():
    ps = params()
    opt = Zero(ps, torch.optim.SGD, lr=0.5)
    extra = nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra], "lr": 0.25})
    assert opt.mode.params[-1] is extra and len(opt.plan.partition.owner) == 3
    for p in [*ps, extra]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(extra.detach(), torch.full((2,), 0.75))


class CountingSGD(torch.optim.SGD):
    """An optimizer that writes into its param groups while stepping (torch's ZeRO exposes such keys)."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["steps_seen"] = group.get("steps_seen", 0) + 1
        return super().step(closure)


@pytest.mark.parametrize("options", [{}, {"strategy": "flat"}, {"strategy": "flat", "reduce_scatter_grads": True}])
def test_keys_the_local_optimizer_sets_while_stepping_reach_param_groups(options):
    ps = params()
    opt = Zero(ps, CountingSGD, lr=0.1, **options)
    for step in range(1, 3):
        for p in ps:
            p.grad = torch.ones_like(p)
        if options.get("reduce_scatter_grads"):  # the gradients are the reduce-scattered ones: run a backward
            opt.zero_grad()
            sum(p.sum() for p in ps).backward()
        opt.step()
        assert opt.param_groups[0]["steps_seen"] == step


def test_reduce_scatter_grads_under_ddp_is_refused_at_the_first_forward():
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = nn.Linear(3, 2)
    ddp = DDP(model)
    opt = Zero(ddp.parameters(), torch.optim.SGD, strategy="flat", reduce_scatter_grads=True, lr=0.1)
    with pytest.raises(ValueError, match=r"also in a DistributedDataParallel model.*run the bare model \(ddp.module\)"):
        ddp(torch.ones(1, 3))
    bare = nn.Linear(3, 2)  # the bare model steps, and after the first step nothing is watched any more
    opt = Zero(bare.parameters(), torch.optim.SGD, strategy="flat", reduce_scatter_grads=True, lr=0.1)
    bare(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert opt.mode.gradients.ddp_watch.id not in torch.nn.modules.module._global_forward_pre_hooks


def test_places_name_the_rank_that_skipped_a_step_and_nothing_else():
    from zero.backends.consistency import Place

    stepping, skipping = Place("step", 2, 3), Place("backward", 2, 4)
    words = "rank 1 skipped step(): it has taken 2 steps and started backward pass 4, while rank 0 is in step 3"
    assert words in stepping.skipped_by(1, skipping, me=0)
    assert words in skipping.skipped_by(0, stepping, me=1)
    assert "backward pass 6" in Place("backward", 2, 6).skipped_by(0, stepping, me=1)  # several passes ahead
    assert stepping.skipped_by(1, Place("backward", 2, 3), me=0) is None  # the same pass: still to meet
    assert stepping.skipped_by(1, Place("backward", 1, 4), me=0) is None  # other counts: a stale place
    assert Place("backward", 2, 4).skipped_by(1, Place("backward", 2, 4), me=0) is None  # accumulating alike
    assert stepping.skipped_by(1, Place("step", 2, 3), me=0) is None
    assert Place("backward", 2, 4).reached(Place("step", 3, 4)) and not Place("backward", 2, 4).reached(stepping)
