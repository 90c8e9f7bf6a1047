"""The local optimizer takes torch's foreach step on the CPU where the user left ``foreach`` to torch:
only for the classes whose foreach step is bitwise their for-loop step (proven here, every option),
invisibly (the optimizer's groups and its state dict keep the user's ``None``)."""

import itertools
import os

import pytest
import torch
import zero_workers as w
from helpers import run_ranks

from zero.backends.local_optimizer import FOREACH_ON_CPU, choose_foreach
from zero.plans.local_step import FOREACH_MAX_BYTES, FOREACH_MEAN_BYTES, takes_foreach

OPTIONS = {
    "Adam": [dict(lr=1e-2, **o) for o in ({}, {"weight_decay": 0.1}, {"amsgrad": True}, {"maximize": True},
                                         {"weight_decay": 0.1, "decoupled_weight_decay": True, "amsgrad": True},
                                         {"betas": (0.8, 0.95), "eps": 1e-6})],
    "AdamW": [dict(lr=1e-2, **o) for o in ({}, {"weight_decay": 0.0}, {"amsgrad": True, "maximize": True})],
    "SGD": [dict(lr=1e-2, **o) for o in ({}, {"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.1},
                                        {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
                                        {"momentum": 0.9, "nesterov": True},
                                        {"momentum": 0.9, "maximize": True})],
}


def _trained(name, options, foreach, dtype, steps=12):
    torch.manual_seed(0)
    shapes = [(17, 5), (64,), (3, 4, 5), (1,)]
    params = [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]
    opt = getattr(torch.optim, name)(params, foreach=foreach, **options)
    g = torch.Generator().manual_seed(1)
    kept = True  # whether every step left the gradients as they were
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
        before = [p.grad.clone() for p in params]
        opt.step()
        kept &= all(torch.equal(p.grad, b) for p, b in zip(params, before))
    _trained.kept = kept
    return params, opt.state_dict()["state"]


def _zero_takes(name, options):
    opt = getattr(torch.optim, name)([torch.zeros(3, requires_grad=True)], **options)
    return choose_foreach(opt, {0})


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
        if _zero_takes(name, options):  # (SGD's nesterov foreach step adds into the gradients: not taken)
            assert _trained.kept, f"{name}({options}): the foreach step changed the user's gradients"


def test_bfloat16_keeps_the_for_loop():
    """In bfloat16 the foreach step differs from the for-loop in the last bit (SGD with momentum), so
    a bfloat16 group keeps torch's choice."""
    loop, _ = _trained("SGD", {"lr": 1e-2, "momentum": 0.9}, False, torch.bfloat16)
    each, _ = _trained("SGD", {"lr": 1e-2, "momentum": 0.9}, True, torch.bfloat16)
    assert not all(torch.equal(a, b) for a, b in zip(loop, each)), "bfloat16 became bitwise: widen FOREACH_ON_CPU"
    assert not takes_foreach("cpu", "bfloat16", [3]) and takes_foreach("cpu", "float32", [3])
    opt = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=1e-2, momentum=0.9)
    assert not choose_foreach(opt, ()) and opt.param_groups[0]["foreach"] is None
    assert choose_foreach(opt, {0}) and opt.param_groups[0]["foreach"] is True


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


def test_the_plan_says_which_groups_take_it():
    """Many small CPU tensors in float32 or float64 take the foreach step; large tensors (where
    it is slower: it leaves the caches the for-loop keeps warm), a group whose temporaries would
    pass `FOREACH_MAX_BYTES` and other dtypes keep the for-loop; the executor follows. On CUDA
    torch takes it by itself, and the plan says so."""
    small = [4096] * 100
    assert takes_foreach("cpu", "float32", small) and takes_foreach("cpu", "float64", small)
    assert not takes_foreach("cpu", "bfloat16", small) and not takes_foreach("meta", "float32", small)
    assert takes_foreach("cuda:0", "bfloat16", [2**22] * 8), "on CUDA torch's own default, whatever the sizes"
    assert not takes_foreach("cpu", "float32", [])
    mean = FOREACH_MEAN_BYTES // 4
    assert takes_foreach("cpu", "float32", [mean] * 4) and not takes_foreach("cpu", "float32", [mean + 1] * 4)
    most = FOREACH_MAX_BYTES // 4
    assert takes_foreach("cpu", "float32", [16] * (most // 16))
    assert not takes_foreach("cpu", "float32", [16] * (most // 16 + 1))
    from zero.plans.holdings import holdings
    from zero.plans.local_step import foreach_groups
    from zero.plans.meta import ParamMeta
    from zero.plans.plan import make_plan

    def taken(metas):
        plan = make_plan(metas, 1, optimizer="adamw")
        return foreach_groups(plan, holdings(plan, 0, 1))

    assert taken([ParamMeta(f"w{i}", (64, 64)) for i in range(8)]) == {0: ("cpu", 8 * 64 * 64 * 4)}
    assert taken([ParamMeta(f"w{i}", (512, 512)) for i in range(4)]) == {}, "large tensors keep the for-loop"
    assert taken([ParamMeta("a", (8,)), ParamMeta("b", (8,), "float64")]) == {}, "one dtype a group"


def _foreach_and_loop(metas, batch, strategy):
    """In a fresh process: the simulated run as zero runs it (foreach), and with the for-loop forced
    on the executor and the plan alike."""
    import zero.backends.rank_state as rank_state
    import zero.plans.footprint as footprint
    from zero.backends.simulate import simulate

    os.environ.pop("ZERO_SIMULATE_CACHE", None)  # (the same inputs both times)
    runs = [simulate(metas, 2, rank, strategy=strategy, batch=batch) for rank in range(2)]
    rank_state.foreach_groups = footprint.foreach_groups = lambda plan, held: {}  # the one answer both read
    return runs, [simulate(metas, 2, rank, strategy=strategy, batch=batch) for rank in range(2)]


@pytest.mark.parametrize("strategy", ["sorted_greedy", "flat"])
def test_the_plan_counts_the_foreach_temporaries_and_a_real_run_makes_them(strategy):
    """A small LLaMA of float32 tensors of 64-128 KiB, whose peak comes in the step: trained for
    real on 2 gloo ranks and simulated on fake tensors, the same peak (to the scalars a batch run
    makes), which the plan predicts to the same few bytes as it does the for-loop's; the foreach
    step's temporaries (a tensor the size of each the rank steps) are what moved it."""
    from test_simulate import _zero_real

    from zero.backends.fresh import in_fresh_process
    from zero.plans.presets import llama

    metas, batch = llama(128, 128, 2, 128, vocab=128, dtype="float32"), (1, 8)
    real = run_ranks(_zero_real, 2, metas, batch, strategy)
    foreach, loop = in_fresh_process(_foreach_and_loop, metas, batch, strategy)
    for rank, (sim, plain) in enumerate(zip(foreach, loop)):
        assert sim.predicted.phase == "step" and plain.predicted.phase == "step", sim.as_dict()
        assert 0 <= real[rank][0] - sim.measured_peak_bytes <= 1024, (rank, real, sim.as_dict())
        assert 0 <= sim.measured_peak_bytes - sim.predicted_peak_bytes <= 128, sim.as_dict()
        assert sim.measured_peak_bytes - sim.predicted_peak_bytes == \
            plain.measured_peak_bytes - plain.predicted_peak_bytes, (sim.as_dict(), plain.as_dict())
        stepped = sim.by_category["state"] // 2  # AdamW: two moments, a float32 step each tensor
        assert sim.predicted.peak - plain.predicted.peak > stepped // 2, "the foreach step's temporaries"


def _every_mode(metas):
    from zero.backends.simulate import simulate

    os.environ.pop("ZERO_SIMULATE_CACHE", None)
    square = lambda m: m.shape == (128, 128)  # noqa: E731
    modes = {"whole": {}, "flat": dict(strategy="flat"), "ZeRO-2": dict(strategy="flat", reduce_scatter_grads=True),
             "hybrid": dict(strategy="flat", whole=square),
             "hybrid ZeRO-2": dict(strategy="flat", whole=square, reduce_scatter_grads=True),
             "bf16, masters, ZeRO-2": dict(strategy="flat", reduce_scatter_grads=True, master_dtype=torch.float32,
                                           reduce_dtype=torch.float32, dtype=torch.bfloat16),
             "Adam": dict(optimizer="adam"), "SGD-momentum, flat": dict(optimizer="sgd_momentum", strategy="flat")}
    return {(name, rank): simulate(metas, 2, rank, **options) for name, options in modes.items() for rank in range(2)}


def test_the_plan_predicts_a_foreach_step_to_the_byte_in_every_mode():
    """Each mode steps the small LLaMA's groups with torch's foreach step (its pipelined ZeRO-2 one
    shard a call, a hybrid plan's every tensor in one call, masters in float32) and the plan predicts
    the simulated peak exactly, most of them in the step."""
    from zero.backends.fresh import in_fresh_process
    from zero.plans.presets import llama

    runs = in_fresh_process(_every_mode, llama(128, 128, 2, 128, vocab=128, dtype="float32"))
    for (name, rank), run in runs.items():
        assert run.measured_peak_bytes == run.predicted_peak_bytes, (name, rank, run.as_dict())
    assert sum(run.predicted.phase == "step" for run in runs.values()) >= 10


def test_on_cuda_the_plan_counts_torchs_own_foreach_step():
    """torch's default on CUDA is its foreach step: a plan of CUDA params predicts its temporaries
    (a tensor the size of each the rank steps), whatever the sizes; the same params on the CPU,
    too large for zero to give it, keep the for-loop's (three tensors the size of one)."""
    from zero.plans.footprint import footprint
    from zero.plans.meta import ParamMeta
    from zero.plans.plan import make_plan

    def transient(device):
        metas = [ParamMeta(f"w{i}", (512, 512), device=device) for i in range(8)]
        fp = footprint(make_plan(metas, 2, optimizer="adamw"), 0)
        return fp.peak - sum(fp.resident.values()), fp.phase

    stepped = 4 * 512 * 512 * 4  # rank 0 steps four of the eight, float32
    assert transient("cuda:0") == (stepped, "step")
    assert transient("cpu") == (3 * 512 * 512 * 4, "step")  # AdamW's two, and the tensor before's denominator


def test_fsdp2s_memory_counts_torchs_foreach_step_on_cuda():
    """FSDP2's peak (`zero.plans.fsdp2_memory`): on CUDA torch steps each group's local shards
    with its foreach step, a temporary the size of each at once, which makes the step the peak of
    64 small units; on the CPU its for-loop holds one shard's, and backward stays the peak."""
    from zero.plans.fsdp2_memory import fsdp2_footprint
    from zero.plans.meta import ParamMeta

    def peak(device):
        return fsdp2_footprint([ParamMeta(f"layers.{i}.w", (64, 64), device=device) for i in range(64)], 2, 0)

    gpu, cpu = peak("cuda:0"), peak("cpu")
    assert gpu.peak_phase == "step" and gpu.by_category["step_temps"] == 64 * 32 * 64 * 4  # every half, float32
    assert cpu.peak_phase.startswith("backward") and gpu.peak_bytes > cpu.peak_bytes
