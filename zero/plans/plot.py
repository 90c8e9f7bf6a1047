"""Figures of plans (matplotlib is imported only when a figure is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["plot_ranks", "plot_balance"]

_PARTS = ("param_bytes", "grad_bytes", "state_bytes", "padding_bytes")


def plot_ranks(plan: Any, ax: Any = None, max_ranks: int = 64, parts: Sequence[str] = _PARTS) -> Any:
    """Stacked bars of what each rank holds (params, grads, optimizer state, padding), in MiB.

    ``parts`` picks the `RankCost` fields to stack (e.g. ``("state_bytes", "padding_bytes")``
    for what sharding changes); shows the first ``max_ranks`` ranks; returns the ``Axes``.
    """
    unknown = [p for p in parts if p not in _PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}; choose from {_PARTS}")
    import matplotlib.pyplot as plt

    ax = ax if ax is not None else plt.subplots(figsize=(8, 3))[1]
    ranks = plan.ranks[:max_ranks]
    bottom = [0.0] * len(ranks)
    for part in parts:
        heights = [getattr(r, part) / 2**20 for r in ranks]
        ax.bar([r.rank for r in ranks], heights, bottom=bottom, label=part.removesuffix("_bytes"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set(xlabel="rank", ylabel="MiB", title=f"{plan.strategy} ({plan.weight}) on {plan.world_size} ranks: "
                                              f"max/mean {plan.max_over_mean:.2f}")
    ax.legend(loc="upper right", fontsize="small")
    return ax


def plot_balance(plans: Sequence[Any], ax: Any = None, against: str = "mean") -> Any:
    """The busiest rank's load over the mean (``against="mean"``) or over the best possible
    (``"bound"``), against world size, one line per (strategy, weight); returns the ``Axes``."""
    import matplotlib.pyplot as plt

    if against not in ("mean", "bound"):
        raise ValueError(f"against must be 'mean' or 'bound', got {against!r}")
    ax = ax if ax is not None else plt.subplots(figsize=(6, 3.5))[1]
    lines: dict[tuple[str, str], list] = {}
    for p in plans:
        lines.setdefault((p.strategy, p.weight), []).append((p.world_size, getattr(p, f"max_over_{against}")))
    for (strategy, weight), points in lines.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=f"{strategy}, {weight}")
    ax.set(xscale="log", yscale="log", xlabel="world size", ylabel=f"busiest rank / {against}")
    ax.legend(fontsize="small")
    return ax
