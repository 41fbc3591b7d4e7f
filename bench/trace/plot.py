"""Attainment against load, per placement: the share of each class's requests that met its objective.

One panel per trace, fleet size and class, every set-up a line over the
run's loads (issue 35, item 5). A request that failed (refused, timed out)
met nothing, so the share counts every request sent, not the ok ones: a
placement cannot look good by refusing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.harness.plots import write_figure
from bench.trace.report import PointReport

__all__ = ["attainment_series", "plot_attainment"]

KINDS = ("short", "long")


def attainment_series(points: Sequence[PointReport], trace: str, engines: int, kind: str, setup: str) -> tuple[list[float], list[float]]:
    """Loads and the share of ``kind`` requests that met their objective under ``setup``, in load order (points without such requests left out)."""
    loads, shares = [], []
    for point in sorted((p for p in points if p.trace == trace and p.engines == engines), key=lambda p: p.load):
        stats = next((s for s in point.classes.get(setup, []) if s.kind == kind), None)
        if stats is None or stats.n == 0 or math.isnan(stats.attainment):
            continue
        loads.append(point.load)
        shares.append(stats.attainment)
    return loads, shares


def _panel(points: Sequence[PointReport], trace: str, engines: int, kind: str) -> Callable[[object], None]:
    group = [p for p in points if p.trace == trace and p.engines == engines]
    setups = list(dict.fromkeys(key for p in group for key in p.classes))
    names = {key: name for p in group for key, name in p.names.items()}  # "hand split 1:1" at 2 engines, "1:3" at 4

    def draw(axes: object) -> None:
        for setup in setups:
            loads, shares = attainment_series(points, trace, engines, kind, setup)
            if loads:
                axes.plot(loads, shares, marker="o", label=names.get(setup, setup))  # type: ignore[attr-defined]
        axes.set_ylim(0, 1.02)  # type: ignore[attr-defined]
        axes.set_xlabel("offered load (fraction of the fleet's modelled capacity)")  # type: ignore[attr-defined]
        axes.set_ylabel("met its objective (share of requests sent)")  # type: ignore[attr-defined]
        axes.set_title(f"{trace}, {engines} engines: {kind} class")  # type: ignore[attr-defined]
        axes.grid(True, alpha=0.3)  # type: ignore[attr-defined]
        axes.legend(fontsize=8)  # type: ignore[attr-defined]

    return draw


def plot_attainment(points: Sequence[PointReport], path: Path, note: str) -> Path | None:
    """The figure, or None when no trace and fleet size was run at two loads or more (nothing to draw a line through)."""
    panels = []
    for trace, engines in dict.fromkeys((p.trace, p.engines) for p in points):
        if len({p.load for p in points if p.trace == trace and p.engines == engines}) < 2:
            continue
        for kind in KINDS:
            if any(s.kind == kind and s.n for p in points if p.trace == trace and p.engines == engines for stats in p.classes.values() for s in stats):
                panels.append(_panel(points, trace, engines, kind))
    if not panels:
        return None
    rows = max(1, math.ceil(len(panels) / 4))
    return write_figure(path, panels, f"Attainment against load, per placement ({note})", rows=rows)
