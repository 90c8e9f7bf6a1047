"""zero.plans.reduction: a gradient reducer's wire bytes by its name (the recorder's side is
tests/backends/test_int8_reducer.py, which runs them on gloo ranks)."""

import pytest

import zero
from zero.plans.footprint import footprint
from zero.plans.reduction import reduction_collectives


def test_the_mean_is_one_reduce_scatter_and_int8_two_all_to_alls_of_codes_and_scales():
    assert reduction_collectives("mean", 3000, "float32", 3) == [("reduce_scatter_sum", 12000)]
    # 1,000 elements a rank in blocks of 256: 4 blocks a chunk (the last padded), a scale each
    assert reduction_collectives("int8/256", 3000, "float32", 3) == [("all_to_all", 3 * 4 * 256),
                                                                     ("all_to_all", 3 * 4 * 4)]


def test_the_footprint_takes_a_reducers_name():
    plan = zero.make_plan([zero.ParamMeta("w", (64, 300), "float32")], 2, "flat")
    plain = footprint(plan, 0, reduce_scatter_grads=True).collectives
    assert plain == footprint(plan, 0, reduce_scatter_grads=True, reducer="mean").collectives
    int8 = footprint(plan, 0, reduce_scatter_grads=True, reducer="int8/256").collectives
    assert {k for k, _ in int8} == {"all_to_all", "all_gather_rows"} and len(int8) == len(plain) + 1


@pytest.mark.parametrize("spec", ["int8", "int8/0", "qgz/256", "mean/2"])
def test_an_unknown_reducer_is_named(spec):
    with pytest.raises(ValueError, match=f"unknown gradient reducer '{spec}'"):
        reduction_collectives(spec, 100, "float32", 2)
