"""advise's threshold search: every layout under every proposed threshold set, judged by one rule, and the pick.

Each threshold set (``thresholds.propose``) is the file with its interactive
class's bounds replaced; under it every layout of ``candidates.candidates`` is
replayed (under "no interactive class" only the shared pool: a split would
leave its interactive engines nothing but borrowed work). The arrivals keep
the classes the log recorded, so each set-up is measured on the same
requests (``judge``'s rule says why). Runs: the file's set is the layout
search advise does anyway; each further set is one more (its layouts plus
the two baselines), and "none" three runs, so at most
``thresholds.MAX_SETS`` layout searches (at 4 engines ~25 runs each).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .candidates import Candidate, shared_pool
from .fleet import Fleet
from .judge import COMPLETED_MIN, PREDICTED_E2E_MAX, Figures, best
from .prefixes import Seen
from .replay.fleet import Arrival
from .report import snippet
from .simulate import Progress, Stats
from .thresholds import Bounds, file_bounds, propose, shares, with_bounds
from .verdict import Advice, Prediction, advise


@dataclass(frozen=True)
class Judged:
    """One layout under one threshold set: its prediction and its figures by ``judge``'s rule."""

    bounds: Bounds
    prediction: Prediction
    figures: Figures


@dataclass(frozen=True)
class Search:
    """Every threshold set's layout search, each judged, and the pick."""

    fleet: Fleet  # the file's
    sets: tuple[tuple[Bounds, float, float], ...]  # each set, its short share of requests and of tokens
    judged: tuple[Judged, ...]
    pick: Judged
    safe: bool  # the pick is no worse than round robin by judge's bounds
    runs: int  # virtual runs, all sets
    wall_s: float
    e2e_max: float = PREDICTED_E2E_MAX  # what "safe" held the predictions to

    def fleet_of(self, bounds: Bounds) -> Fleet:
        return dataclasses.replace(self.fleet, base=with_bounds(self.fleet.base, bounds))


def _failed(s: Stats) -> int:
    return s.short_failed + s.long_n - s.long_ok


def figures(stats: Stats, rr: Stats, settings: int) -> Figures:
    """A prediction's figures against round robin's (``candidates.shared_setup``) on the same arrivals."""

    def x(value: float, base: float) -> float:
        if math.isnan(value) or math.isnan(base):
            return math.nan
        return value / base if base > 0 else (math.inf if value > 0 else 1.0)

    return Figures(
        x(stats.long_e2e_p99, rr.long_e2e_p99),
        x(stats.short_e2e_p99, rr.short_e2e_p99),
        x(stats.short_ttft_p99, rr.short_ttft_p99),
        x(stats.long_goodput, rr.long_goodput),
        max(0, _failed(stats) - _failed(rr)),
        settings,
    )


def settings_of(bounds: Bounds, own: Bounds, candidate: Candidate) -> int:
    """How many things a pick changes: thresholds, the layout, lending (ties go to fewer)."""
    return int(bounds != own) + int(not candidate.shared) + int(candidate.lends)


def search(
    fleet: Fleet,
    arrivals: Sequence[Arrival],
    *,
    seen: Sequence[Seen] | None = None,
    assume_tokens: int = 0,
    jobs: int = 1,
    seconds: float = math.nan,
    file_advice: Advice | None = None,
    e2e_max: float = PREDICTED_E2E_MAX,
    progress: Callable[[str], Progress] | None = None,
) -> Search:
    """Each proposed threshold set's layout search on ``arrivals`` (``file_advice``: the file's set's, already run);
    safe: E2E P99s at most ``e2e_max`` x round robin's. ``progress`` gives, for a set's label, what hears of
    its set-ups replayed."""
    started = time.perf_counter()
    sizes = [(a.prompt_tokens or 0, a.max_tokens or 0) for a in arrivals]
    own = file_bounds(fleet.base)
    found: list[Judged] = []
    runs = 0
    sets: list[tuple[Bounds, float, float]] = []
    proposed = propose(sizes, own)
    for number, bounds in enumerate(proposed, 1):
        sets.append((bounds, *shares(sizes, bounds)))
        if bounds == own and file_advice is not None:
            advice = file_advice
        else:
            mine = dataclasses.replace(fleet, base=with_bounds(fleet.base, bounds))
            layouts = (lambda f: [shared_pool(f)]) if bounds.none else None
            heard = progress(f"thresholds {number} of {len(proposed)} ({bounds.text()})") if progress is not None else None
            advice = advise(mine, arrivals, seen=seen, assume_tokens=assume_tokens, jobs=jobs, seconds=seconds, layouts=layouts, progress=heard)
        runs += len(advice.predictions) + 1 + (advice.ideal.short_n > 0)
        found += [Judged(bounds, p, figures(p.stats, advice.shared, settings_of(bounds, own, p.candidate))) for p in advice.predictions]
    index, safe = best([j.figures for j in found], e2e_max)
    return Search(fleet, tuple(sets), tuple(found), found[index], safe, runs, time.perf_counter() - started, e2e_max)


def _x(value: float) -> str:
    return "-" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:.2f}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def _set_text(bounds: Bounds, share: float, tokens: float) -> str:
    return bounds.text() if bounds.none else f"{bounds.text()} ({_pct(share)} of the requests, {_pct(tokens)} of their tokens short)"


def section(result: Search) -> str:
    """Markdown: the sets tried, each set's best layout, the pick, and its config lines (thresholds included)."""
    own = file_bounds(result.fleet.base)
    pick = result.pick
    head = (
        f"Class thresholds from this traffic: {len(result.sets)} threshold sets x their layouts, {result.runs} virtual runs"
        f" in {result.wall_s:.1f} s (wall). Judged on the log's own classes (what the running config called"
        f" {result.fleet.short_class}, and the rest) against shared round robin: safe = long and short E2E P99"
        f" <= {result.e2e_max:g}x (the bound is 1.1x; advise keeps headroom for its replay's error), long finished/s >= {COMPLETED_MIN:g}x,"
        " no failure beyond round robin's; among safe ones the lowest short E2E P99 (no short requests: the lowest long E2E P99)."
    )
    rows = [
        "| thresholds | short share (requests / tokens) | best layout under them | long E2E P99 x RR | short E2E P99 x RR "
        "| short TTFT P99 x RR | long finished/s x RR | failures beyond RR | safe |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for bounds, share, tokens in result.sets:
        mine = [j for j in result.judged if j.bounds == bounds]
        top = mine[best([j.figures for j in mine], result.e2e_max)[0]]
        f = top.figures
        mark = (" (the file's)" if bounds == own else "") + (" **<- recommended**" if top is pick else "")
        rows.append(
            f"| {bounds.text()}{mark} | {_pct(share)} / {_pct(tokens)} "
            f"| {top.prediction.candidate.name} | {_x(f.long_e2e)} | {_x(f.short_e2e)} | {_x(f.short_ttft)} | {_x(f.completed)} "
            f"| {f.failures_beyond} | {'yes' if f.safe_at(result.e2e_max) else 'no'} |"
        )
    share, tokens = next((s, t) for b, s, t in result.sets if b == pick.bounds)
    verdict = (
        f"Recommended thresholds: {_set_text(pick.bounds, share, tokens)}, with {pick.prediction.candidate.name}"
        f" -- long E2E P99 {_x(pick.figures.long_e2e)}x round robin, short E2E P99 {_x(pick.figures.short_e2e)}x."
    )
    if not result.safe:
        verdict += " No set-up is no worse than round robin by every bound: this one misses them by the least."
    text = snippet(result.fleet_of(pick.bounds), pick.prediction.candidate, pick.bounds)
    return "\n\n".join([head, "\n".join(rows), verdict, "```toml\n" + text + "```"]) + "\n"


def search_json(result: Search) -> dict[str, Any]:
    """The search as JSON: the sets, every judged set-up, the pick."""

    def safe(value: float) -> float | None:
        return value if math.isfinite(value) else None

    def one(j: Judged) -> dict[str, Any]:
        f = j.figures
        return {
            "thresholds": dataclasses.asdict(j.bounds),
            "candidate": j.prediction.candidate.name,
            "long_e2e_vs_rr": safe(f.long_e2e),
            "short_e2e_vs_rr": safe(f.short_e2e),
            "short_ttft_vs_rr": safe(f.short_ttft),
            "completed_vs_rr": safe(f.completed),
            "failures_beyond_rr": f.failures_beyond,
            "safe": f.safe_at(result.e2e_max),
        }

    return {
        "sets": [{"thresholds": dataclasses.asdict(b), "short_share": safe(s), "short_token_share": safe(t)} for b, s, t in result.sets],
        "runs": result.runs,
        "wall_s": result.wall_s,
        "judged": [one(j) for j in result.judged],
        "recommended": one(result.pick),
        "recommended_safe": result.safe,
    }
