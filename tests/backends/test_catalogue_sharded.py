"""#66's rules under the sharded executors: schedule-free's ``eval()`` / ``train()``, Prodigy's
sums over the model, MoMo fed the loss by ``step(closure)``: each equal to one process."""

import catalogue_workers as w
import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.timeout(300)


def _close(got, want, what, tol):
    for j, (a, b) in enumerate(zip(got, want)):
        off = float((a - b).abs().max())
        assert off <= tol, f"{what}: param {j} is off by {off:.2e}"


def _check(phases, ref, where, tol=1e-12):
    assert "train()" in phases["refused"], f"{where}: a step in eval mode was not refused: {phases['refused']!r}"
    for phase in ("y", "x", "y again", "after"):
        _close(phases[phase], ref[phase], f"{where}, {phase}", tol)
    moved = max(float((a - b).abs().max()) for a, b in zip(phases["x"], phases["y"]))
    assert moved > 1e-4, f"{where}: eval() left the params where they were"


def test_one_process_eval_is_optaxs_eval_params():
    import zero.functional as F

    ref = w.one_process(0, 1)
    model = w.fw.make_model()
    tx = F.contrib.schedule_free_adamw(**w.RULE)
    params = dict(model.named_parameters())
    params = {n: p.detach().clone() for n, p in params.items()}
    state = tx.init(params)
    for k in range(4):
        grads = dict(zip(params, w.fw.fixed_grads(model, k)))
        updates, state = tx.update(grads, state, params)
        params = F.apply_updates(params, updates)
    x = F.contrib.schedule_free_eval_params(state, params)
    _close(ref["x"], list(x.values()), "eval() against schedule_free_eval_params", 1e-12)


@pytest.mark.parametrize("world_size, kind", [(2, "flat"), (3, "hybrid"), (2, "masters")])
def test_zero_eval_and_train_equal_one_process(world_size, kind):
    ref = w.one_process(0, 1, masters=kind == "masters")
    for rank, phases in enumerate(run_ranks(w.zero_run, world_size, kind)):
        # masters: float32 masters of bf16 params against float32 params with bf16 gradients, both rounded to bf16
        _check(phases, ref, f"ZeRO {kind}, rank {rank}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_eval_and_train_equal_one_process(world_size):
    ref = w.one_process(0, 1)
    for rank, phases in enumerate(run_ranks(w.fsdp2_run, world_size)):
        _check(phases, ref, f"FSDP2 at {world_size} ranks, rank {rank}")


def test_prodigys_sums_cost_one_small_all_reduce_a_step():
    """Two param groups, each its own Prodigy (as on one process): one all-reduce of its two sums each,
    per whole tensor (the model's 8, and which are in the step), in float64: (2 + 1) x 8 x 8 bytes."""
    for reduces, worst in run_ranks(w.prodigy_sums, 3):
        sums = [r for r in reduces if r == ("all_reduce_sum", "float64", 3 * 8 * 8)]
        assert len(sums) == 2, f"each group's two sums should ride in one all-reduce of float64s: {reduces}"
        assert worst <= 1e-12, f"Prodigy under a flat plan at 3 ranks is off one process by {worst:.2e}"


@pytest.mark.parametrize("engine, world_size", [("zero", 3), ("fsdp2", 2)])
def test_momo_reads_the_closures_loss_as_one_process_does(engine, world_size):
    ref = w.momo_closure(0, 1, "one")
    for rank, got in enumerate(run_ranks(w.momo_closure, world_size, engine)):
        _close(got, ref, f"MoMo-Adam under {engine} at {world_size} ranks, rank {rank}", 1e-12)


def test_momo_with_masters_gets_the_loss_the_closure_returned():
    """With masters the ZeRO rank runs the closure itself before casting the gradients up: the loss
    still reaches the rule (it once was dropped, and MoMo refused: 'needs the loss')."""
    got = run_ranks(w.momo_closure, 2, "zero masters")
    assert all(torch.isfinite(p).all() for params in got for p in params)
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[1])), "the ranks' params differ"


@pytest.mark.parametrize("strategy", ["sorted_greedy", "flat"])
def test_a_line_search_under_zero_is_refused_by_name_on_every_rank(strategy):
    for rank, error in enumerate(run_ranks(w.lbfgs_closure_refused, 2, strategy)):
        assert "line search" in error and "sharded" in error, f"rank {rank}: {error!r}"


def test_hutchinsons_estimate_under_a_flat_plan_is_refused_by_name():
    for rank, error in enumerate(run_ranks(w.hutchinson_refused, 2)):
        assert "hutchinson" in error and "sharded" in error, f"rank {rank}: {error!r}"


def test_a_checkpoint_saved_in_eval_mode_resumes_as_it_was_left():
    """Save in eval mode (the model holds x), load into a fresh model and optimizer, train(): the
    params are y again and the next steps equal an uninterrupted run's (one process)."""
    import zero.functional as F

    def run(resume: bool):
        model = w.fw.make_model()
        opt = F.Optimizer(w.fw.groups(model), F.contrib.schedule_free_adamw(**w.RULE))
        w._run(opt, model, 4)
        opt.eval()
        if resume:
            saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
            model = w.fw.make_model()
            opt = F.Optimizer(w.fw.groups(model), F.contrib.schedule_free_adamw(**w.RULE))
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            assert not opt.training
        opt.train()
        w._run(opt, model, 3, first=4)
        return w._snap(model)

    _close(run(True), run(False), "resumed from a save in eval mode", 1e-12)
