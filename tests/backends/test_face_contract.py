"""torch's optimizer contract on every zero optimizer over several ranks, as a torchtitan user
meets it: torch's ``get_state_dict`` mid-run takes the state and steps nothing; a checkpoint
saved through torch's functions (or torchtitan's flat helpers) resumes at another world size and
layout exactly; torch's AdamW and zero's trade checkpoints; torch's own ZeRO parity test passes.
(One process: tests/functional/test_torch_contract.py.)"""

import face_workers as fw
import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.timeout(600)

ADAMW = ("adamw", dict(learning_rate=1e-2, weight_decay=0.05))
MUON = ("muon", dict(learning_rate=1e-2, weight_decay=0.01))
TORCH_ADAMW = ("from_torch", dict(optimizer_class="AdamW", lr=1e-2, weight_decay=0.05))


def worst(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("kind, world_size, spec", [
    ("fsdp2", 3, ADAMW), ("fsdp2", 3, MUON), ("hsdp", 4, ADAMW), ("zero-whole", 2, ADAMW),
    ("zero-flat", 3, TORCH_ADAMW), ("zero-hybrid", 2, MUON), ("zero2", 2, ADAMW)],
    ids=lambda v: v if isinstance(v, str) else None)
def test_torchs_get_state_dict_mid_run_takes_the_state_and_steps_nothing(kind, world_size, spec):
    """Before, every zero optimizer showed torch an empty ``state``: ``get_state_dict`` stepped it
    at lr=0 (zero's count advanced, its moments decayed) and saved no optimizer tensor."""
    for r in run_ranks(fw.neutral, world_size, kind, spec):
        assert r["same"] and r["tensors"] > 0, r


@pytest.mark.parametrize("saved, loaded, spec", [
    (("fsdp2", 3), ("fsdp2", 2), ADAMW), (("fsdp2", 3), ("fsdp2", 2), MUON), (("fsdp2", 2), ("hsdp", 4), TORCH_ADAMW),
    (("zero-flat", 3), ("zero-whole", 2), ADAMW), (("zero2", 2), ("fsdp2", 3), ADAMW),
    (("zero-hybrid", 3), ("zero-flat", 2), MUON)], ids=lambda v: f"{v[0]}@{v[1]}" if isinstance(v, tuple) else None)
def test_a_checkpoint_through_torchs_functions_resumes_anywhere_exactly(tmp_path, saved, loaded, spec):
    """Saved with torch's ``get_state_dict`` + ``dcp.save`` at W ranks, resumed with its template +
    ``dcp.load`` + ``set_state_dict`` at W' ranks in another layout: one process's run, to 1e-12."""
    run_ranks(fw.save_through_torch, saved[1], saved[0], spec, str(tmp_path / "c"))
    got = run_ranks(fw.resume_through_torch, loaded[1], loaded[0], spec, str(tmp_path / "c"))[0]
    assert worst(got, run_ranks(fw.one_process, 1, spec)[0]) <= 1e-12


def test_torchtitans_flat_helpers_save_and_resume_at_another_world_size(tmp_path):
    """torchtitan 0.3.0's ``init_optim_state`` / ``get_flat_optim_state_dict`` /
    ``load_flat_optim_state_dict`` (what its ``OptimizersContainer`` checkpoints with, keyed
    ``state.{fqn}.{key}``): FSDP2 at 3 ranks to HSDP's 2 x 2, and ZeRO's flat plan at 2 to FSDP2 at 3."""
    run_ranks(fw.save_through_torch, 3, "fsdp2", TORCH_ADAMW, str(tmp_path / "a"), 3, True)
    got = run_ranks(fw.resume_through_torch, 4, "hsdp", TORCH_ADAMW, str(tmp_path / "a"), 3, 3, True)[0]
    assert worst(got, run_ranks(fw.one_process, 1, TORCH_ADAMW)[0]) <= 1e-12
    run_ranks(fw.save_through_torch, 2, "zero-flat", ADAMW, str(tmp_path / "b"), 3, True)
    got = run_ranks(fw.resume_through_torch, 3, "fsdp2", ADAMW, str(tmp_path / "b"), 3, 3, True)[0]
    assert worst(got, run_ranks(fw.one_process, 1, ADAMW)[0]) <= 1e-12


def test_torchs_adamw_and_zeros_trade_checkpoints_both_ways(tmp_path):
    """torch.optim.AdamW over FSDP2 saved through torch's functions resumes in zero's
    from_torch(AdamW) (and the reverse): the same names, each going on as the other's own run."""
    run_ranks(fw.save_through_torch, 2, "torch-fsdp2", None, str(tmp_path / "torch"))
    got = run_ranks(fw.resume_through_torch, 3, "fsdp2", TORCH_ADAMW, str(tmp_path / "torch"))[0]
    torch_run = run_ranks(fw.one_process, 1, None)[0]
    assert worst(got, torch_run) <= 1e-12
    run_ranks(fw.save_through_torch, 3, "zero-flat", TORCH_ADAMW, str(tmp_path / "zero"))
    got = run_ranks(fw.resume_through_torch, 2, "torch-fsdp2", None, str(tmp_path / "zero"))[0]
    assert worst(got, torch_run) <= 1e-12


@pytest.mark.parametrize("optimizer_class", ["Adam", "AdamW"])
@pytest.mark.parametrize("maximize", [False, True])
def test_torchs_own_zero_parity_test_passes(optimizer_class, maximize):
    """The 4 cases of torch's ``test_local_optimizer_parity`` that failed: its state dicts are
    aliased and stepped before they are loaded back, which a checksum in the dict refused. With
    the test's dicts moved as its CUDA run moves them, every check passes; with CPU's aliasing
    (which torch's own ZeRO fails too), zero ends bit for bit where torch's ZeRO does."""
    run_ranks(fw.torch_zero_parity, 2, optimizer_class, maximize)
    ours = run_ranks(fw.torch_zero_parity, 2, optimizer_class, maximize, False, False)
    torchs = run_ranks(fw.torch_zero_parity, 2, optimizer_class, maximize, True, False)
    for a, b in zip(ours, torchs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_torch_state_dict_entries_are_views_in_the_params_placement():
    """Over FSDP2, ``state[p]`` holds DTensors in ``p``'s placement whose local tensors are the
    state the step uses."""
    got = run_ranks(fw.placements, 2)
    assert got[0] == got[1] == ["DTensor"] * 4, got



def test_a_torchtitan_container_of_zero_rules_resumes_at_another_world_size(tmp_path):
    """docs/torchtitan.md: torchtitan's ``OptimizersContainer`` with zero's Muon for the weights and
    from_torch(AdamW) for the rest (its regex groups, torch's keyword names, ``implementation=
    "foreach"``), a warmup LR schedule, checkpointed as torchtitan's checkpointer does (its flat
    FQN-keyed dict) at 3 FSDP2 ranks and resumed at 2: one process's run, to 1e-12."""
    run_ranks(fw.titan_run, 3, None, str(tmp_path / "c"), 0, 3)
    resumed = run_ranks(fw.titan_run, 2, str(tmp_path / "c"), None, 3, 3)[0]
    assert worst(resumed, run_ranks(fw.titan_run, 1, None, None, 0, 6)[0]) <= 1e-12


@pytest.mark.parametrize("kind, world_size", [("zero-flat", 2), ("fsdp2", 2), ("hsdp", 4)])
def test_torchs_generic_optimizer_checks_on_sharded_optimizers(kind, world_size):
    for r in run_ranks(fw.contract, world_size, kind):
        assert r["calls"] == ["pre", "post"] * 3 + ["sd", "sd", "load"], r
        assert r["lr"] == 1e-2 * 0.5 ** 3 and r["same"] and r["repr"], r
        assert r["len"] == r["trainable"], r
        assert "holds process groups and cannot be copied or pickled" in r["copied"], r
    if kind.startswith("zero"):
        assert r["elsewhere"].startswith("the optimizer state was consolidated on rank 0, not on rank 1"), r


@pytest.mark.parametrize("kind, world_size", [("fsdp2", 3), ("hsdp", 4)])
def test_ranks_that_build_different_settings_are_named_over_fsdp2(kind, world_size):
    """One face, one check: over FSDP2 and HSDP as under ZeRO, a rank whose ``lr`` differs is a
    ``ValueError`` on every rank naming the setting, both values and the rank."""
    for said in run_ranks(fw.settings_differ, world_size, kind, fresh=True):
        assert "differ at step() in param groups (sizes and settings such as lr): param group 0's lr is" in said, said
        assert "on rank 0" in said or "on rank 1" in said, said


@pytest.mark.parametrize("kind, world_size", [("fsdp2", 3), ("hsdp", 4)])
def test_a_nan_in_one_ranks_rows_is_named_on_every_rank_and_its_policy_kept(kind, world_size):
    """zero.functional.Optimizer over FSDP2 warns by default (it stepped a NaN into a param with no
    word before); every rank names the param and the rank whose rows held it; "skip" skips on
    every rank together, "raise" raises on every rank."""
    name = "0.weight"
    for r in run_ranks(fw.nan_named, world_size, kind, "warn"):
        assert len(r["warned"]) == 1 and f"step 2: gradients with NaN or inf in {name}, in the gradient rows rank " \
            in r["warned"][0] and r["stepped"], r
    for r in run_ranks(fw.nan_named, world_size, kind, "skip"):
        assert r["warned"][0].endswith("the step is skipped on every rank (nonfinite='skip')") and not r["stepped"], r
    for r in run_ranks(fw.nan_named, world_size, kind, "raise"):
        assert r["raised"].startswith(f"step 2: gradients with NaN or inf in {name}, in the gradient rows"), r


def test_torchs_own_zero_under_torchs_get_state_dict_steps_then_raises(one_rank):
    """The comparison docs/comparison.md draws: torch's ZeroRedundancyOptimizer shows torch's
    ``get_state_dict`` an empty ``state``, so it is stepped at lr=0 (its moments made) and then
    its ``state_dict()`` raises for want of ``consolidate_state_dict``; zero's takes the state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from zero import ZeroRedundancyOptimizer as Zero

    for cls, raises in ((TorchZero, True), (Zero, False)):
        model = torch.nn.Linear(3, 2)
        opt = cls(model.parameters(), torch.optim.Adam, lr=1e-3)
        try:
            get_state_dict(model, opt)
            raised = False
        except RuntimeError:
            raised = True
        stepped = any(float(st["step"]) > 0 for st in opt.optim.state.values())  # the local Adam's step counts
        assert (raised, stepped) == (raises, raises), cls


def test_a_layer_no_gradient_reaches_steps_over_fsdp2_as_on_one_process():
    """The state over FSDP2 starts when the optimizer is built, for every trainable param; a first
    step whose gradients miss a layer still decides the set stepped together, as on one process."""
    got = run_ranks(fw.unused_layer, 3)[0]
    assert worst(got, run_ranks(fw.unused_layer, 1)[0]) <= 1e-12
