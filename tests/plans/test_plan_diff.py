"""zero.diff_plans: what changes between two plans of the same model, and `zero plan --diff`."""

import subprocess
import sys

import pytest

from zero import ParamMeta, diff_plans, make_plan, preset
from zero.plans.render import render

METAS = [ParamMeta("big", (10,)), ParamMeta("a", (5,)), ParamMeta("b", (5,))]


def test_a_plan_against_itself_moves_nothing():
    plan = make_plan(preset("gpt2"), 8)
    d = diff_plans(plan, plan)
    assert d.changed == () and d.moves == () and d.moved_bytes == 0
    assert all(state == total == 0 for _, state, total in d.rank_deltas)


def test_one_param_changing_owner_moves_its_state_and_its_step():
    a, b = make_plan(METAS, 2), make_plan(METAS, 3)  # sorted greedy: big->0, a->1, b->1 / big->0, a->1, b->2
    assert (a.partition.owner, b.partition.owner) == ((0, 1, 1), (0, 1, 2))
    d = diff_plans(a, b)
    assert d.changed == ("b",)
    assert d.moves == ((1, 2, 5 * 2 * 4 + 4),), "Adam: two float32 moments of 5 elements, and the step"
    assert d.rank_deltas == ((0, 0, 0), (1, -44, -44), (2, 44, b.ranks[2].total_bytes))


def test_flat_against_whole_params_moves_elements_between_existing_ranks():
    a, b = make_plan(METAS, 2), make_plan(METAS, 2, "flat")  # flat: rank 0 holds big, rank 1 a and b
    assert diff_plans(a, b).moves == ()
    c = make_plan(METAS, 4, "flat")  # 5 elements a rank: big splits over ranks 0 and 1
    d = diff_plans(a, c)
    assert set(d.changed) == {"big", "a", "b"}
    moves = {(s, t): n for s, t, n in d.moves}
    assert moves[(0, 1)] == 5 * 8 + 4, "the second half of big, and a step for rank 1"
    assert (0, 0) not in moves and all(s < 2 and t < 4 for s, t in moves)


def test_plans_of_different_models_are_an_error():
    with pytest.raises(ValueError, match="param 2 is"):
        diff_plans(make_plan(METAS, 2), make_plan(METAS[:2] + [ParamMeta("b", (6,))], 2))
    with pytest.raises(TypeError, match="must be a zero.Plan"):
        diff_plans(make_plan(METAS, 2), "plan.json")


def test_cli_diff_prints_the_moves(tmp_path):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, plan in zip(paths, (make_plan(METAS, 2), make_plan(METAS, 3))):
        path.write_text(plan.to_json())
    res = subprocess.run([sys.executable, "-m", "zero", "plan", "--diff", *map(str, paths)],
                         capture_output=True, text=True, check=True)
    out = " ".join(res.stdout.split())
    assert "1 of 3 params change placement" in out and "per-rank change" in out
    res = subprocess.run([sys.executable, "-m", "zero", "plan", "--diff", str(paths[0]), str(tmp_path / "nope.json")],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "cannot read plan" in res.stderr


def test_a_cut_diff_table_says_how_many_rows_it_shows_and_how_to_see_all():
    a, b = make_plan(preset("gpt2"), 8), make_plan(preset("gpt2"), 12, "flat")
    d = diff_plans(a, b)
    assert len(d.moves) > 16
    cut = " ".join(str(d).split())
    shown = sum(sorted((n for _, _, n in d.moves), reverse=True)[:16])
    assert f"16 of {len(d.moves)} transfers (the largest) shown" in cut
    assert f"{shown / 2**20:,.1f} of {d.moved_bytes / 2**20:,.1f} MiB" in cut
    assert f"--rows {len(d.moves)}" in cut
    whole = " ".join(render(d.table(len(d.moves))).split())
    assert "shown" not in whole.split("per-rank")[0]
