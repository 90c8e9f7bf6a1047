"""What changes between two plans of the same model: owners, state that must move, per-rank costs.

Plans may differ in strategy, weight or world size (a resharded checkpoint); they must describe
the same parameters. Placement is compared element by element, so whole-parameter and flat
plans compare alike: a parameter owned by rank 2 in one and split over ranks 0-1 in the other
moves its state's elements from 2 to 0 and to 1.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from zero.plans.chunks import param_chunks
from zero.plans.costs import cost_of
from zero.plans.meta import itemsize
from zero.plans.plan import Plan

__all__ = ["PlanDiff", "diff_plans", "placement", "plan_facts"]

Range = tuple[int, int, int]  # (rank, start, end): elements start:end of a flattened param


@dataclass(frozen=True)
class PlanDiff:
    """``changed``: names of the params whose placement differs; ``moves``: ``(src, dst, bytes)``
    of optimizer state that must travel from rank ``src`` of plan a to rank ``dst`` of plan b;
    ``rank_deltas``: ``(rank, state bytes b - a, total bytes b - a)`` for every rank of either."""

    a: Plan
    b: Plan
    changed: tuple[str, ...]
    moves: tuple[tuple[int, int, int], ...]
    rank_deltas: tuple[tuple[int, int, int], ...]

    @property
    def moved_bytes(self) -> int:
        return sum(n for _, _, n in self.moves)

    def table(self, max_rows: int = 16):
        """A `rich` renderable: the moves and the per-rank deltas."""
        from zero.plans.render import diff_table

        return diff_table(self, max_rows)

    def __str__(self) -> str:
        from zero.plans.render import render

        return render(self.table())


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Compare plan ``a`` (where the state is now) with plan ``b`` (where it will be).

    State bytes per element are those of plan ``a``'s optimizer (``slots`` tensors in the
    param's dtype; a low-bit rule's codes and scales for the params it quantizes, whose blocks
    every plan made for it keeps whole); per-param scalars (Adam's ``step``) count once for each rank that receives
    part of a param it held nothing of. Frozen params have no state and never move.
    """
    for plan, name in ((a, "a"), (b, "b")):
        if not isinstance(plan, Plan):
            raise TypeError(f"diff_plans: {name} must be a zero.Plan, got {type(plan).__name__}")
    _check_same_params(a, b)
    spec = cost_of(a.optimizer)
    moves: dict[tuple[int, int], int] = defaultdict(int)
    changed = []
    for i, meta in enumerate(a.metas):
        before, after = placement(a, i), placement(b, i)
        if before != after:
            changed.append(meta.name)
        if not meta.requires_grad:
            continue
        for src, dst, count in _overlaps(before, after):
            if src != dst:
                moves[(src, dst)] += spec.moved_bytes(meta, count, itemsize(meta.dtype))
        held = {r for r, _, _ in before}
        for dst in {r for r, _, _ in after} - held:
            if spec.scalar_bytes:
                moves[(min(held), dst)] += spec.scalar_bytes
    return PlanDiff(a, b, tuple(changed), tuple((s, d, n) for (s, d), n in sorted(moves.items()) if n),
                    _rank_deltas(a, b))


def placement(plan: Plan, index: int) -> tuple[Range, ...]:
    """Which ranks hold which elements of param ``index`` under ``plan``."""
    return param_chunks(index, plan.metas[index].numel, plan.partition, plan.flat)


def _overlaps(before: tuple[Range, ...], after: tuple[Range, ...]):
    for src, s0, s1 in before:
        for dst, d0, d1 in after:
            lo, hi = max(s0, d0), min(s1, d1)
            if lo < hi:
                yield src, dst, hi - lo


def _check_same_params(a: Plan, b: Plan) -> None:
    if len(a.metas) != len(b.metas):
        raise ValueError(f"the plans are for different models: {len(a.metas)} params vs {len(b.metas)}")
    for i, (x, y) in enumerate(zip(a.metas, b.metas)):
        if x != y:
            raise ValueError(f"the plans are for different models: param {i} is {x} in a but {y} in b")


def _rank_deltas(a: Plan, b: Plan) -> tuple[tuple[int, int, int], ...]:
    out = []
    for r in range(max(a.world_size, b.world_size)):
        ra = a.ranks[r] if r < a.world_size else None
        rb = b.ranks[r] if r < b.world_size else None
        state = (rb.state_bytes if rb else 0) - (ra.state_bytes if ra else 0)
        total = (rb.total_bytes if rb else 0) - (ra.total_bytes if ra else 0)
        out.append((r, state, total))
    return tuple(out)


def plan_facts(plan: Plan) -> list[tuple[str, object]]:
    """What a plan is, as labelled values in an order that names the first difference that matters:
    the params (index, name, shape, dtype, group), the plan's settings, then where each param lives.
    Ranks whose plans' fingerprints differ exchange these to say how (see `zero.backends.consistency.check_in`)."""
    facts: list[tuple[str, object]] = [("the number of params", len(plan.metas))]
    facts += [(f"param {i}", f"{m.name} {tuple(m.shape)} {m.dtype} in group {m.group}, "
                             f"{'trainable' if m.requires_grad else 'frozen'}") for i, m in enumerate(plan.metas)]
    facts += [("the plan's world size", plan.world_size), ("the plan's strategy", plan.strategy),
              ("the plan's weight", plan.weight), ("the plan's optimizer", plan.optimizer),
              ("the plan's alignment", plan.alignment), ("the plan's flat buffer size", plan.bucket_numel)]
    facts += [(f"param {i} ({m.name})'s placement (rank, start, end)", placement(plan, i))
              for i, m in enumerate(plan.metas)]
    return facts
