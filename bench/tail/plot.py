"""The plots of ``python -m bench tail``: latency CDFs per class and set-up, short P99 against load."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter


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
    _save(figure, path)


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
    _save(figure, path)


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
    _save(figure, path)


def plot_tradeoff(path: Path, load: float, points: Mapping[str, tuple[float, float]], engines: int) -> None:
    """Short E2E P99 (over the ideal) against long served throughput (over round robin), one point per set-up.

    Down and to the right is better; a point dominates another when it is at
    least as far right and at least as low. The issue's targets are drawn.
    """
    figure, axis = plt.subplots(figsize=(7.5, 5))
    for name, (x, y) in points.items():
        if math.isnan(x) or math.isnan(y):
            continue
        marker = "s" if name.startswith(("shared", "disaggregated")) else "o"
        axis.scatter([x], [y], marker=marker, s=40)
        axis.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    long_goal, short_goal = (0.9, 1.45) if engines == 2 else (0.9, 1.6) if engines == 1 else (0.95, 1.25)
    axis.axvline(long_goal, color="grey", linewidth=0.8, linestyle="--")
    axis.axhline(short_goal, color="grey", linewidth=0.8, linestyle="--", label=f"targets: long >= {long_goal}, short <= {short_goal}x")
    axis.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 1.5, not 1.5 x 10^0
    axis.yaxis.set_major_formatter(plain)
    axis.yaxis.set_minor_formatter(plain)
    axis.set_xlabel("long tokens served in the window / round robin's (shared)")
    axis.set_ylabel("short E2E P99 / short-only's (log)")
    axis.set_title(f"{engines} engine(s), load {load:g}: the trade-off (down-right is better)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    _save(figure, path)


def plot_shift(
    path: Path,
    load: float,
    series: Mapping[str, Sequence[Mapping[str, object]]],
    assignment: Mapping[str, Sequence[tuple[float, Mapping[str, int] | None]]],
    shift_at: float | None,
) -> None:
    """A run whose mix shifts: endpoints per pool (top), per-class E2E P99 (middle) and tokens/s served (bottom) over GPU time.

    ``series[setup]`` rows carry t_gpu_s, kind, e2e_p99_ms, served_tok_s;
    ``assignment[setup]`` is [(GPU s, {pool: endpoints})] from the router's /metrics.
    """
    figure, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (setup, rows) in enumerate(series.items()):
        colour = colours[index % len(colours)]
        for kind, style in (("short", "-"), ("long", "--")):
            mine = [r for r in rows if r["kind"] == kind]
            xs = [float(r["t_gpu_s"]) for r in mine]  # type: ignore[arg-type]
            middle.plot(xs, [float(r["e2e_p99_ms"]) for r in mine], style, color=colour, label=f"{setup} {kind}")  # type: ignore[arg-type]
            bottom.plot(xs, [float(r["served_tok_s"]) for r in mine], style, color=colour, label=f"{setup} {kind}")  # type: ignore[arg-type]
        points = [(t, a) for t, a in assignment.get(setup, []) if a]
        if points:
            top.step([t for t, _ in points], [a.get("interactive", 0) for _, a in points], where="post", color=colour, label=f"{setup}: interactive")
            top.step([t for t, _ in points], [a.get("batch", 0) for _, a in points], ":", where="post", color=colour, label=f"{setup}: batch")
    for axis in (top, middle, bottom):
        if shift_at is not None:
            axis.axvline(shift_at, color="red", linewidth=0.8, linestyle="--")
        axis.grid(True, alpha=0.3)
    top.set_ylabel("endpoints in the pool")
    top.set_title(f"mix shifts at the red line (chat, then the origin's), load {load:g}")
    middle.set_yscale("log")
    middle.set_ylabel("E2E P99 by arrival, ms (GPU)")
    bottom.set_ylabel("tokens/s served (GPU time)")
    bottom.set_xlabel("GPU seconds since the first arrival")
    for axis in (top, middle, bottom):
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=6, ncol=2)
    _save(figure, path)


def _save(figure: Figure, path: Path) -> None:
    """Every plot's last step: lay out, write the PNG at the committed plots' resolution, free the figure."""
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
