"""The tail benchmark's targets: each judged on a result, as rows the report prints."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.harness.open_loop import FAST_REJECTION_MS, ClassStats
from bench.tail.model import (
    ADDED_TTFT_GOAL_MS,
    BASELINES,
    CLASS_OF,
    QUEUE_TIMEOUTS,
    SHORT_DEADLINE_S,
    TAILGUARD_SPLIT_KINDS,
    Options,
    Result,
    SetupResult,
)

# -- the targets -------------------------------------------------------------------------


def checks(result: Result) -> list[dict[str, object]]:
    """The issue's targets, reported (not tuned for), at the loads nearest 0.8 and the top load."""
    by = {(r.setup, round(r.load, 2)): r for r in result.runs}
    loads = sorted({round(r.load, 2) for r in result.runs if not math.isnan(r.load)})
    found: list[dict[str, object]] = []

    def stat(setup: str, load: float, kind: str) -> ClassStats | None:
        run = by.get((setup, load))
        return next((c for c in run.classes if c.kind == kind), None) if run else None

    def add(name: str, value: float | str, target: str, met: bool | None) -> None:
        found.append({"check": name, "value": value, "target": target, "met": met})

    if not loads:
        return found
    mid = min(loads, key=lambda x: abs(x - 0.8))
    dis, ideal, shared = stat("disaggregated", mid, "short"), stat("short-only", mid, "short"), stat("shared", mid, "short")
    if dis and ideal:
        ratio = dis.e2e_ms["p99"] / ideal.e2e_ms["p99"]
        add(f"load {mid:g}: disaggregated short E2E P99 / short-only", round(ratio, 2), "<= 1.25", ratio <= 1.25)
    if dis and shared:
        ratio = shared.e2e_ms["p99"] / dis.e2e_ms["p99"]
        add(f"load {mid:g}: shared short E2E P99 / disaggregated", round(ratio, 2), ">= 5 (if shared inflated)", ratio >= 5)
    long_dis, long_shared = stat("disaggregated", mid, "long"), stat("shared", mid, "long")
    if long_dis and long_shared and long_shared.goodput_tok_s:
        ratio = long_dis.goodput_tok_s / long_shared.goodput_tok_s
        add(f"load {mid:g}: disaggregated long goodput / shared", round(ratio, 2), ">= 0.9", ratio >= 0.9)
    for load in (x for x in loads if x < 0.9):
        for setup in ("priority", "disaggregated"):
            if c := stat(setup, load, "short"):
                failed = c.n - c.outcomes.get("ok", 0)
                add(f"load {load:g}: {setup} short failures", failed, "0", failed == 0)
    for load in loads:
        routed, direct = stat("disaggregated", load, "short"), stat("split-direct", load, "short")
        if routed and direct:
            found.append(_added_ttft_check(load, routed, direct, result.time_scale, judged=load == mid))
    top = max(loads)
    if top >= 1.2:
        for setup in ("priority", "disaggregated"):
            if run := by.get((setup, top)):
                found += _overload_checks(run, result.time_scale)
                found += _router_rejection_checks(run)
    return found


def _added_ttft_check(load: float, routed: ClassStats, direct: ClassStats, scale: float, judged: bool) -> dict[str, object]:
    """Short TTFT P99 through tailguard minus the same split fed directly, in real ms (the router's CPU is real time).

    The tables show GPU ms (real / time scale); the router's added latency is
    judged in real ms, as a caller of a real deployment would feel it.
    """
    routed_ms, direct_ms = routed.ttft_ms["p99"] * scale, direct.ttft_ms["p99"] * scale
    added = routed_ms - direct_ms
    value = f"{added:+.1f} real ms ({routed_ms:.1f} vs {direct_ms:.1f}; {added / scale:+.1f} GPU ms)"
    target = f"<= +{ADDED_TTFT_GOAL_MS:g} real ms" if judged else "- (judged at load 0.8)"
    met = (not math.isnan(added) and added <= ADDED_TTFT_GOAL_MS) if judged else None
    return {"check": f"load {load:g}: disaggregated short TTFT P99 - split-direct", "value": value, "target": target, "met": met}


def _router_rejection_checks(run: SetupResult) -> list[dict[str, object]]:
    """Each kind of rejection's P99 as tailguard's access log timed it (real ms): refusals at arrival must be fast.

    A 503 queue_timeout that waited for a seat until its deadline is slow by
    design; it is reported, not judged.
    """
    found: list[dict[str, object]] = []
    for c in run.classes:
        for kind, r in c.rejections.items():
            p99 = r.router_ms["p99"]
            waited = kind.endswith("after waiting")
            target = "- (waited for its deadline)" if waited else f"<= {FAST_REJECTION_MS:g}"
            met = None if waited or math.isnan(p99) else p99 <= FAST_REJECTION_MS
            value: float | str = "- (no access-log line joined)" if math.isnan(p99) else round(p99, 1)
            found.append({"check": f"load {run.load:g}: {run.setup} {c.kind} {kind} router-side P99 real ms (n {r.n})", "value": value, "target": target, "met": met})
    return found


def _overload_checks(run: SetupResult, scale: float) -> list[dict[str, object]]:
    """Overload targets for one tailguard run: short requests on time, rejections fast, memory flat."""
    found: list[dict[str, object]] = []
    name = f"load {run.load:g}: {run.setup}"

    def add(check: str, value: float | str, target: str, met: bool | None) -> None:
        found.append({"check": f"{name} {check}", "value": value, "target": target, "met": met})

    short = next(c for c in run.classes if c.kind == "short")
    deadline_ms = SHORT_DEADLINE_S * 1000
    add("short E2E P99 ms (ok ones)", round(short.e2e_ms["p99"]), f"<= {deadline_ms:g}", short.e2e_ms["p99"] <= deadline_ms)
    on_time = short.ok_within_deadline or 0.0
    add("short ok ones within deadline", round(on_time, 3), ">= 0.99", on_time >= 0.99)
    add("short served (ok / all)", round(short.outcomes.get("ok", 0) / short.n, 3) if short.n else "-", "-", None)
    for c in run.classes:
        class_deadline_ms = QUEUE_TIMEOUTS[CLASS_OF[c.kind]] * scale * 1000
        for kind, r in c.rejections.items():
            p99 = r.client_ms["p99"]
            if kind.startswith("429"):
                add(f"{c.kind} {kind} P99 real ms", round(p99, 1), f"< {FAST_REJECTION_MS:g}", p99 < FAST_REJECTION_MS)
            elif kind.startswith("503 queue_timeout"):
                bound = class_deadline_ms + 50
                add(f"{c.kind} {kind} P99 real ms", round(p99, 1), f"<= {bound:g} (deadline + 50)", p99 <= bound)
            else:
                add(f"{c.kind} {kind} P99 real ms", round(p99, 1), "-", None)
    slope = run.router_rss_mib.get("window_slope_per_min", math.nan)
    if not math.isnan(slope):
        add("router RSS growth in the window, MiB/min", round(slope, 2), "flat: <= 1", slope <= 1.0)
    return found


# -- issue 12's targets ------------------------------------------------------------------

GOALS_4 = (0.95, 1.25, 2.0)  # 4 engines: long served >= x shared; short E2E P99 <= x ideal; short TTFT P99 <= x ideal


GOALS_2 = (0.9, 1.45)  # 2 engines at 0.9: long >= x round robin; short E2E P99 <= x ideal


GOALS_1 = (0.9, 1.6)  # 1 engine: long >= x FIFO; short E2E P99 <= x ideal


@dataclass(frozen=True)
class Versus:
    """One run against its load's baselines: long served rate over shared's, short P99s over short-only's."""

    long: float
    short_e2e: float
    short_ttft: float
    short_p99_ms: float
    long_tok_s: float
    short_not_ok: int  # measured short requests that did not end ok
    long_failed: int  # measured long requests that ended in an error (not ok and not cut by the run's end)


def versus(result: Result) -> dict[tuple[str, float], Versus]:
    """Each run's ratios to the same load's ``shared`` (long) and ``short-only`` (short) runs."""
    found: dict[tuple[str, float], Versus] = {}
    by = {(r.kind, round(r.load, 2)): r for r in result.runs if r.kind in BASELINES and "#" not in r.setup}
    beside = {(r.kind, round(r.load, 2), r.round): r for r in result.runs if r.kind in BASELINES}
    for run in result.runs:
        load = round(run.load, 2)
        shared = beside.get(("shared", load, run.round)) or by.get(("shared", load))  # the one that ran beside it, if any
        ideal = beside.get(("short-only", load, run.round)) or by.get(("short-only", load))
        short, long = kind_stats(run, "short"), kind_stats(run, "long")
        if short is None:
            continue
        long_rate = long.served_tok_s if long else math.nan
        shared_long = kind_stats(shared, "long") if shared else None
        ideal_short = kind_stats(ideal, "short") if ideal else None
        long_failed = long.n - long.outcomes.get("ok", 0) - long.outcomes.get("cut", 0) if long else 0
        found[(run.setup, load)] = Versus(
            long=long_rate / shared_long.served_tok_s if shared_long and shared_long.served_tok_s else math.nan,
            short_e2e=short.e2e_ms["p99"] / ideal_short.e2e_ms["p99"] if ideal_short else math.nan,
            short_ttft=short.ttft_ms["p99"] / ideal_short.ttft_ms["p99"] if ideal_short else math.nan,
            short_p99_ms=short.e2e_ms["p99"],
            long_tok_s=long_rate,
            short_not_ok=short.n - short.outcomes.get("ok", 0),
            long_failed=long_failed,
        )
    return found


def kind_stats(run: SetupResult, kind: str) -> ClassStats | None:
    return next((c for c in run.classes if c.kind == kind and c.n), None)


def checks12(result: Result, options: Options) -> list[dict[str, object]]:
    """Issue 12's targets for this run's engine count (reported, not tuned for)."""
    found: list[dict[str, object]] = []
    table = versus(result)

    def add(name: str, value: str, target: str, met: bool | None) -> None:
        found.append({"check": name, "value": value, "target": target, "met": met})

    def describe(v: Versus) -> str:
        return f"long {v.long:.2f}, short E2E {v.short_e2e:.2f}x, TTFT {v.short_ttft:.2f}x"

    tailguard = [r for r in result.runs if r.kind in TAILGUARD_SPLIT_KINDS + ("priority", "shared-limit", "vllm-priority")]
    if not any(r.kind == "short-only" for r in result.runs) or not any(r.kind == "shared" for r in result.runs):
        return found
    for run in tailguard:
        v = table.get((run.setup, round(run.load, 2)))
        if v is None:
            continue
        name = f"load {run.load:g}: {run.setup}"
        if options.mix == "shift":
            continue
        if result.engines >= 3:
            long_goal, e2e_goal, ttft_goal = GOALS_4
            met = v.long >= long_goal and v.short_e2e <= e2e_goal and v.short_ttft <= ttft_goal
            add(name, describe(v), f"long >= {long_goal}, E2E <= {e2e_goal}x, TTFT <= {ttft_goal}x", met)
        elif result.engines == 2:
            long_goal, e2e_goal = GOALS_2
            judged = round(run.load, 2) >= 0.9
            met = v.long >= long_goal and v.short_e2e <= e2e_goal
            add(name, describe(v), f"long >= {long_goal} of RR, E2E <= {e2e_goal}x" + ("" if judged else " (judged at 0.9)"), met if judged else None)
        else:
            long_goal, e2e_goal = GOALS_1
            met = v.long >= long_goal and v.short_e2e <= e2e_goal
            add(name, describe(v), f"long >= {long_goal} of FIFO, E2E <= {e2e_goal}x", met)
    if result.engines == 2:
        found += _dominance(result, table)
    if options.mix == "shift":
        found += _shift_checks(result, table, options)
    for run in result.runs:
        if run.engines is None or not run.engines.looks or not run.timeline:
            continue  # no router: engines may queue, that is the point of the baseline
        over = [p for p, n in run.engines.max_sent.items() if n > run.engines.caps.get(p, n)]
        worst = max(run.engines.max_sent.values(), default=0)
        add(
            f"load {run.load:g}: {run.setup} engines' running + waiting, max over {run.engines.looks} looks",
            f"{worst} (caps {sorted(set(run.engines.caps.values()))})", "<= each endpoint's cap", not over,
        )
    return found


def _dominance(result: Result, table: dict[tuple[str, float], Versus]) -> list[dict[str, object]]:
    """2 engines: does each lending/rebalancing setting dominate round robin and every static split at its load?"""
    found: list[dict[str, object]] = []
    for load in sorted({round(r.load, 2) for r in result.runs}):
        others = [r for r in result.runs if round(r.load, 2) == load and r.kind in ("shared", "disaggregated")]
        for run in (r for r in result.runs if round(r.load, 2) == load and r.kind in ("lend", "rebalance", "lend-rebalance")):
            mine = table.get((run.setup, load))
            if mine is None:
                continue
            beaten = []
            for other in others:
                theirs = table.get((other.setup, load))
                if theirs is None:
                    continue
                at_least = mine.long_tok_s >= theirs.long_tok_s * 0.99 and mine.short_p99_ms <= theirs.short_p99_ms * 1.01
                better = mine.long_tok_s > theirs.long_tok_s * 1.01 or mine.short_p99_ms < theirs.short_p99_ms * 0.99
                if not (at_least and better):
                    beaten.append(other.setup)
            value = "dominates all" if not beaten else "not over " + ", ".join(beaten)
            found.append(
                {"check": f"load {load:g}: {run.setup} dominates {', '.join(o.setup for o in others)}", "value": value,
                 "target": "as good on both axes (1% slack), better on one", "met": not beaten}
            )
    return found


def _shift_checks(result: Result, table: dict[tuple[str, float], Versus], options: Options) -> list[dict[str, object]]:
    """The shifting mix: nothing dropped, short P99 within the 4-engine target, the assignment follows."""
    found: list[dict[str, object]] = []
    for run in result.runs:
        if run.kind not in TAILGUARD_SPLIT_KINDS:
            continue
        v = table.get((run.setup, round(run.load, 2)))
        dropped = sum(n for by in run.outcomes_all.values() for outcome, n in by.items() if outcome not in ("ok", "cut"))
        cut = sum(by.get("cut", 0) for by in run.outcomes_all.values())
        name = f"shift load {run.load:g}: {run.setup}"
        found.append(
            {"check": f"{name}: requests that failed (whole run; still running at the drain's end: {cut})", "value": str(dropped), "target": "0", "met": dropped == 0}
        )
        if v is not None:
            long_goal, e2e_goal, ttft_goal = GOALS_4
            met = v.short_e2e <= e2e_goal and v.short_ttft <= ttft_goal
            found.append(
                {"check": f"{name}: short P99 over the window vs short-only", "value": f"E2E {v.short_e2e:.2f}x, TTFT {v.short_ttft:.2f}x",
                 "target": f"E2E <= {e2e_goal}x, TTFT <= {ttft_goal}x", "met": met}
            )
        if run.kind in ("rebalance", "lend-rebalance"):
            shift_at = options.phase_seconds
            after = [(t, m) for t, m in run.moves if t >= shift_at and "leaves" in m]
            before = [(t, m) for t, m in run.moves if t < shift_at and "leaves" in m]
            first = f"{(after[0][0] - shift_at) / options.time_scale:.1f} GPU s after the shift" if after else "no move after the shift"
            value = f"{len(before)} move(s) in phase 1, {len(after)} in phase 2; first of phase 2 {first} (hold {options.rebalance.hold:g} GPU s)"
            found.append({"check": f"{name}: the assignment follows the mix", "value": value, "target": "a move each way", "met": bool(before and after)})
    return found
