"""The plots of ``python -m bench tail``: latency CDFs per class and set-up, short P99 against load."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402


def plot_cdfs(
    path: Path, load: float, curves: Mapping[str, Mapping[str, Sequence[float]]], metric: str = "end-to-end latency, ms (GPU time)"
) -> None:
    """One panel per class: the latency CDF (``metric``, log x) of each set-up. ``curves[setup][kind]`` is sorted."""
    kinds = sorted({kind for by_kind in curves.values() for kind in by_kind}, key=lambda k: k != "short")
    figure, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for axis, kind in zip(axes[0], kinds):
        for setup, by_kind in curves.items():
            values = by_kind.get(kind, [])
            if values:
                axis.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=setup)
        axis.set_xscale("log")
        axis.set_title(f"{kind} requests, load {load:g}")
        axis.set_xlabel(metric)
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


def plot_timelines(
    path: Path, load: float, series: Mapping[str, Sequence[tuple[float, float, float | None]]], window: tuple[float, float]
) -> None:
    """The router's RSS (top) and its waiting requests (bottom) over a run, one line per set-up.

    ``series[setup]`` is [(real s, RSS MiB, waiting or None)]; ``window`` (real s)
    is shaded: memory that keeps rising there, at a steady load, is a leak.
    """
    figure, (rss_axis, queue_axis) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for setup, points in series.items():
        rss_axis.plot([t for t, _, _ in points], [m for _, m, _ in points], label=setup)
        queued = [(t, w) for t, _, w in points if w is not None]
        queue_axis.plot([t for t, _ in queued], [w for _, w in queued], label=setup)
    for axis in (rss_axis, queue_axis):
        axis.axvspan(*window, color="grey", alpha=0.12, label="measured window" if axis is rss_axis else None)
        axis.grid(True, alpha=0.3)
    rss_axis.set_ylim(bottom=0)
    rss_axis.set_ylabel("router RSS, MiB")
    rss_axis.set_title(f"tailguard process, load {load:g}")
    rss_axis.legend(fontsize=8)
    queue_axis.set_ylabel("requests waiting for a seat")
    queue_axis.set_xlabel("real seconds since the first arrival")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
