"""The sweep's tables and plots: markdown for people, PNG where a picture beats a table."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.harness.plots import write_figure
from bench.harness.report import md_table
from bench.sweep.check import Comparison, EngineAgreement
from tailguard.server.advise.replay.point import ClassStats, PointResult

OK_SHARE_FLAG = 0.99  # below this share of ok answers a percentile hides failures: say so


def _ms(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _ok_share(stats: ClassStats) -> float:
    return stats.ok / stats.n if stats.n else math.nan


def full_table(results: Sequence[PointResult]) -> str:
    """Every point and class: counts, outcomes, percentiles, goodput; what the point cost."""
    header = [
        "set-up", "load", "req/s", "class", "n", "ok", "429", "503", "timeout", "TTFT P50 ms", "TTFT P99 ms", "E2E P50 ms", "E2E P99 ms",
        "goodput req/s", "goodput tok/s", "preemptions", "CPU s",
    ]
    return "\n".join(md_table(header, (
        (
            r.setup, f"{r.load:g}", f"{r.rate:.1f}", c.kind, c.n, c.ok, *(c.outcomes.get(k, 0) for k in ("429", "503", "timeout")),
            *map(_ms, (c.ttft_p50_ms, c.ttft_p99_ms, c.e2e_p50_ms, c.e2e_p99_ms)), f"{c.goodput_rps:.1f}", f"{c.goodput_tokens_per_s:,.0f}",
            r.preemptions, f"{r.cpu_s:.1f}",
        )
        for r in results
        for c in r.classes
    )))


def cost_summary(results: Sequence[PointResult]) -> str:
    """What simulating cost: CPU per simulated request, and per point by load and set-up."""
    cpu = sum(r.cpu_s for r in results)
    requests = sum(r.requests for r in results)
    simulated = sum(r.simulated_s for r in results)
    setups = list(dict.fromkeys(r.setup for r in results))
    loads = sorted({r.load for r in results})
    cells = {(r.setup, r.load): r for r in results}
    lines = [
        f"**CPU cost**: {cpu:,.0f} s of CPU for {len(results)} points, {requests:,} simulated requests and "
        f"{simulated / 3600:,.1f} h of simulated traffic: {cpu / requests * 1e6 if requests else math.nan:.0f} µs per request. "
        "CPU seconds per point (its window, warm-up and tail):",
        "",
        *md_table(["load", *setups], ([f"{load:g}", *(f"{cells[(s, load)].cpu_s:.1f}" if (s, load) in cells else "" for s in setups)] for load in loads)),
    ]
    return "\n".join(lines)


def engine_table(checks: Sequence[EngineAgreement]) -> str:
    """The same seeded submissions (some hung up) through bench.sim.Engine and the sweep's engine."""
    header = [
        "engine", "offered req/s", "simulated s", "requests", "hung up", "shared documents", "preemptions (sim / sweep)",
        "prefix-cache hit tokens (sim / sweep)", "ended differently", "largest timestamp difference",
    ]
    return "\n".join(md_table(header, (
        (
            c.profile, f"{c.offered_req_per_s:.1f}", f"{c.seconds:g}", c.requests, c.hang_ups, c.documents or "none",
            f"{c.preemptions_reference} / {c.preemptions_sweep}", f"{c.prefix_hits_reference:,} / {c.prefix_hits_sweep:,}",
            c.differing, f"{c.max_difference_s:.3g} s",
        )
        for c in checks
    )))


def pivot(results: Sequence[PointResult], kind: str, metric: str, title: str) -> str:
    """One metric of one class: loads down, set-ups across; '(n% ok)' where answers failed."""
    setups = list(dict.fromkeys(r.setup for r in results))
    loads = sorted({r.load for r in results})
    cells = {(r.setup, r.load): r.stats(kind) for r in results}
    rows = []
    for load in loads:
        row = [f"{load:g}"]
        for setup in setups:
            stats = cells.get((setup, load))
            if stats is None:
                row.append("")
                continue
            cell = _ms(getattr(stats, metric))
            share = _ok_share(stats)
            if share < OK_SHARE_FLAG:
                cell += f" ({share:.0%} ok)"
            row.append(cell)
        rows.append(row)
    return "\n".join([f"**{title}**", "", *md_table(["load", *setups], rows)])


def comparison_table(rows: Sequence[Comparison]) -> str:
    header = ["set-up", "class", "metric", "real ms", "virtual ms", "virtual / real"]
    return "\n".join(md_table(header, ((r.setup, r.kind, r.metric, _ms(r.real_ms), _ms(r.virtual_ms), f"{r.ratio:.2f}") for r in rows)))


# -- plots ----------------------------------------------------------------------------


def _series(results: Sequence[PointResult], setup: str, kind: str, metric: str) -> tuple[list[float], list[float], list[bool]]:
    """Loads, values and whether each point's percentile hides failures (> 1% not ok)."""
    points = sorted((r for r in results if r.setup == setup and r.stats(kind) is not None), key=lambda r: r.load)
    loads, values, flagged = [], [], []
    for r in points:
        stats = r.stats(kind)
        assert stats is not None
        value = getattr(stats, metric)
        if math.isnan(value):
            continue
        loads.append(r.load)
        values.append(value)
        flagged.append(_ok_share(stats) < OK_SHARE_FLAG)
    return loads, values, flagged


def _panel(axes: object, results: Sequence[PointResult], setups: Sequence[str], kind: str, metric: str, title: str) -> None:
    for setup in setups:
        loads, values, flagged = _series(results, setup, kind, metric)
        if not loads:
            continue
        (line,) = axes.plot(loads, values, marker="o", label=setup)  # type: ignore[attr-defined]
        bad = [(x, y) for x, y, f in zip(loads, values, flagged) if f]
        if bad:
            axes.scatter(*zip(*bad), s=120, facecolors="none", edgecolors=line.get_color(), linewidths=1.5)  # type: ignore[attr-defined]
    axes.set_yscale("log")  # type: ignore[attr-defined]
    axes.set_xlabel("offered load (fraction of the shared fleet's capacity)")  # type: ignore[attr-defined]
    axes.set_ylabel("ms")  # type: ignore[attr-defined]
    axes.set_title(title)  # type: ignore[attr-defined]
    axes.grid(True, which="both", alpha=0.3)  # type: ignore[attr-defined]
    axes.legend(fontsize=8)  # type: ignore[attr-defined]


def _figure(path: Path, panels: Sequence[Callable[[object], None]], suptitle: str) -> Path:
    return write_figure(path, panels, suptitle + "\n(circled: more than 1% of that class's requests failed; the percentile covers the ok ones)")


def plot_headline(results: Sequence[PointResult], path: Path, note: str) -> Path:
    """Short requests' E2E P99 against load, every set-up on one log axis."""
    setups = list(dict.fromkeys(r.setup for r in results))
    return _figure(
        path,
        [lambda ax: _panel(ax, results, setups, "short", "e2e_p99_ms", "short requests: E2E P99")],
        f"Short E2E P99 vs load, virtual time ({note})",
    )


def plot_split(results: Sequence[PointResult], split_setup: str, path: Path, note: str) -> Path:
    """One split against the baselines: short TTFT P99, short E2E P99, long E2E P99."""
    setups = [s for s in dict.fromkeys(r.setup for r in results) if not s.startswith("disaggregated") or s == split_setup]
    return _figure(
        path,
        [
            lambda ax: _panel(ax, results, setups, "short", "ttft_p99_ms", "short: TTFT P99"),
            lambda ax: _panel(ax, results, setups, "short", "e2e_p99_ms", "short: E2E P99"),
            lambda ax: _panel(ax, results, setups, "long", "e2e_p99_ms", "long: E2E P99"),
        ],
        f"{split_setup} vs shared / priority / short-only ({note})",
    )
