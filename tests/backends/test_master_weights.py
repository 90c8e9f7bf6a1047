"""Master weights (``master_dtype``), reduce dtype and loss scaling, against the recipe done by hand.

Reference (`master_workers.MasterReference`): one process keeps fp32 copies of the bf16 params,
steps the optimizer on them with the averaged gradients cast to fp32 and writes them back rounded.
"""

import copy
import math
import warnings

import master_workers as w
import numpy as np
import plan_workers as pw
import pytest
import torch
from helpers import assert_params_close, run_ranks

import zero
from zero.backends import ShardedGradScaler
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends.precision import MASTER_KEY

pytestmark = pytest.mark.timeout(600)


def _check(results, name):
    for r in results:
        assert r["state_dtypes"] in ([], ["torch.float32"]), r["state_dtypes"]  # moments in the master dtype
        if name != "clip_adamw":  # a functional rule's state is not in optim.state (its masters are counted)
            assert r["measured"] == r["planned"], (r["measured"], r["planned"])
        else:
            assert r["measured"][1] == r["planned"][1], (r["measured"], r["planned"])
    head = results[0]
    assert head["n_masters"] == 9  # every trainable param's master reached the global state dict
    if name == "clip_adamw":
        # The sharded global norm sums in another order than one process: masters agree to fp32
        # rounding, and a master that lands on a bf16 rounding boundary may round the other way.
        assert head["masters_rel"] < 1e-6, head["masters_rel"]
        assert all(r["bf16_differ"] <= 4 for r in results), [r["bf16_differ"] for r in results]
    else:
        assert head["masters_exact"], head["masters_rel"]
        assert all(r["bf16_equal"] for r in results)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["sorted_greedy", "flat"])
def test_adamw_on_fp32_masters_equals_the_recipe_bit_for_bit(world_size, strategy):
    """Masters bit-equal to the reference's (torch.optim rules), bf16 params equal, and each rank's
    master + state bytes exactly the plan's."""
    _check(run_ranks(w.masters_vs_reference, world_size, "adamw", strategy, timeout=240), "adamw")


@pytest.mark.parametrize("name", ["sgd_nesterov", "clip_adamw"])
@pytest.mark.parametrize("strategy", ["sorted_greedy", "flat"])
def test_other_rules_on_masters_at_3_ranks(name, strategy):
    _check(run_ranks(w.masters_vs_reference, 3, name, strategy, timeout=240), name)


def test_masters_reshard_flat_2_to_whole_3_and_continue_bit_identically(tmp_path):
    """Masters travel in the global state dict (under MASTER_KEY) and resume at another world
    size and plan as if never interrupted."""
    first, second = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    run_ranks(pw.reshard_leg, 2, "flat", None, first, 0, 4, True, timeout=120)
    saved = torch.load(first, weights_only=True)["optim"]["state"]
    assert all(MASTER_KEY in st and st[MASTER_KEY].dtype == torch.float32 for st in saved.values())
    results = run_ranks(pw.reshard_leg, 3, "sorted_greedy", first, second, 4, 4, True, timeout=120)
    expected = w.single_process(8)
    for r in results:
        for got, want in zip(r["params"], expected):
            assert torch.equal(torch.from_numpy(got), want)


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_reduce_scattered_gradients_in_the_reduce_dtype(reduce_dtype):
    """Two micro-batches under no_sync, the sum and the reduce-scatter in ``reduce_dtype`` (fp32:
    the bf16 gradients are accumulated into fp32 buffers), equal to the sum done by hand."""
    results = run_ranks(w.reduce_scattered, 2, reduce_dtype, timeout=180)
    for r in results:
        assert r["equal"], r["worst"]
        assert r["grad_dtypes"] == [str(reduce_dtype or torch.bfloat16)]


def test_fp16_loss_scale_skips_on_every_rank_when_one_shard_overflows():
    """An inf in rank 1's gradient of one param only: every rank skips steps 2 and 4, backs off
    the scale alike, and the params stay equal and finite."""
    a, b = run_ranks(w.inf_on_one_shard, 2, timeout=180)
    assert a["history"] == b["history"], (a["history"], b["history"])
    assert [moved for _, moved in a["history"]] == [True, True, False, True, False, True]
    scales = [scale for scale, _ in a["history"]]
    assert scales[2] == scales[1] / 2 and scales[4] == scales[3] / 2
    assert a["finite"] and np.array_equal(a["params"], b["params"])


def test_torch_grad_scaler_under_reduce_scatter_is_refused_by_name():
    a, b = run_ranks(w.inf_on_one_shard, 2, 6, False, timeout=180)
    for r in (a, b):
        assert "ShardedGradScaler" in r["error"], r


# -- one rank, in process -----------------------------------------------------------------------

def _bf16_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)


def test_masters_keep_small_updates_that_bf16_loses(one_rank):
    """lr * grad below half a bf16 ulp of the weight: bf16 stepping never moves it; the masters
    accumulate the updates until the rounded param moves."""
    moved = {}
    for master in (None, torch.float32):
        model = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            model.weight.fill_(1.0)
        opt = Zero(model.parameters(), torch.optim.SGD, master_dtype=master, lr=1e-3)
        for _ in range(20):
            model.weight.grad = torch.ones_like(model.weight)
            opt.step()
        moved[master] = float(model.weight)
    assert moved[None] == 1.0
    assert moved[torch.float32] == pytest.approx(0.98, abs=4e-3)


def test_plain_grad_scaler_with_masters_on_one_rank(one_rank):
    """torch.amp.GradScaler drives the step: gradients unscaled in fp32, an inf skips the step."""
    model = _bf16_model()
    opt = Zero(model.parameters(), torch.optim.AdamW, master_dtype="float32", lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    x = torch.randn(4, 8).to(torch.bfloat16)
    scaler.scale(model(x).float().square().mean()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad()
    scaler.scale(model(x).float().square().mean()).backward()
    model[0].weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 128.0


def test_unfrozen_param_gets_a_master(one_rank):
    model = _bf16_model()
    model[1].bias.requires_grad_(False)
    opt = Zero(model.parameters(), torch.optim.SGD, master_dtype=torch.float32, lr=1.0)
    assert opt.masters.nbytes() == 4 * (8 * 16 + 16 + 16 * 4)
    model[1].bias.requires_grad_(True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    assert opt.masters.nbytes() == 4 * (8 * 16 + 16 + 16 * 4 + 4)


def test_state_dict_without_masters_starts_them_from_the_params(one_rank):
    model = _bf16_model()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    plain.step()
    opt = Zero(model.parameters(), torch.optim.AdamW, master_dtype=torch.float32, lr=1e-2)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the params changed after the optimizer was built
    opt.load_state_dict(plain.state_dict())
    master = opt.optim.param_groups[0]["params"][0]
    assert torch.equal(master, model[0].weight.float())
    assert opt.optim.state[master]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(master_dtype=torch.int32), "master_dtype must be a float dtype"),
    (dict(master_dtype="float8"), "master_dtype must be a float dtype"),
    (dict(master_dtype=3), "master_dtype must be a torch.dtype"),
    (dict(master_dtype=torch.float16), "less precise than param"),
    (dict(reduce_dtype=torch.float32), "reduce_dtype=torch.float32 is the dtype of the gradients' reduce-scatter"),
    (dict(reduce_dtype="int8", reduce_scatter_grads=True, strategy="flat"), "reduce_dtype must be a float dtype"),
])
def test_bad_precision_arguments_are_named(one_rank, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Zero(_bf16_model().parameters(), torch.optim.AdamW, lr=1e-2, **kwargs)


def test_plan_and_argument_must_agree_on_the_master_dtype(one_rank):
    model = _bf16_model()
    plan = zero.make_plan(zero.param_metas(list(model.parameters())), 1)
    with pytest.raises(ValueError, match="the plan was made with master_dtype=None"):
        Zero(model.parameters(), torch.optim.AdamW, plan=plan, master_dtype=torch.float32)
    planned = zero.make_plan(zero.param_metas(list(model.parameters())), 1, master_dtype="float32")
    assert Zero(model.parameters(), torch.optim.AdamW, plan=planned).master_dtype == torch.float32


def test_fp16_params_warn_at_construction(one_rank):
    model = _bf16_model().half()
    with pytest.warns(UserWarning, match="float16 .*GradScaler"):
        Zero(model.parameters(), torch.optim.AdamW, master_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Zero(_bf16_model().parameters(), torch.optim.AdamW, master_dtype=torch.float32)


def test_sharded_scaler_unscales_the_reduced_gradients_so_they_can_be_clipped(one_rank):
    """The AMP habit under reduce_scatter_grads: scale, backward, unscale_, clip_grad_norm_, step,
    update, equal to torch's scaler and AdamW on one process, an overflowing step skipped by both
    (the scales agree); a plain scaler driving the step is refused (per step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref_m = copy.deepcopy(model)
    opt = Zero(model.parameters(), torch.optim.AdamW, strategy="flat", reduce_scatter_grads=True, lr=1e-2)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    sharded, plain = ShardedGradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        norms = []
        ref_clip = lambda n: torch.nn.utils.clip_grad_norm_(ref_m.parameters(), n)  # noqa: E731
        for m, o, scaler, clip in ((model, opt, sharded, opt.clip_grad_norm_), (ref_m, ref, plain, ref_clip)):
            scaler.scale(m(x).square().sum() * (math.inf if step == 2 else 1)).backward()
            scaler.unscale_(o)
            norms.append(float(clip(0.05)))
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        assert norms[0] == pytest.approx(norms[1], rel=1e-5) or not math.isfinite(norms[1]), (step, norms)
        assert sharded.get_scale() == plain.get_scale(), step
        assert_params_close(model, ref_m, rtol=1e-5, atol=1e-6, what=f"step {step}")
    assert sharded.get_scale() == 2.0**9  # step 2 overflowed: both skipped it and backed off
    plain.scale(model(torch.randn(2, 8)).sum()).backward()
    with pytest.raises(ValueError, match="ShardedGradScaler"):
        plain.step(opt)


def _plans(model):
    metas = zero.param_metas(model)
    return {"whole": zero.make_plan(metas, 1, "sorted_greedy", master_dtype="float32"),
            "flat": zero.make_plan(metas, 1, "flat", master_dtype="float32"),
            "hybrid": zero.make_plan(metas, 1, "flat", master_dtype="float32", whole=lambda m: len(m.shape) == 2)}


CHANGES = {  # what users do to a model after building its optimizer
    "load_state_dict": lambda model, values: model.load_state_dict(values),
    "nn.init": lambda model, values: [torch.nn.init.constant_(p, 3.0) for p in model.parameters()],
    ".data writes": lambda model, values: [p.data.copy_(values[n]) for n, p in model.named_parameters()],
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("plan_kind", ["whole", "flat", "hybrid"])
def test_weights_loaded_after_the_optimizer_are_what_it_steps(one_rank, plan_kind, change):
    """The fine-tuning habit: build the bf16 model and its optimizer with fp32 masters, then load
    the pretrained weights. The step starts from the loaded weights, as an optimizer built after
    loading does (bit for bit), instead of writing the masters of the random init back."""
    pretrained = {n: torch.full_like(p, 3.0) for n, p in _bf16_model().named_parameters()}
    ends = []
    for build_first in (True, False):
        model = _bf16_model()
        make = lambda m=model: Zero(m.parameters(), torch.optim.AdamW, plan=_plans(m)[plan_kind], lr=1e-6)  # noqa: E731
        opt = make() if build_first else None
        with torch.no_grad():
            CHANGES[change](model, pretrained)
        opt = opt or make()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
                opt.step()
        told = [w for w in caught if "changed outside the optimizer" in str(w.message)]
        assert len(told) == (1 if build_first else 0), [str(w.message) for w in caught]
        ends.append([p.detach().clone() for p in model.parameters()])
    for loaded_after, loaded_before in zip(*ends):
        assert torch.equal(loaded_after, loaded_before)
        assert (loaded_after - 3.0).abs().max() < 0.02  # 3.0 less three steps of 1e-6, in bf16
