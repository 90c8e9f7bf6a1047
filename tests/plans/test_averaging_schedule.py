"""`zero.plans.averaging_schedule`: post-local SGD's schedule, checked without a process group."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero.plans.averaging_schedule import (
    check_period,
    check_warmup,
    hierarchical_level,
    hierarchy,
    periodic_due,
    subgroup_blocks,
)


@given(st.integers(0, 200), st.integers(1, 9), st.integers(0, 20))
def test_periodic_due_every_period_after_warmup(step, period, warmup):
    due = [s for s in range(step + 1) if periodic_due(s, period, warmup)]
    assert due == list(range(warmup, step + 1, period))


@given(st.integers(0, 300), st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True), st.integers(0, 10))
def test_hierarchical_level_is_the_largest_dividing_period(step, periods, warmup):
    periods = tuple(sorted(periods))
    level = hierarchical_level(step, periods, warmup)
    dividing = [i for i, p in enumerate(periods) if step % p == 0]
    assert level == (None if step < warmup or not dividing else dividing[-1])


@given(st.integers(1, 6), st.integers(1, 6))
def test_subgroup_blocks_partition_the_group(blocks, size):
    out = subgroup_blocks(blocks * size, size)
    assert [r for b in out for r in b] == list(range(blocks * size))
    assert all(len(b) == size for b in out)


def test_hierarchy_keeps_torch_order():
    assert hierarchy({2: 2, 4: 4, 8: 8}, 8) == ((2, 2), (4, 4), (8, 8))
    assert hierarchy({3: 8}, 8) == ((3, 8),)
    assert hierarchy({2: 3, 4: 6}, 6) == ((2, 3), (4, 6)), "3 nests in 6"


@pytest.mark.parametrize("levels, size, error, match", [
    ({}, 4, ValueError, "non-empty"),
    ([(2, 4)], 4, ValueError, "non-empty mapping"),
    ({4: 4, 2: 2}, 4, ValueError, "periods must increase, got 4 before 2"),
    ({2: 4, 4: 6}, 6, ValueError, "group size 4 \\(period 2\\) does not divide group size 6"),
    ({2: 2, 4: 2}, 4, ValueError, "last group size .* is 2, but the process group has 4"),
    ({0: 4}, 4, ValueError, "period must be >= 1, got 0"),
    ({2.0: 4}, 4, TypeError, "period must be an int, got 2.0"),
    ({2: True}, 4, TypeError, "group size must be an int, got True"),
])
def test_hierarchy_names_the_bad_value(levels, size, error, match):
    with pytest.raises(error, match=match):
        hierarchy(levels, size)


@pytest.mark.parametrize("call, error, match", [
    (lambda: check_period(0), ValueError, "period must be >= 1, got 0"),
    (lambda: check_period(1.5), TypeError, "period must be an int, got 1.5"),
    (lambda: check_warmup(-1), ValueError, "warmup_steps must be >= 0, got -1"),
    (lambda: subgroup_blocks(6, 4), ValueError, "group size 4 does not divide the process group's 6 ranks"),
])
def test_bad_values(call, error, match):
    with pytest.raises(error, match=match):
        call()
