"""Whether one rank holds far more optimizer state than the others (`state_imbalance`), and what
to do about it: a param stepped whole by one owner (Muon's embedding, a head) that alone outweighs
the other ranks' shares. A plan is still valid then, but a memory budget set by the mean fails on
that rank, so `zero plan` says it."""

from __future__ import annotations

from collections.abc import Sequence

from zero.plans.costs import cost_of
from zero.plans.meta import ParamMeta, itemsize

__all__ = ["state_imbalance", "IMBALANCE"]

IMBALANCE = 1.5  # the busiest rank's state over the mean that is worth a word


def state_imbalance(states: Sequence[int], owned: Sequence[Sequence[int]], metas: Sequence[ParamMeta],
                    optimizer: str, limit: float = IMBALANCE) -> str | None:
    """A warning when the busiest rank's state (``states[r]``, bytes) is over ``limit`` times the
    mean, naming the largest param it steps whole (``owned[r]``: indices into ``metas``) and the
    way to spread it; None when the state is balanced within ``limit``."""
    mean = sum(states) / len(states) if states else 0
    rank = max(range(len(states)), key=states.__getitem__, default=0)
    if not mean or states[rank] <= limit * mean:
        return None
    spec = cost_of(optimizer)
    sizes = {i: spec.state_bytes(metas[i], itemsize(metas[i].dtype)) for i in owned[rank]}
    said = (f"warning: rank {rank} holds {_mib(states[rank])} MiB of optimizer state, {states[rank] / mean:.2f}x the "
            f"mean ({_mib(mean)} MiB)")
    if not sizes:
        return said
    big = max(sizes, key=sizes.__getitem__)
    meta = metas[big]
    said += (f": {meta.name!r} {tuple(meta.shape)} alone is {_mib(sizes[big])} MiB, stepped whole by that rank")
    if spec.keeps_whole:
        arg = "muon_weight_dimension_numbers" if "muon" in optimizer else "weight_dimension_numbers"
        return said + (f" ({optimizer} steps whole matrices). Route it to the rule's element-wise part, "
                       f"{arg}=lambda ps: {{n: None if n == {meta.name!r} or p.ndim != 2 else "
                       "MuonDimensionNumbers() for n, p in ps.items()}, and a flat plan (--strategy flat) or FSDP2 "
                       "shards it over every rank")
    return said + " (a whole-param plan): --strategy flat shards every param over the ranks"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"
