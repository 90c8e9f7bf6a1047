"""`zero.ZeroRedundancyOptimizer` over HSDP (``fully_shard`` on a ``replicas x shards`` mesh): the
state and the step sharded over the replicas too, against one process, on 4 gloo ranks as 2x2 and 2
ranks as 2x1 and 1x2; checkpoints across layouts and to and from ``torch.optim``."""

import hsdp_workers as w
import pytest
from helpers import run_ranks

pytestmark = pytest.mark.timeout(600)

CLIP_ADAMW = ("chain", [("clip_by_global_norm", dict(max_norm=0.5)),
                        ("adamw", dict(learning_rate=1e-2, weight_decay=0.1))])
MUON = ("muon", dict(learning_rate=1e-2))
TORCH_ADAMW = ("torch", dict(optimizer_class="AdamW", lr=1e-2, weight_decay=0.05))
ADAM_SCALAR = 4  # the bytes of torch's per-param ``step`` that the "adam" cost counts and zero's rules share


@pytest.mark.parametrize("world_size, replicas", [(4, 2), (2, 2), (2, 1)])
def test_zero_over_the_replicas_steps_as_one_process_and_holds_its_part(world_size, replicas):
    """Fixed gradients, float64, 8 steps, two param groups: the rule's global-norm clipping, torch's
    AdamW class after torch's ``clip_grad_norm_`` (the user's habit), Muon, and zero's factory with
    keywords (against the built rule on one process); each rank's state is its part exactly (the
    plan's), once across the mesh."""
    specs = {"clip + adamw": CLIP_ADAMW, "muon": MUON,
             "F.adamw with keywords": ("factory", dict(name="adamw", learning_rate=1e-2, weight_decay=0.1))}
    ranks = run_ranks(w.against_one_process, world_size, replicas, specs)
    ranks_clipped = run_ranks(w.against_one_process, world_size, replicas, {"torch AdamW": TORCH_ADAMW}, 8, 0.5)
    for name in (*specs, "torch AdamW"):  # every route against one process
        got = [r.get(name) or c[name] for r, c in zip(ranks, ranks_clipped)]
        assert max(g[0] for g in got) <= 1e-12, (name, got)
    for name in ("clip + adamw", "torch AdamW"):  # nothing held twice: the ranks' state adds up to one process's
        got = [r.get(name) or c[name] for r, c in zip(ranks, ranks_clipped)]
        assert sum(g[1] for g in got) == got[0][3], (name, got)
    # Muon's adds up to one process's but for the coefficient vector (3 numbers) each state set keeps
    muon = [r["muon"] for r in ranks]
    assert 0 <= sum(m[1] for m in muon) - muon[0][3] <= 2 * 24 * world_size, muon
    for r, c in zip(ranks, ranks_clipped):
        for _, held, planned, alone in (r["clip + adamw"], c["torch AdamW"]):
            stepped = 8  # every param has state on every rank (a part, maybe empty): the plan counts a step each
            assert held + ADAM_SCALAR * stepped == planned
            assert held <= (1 / world_size + 0.01) * alone  # 0.26 of one process at 2x2


def test_a_real_backward_through_hsdp():
    for spec in (TORCH_ADAMW, MUON):
        for world_size, replicas in ((4, 2), (2, 2), (2, 1)):
            worst = max(run_ranks(w.backward_against_one_process, world_size, replicas, spec))
            assert worst <= 1e-10, (spec[0], world_size, replicas, worst)


def test_each_matrix_is_orthogonalised_once_across_the_mesh():
    """Four weights over 2 replicas x 2 shards: each once in the mesh, by the rank the plan names."""
    runs = run_ranks(w.newton_schulz_runs, 4, 2)
    assert [r for r, _ in runs] == [owned for _, owned in runs], runs
    assert sum(r for r, _ in runs) == 4


@pytest.mark.parametrize("world_size, replicas", [(4, 2), (2, 2), (2, 1)])
def test_fp32_masters_of_bf16_params_are_sharded_the_same_way(world_size, replicas):
    got = run_ranks(w.masters_against_one_process, world_size, replicas)
    assert all(worst == 0.0 for worst, _, _ in got), got
    assert sum(held for _, held, _ in got) == got[0][2]  # each master element once in the mesh


def test_masters_resume_across_layouts_and_from_a_state_dict(tmp_path):
    assert run_ranks(w.masters_across_layouts, 4, str(tmp_path / "m")) == [(0.0, 0.0)] * 4


def test_params_written_after_building_the_optimizer_are_what_the_masters_step_from():
    got = run_ranks(w.params_loaded_after_building, 4)
    assert all(worst == 0.0 for worst, _ in got), got
    said = [m for _, ms in got for m in ms]
    assert said and all("changed outside the optimizer" in m for m in said), said


def test_the_traffic_within_and_across_replicas_is_the_plans():
    for spec in (MUON, CLIP_ADAMW):
        for sent, planned in run_ranks(w.recorded_traffic, 4, 2, spec):
            assert sent == planned, (spec[0], sent, planned)
            assert planned["across"], planned


def test_a_checkpoint_resumes_across_layouts(tmp_path):
    """2x2 -> 1x4 -> 4x1 (DCP, zero's save and load) -> zero's ZeRO-2 on plain params, each
    continuing as one process."""
    d = str(tmp_path)
    run_ranks(w.leg, 4, ("zero", 2), None, d + "/a", 0, 3)
    for where, load, save, first, ref in ((("zero", 1), "/a", "/b", 3, (6,)), (("zero", 4), "/b", "/c", 6, (9,)),
                                          (("zero2",), "/c", None, 9, (9, 3))):
        got = run_ranks(w.leg, 4, where, d + load, save and d + save, first, 3)[0]
        assert _worst(got, run_ranks(w.one_process_legs, 1, *ref)[0]) <= 1e-12, where


def test_torch_optims_hsdp_checkpoint_continues_under_zero_and_back(tmp_path):
    d = str(tmp_path)
    run_ranks(w.leg, 4, ("torch", 2), None, d + "/t", 0, 3)  # saved by torch's get_state_dict and dcp.save
    got = run_ranks(w.leg, 4, ("zero", 2), d + "/t", d + "/z", 3, 3)[0]
    assert _worst(got, run_ranks(w.one_process_legs, 1, 6)[0]) <= 1e-12
    got = run_ranks(w.leg, 4, ("torch", 2), d + "/z", None, 6, 3)[0]
    assert _worst(got, run_ranks(w.one_process_legs, 1, 9)[0]) <= 1e-12


def test_zeros_adamw_checkpoint_continues_under_zero_stepping_torchs_adamw_and_back(tmp_path):
    """zero.functional.adamw's state (Optax's paths) loads into ZeroRedundancyOptimizer(params,
    torch.optim.AdamW) (torch's names), resharded 2x2 -> 1x4, with the saved rate; and back."""
    d = str(tmp_path)
    run_ranks(w.leg, 4, ("zero", 2), None, d + "/z", 0, 3)
    got = run_ranks(w.leg, 4, ("zero_torch", 1), d + "/z", d + "/t", 3, 3)[0]
    assert _worst(got, run_ranks(w.one_process_legs, 1, 6)[0]) <= 1e-12
    got = run_ranks(w.leg, 4, ("zero", 2), d + "/t", None, 6, 3)[0]
    assert _worst(got, run_ranks(w.one_process_legs, 1, 9)[0]) <= 1e-12


def test_zero_functional_optimizer_over_hsdp_replicates_the_state_as_torch_optim_does():
    for spec in (w.ADAMW, MUON):
        got = run_ranks(w.functional_optimizer_on_hsdp, 4, spec)
        assert all(worst <= 1e-12 for worst, _, _ in got), got
        if spec is w.ADAMW:
            assert sum(held for _, held, _ in got) == 2 * got[0][2]  # the 2 replicas each hold it all


def test_what_fsdp2_decides_is_refused_by_name():
    said = {case: run_ranks(w.refused, 4, case)[0] for case in ("strategy", "reduce_scatter_grads", "custom class",
                                                               "rule with keywords")}
    assert said["strategy"].startswith("ValueError") and "strategy='flat' is not taken" in said["strategy"]
    assert "reduce_scatter_grads=True" in said["reduce_scatter_grads"]
    assert said["custom class"].startswith("TypeError") and "refused.<locals>.Mine" in said["custom class"]
    assert "no keyword hyperparameters; got ['lr']" in said["rule with keywords"]


def _worst(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_nan_gradients_are_named_skipped_or_raised():
    got = run_ranks(w.nonfinite_steps, 4, "warn")
    # every rank names the param and the ranks whose rows held it (their flags rode in the check-in)
    assert all(said.startswith("step 2: gradients with NaN or inf in 2.weight, in the gradient rows rank 0, 2 hold,")
               for said, _, _ in got), got
    for policy in ("skip", "raise"):
        got = run_ranks(w.nonfinite_steps, 4, policy)
        assert all(moved == 0.0 for _, _, moved in got), (policy, got)  # every rank, together
        assert all(skipped == (policy == "skip") for _, skipped, _ in got), (policy, got)
        if policy == "raise":
            assert all(said.startswith("raised: step 2: gradients with NaN or inf") for said, _, _ in got), got
