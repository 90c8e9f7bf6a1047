"""`make demo`'s job (the tutorial on 2 gloo ranks), scaled down."""

from zero.tools import demo


def test_demo_runs_and_both_optimizers_end_equal(capsys):
    code = demo.main(["--layers", "4", "--width", "64", "--steps", "2"])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines to the terminal width
    assert code == 0
    assert "identical across ranks and optimizers" in out
    assert "0.50x of plain Adam's" in out


def test_under_torchrun_it_says_what_it_cannot_measure():
    import subprocess
    import sys
    from pathlib import Path

    from zero.tools.launch import free_port

    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "zero.tools.demo",
               "--layers", "2", "--width", "32", "--steps", "2"]
    res = subprocess.run(command, capture_output=True, text=True, timeout=180)
    out = " ".join(res.stdout.split())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "peak memory not shown: under torchrun on CPU" in out and "identical across ranks" in out


def test_a_checkpoint_resumes_at_another_world_size_as_one_optimizer(tmp_path):
    from zero.tools import launch

    path = str(tmp_path / "ck.pt")
    saved = launch.run(demo.train_and_save, 2, path, 3)
    resumed = launch.run(demo.load_and_train, 3, path, 3, 3)
    assert saved == [demo.plain_training(3)] * 2
    assert resumed == [demo.plain_training(6)] * 3
