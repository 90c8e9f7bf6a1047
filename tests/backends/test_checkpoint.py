"""Sharded checkpoints (`zero.backends.checkpoint`): DCP's format, each rank writing what it holds.

Legs of 4 steps chain through checkpoints at different world sizes and plans, through FSDP2 and
through ``dcp_to_torch_save``; every chain ends equal (to the bit) to one process stepping the
same gradients, or to the uninterrupted run where it keeps master weights.
"""

import json
import os
import re

import alias_cases
import checkpoint_workers as cw
import numpy as np
import plan_workers as pw
import pytest
import torch
from helpers import fixed_grads, make_model, run_ranks, set_grads

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::FutureWarning")]


def _params(rows):
    return rows[0]["params"]


def _equal(got, want):
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b.double().numpy() if isinstance(b, torch.Tensor) else b)


def test_a_checkpoint_resumes_at_other_world_sizes_and_plans_to_the_bit(tmp_path):
    run_ranks(cw.dcp_leg, 2, "flat", None, str(tmp_path / "a"), 0, 4, timeout=120)
    run_ranks(cw.dcp_leg, 3, "sorted_greedy", str(tmp_path / "a"), str(tmp_path / "b"), 4, 4, timeout=120)
    rows = run_ranks(cw.dcp_leg, 4, "flat", str(tmp_path / "b"), None, 8, 4, timeout=120)
    _equal(_params(rows), pw.single_process(12))


def _within_one_rounding(got, want):
    """bf16 params at most one bf16 step apart, in at most 1 element of 200: masters restarted from
    the bf16 params would leave a rounding's difference in a large share of the elements."""
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        ulp = np.spacing(np.abs(b).astype(np.float32)) * 2.0**16  # bf16 keeps 8 of fp32's 24 bits
        assert np.all(np.abs(a - b) <= ulp), "beyond one bf16 rounding"
        assert np.count_nonzero(a != b) <= max(1, b.size // 200), f"{np.count_nonzero(a != b)} of {b.size} differ"


@pytest.mark.parametrize("rule", ["adamw", "lamb"])
def test_master_weights_travel_in_the_checkpoint(tmp_path, rule):
    """bf16 params on fp32 masters: had the masters restarted from the bf16 params on load, the
    run would drift from the uninterrupted one (a torch class; a zero.functional rule)."""
    run_ranks(cw.dcp_leg, 3, "flat", None, str(tmp_path / "a"), 0, 4, True, rule, timeout=120)
    resumed = run_ranks(cw.dcp_leg, 2, "sorted_greedy", str(tmp_path / "a"), None, 4, 4, True, rule, timeout=120)
    whole = run_ranks(cw.dcp_leg, 2, "flat", None, None, 0, 8, True, rule, timeout=120)
    if rule == "adamw":
        _equal(_params(resumed), _params(whole))
    else:  # LAMB's per-tensor norms sum in another order on 3 and 2 ranks: a rare bf16 rounding flips
        _within_one_rounding(_params(resumed), _params(whole))
    assert any(k.endswith(".master") for k in checkpoint_keys(tmp_path / "a"))


def test_fsdp2_loads_zero_checkpoints_and_zero_loads_fsdp2s(tmp_path):
    run_ranks(cw.dcp_leg, 3, "flat", None, str(tmp_path / "zero"), 0, 4, timeout=120)
    run_ranks(cw.fsdp2_leg, 2, str(tmp_path / "zero"), str(tmp_path / "fsdp2"), 4, 4, timeout=120)
    rows = run_ranks(cw.dcp_leg, 4, "sorted_greedy", str(tmp_path / "fsdp2"), None, 8, 4, timeout=120)
    _equal(_params(rows), pw.single_process(12))


def test_dcp_to_torch_save_gives_a_file_plain_adamw_resumes_from(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_ranks(cw.dcp_leg, 3, "flat", None, str(tmp_path / "zero"), 0, 4, timeout=120)
    dcp_to_torch_save(tmp_path / "zero", tmp_path / "full.pt")
    _equal([p.double().numpy() for p in cw.plain_leg(str(tmp_path / "full.pt"), 4, 4)], pw.single_process(8))


@pytest.mark.parametrize("strategy", ["flat", "sorted_greedy"])
def test_each_rank_hands_dcp_views_of_its_own_state_and_nothing_more(strategy):
    """The save path copies nothing: every tensor is the optimizer's own state (or master), and
    each rank's bytes are exactly the plan's state + master bytes for it."""
    for row in run_ranks(cw.held_views, 3, strategy, timeout=120):
        assert row["copies"] == 0
        assert row["bytes"] == row["planned"] > 0


def test_a_rank_killed_mid_save_leaves_the_last_checkpoint_whole_and_the_partial_one_refused(tmp_path):
    from zero.backends.checkpoint import read_metadata

    good, partial = str(tmp_path / "good"), str(tmp_path / "partial")
    run_ranks(cw.dcp_leg, 2, "flat", None, good, 0, 4, timeout=120)
    rows = run_ranks(cw.killed_save, 2, good, partial, timeout=120, pg_timeout=20, allow_exit=(1,))
    assert rows[0] != "saved"
    with pytest.raises(ValueError, match=r"incomplete: it has no \.metadata .* save did not finish"):
        read_metadata(partial)
    rows = run_ranks(cw.dcp_leg, 3, "sorted_greedy", good, None, 4, 4, timeout=120)
    _equal(_params(rows), pw.single_process(8))


def test_a_rank_killed_mid_save_over_a_checkpoint_leaves_it_whole_and_the_next_save_replaces_it(tmp_path):
    """Saving over the last checkpoint (the torch habit: one path, saved every N steps) while a
    rank dies: the old checkpoint is still there, whole, and resumes; the next save replaces it."""
    path = str(tmp_path / "last")
    run_ranks(cw.dcp_leg, 2, "flat", None, path, 0, 4, timeout=120)
    before = sorted(os.listdir(path))
    rows = run_ranks(cw.killed_save_over, 2, path, timeout=120, pg_timeout=20, allow_exit=(1,))
    assert rows[0] != "saved"
    assert sorted(os.listdir(path)) == before
    rows = run_ranks(cw.dcp_leg, 3, "sorted_greedy", path, None, 4, 4, timeout=120)
    _equal(_params(rows), pw.single_process(8))  # the step-4 checkpoint, not a mix of steps 4 and 5
    assert [n for n in os.listdir(tmp_path) if n.startswith("last.saving-")]  # the dead save's sibling
    run_ranks(cw.dcp_leg, 2, "flat", None, path, 0, 2, timeout=120)  # saved over: replaced, leftovers gone
    assert sorted(os.listdir(tmp_path)) == ["last"]
    rows = run_ranks(cw.dcp_leg, 2, "flat", path, None, 2, 6, timeout=120)
    _equal(_params(rows), pw.single_process(8))


def _corrupt(path, at: float) -> None:
    """8 bytes overwritten at ``at`` of the file (as rot, a bad disk or a stray write would)."""
    data = bytearray(path.read_bytes())
    pos = int(len(data) * at)
    data[pos:pos + 8] = bytes(255 - b for b in data[pos:pos + 8])
    path.write_bytes(bytes(data))


def test_a_changed_byte_anywhere_in_a_data_file_is_refused_by_every_rank_before_anything_loads(tmp_path):
    """8 bytes changed at 10, 35, 60 or 85% of one rank's .distcp file (each once, on a fresh
    copy): every rank raises the same ValueError naming the file, the tensor and its piece, and
    neither the model nor the optimizer changed. (Before checksums, all four loaded.)"""
    import shutil

    run_ranks(cw.dcp_leg, 2, "flat", None, str(tmp_path / "good"), 0, 4)
    assert (tmp_path / "good" / ".zero-checksums.json").exists()
    for at in (0.10, 0.35, 0.60, 0.85):
        bad = tmp_path / f"bad{at}"
        shutil.copytree(tmp_path / "good", bad)
        _corrupt(bad / "__1_0.distcp", at)
        rows = run_ranks(cw.load_or_error, 2, str(bad))
        assert rows[0]["error"] == rows[1]["error"], "every rank says the same"
        assert re.search(r"is damaged, so nothing was loaded: the checkpoint's '(model|optim)\.[\w.]+'( at offsets "
                         r"\[[\d, ]+\])? \(bytes \d+\.\.\d+ of __1_0\.distcp\) does not match its checksum",
                         rows[0]["error"]), (at, rows[0]["error"])
        assert all(r["unchanged"] for r in rows), at


def test_a_truncated_metadata_and_a_missing_or_short_data_file_are_value_errors_naming_the_file(tmp_path):
    import shutil

    run_ranks(cw.dcp_leg, 2, "flat", None, str(tmp_path / "good"), 0, 2)
    cases = {}
    for case in ("metadata", "missing", "short", "sidecar"):
        shutil.copytree(tmp_path / "good", tmp_path / case)
        cases[case] = tmp_path / case
    meta = cases["metadata"] / ".metadata"
    meta.write_bytes(meta.read_bytes()[:200])
    (cases["missing"] / "__0_0.distcp").unlink()
    short = cases["short"] / "__1_0.distcp"
    short.write_bytes(short.read_bytes()[:1000])
    (cases["sidecar"] / ".metadata").write_bytes((cases["sidecar"] / ".metadata").read_bytes() + b"\0")
    want = {"metadata": r"\.metadata' does not match its checksum",
            "missing": r"the data file '.*/missing/__0_0\.distcp' is missing",
            "short": r"the data file '.*/short/__1_0\.distcp' is short: 1000 bytes where its pieces need \d+",
            "sidecar": r"\.metadata' does not match its checksum"}
    for case, pattern in want.items():
        rows = run_ranks(cw.load_or_error, 2, str(cases[case]))
        assert rows[0]["error"] == rows[1]["error"] and re.search(pattern, rows[0]["error"]), (case, rows[0]["error"])
        assert all(r["unchanged"] for r in rows), case
    (cases["metadata"] / ".zero-checksums.json").unlink()  # no hash to catch it: the pickle itself fails, named
    rows = run_ranks(cw.load_or_error, 2, str(cases["metadata"]))
    assert re.search(r"\.metadata' cannot be read \(UnpicklingError: .*\): it is truncated or damaged \(200 bytes\)",
                     rows[0]["error"]), rows[0]["error"]


def test_zero_checkpoint_verify_checks_every_piece_without_loading(tmp_path, capsys):
    from zero.tools.cli import main

    run_ranks(cw.dcp_leg, 2, "flat", None, str(tmp_path / "ck"), 0, 1)
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 0
    assert re.fullmatch(r".*/ck: \d+ pieces in 2 files match their checksums \(xxh3_64\)\n", capsys.readouterr().out)
    _corrupt(tmp_path / "ck" / "__0_0.distcp", 0.5)
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 1
    out = capsys.readouterr().out
    assert re.match(r"DAMAGED: the checkpoint's '.*' .*\(bytes \d+\.\.\d+ of __0_0\.distcp\) does not match its "
                    r"checksum", out) and out.endswith("/ck: 1 problems found\n"), out
    (tmp_path / "ck" / ".zero-checksums.json").unlink()
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 0
    assert "no checksums (saved by DCP or FSDP2 directly, or an older zero)" in capsys.readouterr().out


def test_zero_checkpoint_verify_exits_1_on_a_damaged_or_unfinished_checkpoint_and_2_without_one(tmp_path, capsys):
    """docs/cli.md: exit status 1 if the checkpoint is damaged, its metadata included; 2 for no checkpoint."""
    from zero.tools.cli import main

    run_ranks(cw.dcp_leg, 2, "flat", None, str(tmp_path / "ck"), 0, 1)
    capsys.readouterr()
    meta = tmp_path / "ck" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:200])
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("DAMAGED: ") and ".metadata" in out and out.endswith("/ck: 1 problems found\n"), out
    meta.unlink()  # a save that never finished writes no .metadata
    assert main(["checkpoint", "verify", str(tmp_path / "ck")]) == 1
    assert "its save did not finish" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    (tmp_path / "jax" / "zero").mkdir(parents=True)
    (tmp_path / "jax" / "zero" / "metadata").write_text("{ truncated")
    assert main(["checkpoint", "verify", str(tmp_path / "jax")]) == 1
    assert "has a damaged zero/metadata (JSONDecodeError" in capsys.readouterr().out


def test_a_checkpoint_without_checksums_loads_with_a_warning_that_it_cannot_be_verified(tmp_path):
    run_ranks(cw.dcp_leg, 2, "flat", None, str(tmp_path / "old"), 0, 2)
    (tmp_path / "old" / ".zero-checksums.json").unlink()  # as an older zero, or FSDP2, saved it
    for r in run_ranks(cw.load_or_error, 2, str(tmp_path / "old")):
        assert r["error"] is None and not r["unchanged"]
        assert r["warnings"] == [f"UnverifiedCheckpointWarning: the checkpoint at '{tmp_path / 'old'}' has no "
                                 "checksums (saved by DCP or FSDP2 directly, or by an older zero): it loads, but its "
                                 "bytes cannot be verified"]


def test_a_consolidated_state_dict_keeps_torchs_reference_semantics_and_an_earlier_ones_checksums(one_rank,
                                                                                                 tmp_path):
    """An in-memory state dict is torch's: no checksum in it, and one loaded into a plain optimizer
    and stepped there (its tensors aliased, as torch's are) loads its current values back, as into
    torch's own ZeRO. A dict saved with checksums by an earlier zero is still checked: a byte
    changed in its file is refused, naming the tensor, before anything is loaded."""
    from zero.backends.checkpoint.integrity import state_dict_checksums

    model, opt = _one_rank_run(tmp_path)
    opt.consolidate_state_dict(to=0)
    sd = opt.state_dict()
    assert "zero_checksums" not in sd and "3" not in sd["state"] and 3 not in sd["state"]
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain.load_state_dict(sd)  # aliases the dict's tensors (same dtype and device)
    set_grads(model, fixed_grads(list(model.parameters()), 1))
    plain.step()  # ... and steps them
    stepped = {k: v.clone() for k, v in sd["state"][4].items()}
    fresh_model, fresh = _one_rank_run(tmp_path)
    fresh.load_state_dict(sd)  # its current values, as torch's ZeRO would load them
    fresh.consolidate_state_dict(to=0)
    again = fresh.state_dict()["state"][4]
    assert all(torch.equal(again[k], stepped[k]) for k in stepped)
    earlier = {**sd, "zero_checksums": state_dict_checksums(sd["state"])}  # an earlier zero's form
    torch.save(earlier, tmp_path / "optim.pt")
    data = bytearray((tmp_path / "optim.pt").read_bytes())
    at = data.find(sd["state"][4]["exp_avg"].numpy().tobytes()[:64])  # inside param 4's exp_avg (3 is frozen)
    data[at + 100:at + 108] = bytes(255 - b for b in data[at + 100:at + 108])
    (tmp_path / "optim.pt").write_bytes(bytes(data))
    damaged = torch.load(tmp_path / "optim.pt", weights_only=True)  # loads, silently
    with pytest.raises(ValueError, match=r"the state dict's param 4's 'exp_avg' do not match their checksums "
                                         r"\(1 tensors\)"):
        fresh.load_state_dict(damaged)


def _one_rank_run(tmp_path, model=None, optimizer_class=torch.optim.AdamW, **kw):
    from zero.backends import ZeroRedundancyOptimizer as Zero

    model = model if model is not None else make_model("plan")
    kw = {"lr": 1e-2, **kw} if isinstance(optimizer_class, type) else kw
    opt = Zero(model.parameters(), optimizer_class, **kw)
    set_grads(model, fixed_grads(list(model.parameters()), 0))
    opt.step()
    return model, opt


@pytest.fixture
def saved(tmp_path, one_rank):
    from zero.backends import checkpoint

    model, opt = _one_rank_run(tmp_path)
    checkpoint.save(tmp_path / "ckpt", model, opt)
    return tmp_path / "ckpt"


def test_a_checkpoint_of_another_model_is_a_value_error_naming_the_fqn(saved, tmp_path):
    from torch import nn

    from zero.backends import checkpoint

    wider = make_model("plan")
    wider[4] = nn.Linear(40, 4).double()
    model, opt = _one_rank_run(tmp_path, wider)
    with pytest.raises(ValueError, match=r"'model\.4\.weight' has shape \(3, 40\) but here it has shape \(4, 40\)"):
        checkpoint.load(saved, model, opt)
    shorter = torch.nn.Sequential(*list(make_model("plan"))[:4])
    model, opt = _one_rank_run(tmp_path, shorter)
    with pytest.raises(ValueError, match=r"model tensors this model does not have: \['model\.4\.bias', 'model\.4\.w"):
        checkpoint.load(saved, model, opt)
    longer = torch.nn.Sequential(*make_model("plan"), nn.Linear(3, 2).double())
    model, opt = _one_rank_run(tmp_path, longer)
    with pytest.raises(ValueError, match=r"lacks 8 tensors .* \(the model's \['5\.bias', '5\.weight'\]: it was"):
        checkpoint.load(saved, model, opt)


def test_a_checkpoint_of_another_optimizer_names_the_missing_state(saved, tmp_path):
    from zero.backends import checkpoint

    model, opt = _one_rank_run(tmp_path, optimizer_class=torch.optim.RMSprop, momentum=0.9)
    with pytest.raises(ValueError, match=r"lacks .* tensors .*'optim\.state\.0\.weight\.momentum_buffer'"):
        checkpoint.load(saved, model, opt)


def test_a_checkpoint_of_another_optimizer_names_the_rule_that_saved_it_and_the_one_loading(saved, tmp_path):
    import zero.functional as F
    from zero.backends import checkpoint

    model, opt = _one_rank_run(tmp_path, optimizer_class=torch.optim.SGD, momentum=0.9)
    with pytest.raises(ValueError, match=r"lacks 9 tensors .*\(its optimizer state was saved by torch\.optim\.AdamW "
                                         r"\(state exp_avg, exp_avg_sq, step\), and this optimizer steps "
                                         r"torch\.optim\.SGD\)"):
        checkpoint.load(saved, model, opt)
    model, opt = _one_rank_run(tmp_path, optimizer_class=F.lion(1e-3))
    with pytest.raises(ValueError, match=r"saved by torch\.optim\.AdamW .*this optimizer steps zero\.functional\.lion: "
                                         r"torch\.optim's state loads directly into the rule with the same maths only"):
        checkpoint.load(saved, model, opt)
    functional = tmp_path / "functional"
    checkpoint.save(functional, *_one_rank_run(tmp_path, optimizer_class=F.lion(1e-2)))
    model, opt = _one_rank_run(tmp_path, optimizer_class=torch.optim.AdamW)  # (zero's adamw would load: #65)
    with pytest.raises(ValueError, match=r"saved by a zero\.functional rule \(state count, inner_state\.0\.count, "
                                         r".*\), and torch\.optim\.AdamW loads zero's state only from the rule"):
        checkpoint.load(functional, model, opt)


@pytest.mark.parametrize("cls, settings, rule, refused", [
    (torch.optim.AdamW, dict(amsgrad=True), "adamw", r"has amsgrad=True, which zero\.functional\.adamw does not have"),
    (torch.optim.Adam, dict(weight_decay=0.01), "adam", r"has weight_decay=0\.01, .* decays by L2 in the gradient"),
    (torch.optim.SGD, dict(momentum=0.9, dampening=0.1), "sgd", r"has dampening=0\.1, which zero\.functional\.sgd"),
    (torch.optim.SGD, dict(momentum=0.9, nesterov=True), "sgd", r"has nesterov=True, .* fixed when it is built"),
])
def test_torch_settings_the_functional_rule_does_not_have_are_refused_by_name(one_rank, tmp_path, cls, settings,
                                                                              rule, refused):
    import zero.functional as F
    from zero.backends import checkpoint

    checkpoint.save(tmp_path / "torch", *_one_rank_run(tmp_path, optimizer_class=cls, **settings))
    model, opt = _one_rank_run(tmp_path, optimizer_class=getattr(F, rule)(1e-2, **({"momentum": 0.9} if rule == "sgd"
                                                                                  else {})))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=refused):
        checkpoint.load(tmp_path / "torch", model, opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "nothing loaded before the refusal"


@pytest.mark.parametrize("rule, cls, refused", [
    (lambda F: F.adamw(1e-2, eps_root=1e-9), torch.optim.AdamW, r"has eps_root=1e-09, which torch\.optim\.AdamW"),
    (lambda F: F.adamw(1e-2, weight_decay=0.1), torch.optim.Adam, r"weight_decay=0\.1, .* load it into AdamW"),
    (lambda F: F.lion(1e-2), torch.optim.AdamW, r"saved by a zero\.functional rule .* adam into Adam or AdamW"),
])
def test_a_rules_settings_torchs_class_does_not_have_are_refused_by_name(one_rank, tmp_path, rule, cls, refused):
    """The other way: zero.functional's checkpoint into the ZeRO stepping torch's class."""
    import zero.functional as F
    from zero.backends import checkpoint

    checkpoint.save(tmp_path / "rule", *_one_rank_run(tmp_path, optimizer_class=rule(F)))
    model, opt = _one_rank_run(tmp_path, optimizer_class=cls)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=refused):
        checkpoint.load(tmp_path / "rule", model, opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "nothing loaded before the refusal"


def test_torch_steps_that_differ_within_a_group_are_refused_by_name(one_rank, tmp_path):
    """torch keeps a step per param (a param without a gradient skips one); the rule one count."""
    import zero.functional as F
    from zero.backends import checkpoint

    model, opt = _one_rank_run(tmp_path)
    model[0].bias.grad = None  # 0.bias sits out the second step
    opt.step()
    checkpoint.save(tmp_path / "torch", model, opt)
    model, opt = _one_rank_run(tmp_path, optimizer_class=F.adamw(1e-2))
    with pytest.raises(ValueError, match=r"in param group 0 they differ \('0\.bias' at step 1, '4\.bias' at 2\); "
                                         r"zero\.functional\.adamw keeps one count"):
        checkpoint.load(tmp_path / "torch", model, opt)


@pytest.mark.parametrize("saved_rule, loaded_rule", [("adamw", "f_adamw"), ("sgd_momentum", "f_sgd"),
                                                     ("f_adamw", "adamw")])
def test_a_torch_checkpoint_loads_into_the_functional_rule_with_the_same_maths(tmp_path, saved_rule, loaded_rule):
    """torch.optim.AdamW (SGD) on 2 ranks, saved; resumed at 3 ranks under another plan by
    zero.functional.adamw (sgd), built with other settings: it takes the checkpoint's moments,
    steps and settings, and goes on as torch's own resumed run does. And the other way: the
    rule's checkpoint resumed by the ZeRO stepping torch.optim.AdamW."""
    run_ranks(cw.dcp_leg, 2, "flat", None, str(tmp_path / "a"), 0, 4, False, saved_rule)
    theirs = run_ranks(cw.dcp_leg, 3, "sorted_greedy", str(tmp_path / "a"), None, 4, 4, False, saved_rule)
    ours = run_ranks(cw.dcp_leg, 3, "sorted_greedy", str(tmp_path / "a"), None, 4, 4, False, loaded_rule)
    for a, b in zip(_params(ours), _params(theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15)


def test_an_fsdp2_adamw_checkpoint_continues_as_zero_functional_adamw(tmp_path):
    run_ranks(cw.fsdp2_leg, 2, None, str(tmp_path / "fsdp2"), 0, 4, timeout=120)
    rows = run_ranks(cw.dcp_leg, 3, "flat", str(tmp_path / "fsdp2"), None, 4, 4, False, "f_adamw", timeout=120)
    for a, b in zip(_params(rows), pw.single_process(8)):
        np.testing.assert_allclose(a, b.double().numpy(), rtol=1e-13, atol=1e-15)


def test_options_a_sharded_state_dict_cannot_honour_are_refused(saved, tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from zero.backends import checkpoint

    model, opt = _one_rank_run(tmp_path)
    for name in ("full_state_dict", "cpu_offload", "broadcast_from_rank0"):
        with pytest.raises(ValueError, match=rf"StateDictOptions\({name}=True\) is not supported"):
            checkpoint.get_state_dict(model, opt, options=StateDictOptions(**{name: True}))
    with pytest.raises(TypeError, match=r"must be one of zero's \(ZeroRedundancyOptimizer, "
                                        r"zero.functional.Optimizer\), got AdamW"):
        checkpoint.get_state_dict(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="optimizer's param 0 .* is not a parameter of the model"):
        checkpoint.get_state_dict(make_model("plan"), opt)


def test_the_flattened_layout_round_trips(saved, tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from zero.backends import checkpoint

    model, opt = _one_rank_run(tmp_path)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    _, optim_sd = checkpoint.get_state_dict(model, opt, options=flat)
    assert "state.4.weight.exp_avg" in optim_sd and optim_sd["param_groups.4.weight.lr"] == 1e-2
    fresh_model, fresh = _one_rank_run(tmp_path)
    fresh.param_groups[0]["lr"] = 0.5
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(1.0)
    model_sd, _ = checkpoint.get_state_dict(model, opt)
    checkpoint.set_state_dict(fresh_model, fresh, model_state_dict=model_sd, optim_state_dict=optim_sd, options=flat)
    assert fresh.param_groups[0]["lr"] == 1e-2
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.parameters(), model.parameters()))  # copied in
    del model_sd["4.bias"]
    with pytest.raises(ValueError, match=r"missing FQNs \['4\.bias'\], unexpected FQNs \[\]"):
        checkpoint.set_state_dict(fresh_model, fresh, model_state_dict=model_sd, optim_state_dict=optim_sd,
                                  options=flat)
    got, want = fresh.optim.state_dict()["state"][0], opt.optim.state_dict()["state"][0]
    torch.testing.assert_close(got["exp_avg"], want["exp_avg"], rtol=0, atol=0)


def test_zero_checkpoint_show_reads_a_checkpoint_without_a_process_group(tmp_path, capsys):
    from zero.tools.cli import main

    run_ranks(cw.dcp_leg, 3, "flat", None, str(tmp_path / "ckpt"), 0, 1, timeout=120)
    assert main(["checkpoint", "show", str(tmp_path / "ckpt"), "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    weight = rows["optim.state.3.weight.exp_avg"]  # 2560 elements split over the 3 ranks' shards
    assert weight["shape"] == [40, 64] and weight["dtype"] == "float64" and weight["bytes"] == 2560 * 8
    assert weight["complete"] and {c["file"] for c in weight["chunks"]} == {f"__{r}_0.distcp" for r in range(3)}
    assert sum(np.prod(c["sizes"]) for c in weight["chunks"]) == 2560
    assert rows["optim.param_groups.1.lr"]["kind"] == "bytes"
    assert main(["checkpoint", "show", str(tmp_path / "ckpt")]) == 0
    assert "optim.state.3.weight.exp_avg" in capsys.readouterr().out
    os.remove(tmp_path / "ckpt" / ".metadata")
    assert main(["checkpoint", "show", str(tmp_path / "ckpt")]) == 2
    assert "incomplete: it has no .metadata" in capsys.readouterr().err


def test_reduce_scattered_and_overlapped_runs_save_and_resume(tmp_path):
    """reduce_scatter_grads at 2 ranks -> the DDP overlap at 4 -> reduce_scatter_grads at 2, against
    one process. Even uninterrupted, these modes differ from one process in the last bit (their
    gradient reductions round differently), hence a tolerance; a lost or misplaced state is 1e-3."""
    run_ranks(cw.mode_leg, 2, "reduce_scatter", None, str(tmp_path / "a"), 0, 3, timeout=120)
    run_ranks(cw.mode_leg, 4, "overlap", str(tmp_path / "a"), str(tmp_path / "b"), 3, 3, timeout=120)
    rows = run_ranks(cw.mode_leg, 2, "reduce_scatter", str(tmp_path / "b"), None, 6, 3, timeout=120)
    for got, want in zip(_params(rows), cw.single_process_batches(9)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("rule", ["clip_adamw", "from_torch_adamw"])
def test_functional_rules_checkpoint_their_optax_shaped_state_by_fqn(tmp_path, rule):
    """A zero.functional chain (global-norm clipping, AdamW; the sharded norm sums in another
    order) and from_torch(AdamW) through flat@2 -> whole@3 -> flat@4 against one process. LAMB,
    with masters, below."""
    run_ranks(cw.dcp_leg, 2, "flat", None, str(tmp_path / "a"), 0, 4, False, rule, timeout=120)
    rows = run_ranks(cw.dcp_leg, 3, "sorted_greedy", str(tmp_path / "a"), str(tmp_path / "b"), 4, 4, False, rule,
                     timeout=120)
    rows = run_ranks(cw.dcp_leg, 4, "flat", str(tmp_path / "b"), None, 8, 4, False, rule, timeout=120)
    for got, want in zip(_params(rows), cw.one_process(rule, 12)):
        want = want.numpy()
        assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()  # the bound for rules not torch's
    mine = [k.removeprefix("optim.state.3.weight.") for k in checkpoint_keys(tmp_path / "b")
            if k.startswith("optim.state.3.weight.")]  # Optax's state layout under the FQN; torch's names for its rules
    if rule == "from_torch_adamw":
        assert sorted(mine) == ["exp_avg", "exp_avg_sq", "step"], mine
    else:
        assert any(k.endswith(".mu") for k in mine) and any(k.endswith(".count") for k in mine), mine


def checkpoint_keys(path):
    from zero.backends.checkpoint import describe

    return [r["key"] for r in describe(path)]


def test_a_functional_state_dict_handed_over_is_copied_in(one_rank, tmp_path):
    """set_state_dict with tensors that are not the optimizer's own (another run's dict): each
    leaf, per-param and shared, is copied in."""
    import zero.functional as zf
    from zero.backends import checkpoint
    from zero.functional.adapters.state_tree import state_leaves

    tx = zf.chain(zf.clip_by_global_norm(1.0), zf.adamw(1e-2, weight_decay=0.1))
    model, opt = _one_rank_run(tmp_path, optimizer_class=tx)
    for _ in range(2):
        opt.step()  # the same gradients again: count 3
    fresh_model, fresh = _one_rank_run(tmp_path, optimizer_class=tx)
    model_sd, optim_sd = checkpoint.get_state_dict(model, opt)
    checkpoint.set_state_dict(fresh_model, fresh, model_state_dict=model_sd, optim_state_dict=optim_sd)
    (idx, got), = fresh.optim.set_states(0).items()
    (_, want), = opt.optim.set_states(0).items()
    assert int(got.inner_state[1][0].count) == 3  # the chain under inject_hyperparams: its group's lr
    for (ka, _, a), (kb, _, b) in zip(state_leaves(got, len(idx)), state_leaves(want, len(idx))):
        assert ka == kb and (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), ka


def test_post_local_sgd_saves_its_averager_step(tmp_path):
    """5 steps at 2 ranks (the 5th averages), resumed at 4: the averager goes on from step 5."""
    run_ranks(cw.local_sgd_leg, 2, None, str(tmp_path / "a"), 0, 5, timeout=120)
    rows = run_ranks(cw.local_sgd_leg, 4, str(tmp_path / "a"), None, 5, 3, timeout=120)
    assert rows[0]["resumed_at"] == 5 and rows[0]["averager_step"] == 8
    _equal(_params(rows), pw.single_process(8))  # every rank steps the same gradients: averages change nothing


def test_post_local_sgd_between_averages_is_refused(one_rank, tmp_path):
    from zero.backends import PeriodicModelAverager, PostLocalSGDOptimizer, checkpoint

    model, inner = _one_rank_run(tmp_path)
    opt = PostLocalSGDOptimizer(inner, PeriodicModelAverager(period=2, warmup_steps=0))
    opt.step()  # step 0 averages
    checkpoint.get_state_dict(model, opt)
    opt.step()  # step 1 does not
    with pytest.raises(ValueError, match="model replicas differ at averager step 2"):
        checkpoint.get_state_dict(model, opt)


def test_async_save_writes_a_checkpoint_that_loads(tmp_path):
    run_ranks(cw.dcp_leg, 2, "flat", None, str(tmp_path / "a"), 0, 4, False, "adamw", True, timeout=120)
    rows = run_ranks(cw.dcp_leg, 3, "sorted_greedy", str(tmp_path / "a"), None, 4, 4, timeout=120)
    _equal(_params(rows), pw.single_process(8))


def test_a_run_with_uneven_inputs_under_join_saves_and_resumes(tmp_path):
    """Saved after a Join loop (rank 1 ran out of inputs a step before rank 2): resuming from it
    continues exactly as the run that saved it."""
    saver = run_ranks(cw.join_leg, 3, str(tmp_path / "a"), False, timeout=120)
    resumed = run_ranks(cw.join_leg, 3, str(tmp_path / "a"), True, timeout=120)
    _equal(_params(resumed), _params(saver))


def test_both_formats_round_trip_every_mode_over_the_same_holdings(tmp_path):
    """Whole, flat, reduce-scattered, hybrid (plain and reduce-scattered) and DDP-overlap modes,
    with and without fp32 masters, at 3 ranks: torch's consolidated dict and DCP's checkpoint each
    give every rank back exactly the local state it held, and the two formats agree (both are
    written over the plan's holdings, `zero.plans.holdings`, not over a mode's bookkeeping)."""
    rows = run_ranks(cw.formats_round_trip, 3, str(tmp_path), list(cw.MODES), timeout=240)
    for rank, row in enumerate(rows):
        for mode, r in row.items():
            assert r["consolidated"] and r["dcp"] and r["formats_agree"], (rank, mode, r)
    assert {r["mode"] for r in rows[0].values()} == {"WholeParams", "FlatShards", "ReduceScatteredShards",
                                                     "FlatShards hybrid", "FlatShards hybrid reduced", "DDPOverlap"}
    assert all(r["pieces"] > 0 for row in rows for r in row.values())


SWEEP_RULES = {name: (name, {**alias_cases.ALIASES, **alias_cases.MORE_ALIASES, **alias_cases.CONTRIB}[name])
               for name in ("adamw", "adafactor", "lion", "muon", "soap", "shampoo")}


def test_every_rule_saves_under_every_plan_and_resumes_bitwise_here_and_to_rounding_at_another_world_size(tmp_path):
    """The random-layout sweep's model (#65): each rule, under a flat plan (hybrid where the rule
    needs matrices whole: Adafactor's vectors keep 1-element placeholders in flat shards) and a
    whole-param plan, saved after 3 steps and resumed at the same world size: bitwise the
    uninterrupted run, at 2 and 3 ranks. The flat checkpoints saved at 2 ranks resumed at 3: the
    run at 3 to rounding (the flat shards' sums fall elsewhere), every rule, Adafactor's
    placeholders loaded as saved."""
    for world_size in (2, 3):
        got = run_ranks(cw.resume_sweep, world_size, str(tmp_path / str(world_size)), SWEEP_RULES,
                        ("flat", "sorted_greedy"))[0]
        assert all(d == 0.0 for d in got.values()), (world_size, got)
    got = run_ranks(cw.resume_sweep, 3, str(tmp_path / "2"), SWEEP_RULES, ("flat",), 2)[0]
    assert all(d <= 1e-12 for d in got.values()), got
