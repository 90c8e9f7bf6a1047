"""Low-bit Adam state under ZeRO: the same bits at every world size and plan, the plan's bytes on
every rank, checkpoints that move between world sizes and plans, and the plans it refuses."""

import helpers
import lowbit_workers as lw
import pytest
import torch
from helpers import fixed_grads, run_ranks, set_grads
from torch import nn

import zero
import zero.functional as zf
from zero.backends import ZeroRedundancyOptimizer as Zero
from zero.backends import checkpoint as ckpt
from zero.functional import contrib

STEPS = 6


def one_process(rule: str, masters: bool, steps: int = STEPS) -> list[torch.Tensor]:
    """The reference: `zero.functional.Optimizer` in this process; with masters, over float32
    copies of the bfloat16 params, each step's gradients cast up into them and the params
    rounded from them (what fp32 masters mean)."""
    model = lw.lowbit_model(torch.bfloat16 if masters else torch.float32)
    stepped = lw.lowbit_model(torch.float32) if masters else model
    if masters:
        stepped.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt = zf.Optimizer(lw.groups(stepped), lw.tx_of(rule))
    for k in range(steps):
        grads = fixed_grads(list(model.parameters()), k)
        set_grads(stepped, [g.float() for g in grads])
        opt.step()
    return [p.detach().to(torch.bfloat16 if masters else torch.float32).to(torch.float64)
            for p in stepped.parameters()]


# The widest cases once each: every world size 1-4, every plan, both bit widths, masters or not.
CASES = [("8bit", 1, "sorted_greedy", False), ("8bit", 2, "flat-own", False), ("8bit", 3, "hybrid", False),
         ("8bit", 4, "sorted_greedy", True), ("8bit", 3, "flat-own", True), ("4bit", 4, "flat-own", False),
         ("4bit", 2, "hybrid", True), ("4bit", 3, "sorted_greedy", False), ("adam8bit", 2, "flat-own", False)]


@pytest.mark.parametrize("rule,world_size,strategy,masters", CASES)
def test_every_world_size_and_plan_gives_one_process_bits(rule, world_size, strategy, masters):
    """Params bitwise those of one process after 6 steps; each rank's state bytes (codes, scales,
    full-precision moments) exactly the plan's; the plan named for the rule and stepped in place."""
    results = run_ranks(lw.train, world_size, rule, strategy, masters, STEPS)
    ref = one_process(rule, masters)
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], ref))
        assert r["state_bytes"] == r["planned"] > 0
        assert r["plan"] in ({"adamw8bit", "adam8bit"} if "8" in rule else {"adamw4bit"})
        assert r["path"].startswith("zero low-bit Adam")


def test_zero2_with_low_bit_state_equals_ddp():
    """Gradients reduce-scattered into the block-aligned shards (3 ranks, each on its own data):
    the params of DDP + the same rule, every step, to the rounding of the gradients' sums (three
    addends summed in another order; at 2 ranks, measured: the same bits)."""
    for worst in run_ranks(lw.zero2_vs_ddp, 3, "8bit", 4):
        assert max(worst) <= 1e-5, worst


@pytest.mark.parametrize("rule,saved,resumed", [("8bit", (2, "flat-own"), (3, "sorted_greedy")),
                                                ("4bit", (3, "sorted_greedy"), (2, "flat-own")),
                                                ("8bit", (2, "hybrid"), (1, "flat-own"))])
def test_a_dcp_checkpoint_resumes_bit_for_bit_at_another_world_size_and_plan(tmp_path, rule, saved, resumed):
    """Codes and scales saved by FQN (each rank its own blocks), loaded under another world size
    and plan: the run continues as if never interrupted, bit for bit."""
    path = str(tmp_path / "ckpt")
    run_ranks(lw.save_then_resume, saved[0], path, rule, saved[1], (3, 3), "save")
    out = run_ranks(lw.save_then_resume, resumed[0], path, rule, resumed[1], (3, 3), "resume")
    ref = one_process(rule, False)
    for r in out:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], ref))


def test_the_consolidated_state_dict_resumes_bit_for_bit_at_another_world_size_and_plan(tmp_path):
    """torch's consolidated format holds each param's codes and scales whole (put together from
    the ranks' blocks): saved at 2 ranks under a flat plan, resumed at 3 under a whole-param one."""
    path = str(tmp_path / "consolidated.pt")
    run_ranks(lw.consolidated_save_then_resume, 2, path, "4bit", "flat-own", (3, 3), "save")
    saved = torch.load(path, weights_only=False)["optim"]["state"]
    assert saved[0]["inner_state.0.mu.codes"].shape == (8192 // 2,)  # 4-bit: two codes a byte
    assert saved[0]["inner_state.0.mu.scale"].shape == (8192 // 128,)
    out = run_ranks(lw.consolidated_save_then_resume, 3, path, "4bit", "sorted_greedy", (3, 3), "resume")
    ref = one_process("4bit", False)
    for r in out:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], ref))


# -- what the backend refuses, and the plan it makes (one gloo rank, in process) -----------------

@pytest.mark.usefixtures("one_rank")
def test_a_flat_plan_cutting_inside_blocks_is_refused_naming_the_param():
    model = lw.lowbit_model()
    plan = zero.make_plan(zero.param_metas(lw.groups(model)), 1, "flat")  # cut for Adam: anywhere
    with pytest.raises(ValueError, match=r"param '0.weight'.*8-bit blocks of 256.*optimizer='adamw8bit'"):
        Zero(lw.groups(model), contrib.adamw_8bit(1e-3), plan=plan)
    other = zero.make_plan(zero.param_metas(lw.groups(model)), 1, "flat", optimizer="adamw8bit/512")
    with pytest.raises(ValueError, match=r"cuts its flat buffer at 512"):
        Zero(lw.groups(model), contrib.adamw_8bit(1e-3), plan=other)


@pytest.mark.usefixtures("one_rank")
def test_strategy_flat_makes_the_block_aligned_plan_and_says_so():
    model = lw.lowbit_model()
    opt = Zero(lw.groups(model), contrib.adamw_4bit(1e-3, block_size=64), strategy="flat")
    assert opt.plan.optimizer == "adamw4bit/64"
    blocks = {b.block for b in opt.plan.flat.buffers}
    assert blocks == {0, 64} and all(b.shard_numel % 64 == 0 for b in opt.plan.flat.buffers if b.block)
    assert "blocks of 64" in str(opt.plan)


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_torchaos_classes_run_whole_params_and_are_refused_on_a_flat_plan(name, tmp_path):
    """Whole-param plans give torchao's class whole params, as it expects, and its state (torchao's
    own tensor subclasses) round-trips a DCP checkpoint; a flat plan's shards would change its
    numbers (ao#4912): a ValueError that points to zero's rule."""
    torchao_optim = helpers.torchao_optim()
    cls = getattr(torchao_optim, name)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 3))
    twin = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 3))
    twin.load_state_dict(model.state_dict())
    ours, ref = Zero(model.parameters(), cls, lr=1e-2), cls(twin.parameters(), lr=1e-2)
    for k in range(3):
        for m, opt in ((model, ours), (twin, ref)):
            set_grads(m, fixed_grads(list(m.parameters()), k))
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    ckpt.save(str(tmp_path / "ao"), model, ours)
    again = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 3))
    resumed = Zero(again.parameters(), cls, lr=1e-2)
    ckpt.load(str(tmp_path / "ao"), again, resumed)
    for m, opt in ((model, ours), (again, resumed)):
        set_grads(m, fixed_grads(list(m.parameters()), 3))
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    with pytest.raises(ValueError, match=rf"torchao.optim.{name}.*ao#4912.*contrib.{name.lower()[:5]}_{name[-4:]}"):
        Zero(model.parameters(), cls, strategy="flat", lr=1e-2)
