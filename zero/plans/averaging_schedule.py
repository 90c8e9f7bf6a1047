"""Post-local SGD's schedule as values: when parameters are averaged, and across which ranks.

Pure functions over step numbers and group sizes; `zero.backends` averagers execute them. The
semantics are those of torch's `model_averaging` package: a periodic averager
averages at ``step >= warmup_steps`` whenever ``(step - warmup_steps) % period == 0``; a
hierarchical one, past its warm-up, averages in the group of the largest period that divides
``step`` (so a step divisible by 8 averages globally, not also within pairs first).
"""

from __future__ import annotations

from collections.abc import Mapping

from zero.plans.checks import check_int

__all__ = ["check_period", "check_warmup", "periodic_due", "hierarchy", "hierarchical_level", "subgroup_blocks"]


def check_period(period: object) -> int:
    return check_int("period", period, 1)


def check_warmup(warmup_steps: object) -> int:
    return check_int("warmup_steps", warmup_steps, 0)


def periodic_due(step: int, period: int, warmup_steps: int) -> bool:
    """Whether a `PeriodicModelAverager` averages at ``step`` (0-based, counted once per step)."""
    return step >= warmup_steps and (step - warmup_steps) % period == 0


def hierarchy(period_group_size: Mapping[int, int], group_size: int) -> tuple[tuple[int, int], ...]:
    """Validated ``(period, group size)`` levels, lowest first.

    Periods must increase, and each level's groups must nest in the next: every size divides the
    next one, and the last is the whole group (``group_size``). Torch takes any dict order and
    would then average in the wrong group; here that is an error.
    """
    if not isinstance(period_group_size, Mapping) or not period_group_size:
        raise ValueError(f"period_group_size_dict must be a non-empty mapping period -> group size, "
                         f"got {period_group_size!r}")
    levels = tuple((check_int("period", p, 1), check_int("group size", s, 1)) for p, s in period_group_size.items())
    for (p0, s0), (p1, s1) in zip(levels, levels[1:]):
        if p1 <= p0:
            raise ValueError(f"periods must increase, got {p0} before {p1} in {dict(period_group_size)}")
        if s1 % s0:
            raise ValueError(f"group size {s0} (period {p0}) does not divide group size {s1} (period {p1}): "
                             "each level's groups must nest in the next")
    if levels[-1][1] != group_size:
        raise ValueError(f"the last group size in period_group_size_dict is {levels[-1][1]}, "
                         f"but the process group has {group_size} ranks: the top level must be the whole group")
    return levels


def hierarchical_level(step: int, periods: tuple[int, ...], warmup_steps: int) -> int | None:
    """Index of the level that averages at ``step``, or None: the largest period dividing ``step``."""
    if step < warmup_steps:
        return None
    for level in reversed(range(len(periods))):
        if step % periods[level] == 0:
            return level
    return None


def subgroup_blocks(group_size: int, size: int) -> tuple[tuple[int, ...], ...]:
    """Group ranks split into consecutive blocks of ``size`` (as torch's ``new_subgroups``)."""
    check_int("group size", size, 1)
    if group_size % size:
        raise ValueError(f"group size {size} does not divide the process group's {group_size} ranks")
    return tuple(tuple(range(start, start + size)) for start in range(0, group_size, size))
