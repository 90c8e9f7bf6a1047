"""Figures for BENCHMARKS.md, drawn by the bench scripts' ``--plot PATH`` (matplotlib, no screen)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def grouped_bars(path: str, title: str, groups: Mapping[str, Mapping[str, float]], ylabel: str) -> None:
    """One cluster of bars per group (e.g. a model), one bar per series (e.g. an implementation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for k, name in enumerate(series):
        xs = [i + k * width for i in range(len(groups))]
        ax.bar(xs, [values.get(name, 0.0) for values in groups.values()], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], list(groups))
    ax.set(title=title, ylabel=ylabel)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def lines(path: str, title: str, xs: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str,
          ylabel: str) -> None:
    """Log-log lines, one per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set(title=title, xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
