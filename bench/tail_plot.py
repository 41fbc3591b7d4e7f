"""The plots of ``python -m bench tail``: latency CDFs per class and set-up, short P99 against load."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402


def plot_cdfs(path: Path, load: float, curves: Mapping[str, Mapping[str, Sequence[float]]]) -> None:
    """One panel per class: the end-to-end latency CDF (GPU ms, log x) of each set-up. ``curves[setup][kind]`` is sorted."""
    kinds = sorted({kind for by_kind in curves.values() for kind in by_kind}, key=lambda k: k != "short")
    figure, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for axis, kind in zip(axes[0], kinds):
        for setup, by_kind in curves.items():
            values = by_kind.get(kind, [])
            if values:
                axis.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=setup)
        axis.set_xscale("log")
        axis.set_title(f"{kind} requests, load {load:g}")
        axis.set_xlabel("end-to-end latency, ms (GPU time)")
        axis.set_ylabel("fraction of finished requests")
        axis.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_p99_vs_load(path: Path, series: Mapping[str, Sequence[tuple[float, float]]], deadline_ms: float) -> None:
    """Short requests' end-to-end P99 against offered load, one line per set-up (log y)."""
    figure, axis = plt.subplots(figsize=(6.5, 4.2))
    for setup, points in series.items():
        shown = [(x, y) for x, y in points if not math.isnan(y)]
        if shown:
            axis.plot([x for x, _ in shown], [y for _, y in shown], marker="o", label=setup)
    axis.axhline(deadline_ms, color="red", linewidth=0.8, linestyle="--", label="short deadline")
    axis.set_yscale("log")
    axis.set_xlabel("offered load (fraction of the shared set-up's modelled capacity)")
    axis.set_ylabel("short end-to-end P99, ms (GPU time)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
