"""The trace benchmark's report: per class beside round robin and the hand split, and the issue's targets met or missed.

The targets (issue 23), for a tailguard set-up against round robin on the
same arrivals: each class's E2E P99 <= 1.1x, completed/s >= 0.97x, no more
failed requests than round robin's (counted per class: failures beyond
round robin's), short TTFT P99 <= 0.5x and short E2E P99 <= 0.7x.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tailguard.server.advise.replay.point import ClassStats
from tailguard.server.advise.replay.rebalancing import Rebalancing

E2E_P99_MAX = 1.1
COMPLETED_MIN = 0.97
SHORT_TTFT_P99_MAX = 0.5
SHORT_E2E_P99_MAX = 0.7


def ratio(value: float, base: float) -> float:
    """value / base; NaN when either is NaN or base is 0."""
    if math.isnan(value) or math.isnan(base) or base == 0:
        return math.nan
    return value / base


def failed(stats: ClassStats) -> int:
    return stats.n - stats.ok


def completed(classes: Sequence[ClassStats]) -> float:
    """Completed requests per second, all classes."""
    return sum(c.goodput_rps for c in classes)


@dataclass(frozen=True)
class Check:
    """One target: its measured value beside its bound; ``passed`` None when the class had no requests."""

    what: str
    value: float
    bound: str
    passed: bool | None

    def text(self) -> str:
        if self.passed is None:
            return f"{self.what}: no requests"
        shown = f"{self.value:.0f}" if self.what.startswith("failures") else f"{self.value:.2f}x"
        return f"{self.what} {shown} ({self.bound}) {'pass' if self.passed else 'MISS'}"


def _at_most(what: str, value: float, bound: float) -> Check:
    return Check(what, value, f"<= {bound:g}x", not math.isnan(value) and value <= bound)


def checks(candidate: Sequence[ClassStats], rr: Sequence[ClassStats]) -> list[Check]:
    """The targets for ``candidate`` against round robin's ``rr`` on the same arrivals."""
    base = {c.kind: c for c in rr}
    out: list[Check] = []
    for stats in candidate:
        if stats.n:
            out.append(_at_most(f"no worse: {stats.kind} E2E P99", ratio(stats.e2e_p99_ms, base[stats.kind].e2e_p99_ms), E2E_P99_MAX))
    speed = ratio(completed(candidate), completed(rr))
    out.append(Check("no worse: completed/s", speed, f">= {COMPLETED_MIN:g}x", not math.isnan(speed) and speed >= COMPLETED_MIN))
    beyond = sum(max(0, failed(c) - failed(base[c.kind])) for c in candidate)
    out.append(Check("failures beyond RR's", beyond, "0", beyond == 0))
    short = next((c for c in candidate if c.kind == "short"), None)
    if short is None or not short.n:
        out.append(Check("better: short TTFT/E2E P99", math.nan, "", None))
    else:
        out.append(_at_most("better: short TTFT P99", ratio(short.ttft_p99_ms, base["short"].ttft_p99_ms), SHORT_TTFT_P99_MAX))
        out.append(_at_most("better: short E2E P99", ratio(short.e2e_p99_ms, base["short"].e2e_p99_ms), SHORT_E2E_P99_MAX))
    return out


def targets_line(name: str, found: Sequence[Check]) -> str:
    met = sum(c.passed is True for c in found)
    judged = sum(c.passed is not None for c in found)
    return f"- **{name}** targets, {met} of {judged} met: " + "; ".join(c.text() for c in found)


def _x(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.2f}"


def _ms(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:,.0f}"


def class_row(name: str, stats: ClassStats, rr: ClassStats, split: ClassStats) -> str:
    """One table row: the class's numbers and its ratios to round robin and the hand split."""
    failures = ", ".join(f"{k} {v}" for k, v in stats.outcomes.items() if k != "ok") or "0"
    ratios = [
        f"{_x(ratio(getattr(stats, key), getattr(rr, key)))} / {_x(ratio(getattr(stats, key), getattr(split, key)))}"
        for key in ("ttft_p99_ms", "e2e_p99_ms", "goodput_rps")
    ]
    return (
        f"| {name} | {stats.kind} | {stats.n} | {stats.ok} | {failures} | {_ms(stats.ttft_p50_ms)} / {_ms(stats.ttft_p99_ms)} |"
        f" {_ms(stats.e2e_p50_ms)} / {_ms(stats.e2e_p99_ms)} | {stats.goodput_rps:.2f} | {_share(stats.attainment)} | " + " | ".join(ratios) + " |"
    )


def _share(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.3f}"


TABLE_HEAD = (
    "| set-up | class | n | ok | failed | TTFT P50 / P99 ms | E2E P50 / P99 ms | completed/s | met objective |"
    " TTFT P99 x RR / x split | E2E P99 x RR / x split | completed/s x RR / x split |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


@dataclass(frozen=True)
class PointReport:
    """One trace x engines x load: every set-up's per-class stats, by set-up key."""

    trace: str
    engines: int
    load: float
    rate: float
    capacity_per_engine: float
    requests: int
    short: int
    left_out: int
    names: dict[str, str]  # key -> the set-up's display name
    classes: dict[str, list[ClassStats]]  # key -> per-class stats
    prefix_hit_rates: dict[str, float]  # key -> cached prompt tokens over prompt tokens looked up, all engines
    rebalancing: dict[str, Rebalancing] = field(default_factory=dict)  # key -> what rebalancing did, for set-ups that rebalance

    def title(self) -> str:
        return f"{self.trace}, {self.engines} engines, load {self.load:g}"


def point_section(point: PointReport, rr: str, split: str) -> list[str]:
    """A point's heading, table and one targets line per candidate."""
    lines = [
        f"### {point.title()}",
        "",
        f"{point.requests} requests ({point.short} short; {point.left_out} over the context left out),"
        f" {point.rate:.2f} req/s offered = {point.load:g} x {point.engines} x {point.capacity_per_engine:.3f} req/s per engine.",
        "",
        TABLE_HEAD,
    ]
    by_kind = {key: {c.kind: c for c in stats} for key, stats in point.classes.items()}
    for key, stats in point.classes.items():
        for cls in stats:
            if cls.n:
                lines.append(class_row(point.names[key], cls, by_kind[rr][cls.kind], by_kind[split][cls.kind]))
    hits = ", ".join(f"{point.names[key]} {_x(rate)}" for key, rate in point.prefix_hit_rates.items())
    lines += ["", f"Prefix-cache hit rate (the engines' own, vLLM's two counters): {hits}."]
    if point.rebalancing:
        moved = "; ".join(f"{point.names[key]}: {books.text()}" for key, books in point.rebalancing.items())
        lines += ["", f"Rebalancing (moves made; each pool's seats at the end): {moved}."]
    if not point.short:
        lines += ["", "No short requests at these thresholds: the short-class targets do not apply."]
    lines.append("")
    for key, stats in point.classes.items():
        if key not in (rr, split):
            lines.append(targets_line(point.names[key], checks(stats, point.classes[rr])))
    return [*lines, ""]


def headline(points: Sequence[PointReport], rr: str, split: str) -> list[str]:
    """One row per point and candidate: the ratios the targets judge, against round robin."""
    lines = [
        "| trace | engines | load | set-up | long E2E P99 x RR | short TTFT P99 x RR | short E2E P99 x RR | completed/s x RR | failures beyond RR | targets met |"
        " met objective, short / long (RR's) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point in points:
        base = {c.kind: c for c in point.classes[rr]}
        for key, stats in point.classes.items():
            if key in (rr, split):
                continue
            mine = {c.kind: c for c in stats}
            found = checks(stats, point.classes[rr])
            beyond = next(c for c in found if c.what.startswith("failures")).value
            long_e2e = ratio(mine["long"].e2e_p99_ms, base["long"].e2e_p99_ms) if "long" in mine else math.nan
            has_short = "short" in mine and mine["short"].n > 0
            short_ttft = ratio(mine["short"].ttft_p99_ms, base["short"].ttft_p99_ms) if has_short else math.nan
            short_e2e = ratio(mine["short"].e2e_p99_ms, base["short"].e2e_p99_ms) if has_short else math.nan
            met = f"{sum(c.passed is True for c in found)} / {sum(c.passed is not None for c in found)}"
            lines.append(
                f"| {point.trace} | {point.engines} | {point.load:g} | {point.names[key]} | {_x(long_e2e)} | {_x(short_ttft)} | {_x(short_e2e)} |"
                f" {_x(ratio(completed(stats), completed(point.classes[rr])))} | {beyond:.0f} | {met} | {_attained(mine, base)} |"
            )
    return lines


def _attained(mine: dict[str, ClassStats], rr: dict[str, ClassStats]) -> str:
    """Each kind's share that met its objective, round robin's beside it."""
    return " / ".join(
        f"{_share(mine[kind].attainment)} ({_share(rr[kind].attainment)})" if kind in mine and kind in rr else "—" for kind in ("short", "long")
    )


def rebalancing_table(points: Sequence[PointReport]) -> list[str]:
    """One row per point and set-up that rebalances: its moves and each pool's seats at the end (none: no such set-up)."""
    rows = [
        f"| {point.trace} | {point.engines} | {point.load:g} | {point.names[key]} | {books.whole_moves} | {books.seat_moves} |"
        f" {books.draining} | {' : '.join(f'{name} {seats}' for name, seats in books.pool_seats.items())} |"
        for point in points
        for key, books in point.rebalancing.items()
    ]
    if not rows:
        return []
    return [
        "| trace | engines | load | set-up | whole-engine moves | seat moves | draining at the end | seats per pool at the end |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
