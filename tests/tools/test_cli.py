"""The `zero` command line, run as users run it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zero import Plan


def zero(*args, check=True):
    return subprocess.run([sys.executable, "-m", "zero", *args], capture_output=True, text=True,
                          check=check)


def test_plan_preset_and_json(tmp_path):
    out = tmp_path / "plan.json"
    res = zero("plan", "--preset", "llama-7b", "-w", "64", "--strategy", "greedy", "--json", str(out))
    assert "greedy on 64 ranks" in res.stdout and "saved" in res.stdout
    plan = Plan.from_json(out.read_text())
    assert plan.world_size == 64 and len(plan.metas) == 291


def _gpt2_numels() -> list[int]:
    from zero.plans.presets import preset

    return [m.numel for m in preset("gpt2") if m.requires_grad]


def test_plan_tables_fit_100_columns_with_their_unit_in_the_header():
    for args in (("--preset", "llama-7b", "-w", "64"), ("--preset", "llama-7b", "-w", "64", "--compare"),
                 ("--preset", "llama-7b", "-w", "1024", "--strategy", "flat", "--master-dtype", "float32")):
        out = zero("plan", *args).stdout
        assert max(map(len, out.splitlines())) <= 100, args
        assert "MiB per rank" in out and out.count("MiB") == 1, args  # one unit, said once, in the title


def test_plan_compare_lists_every_strategy():
    res = zero("plan", "--preset", "gpt2", "-w", "8", "--compare")
    for strategy in ("sorted_greedy", "greedy", "contiguous", "flat"):
        assert strategy in res.stdout


def test_plan_shapes_file_and_torch_model(tmp_path):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"w": [300, 20], "b": [20], "emb": {"shape": [50, 20], "dtype": "bfloat16"}}))
    assert "3 tensors on 2 ranks" in zero("plan", "--shapes", str(shapes), "-w", "2", "--compare").stdout
    mod = tmp_path / "tiny_model.py"
    mod.write_text("from torch import nn\ndef build():\n    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))\n")
    res = subprocess.run([sys.executable, "-m", "zero", "plan", "--model", "tiny_model:build", "-w", "3"],
                         capture_output=True, text=True, check=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(tmp_path), "PATH": ""})
    assert "sorted_greedy on 3 ranks" in res.stdout


def test_bad_arguments_fail_cleanly(tmp_path):
    res = zero("plan", "--preset", "gpt2", "-w", "0", check=False)
    assert res.returncode == 2 and "world_size must be >= 1, got 0" in res.stderr
    res = zero("plan", "--model", "nocolon", check=False)
    assert res.returncode == 2 and "module:attr" in res.stderr


def test_user_errors_name_the_culprit(tmp_path):
    (tmp_path / "mymod.py").write_text("from torch import nn\ndef build():\n    return nn.Linear(4, 4)\n")
    console = [str(Path(sys.executable).parent / "zero")]  # the console script, run beside mymod.py
    res = subprocess.run(console + ["plan", "--model", "mymod:build", "-w", "2"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 0 and "sorted_greedy on 2 ranks" in res.stdout, res.stderr
    res = subprocess.run(console + ["plan", "--model", "mymod:nope"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and "module 'mymod' has no attribute 'nope'" in res.stderr, res.stderr
    truncated = tmp_path / "shapes.json"
    truncated.write_text('{"w": [3, 4], "b": [')
    res = zero("plan", "--shapes", str(truncated), check=False)
    assert res.returncode == 2 and f"--shapes {truncated}: not valid JSON" in res.stderr, res.stderr
    res = zero("plan", "--preset", "gpt2", "--compare", "--json", str(tmp_path / "x.json"), check=False)
    assert res.returncode == 2 and "not allowed with argument" in res.stderr and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("flag", ["--world-size", "--steps"])
def test_demo_rejects_non_positive_counts(flag):
    res = zero("demo", flag, "0", check=False)
    assert res.returncode == 2 and "must be >= 1, got 0" in res.stderr, res.stderr


def test_version_and_bench():
    assert zero("--version").stdout.startswith("zero ")
    res = zero("bench", "plan", "--args", "--presets gpt2 --worlds 2 --metas gpt2")  # its smallest run
    assert "planning time" in res.stdout and "1 benchmark(s)" in res.stdout
    res = zero("bench", "nope", check=False)
    assert res.returncode == 2 and "unknown benchmark 'nope'" in res.stderr


@pytest.mark.parametrize("content", [[300, 20], [[300, 20], [20]], 42])
def test_shapes_that_are_not_a_mapping_name_the_expected_form(tmp_path, content):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(content))
    res = zero("plan", "--shapes", str(shapes), check=False)
    assert res.returncode == 2 and "must map each param's name to its shape" in res.stderr, res.stderr
    assert '{"w": [300, 20]' in res.stderr


def test_plan_counts_master_weights(tmp_path):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"w": {"shape": [300, 20], "dtype": "bfloat16"}}))
    out = zero("plan", "--shapes", str(shapes), "-w", "2", "--strategy", "flat", "--master-dtype", "float32").stdout
    assert "float32 masters" in out and "masters" in out and "MiB per rank" in " ".join(out.split())
    res = zero("plan", "--shapes", str(shapes), "--master-dtype", "int8", check=False)
    assert res.returncode == 2 and "master_dtype must be a float dtype" in res.stderr, res.stderr


def test_simulate_prints_each_rank_and_writes_the_json(tmp_path, capsys):
    """``zero simulate``: the real step of ranks 0 and 7 of 8 under torch's fake group, its
    measured peak and collectives beside the plan's, in a table per rank and one JSON object each."""
    out = tmp_path / "sim.json"
    res = zero("simulate", "--preset", "gpt2", "-w", "8", "--strategy", "flat", "--reduce-scatter-grads",
               "--ranks", "0,7", "--json", str(out))
    assert "rank 0 of 8" in res.stdout and "rank 7 of 8" in res.stdout and "GiB per rank" in res.stdout
    assert "sent per step, zero's collectives" in res.stdout and "DDP's all-reduce" not in res.stdout  # ZeRO-2
    assert max(map(len, res.stdout.splitlines())) <= 100
    runs = json.loads(out.read_text())
    assert [r["rank"] for r in runs] == [0, 7]
    for r in runs:
        assert r["measured_peak_bytes"] == pytest.approx(r["predicted_peak_bytes"], rel=0.03)
        assert r["collective_bytes"] == r["plan_collective_bytes"] > 0
        assert r["ddp_allreduce_bytes"] == 0
        assert set(r["by_category"]) >= {"params", "grads", "state"}
    zero1 = zero("simulate", "--preset", "gpt2", "-w", "8", "--ranks", "0", "--json", str(out))
    grads = sum(4 * n for n in _gpt2_numels())
    r = json.loads(out.read_text())[0]
    assert r["ddp_allreduce_bytes"] == 2 * grads * 7 // 8  # all-reduce: 2 (W - 1) / W of the gradients
    assert "sent per step, DDP's all-reduce" in zero1.stdout and "not simulated" in zero1.stdout
    from zero.tools.cli import main  # refused before any rank runs: in this process (no 3-4 s of imports)

    assert main(["simulate", "--preset", "gpt2", "-w", "8", "--ranks", "8"]) == 2
    assert "--ranks [8] are not ranks of a world of 8" in capsys.readouterr().err


def test_plan_for_fsdp2s_layout():
    out = zero("plan", "--preset", "gpt2", "-w", "8", "--engine", "fsdp2", "--optimizer", "muon").stdout
    assert "FSDP2 plan: 148 params over 8 ranks, muon, 50 stepped whole by an owner" in out
    bad = zero("plan", "--preset", "gpt2", "--engine", "fsdp2", "--strategy", "flat", check=False)
    assert bad.returncode != 0 and "--strategy shape zero's own plans" in bad.stderr


_FACTORY = '''import torch
from torch import nn


def build():
    """What model constructors do: tied weights, jitter in place under no_grad, a cast at the end."""
    model = nn.Sequential(nn.Embedding(64, 16), nn.LayerNorm(16), nn.Linear(16, 64, bias=False))
    model[2].weight = model[0].weight
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model.to(torch.bfloat16)
'''


def test_simulate_runs_a_factory_that_jitters_and_casts_and_fsdp2_takes_dtype(tmp_path, monkeypatch):
    from zero.tools.simulate import main

    (tmp_path / "jittered.py").write_text(_FACTORY)
    monkeypatch.chdir(tmp_path)  # found beside the user, as the command finds it
    out = tmp_path / "sim.json"
    peaks = {}
    for engine, dtype in (("zero", None), ("fsdp2", None), ("fsdp2", "float32")):
        argv = ["--model", "jittered:build", "-w", "4", "--ranks", "0", "--engine", engine, "--json", str(out)]
        assert main(argv + (["--dtype", dtype] if dtype else [])) == 0, (engine, dtype)
        (r,) = json.loads(out.read_text())
        assert r["measured_peak_bytes"] == pytest.approx(r["predicted_peak_bytes"], rel=0.03), (engine, dtype)
        peaks[engine, dtype] = r["predicted_peak_bytes"]
    # the factory's bf16 cast back to float32: every tensor doubles (to the padding of its shards)
    assert peaks["fsdp2", "float32"] == pytest.approx(2 * peaks["fsdp2", None], rel=0.01)


def test_plan_warns_when_one_rank_holds_far_more_state_and_says_how_to_route_it():
    """GPT-2 under Muon's default routing: rank 0 steps the 50257x768 embedding whole (#65)."""
    for engine in ("zero", "fsdp2"):
        res = zero("plan", "--preset", "gpt2", "-w", "8", "--optimizer", "muon", "--engine", engine)
        assert "warning: rank 0 holds 147." in res.stderr and "2.48x the mean" in res.stderr, res.stderr
        assert "'wte.weight' (50257, 768) alone is 147.2 MiB" in res.stderr
        assert "muon_weight_dimension_numbers=lambda ps: {n: None if n == 'wte.weight'" in res.stderr
    assert zero("plan", "--preset", "gpt2", "-w", "8", "--optimizer", "adamw", "--strategy", "flat").stderr == ""
    assert zero("plan", "--preset", "llama-7b", "-w", "64", "--optimizer", "muon").stderr == ""


def test_state_imbalance_is_said_over_its_limit_only():
    from zero.plans.balance import state_imbalance
    from zero.plans.meta import ParamMeta

    metas = (ParamMeta("emb", (1000, 10)), ParamMeta("w", (10, 10)))
    assert state_imbalance([150, 100, 50], [[0], [1], []], metas, "adamw") is None  # 1.5x the mean: not over
    said = state_imbalance([151, 100, 49], [[0], [1], []], metas, "adamw")
    assert said.startswith("warning: rank 0 holds 0.0 MiB of optimizer state, 1.51x the mean") and "'emb'" in said


def test_plan_split_heads(tmp_path):
    """``zero plan --strategy flat --split-heads``: the per-head matrices cut at head edges (each of
    LLaMA-7B's 3,072 q, k, v heads once, 48 a rank at 64 ranks), saved and reloaded as such;
    without a flat strategy it is an error naming the strategy."""
    out = tmp_path / "plan.json"
    heads = {f"layers.{i}.self_attn.{n}_proj.weight": 32 for i in range(32) for n in "qkv"}
    res = zero("plan", "--preset", "llama-7b", "-w", "64", "--strategy", "flat", "--weight", "step_flops",
               "--optimizer", f"muon(heads={heads!r})", "--split-heads", "--json", str(out))
    assert "(96 params cut at head edges) on 64 ranks" in " ".join(res.stdout.split())
    plan = Plan.from_json(out.read_text())
    (buf,) = [b for b in plan.flat.buffers if b.head]
    assert buf.shard_numel == 48 * buf.head and plan.max_over_bound <= 1.05
    bad = zero("plan", "--preset", "gpt2", "--split-heads", check=False)
    assert bad.returncode == 2 and "strategy 'sorted_greedy' keeps every param whole" in bad.stderr
