"""`zero.backends.checkpoint.save(..., async_save=True)` under ZeRO's flat plan, FSDP2 and HSDP: it
blocks only while the state is copied; what it writes is bitwise the synchronous save at the step it
was taken, though steps run during the write; a second save waits for the first; a rank that dies
during the background write leaves the last checkpoint whole and nothing that loads silently."""

import os
import re

import async_save_workers as aw
import pytest
import torch
from helpers import run_ranks


def _everything(path) -> dict:
    """Every tensor and setting of a DCP checkpoint, whole (DCP's own reader into one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.fspath(path) + ".pt"
    dcp_to_torch_save(os.fspath(path), out)
    return torch.load(out, weights_only=False)


def _assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), (where, sorted(set(a) ^ set(b)))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


# keep: the second save copies into the first's kept buffers (keep_staging=True), under ZeRO's
# ShardedTensors and HSDP's 2-D DTensors: written over while the first was still writing, the
# first checkpoint would hold the later steps
@pytest.mark.parametrize("where,world_size,keep", [("flat", 3, False), ("fsdp2", 2, False), ("hsdp", 4, False),
                                                   ("flat", 3, True), ("hsdp", 4, True)])
def test_a_background_save_is_the_synchronous_save_at_its_step(tmp_path, where, world_size, keep):
    from zero.tools.cli import main

    rows = run_ranks(aw.async_against_sync, world_size, where, str(tmp_path), keep, timeout=240)
    assert all(r["in_flight_after_steps"] for r in rows), "the steps ran while the write was in flight"
    assert all(r["first_done_when_second_started"] for r in rows), "a second save waits for the first"
    assert all(r["blocked_s"] < aw.DELAY for r in rows), "save(async_save=True) returns before the write"
    _assert_same(_everything(tmp_path / "async"), _everything(tmp_path / "sync"), "async vs sync")
    assert main(["checkpoint", "verify", str(tmp_path / "async")]) == 0
    assert main(["checkpoint", "verify", str(tmp_path / "second")]) == 0
    # the second save holds the state after the steps taken during the first: resuming from it
    # continues the run that saved it exactly
    ahead = run_ranks(aw.resumed, world_size, where, str(tmp_path / "second"), 5, 0, timeout=240)
    for a, b in zip(ahead[0], rows[0]["params"]):
        assert torch.equal(a, b)
    later = run_ranks(aw.resumed, world_size, where, str(tmp_path / "async"), 3, 2, timeout=240)
    for a, b in zip(later[0], rows[0]["params"]):
        assert torch.equal(a, b), "resumed from the background save = the run that took those steps"


def test_a_rank_dying_during_the_background_write_leaves_the_last_checkpoint(tmp_path, capsys):
    from zero.backends.checkpoint import read_metadata
    from zero.tools.cli import main

    path = tmp_path / "last"
    rows = run_ranks(aw.crash_during_background_write, 2, str(path), timeout=120, pg_timeout=20, allow_exit=(1,))
    assert rows[0]["outcome"] != "saved", "the survivor's future raises"
    assert main(["checkpoint", "verify", str(path)]) == 0, "the step-3 checkpoint is whole"
    resumed = run_ranks(aw.resumed, 2, "flat", str(path), 3, 2, timeout=120)
    for a, b in zip(resumed[0], rows[0]["params"]):  # steps 3 and 4 again from it: the run that crashed
        assert torch.equal(a, b), "the last checkpoint resumes to the bit"
    siblings = [n for n in os.listdir(tmp_path) if n.startswith("last.saving-")]
    assert len(siblings) == 1, os.listdir(tmp_path)
    with pytest.raises(ValueError, match=r"incomplete: it has no \.metadata .* save did not finish"):
        read_metadata(tmp_path / siblings[0])
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(tmp_path / siblings[0])]) == 1
    assert re.search(r"incomplete", capsys.readouterr().out)


def test_kept_staging_is_reused_for_the_same_layout_only_and_refused_where_it_would_be_ignored(tmp_path):
    """The kept buffers take the next state of the same layout (the same memory, the new values and
    settings); a tensor of another shape makes new ones (a copy into the old would broadcast)."""
    from zero.backends.checkpoint import save
    from zero.backends.checkpoint.staging import KeptStaging

    stager = KeptStaging()
    first = stager.stage({"w": torch.ones(3), "step": 1, "groups": [{"lr": 0.1}]})
    second = stager.stage({"w": torch.full((3,), 2.0), "step": 2, "groups": [{"lr": 0.2}]})
    assert second["w"].data_ptr() == first["w"].data_ptr() and second["w"].tolist() == [2.0, 2.0, 2.0]
    assert second["step"] == 2 and second["groups"] == [{"lr": 0.2}]
    third = stager.stage({"w": torch.full((1,), 5.0), "step": 3, "groups": [{"lr": 0.2}]})
    assert third["w"].tolist() == [5.0]
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs async_save=True"):
        save(tmp_path / "c", model, torch.optim.SGD(model.parameters(), lr=0.1), keep_staging=True)
    with pytest.raises(ValueError, match="give one"):
        save(tmp_path / "c", model, torch.optim.SGD(model.parameters(), lr=0.1), async_save=True, keep_staging=True,
             async_stager=stager)
