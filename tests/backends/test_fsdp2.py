"""zero's rules over FSDP2's DTensor params (`zero.functional.Optimizer` on a ``fully_shard``-ed
model) against one process: every alias and contrib rule, both placements, uneven shards, two
param groups, a real backward, low-bit bits at every mesh size, whole matrices by owner."""

import alias_cases
import fsdp2_workers as w
import pytest
import torch
from helpers import run_ranks

pytestmark = pytest.mark.timeout(600)

CONTRIB = alias_cases.CONTRIB
CHAINS = {"clip_by_global_norm + adamw": ("chain", [("clip_by_global_norm", dict(max_norm=0.5)),
                                                    ("adamw", dict(learning_rate=1e-2, weight_decay=0.1))]),
          "centralize + sgd": ("chain", [("centralize", {}), ("sgd", dict(learning_rate=1e-2))]),
          "adaptive_grad_clip + adam": ("chain", [("adaptive_grad_clip", dict(clipping=0.1)),
                                                  ("adam", dict(learning_rate=1e-2))]),
          # Optax's transformations over whole tensors or the whole model (#66)
          "normalize_by_update_norm + sgd": ("chain", [("normalize_by_update_norm", dict(scale_factor=2.0)),
                                                       ("sgd", dict(learning_rate=1e-2))]),
          "scale_by_param_block_norm + adam": ("chain", [("scale_by_param_block_norm", dict(min_scale=0.5)),
                                                         ("adam", dict(learning_rate=1e-2))]),
          "distance_over_gradients": ("chain", [("scale_by_distance_over_gradients", dict(reps_rel=1e-2)),
                                                ("scale", dict(step_size=-0.1))]),
          "sgd + keep_params_nonnegative": ("chain", [("sgd", dict(learning_rate=0.3)),
                                                      ("keep_params_nonnegative", {})])}
RULES = {**{name: (name, kw) for name, kw in {**alias_cases.ALIASES, **alias_cases.MORE_ALIASES, **CONTRIB,
                                              "sm3": dict(learning_rate=1e-2)}.items()}, **CHAINS}


def test_every_rule_steps_fsdp2s_params_as_one_process_does(world_size=3):
    """Shard(0) with uneven rows (37 over 3: 13/13/11; the 64 x 96 weight's rows cut its low-bit
    blocks, so an owner steps it), 10 steps of fixed gradients, float64. (At 2 ranks, where those
    rows fall on block edges and are stepped in place, the low-bit and per-head tests below and
    the random layouts step them: the widest case runs once.)"""
    worst = run_ranks(w.compare_rules, world_size, RULES)[0]
    bad = {name: d for name, d in worst.items() if not d <= 1e-12}
    assert not bad, f"differ from one process at {world_size} ranks: {bad}"


def test_four_ranks_and_shard_1():
    """4 ranks (one with a single row of 5: 2/2/1/0), and weights on Shard(1) from a shard_placement_fn."""
    some = {k: RULES[k] for k in ("adamw", "lamb", "muon", "adafactor", "adamw_8bit", "sm3",
                                  "clip_by_global_norm + adamw")}
    for dim in (0, 1):
        worst = run_ranks(w.compare_rules, 4, some, 10, dim)[0]
        bad = {name: d for name, d in worst.items() if not d <= 1e-12}
        assert not bad, f"differ from one process on Shard({dim}): {bad}"


@pytest.mark.parametrize("rule", ["adamw_8bit", "adamw_4bit"])
def test_low_bit_params_are_the_same_bits_at_every_mesh_size(rule):
    """The 64 x 96 weight's 256-element blocks lie whole on each rank at 2 and 4 ranks and are cut
    between ranks at 3, where its owner steps it whole: the same bits at 1 to 4 ranks."""
    spec = (rule, CONTRIB[rule])
    one = run_ranks(w.low_bit_params, 1, spec)[0]
    for world_size in (2, 3, 4):
        got = run_ranks(w.low_bit_params, world_size, spec)[0]
        for j, (a, b) in enumerate(zip(got, one)):
            assert torch.equal(a, b), f"{rule} at {world_size} ranks: param {j} differs from one process"


@pytest.mark.parametrize("rule", ["adamw", "muon"])
def test_a_real_backward_through_fsdp2(rule):
    spec = ("chain", [("clip_by_global_norm", dict(max_norm=0.5)), (rule, CONTRIB.get(rule, dict(learning_rate=1e-2)))])
    for world_size in (2, 3):
        worst = max(run_ranks(w.backward_against_one_process, world_size, spec))
        assert worst <= 1e-10, f"{rule} at {world_size} ranks: {worst}"


def test_each_matrix_is_orthogonalised_once_by_its_owner():
    runs = run_ranks(w.newton_schulz_runs, 3)
    assert [r for r, _ in runs] == [owned for _, owned in runs], runs
    assert sum(r for r, _ in runs) == 4  # the model's four weights, each once across the ranks


def test_the_exchanged_bytes_are_the_plans():
    for rule in ("muon", "adamw_8bit"):
        for sent, planned in run_ranks(w.recorded_exchange, 3, (rule, CONTRIB[rule])):
            assert sent == planned, rule


def test_torchs_and_optaxs_rules_by_their_adapters():
    specs = {"from_torch AdamW": ("from_torch", dict(optimizer_class="AdamW", lr=1e-2, weight_decay=0.05)),
             "from_torch RMSprop": ("from_torch", dict(optimizer_class="RMSprop", lr=1e-2, centered=True)),
             "from_optax adam": ("from_optax", dict(name="adam", learning_rate=1e-2)),
             "from_optax adafactor": ("from_optax", dict(name="adafactor", learning_rate=1e-2))}
    worst = run_ranks(w.compare_rules, 3, specs)[0]
    assert all(d <= 1e-12 for d in worst.values()), worst
    # not declared per tensor: refused (Optax's code would read only each owner's tensors)
    said = run_ranks(w.first_step_error, 2, ("from_optax", dict(name="adam", learning_rate=1e-2, per_tensor=False)))
    assert all("from_optax(tx, per_tensor=True)" in s for s in said), said


def test_fsdp2s_mixed_precision_steps_as_torchs_adamw():
    """bf16 compute and fp32 gradients over fp32 sharded params: zero's AdamW steps as torch's."""
    worst = max(run_ranks(w.mixed_precision_against_torch, 2))
    assert worst <= 1e-5, worst


def test_a_state_dict_resumes_on_the_same_layout_and_is_refused_on_another():
    assert max(run_ranks(w.state_dict_round_trip, 2, RULES["muon"])) == 0.0
    got = run_ranks(w.load_elsewhere, 2)
    assert got[0] == "loaded"
    assert "rank 0 of FSDP2 plan" in got[1] and "rank 1 of FSDP2 plan" in got[1], got[1]


def test_plain_params_beside_fsdp2s_are_named(one_rank):
    import torch.nn as nn

    import zero.functional as F

    model = w.make_model()
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    with pytest.raises(ValueError, match=r"plain param '2.weight' beside sharded param '0.weight'"):
        F.Optimizer(model, F.adamw(1e-2))
    assert isinstance(model[2], nn.Linear)


def _worst(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("rule", ["adamw", "muon", "adafactor", "muon_8bit"])
def test_a_dcp_checkpoint_resumes_at_another_mesh_size(tmp_path, rule):
    """Saved at 2 ranks (states of pieces as DTensors, owners' whole), resumed at 3, as one process."""
    spec = RULES[rule]
    run_ranks(w.train_and_save, 2, spec, str(tmp_path / "c"))
    got = run_ranks(w.resume_and_train, 3, spec, str(tmp_path / "c"))[0]
    assert _worst(got, run_ranks(w.one_process, 1, spec)[0]) <= 1e-12


def test_torchs_adamw_on_fsdp2_and_zeros_zero_1_and_2_checkpoints_continue_on_fsdp2(tmp_path):
    run_ranks(w.torch_saves_fsdp2, 2, str(tmp_path / "torch"))
    # built with another rate: the checkpoint's settings, moments and steps are taken, as torch's load does
    got = run_ranks(w.zero_loads_on_fsdp2, 3, ("adamw", dict(learning_rate=5e-2)), str(tmp_path / "torch"))[0]
    assert _worst(got, run_ranks(w.one_process, 1, None)[0]) <= 1e-12
    spec = RULES["adamw"]
    run_ranks(w.zero_flat_saves, 3, spec, str(tmp_path / "zero"))
    got = run_ranks(w.zero_loads_on_fsdp2, 2, spec, str(tmp_path / "zero"))[0]
    assert _worst(got, run_ranks(w.one_process, 1, spec)[0]) <= 1e-12
    # ZeRO-2 (gradient shards only, from a real backward) at 3 ranks, continued on FSDP2 at 2
    run_ranks(w.zero2_then_fixed, 3, spec, str(tmp_path / "zero2"))
    got = run_ranks(w.zero_loads_on_fsdp2, 2, spec, str(tmp_path / "zero2"))[0]
    assert _worst(got, run_ranks(w.zero2_then_fixed, 1, spec, None)[0]) <= 1e-12


@pytest.mark.parametrize("rule", ["adamw_8bit", "adamw_4bit"])
def test_low_bit_state_resumes_at_another_mesh_size_to_the_bit(tmp_path, rule):
    """Saved at 2 ranks (the 64 x 96 weight's codes and scales as runs of each rank's rows), resumed
    at 3 (where its owner steps it whole): the same bits as one process."""
    spec = RULES[rule]
    run_ranks(w.train_and_save, 2, spec, str(tmp_path / "c"))
    got = run_ranks(w.resume_and_train, 3, spec, str(tmp_path / "c"))[0]
    for j, (a, b) in enumerate(zip(got, run_ranks(w.one_process, 1, spec)[0])):
        assert torch.equal(a, b), f"{rule}: param {j} differs"



def test_zeros_adamw_on_fsdp2_continues_as_torchs_adamw_and_other_rules_are_refused(tmp_path):
    run_ranks(w.zero_saves_fsdp2, 3, RULES["adamw"], str(tmp_path / "adamw"))
    # torch's AdamW built with another rate takes the checkpoint's settings, moments and count
    got = run_ranks(w.torch_loads_on_fsdp2, 2, str(tmp_path / "adamw"))[0]
    assert _worst(got, run_ranks(w.one_process, 1, None)[0]) <= 1e-12
    # torch's own checkpoint through zero's load: as torch's functions load it
    run_ranks(w.torch_saves_fsdp2, 2, str(tmp_path / "torch"))
    got = run_ranks(w.torch_loads_on_fsdp2, 3, str(tmp_path / "torch"))[0]
    assert _worst(got, run_ranks(w.one_process, 1, None)[0]) <= 1e-12
    run_ranks(w.zero_saves_fsdp2, 2, RULES["muon"], str(tmp_path / "muon"))
    said = run_ranks(w.torch_refuses, 2, str(tmp_path / "muon"))[0]
    assert "saved by a zero.functional rule" in said and "torch.optim.AdamW loads zero's state only" in said, said


def test_ranks_whose_plans_differ_are_told_which_param_differs():
    # rank 0 steps AdamW, rank 1 Muon: their plans differ, and the first step says where
    said = run_ranks(w.first_step_error, 2, [("adamw", dict(learning_rate=1e-2)), ("muon", dict(learning_rate=1e-2))])
    assert all("param 0 (name, shape, dtype, dim, owner, block) by rank: 0: ('0.weight'" in s for s in said), said


def test_muons_label_on_a_vector_is_named_as_on_one_process():
    """The dimension numbers label the vector 4.bias: over FSDP2 the optimizer's construction names
    it (not a matrix in pieces, with a flat plan's advice), as one process names it."""
    said = run_ranks(w.muon_label_error, 2) + run_ranks(w.muon_label_error, 2, True, True)  # and ZeRO's hybrid
    one = w.muon_label_error(0, 1, fsdp2=False)
    for s in said + [one]:
        assert "labels '4.bias' (shape (64,)) as a Muon weight, but it has rank 1" in s, s
