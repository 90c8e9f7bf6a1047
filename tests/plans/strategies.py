"""Hypothesis strategies for parameter metadata."""

from hypothesis import strategies as st

from zero import ParamMeta

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@st.composite
def metas(draw, min_size=1, max_size=40, devices=("cpu", "cuda:0"),
          dtypes=("float32", "bfloat16", "float64"), frozen=True, groups=3, shapes=shapes):
    n = draw(st.integers(min_size, max_size))
    group_sizes = sorted(draw(st.lists(st.integers(0, groups - 1), min_size=n, max_size=n)))
    return [ParamMeta(f"p{i}", draw(shapes), draw(st.sampled_from(dtypes)),
                      draw(st.sampled_from(devices)), group_sizes[i],
                      draw(st.booleans()) if frozen else True) for i in range(n)]
