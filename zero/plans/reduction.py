"""What a bucket's gradient reduction puts on the wire under ZeRO-2, by the reducer's name: the
plan's count, which `zero.plans.footprint` lists and each `zero.backends.comm.Reducer` reports
(its ``spec``), so the recorder's bytes and the plan's come from one formula.

- ``"mean"``: one reduce-scatter of the bucket in its dtype (`zero.backends.comm.MeanReducer`);
- ``"int8/B"``: int8 codes and one float32 scale per block of ``B`` elements of each rank's chunk,
  by two all-to-alls (`zero.backends.int8_reducer.Int8Reducer`).
"""

from __future__ import annotations

import math

from zero.plans.meta import itemsize

__all__ = ["reduction_collectives"]


def reduction_collectives(spec: str, numel: int, dtype: str, world: int) -> list[tuple[str, int]]:
    """``(kind, bytes)`` of each collective reducing a bucket of ``numel`` elements (all ranks'
    chunks) of ``dtype`` over ``world`` ranks, as the collective recorder records them."""
    name, _, block = spec.partition("/")
    if name == "mean" and not block:
        return [("reduce_scatter_sum", numel * itemsize(dtype))]
    if name == "int8" and block.isdigit() and int(block) > 0:
        blocks = math.ceil(numel // world / int(block))
        return [("all_to_all", world * blocks * int(block)), ("all_to_all", world * blocks * 4)]
    raise ValueError(f"unknown gradient reducer {spec!r}: 'mean', or 'int8/BLOCK' (e.g. 'int8/256')")
