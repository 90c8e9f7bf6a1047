"""`zero.plans.chunks`: a rank's state as boxes of the params' own shapes (pure; no torch)."""

from math import prod

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero.plans.chunks import Box, param_chunks, range_boxes


def _flat_indices(shape, box):
    """Row-major flat indices of a box's elements, in order."""
    strides = [prod(shape[d + 1:]) for d in range(len(shape))]
    out = [0]
    for d in range(len(shape)):
        out = [base + (box.offsets[d] + k) * strides[d] for base in out for k in range(box.sizes[d])]
    return out


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    numel = prod(shape)
    start = draw(st.integers(0, numel))
    return shape, start, draw(st.integers(start, numel))


@given(shape_and_range())
def test_boxes_cover_the_range_exactly_each_contiguous_in_order(case):
    shape, start, end = case
    boxes = range_boxes(shape, start, end)
    covered = []
    for box in boxes:
        idx = _flat_indices(shape, box)
        assert idx == list(range(box.start, box.start + box.numel)), (box, "not contiguous")
        assert all(0 <= o and o + s <= d for o, s, d in zip(box.offsets, box.sizes, shape))
        covered += idx
    assert covered == list(range(start, end))
    assert len(boxes) <= max(1, 2 * len(shape))


def test_whole_rows_make_one_box_and_a_ragged_range_three():
    assert range_boxes((4, 3), 3, 9) == (Box((1, 0), (2, 3), 3),)
    assert range_boxes((4, 3), 2, 10) == (Box((0, 2), (1, 1), 2), Box((1, 0), (2, 3), 3), Box((3, 0), (1, 1), 9))
    assert range_boxes((), 0, 1) == (Box((), (), 0),)
    assert range_boxes((4, 3), 5, 5) == ()


def test_a_range_outside_the_tensor_is_a_value_error():
    with pytest.raises(ValueError, match=r"range 3:13 .* shape \(4, 3\)"):
        range_boxes((4, 3), 3, 13)


def test_chunks_and_holdings_follow_the_plan():
    import zero

    metas = zero.param_metas({"a": (5, 3), "b": (7,), "c": (2, 2)})
    flat = zero.make_plan(metas, 3, strategy="flat")
    for i, m in enumerate(metas):
        ranges = param_chunks(i, m.numel, None, flat.flat)
        assert sum(e - s for _, s, e in ranges) == m.numel
    whole = zero.make_plan(metas, 3)
    assert param_chunks(0, 15, whole.partition, None) == ((whole.partition.owner[0], 0, 15),)
    held = [h for r in range(3) for h in zero.holdings(flat, r).held]
    assert sorted((h.param, h.start, h.end) for h in held) == sorted(
        (i, s, e) for i, m in enumerate(metas) for _, s, e in param_chunks(i, m.numel, None, flat.flat))
