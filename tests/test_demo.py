"""`make demo`'s job (the tutorial on 2 gloo ranks), scaled down."""

from zero.tools import demo


def test_demo_runs_and_both_optimizers_end_equal(capsys):
    code = demo.main(["--layers", "4", "--width", "64", "--steps", "2"])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines to the terminal width
    assert code == 0
    assert "identical across ranks and optimizers" in out
    assert "0.50x of plain Adam's" in out
