"""zero.ZeroRedundancyOptimizer on 2, 3 and 4 gloo ranks against torch's and a single process."""

import re

import pytest
import zero_workers as w
from helpers import groups_of, make_model, run_ranks


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_torch_zero_and_single_process(world_size):
    """Adam, AdamW, SGD(momentum, maximize) x parameters_as_bucket_view None (the default: small
    params are row views, large ones go direct) / False / True: see `zero_workers.torch_parity`."""
    results = run_ranks(w.torch_parity_matrix, world_size)
    for config in results[0]:
        for rank, by_config in enumerate(results):
            r = by_config[config]
            assert r["gathers"] == [1] * 24, f"{config}: one param all-gather per step for one dtype"
            bucket_view = config[1]
            expected = [("row" if n < 150 else "own") if bucket_view is None else "row" if bucket_view else "own"
                        for n in r["numels"]]
            assert r["storage"] == expected, f"{config}: where the params live (row views or their own storage)"
            assert r["state_bytes"] == r["plan_state_bytes"], f"{config} rank {rank}: state bytes differ from the plan"
        total = sum(by_config[config]["state_bytes"] for by_config in results)
        assert max(by_config[config]["state_bytes"] for by_config in results) < total, "state is sharded"


def test_named_params_reach_masks_on_the_fused_kernel():
    results = run_ranks(w.named_masks, 2)
    assert all(r["path"].startswith("fused: _fused_adamw_") for r in results), results[0]["path"]
    names = sorted(n for r in results for n in r["names"])
    assert names == sorted(f"{i}.{k}" for i in range(4) for k in ("weight", "bias")), "each rank names what it owns"
    assert "flat plan's local optimizer steps shards" in results[0]["flat"]
    assert "flat plan's local optimizer steps shards" in results[0]["flat_factory"], "a factory's mask= default"


@pytest.mark.parametrize("world_size", [2, 3])
def test_functional_local_optimizers(world_size):
    results = run_ranks(w.functional_parity, world_size)
    assert results[0]["factory_groups_lr"] == [1e-2, 5e-3]
    assert results[0]["chunked_gathers"] > 1


def test_reshards_4_to_2_to_3_ranks_as_one_optimizer(tmp_path):
    import torch

    paths = [tmp_path / f"leg{i}.pt" for i in range(3)]
    run_ranks(w.train_leg, 4, None, str(paths[0]), 0, 6)
    run_ranks(w.train_leg, 2, str(paths[0]), str(paths[1]), 6, 6)
    bytes3 = run_ranks(w.train_leg, 3, str(paths[1]), str(paths[2]), 12, 6)
    model = make_model("small")
    ref = torch.optim.Adam(groups_of(model), lr=1e-2, weight_decay=0.01)
    for step in range(18):
        w.set_grads(model, w.fixed_grads(list(model.parameters()), step))
        ref.step()
    saved = torch.load(paths[2], weights_only=False)
    for name, p in model.state_dict().items():
        assert torch.equal(saved["model"][name], p), f"{name} differs from one optimizer after 4 -> 2 -> 3 ranks"
    for i, st in ref.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(saved["optim"]["state"][i][k], v), f"state {i}.{k}"
    assert sum(r["state_bytes"] for r in bytes3) == w.state_nbytes(ref), "3 shards hold exactly one optimizer's state"


def test_mixed_dtypes_work_where_torch_raises():
    r = run_ranks(w.mixed_dtypes, 2)[0]
    assert r["torch_error"] is not None and "same dense type" in r["torch_error"]
    assert r["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float64"]
    assert r["gathers"] == 3, "one all-gather per dtype"


def test_join_with_uneven_inputs_matches_torch():
    run_ranks(w.join_uneven, 2)


def test_a_join_hook_sets_gradients_through_all_params_as_with_torchs():
    """torch's own ZeRO test sets a joined rank's gradients in a JoinHook through
    ``zero_optim._all_params``: code written that way runs, and steps as torch's class does."""
    rows = run_ranks(w.join_sets_grads_through_all_params, 3)
    assert [r["shadowed"] for r in rows] == [[4, 4], [2, 2], [0, 0]], "the joined ranks' hooks set grads"
    assert rows[0]["all_params"] == [tuple(p.shape) for p in w.make_model("small").parameters()]


def test_torchs_attributes_that_code_in_the_wild_reads_are_there_and_agree_with_torchs():
    """The names torch's class exposes that drop-in code reads (`TORCH_NAMES`) exist on ours and
    give torch's values over the same params; a flat plan, where a param has no one owner, says
    so instead of answering."""
    for r in run_ranks(w.torch_names, 3):
        assert r["missing"] == {"ours": [], "torch": []}
        assert r["read_only"]
        same = r["same"]
        ours, theirs = same.pop("scalars")
        assert ours == theirs, "global_rank, initialized, _overlap_with_ddp, world_size, rank, type(optim)"
        assert all(same.values()), same
        assert "splits params across ranks" in r["flat_error"]


def test_non_default_process_groups():
    results = run_ranks(w.subgroups, 4)
    assert [(r["group_rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]


def test_amp_grad_scaler_clipping_and_lr_scheduler():
    results = run_ranks(w.training_tools, 2)
    for r in results:
        assert r["skipped"][5] and sum(r["skipped"]) == 1, "the inf step is skipped on every rank, only it"
    assert results[0]["lr"] == 0.5 * 1e-2 * 0.5 ** 4


@pytest.mark.parametrize("world_size", [3])
def test_add_param_group_keeps_owners_and_matches_torch(world_size):
    results = run_ranks(w.add_param_group, world_size)
    assert results[0]["lr"] == [1e-2, 3e-2]


def test_a_dead_rank_fails_the_step_instead_of_hanging_and_is_named():
    for r in run_ranks(w.rank_dies, 3, pg_timeout=5, allow_exit=(2,), timeout=60)[:2]:
        assert r["error"] == "RuntimeError" and r["seconds"] < 10, r
        assert "rank 2 did not answer" in r["message"], r["message"]


@pytest.mark.parametrize("mode, world_size, skipper", [("ddp", 3, 1), ("rs", 2, 0)])
def test_a_rank_that_skips_step_in_a_loop_is_named_on_every_rank_at_once(mode, world_size, skipper):
    """DDP + ZeRO, and a flat plan with reduce_scatter_grads: the skipper's next backward pass
    would pair its gradients' collective with the others' step; every rank raises instead, within
    a second, where the process group's timeout (60 s here, gloo's default 30 min) would hang."""
    results = run_ranks(w.skips_a_step, world_size, mode, skipper, timeout=90, fresh=True)  # they diverge
    for r in results:
        assert r["error"] == "ValueError" and r["seconds"] < 5, r
        assert f"rank {skipper} skipped step(): it has taken 2 steps and started backward pass 4" in r["message"], r
        assert "is in step 3 after 3 backward passes" in r["message"], r["message"]


def test_a_rank_dying_in_backward_is_named_where_zero_owns_the_gradient_collectives():
    results = run_ranks(w.dies_in_backward, 3, pg_timeout=60, timeout=90, allow_exit=(2,))
    for rank, r in enumerate(results[:2]):
        assert r["error"] == "RuntimeError" and r["iteration"] == 2 and r["seconds"] < 5, r
        # the dead rank 2 named; the other live rank too when it had already ended on its own error
        # (and so stopped answering) by the time this rank looked, as on 2 busy cores
        other = 1 - rank
        assert re.match(rf"rank {rank} \(of 3\) waited for the gradients' reduce-scatter and the collective failed; "
                        rf"rank ({other}, )?2 did not answer", r["message"]), r["message"]


def test_gradient_accumulation_under_ddp_meets_and_goes_on():
    """The backward passes of accumulation start with no step since the last, as a skipped step's
    would: on every rank alike, they meet and go on, equal to DDP + Adam."""
    assert max(run_ranks(w.accumulates_under_ddp, 2, pg_timeout=30, timeout=90)) <= 1e-6


def test_a_stopped_rank_is_named_after_the_heartbeat_bound():
    results = run_ranks(w.stops_before_a_step, 2, 3.0, pg_timeout=120, timeout=90, allow_exit=(1,))
    r = results[0]
    assert r["error"] == "RuntimeError" and 3.0 <= r["seconds"] < 10, r
    assert "rank 1 has not answered for 3 s while rank 0 waits in step" in r["message"], r["message"]


@pytest.mark.parametrize("case, words", [
    ("groups", "differ at step() in param groups (sizes and settings such as lr): the number of param groups is 1 "
               "here and 2 on rank 0; every rank must"),
    ("lr", "differ at step() in param groups (sizes and settings such as lr): param group 0's lr is 0.01 here and "
           "0.02 on rank 0; every rank must"),
    ("skipped_step", "rank 1 is in consolidate_state_dict but rank 0 is in step"),
    ("consolidate_to", "differ at consolidate_state_dict() in the call's argument (to=, or the new group): 1 here, "
                       "0 on rank 0; every rank must"),
    ("model", "differ at step() in plan (params, groups, placement): param 7 is '7 (3,) float32 in group 0, "
              "trainable' here and '7 (4,) float32 in group 0, trainable' on rank 0; every rank must"),
])
def test_ranks_that_diverge_get_a_clear_error_instead_of_drifting(case, words):
    results = run_ranks(w.diverged, 2, case, pg_timeout=10, timeout=90)
    assert all(r["message"] is not None for r in results), results
    assert words in results[1]["message"], results[1]["message"]
    assert not re.search(r"\d{7,}", results[0]["message"] + results[1]["message"]), "no checksum in a message"
    assert all("step" in r for r in results) and results[0]["step"] == results[1]["step"], "in the same call"


def test_add_param_group_on_some_ranks_only_is_a_clear_error():
    results = run_ranks(w.add_group_on_some_ranks, 2, pg_timeout=5, timeout=60)
    assert [r["error"] for r in results] == ["ValueError", "ValueError"]
    assert "rank 0 is in add_param_group but rank 1 is in step" in results[0]["message"]


def test_every_alias_steps_the_same_sharded_on_two_ranks_as_in_one_process():
    from alias_cases import ALIASES

    results = run_ranks(w.aliases_sharded, 2, sorted(ALIASES))
    assert results[0] == sorted(ALIASES)


def test_an_optax_rule_is_sharded_only_when_declared_per_tensor():
    """Optax's code cannot be seen into: clip_by_global_norm on 2 ranks would clip each rank's own
    params by their own norm (it did, silently, under whole-param plans). Undeclared, it is refused
    at 2 ranks and runs on one; declared per tensor, optax.adam on 2 ranks equals one rank."""
    import torch

    from_optax_on_ranks = w.from_optax_on_ranks
    said = run_ranks(from_optax_on_ranks, 2, None)
    assert all("from_optax(tx, per_tensor=True)" in s and "clip_by_global_norm" in s for s in said), said
    assert isinstance(run_ranks(from_optax_on_ranks, 1, None)[0], list)
    assert isinstance(run_ranks(from_optax_on_ranks, 2, False)[0], str)
    two, one = run_ranks(from_optax_on_ranks, 2, True)[0], run_ranks(from_optax_on_ranks, 1, True)[0]
    assert all(torch.equal(a, b) for a, b in zip(two, one))
