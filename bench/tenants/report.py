"""The tenants report: a table a set-up, the ratios the issue's targets use, and their verdicts."""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.harness.report import Target, maybe, md_table, targets_table
from bench.tenants.measure import Result
from bench.tenants.model import ratio
from bench.tenants.stats import SetupNumbers, TenantNumbers

LATENCY_TARGET = 1.2  # B's P99 with A bursting, at most this many times its solo P99
BUSY_TARGET = 0.95  # the fair run's busy fraction, at least this share of the FIFO run's
WEIGHT_TOLERANCE = 0.10  # tokens served A:B within this share of the weights' ratio


def _b(setups: Sequence[SetupNumbers], name: str) -> TenantNumbers | None:
    for setup in setups:
        if setup.name == name:
            return setup.tenants.get("B")
    return None


def _busy(setups: Sequence[SetupNumbers], name: str) -> float:
    return next((s.busy for s in setups if s.name == name), math.nan)


def p99_ratio(numerator: TenantNumbers | None, denominator: TenantNumbers | None, metric: str) -> float:
    """B's ``metric`` ("ttft" or "e2e") P99 in one set-up over another's; NaN where either is missing."""
    if numerator is None or denominator is None:
        return math.nan
    values = [getattr(n, f"{metric}_ms")["p99"] for n in (numerator, denominator)]
    return ratio(values[0], values[1])


def weight_error(a_tokens: int, b_tokens: int, weights: tuple[float, float]) -> float:
    """How far the tokens served A:B are from the weights' ratio, as a share of it (0.05 = 5% off); NaN if B got none."""
    if b_tokens <= 0:
        return math.nan
    return abs(a_tokens / b_tokens / (weights[0] / weights[1]) - 1)


def targets(result: Result, weights: tuple[float, float]) -> list[Target]:
    """The issue's two fairness targets, checked on this run's numbers (NaN is a miss)."""
    setups, found = result.setups, []
    solo, fair = _b(setups, "solo"), _b(setups, "fair")
    for metric, label in (("ttft", "TTFT"), ("e2e", "E2E")):
        value = p99_ratio(fair, solo, metric)
        found.append(Target(f"B's {label} P99, fair / solo", f"<= {LATENCY_TARGET:g}x", f"{value:.2f}x", value <= LATENCY_TARGET))
    busy = ratio(_busy(setups, "fair"), _busy(setups, "fifo"))
    found.append(Target("busy fraction, fair / fifo", f">= {BUSY_TARGET:g}", f"{busy:.3f}", busy >= BUSY_TARGET))
    if result.weighted is not None:
        a, b = (result.weighted.tenants.get(t) for t in ("A", "B"))
        error = weight_error(a.tokens if a else 0, b.tokens if b else 0, weights)
        served = f"{a.tokens if a else 0}:{b.tokens if b else 0} tokens = {ratio(a.tokens, b.tokens) if a and b else math.nan:.2f}:1"
        goal = f"{weights[0] / weights[1]:g}:1 within {WEIGHT_TOLERANCE:.0%}"
        found.append(Target("tokens served A:B, both backlogged", goal, f"{served} ({error:.1%} off)", error <= WEIGHT_TOLERANCE))
    return found


def _tenant_cells(numbers: TenantNumbers | None) -> list[str]:
    if numbers is None:
        return ["-"] * 8
    return [
        str(numbers.requests), str(numbers.ok), str(numbers.failed), str(numbers.cut),
        f"{numbers.ttft_ms['p50']:.0f}", f"{numbers.ttft_ms['p99']:.0f}", f"{numbers.e2e_ms['p50']:.0f}", f"{numbers.e2e_ms['p99']:.0f}",
    ]  # fmt: skip


def setup_table(setups: Sequence[SetupNumbers]) -> list[str]:
    header = [
        "set-up",
        "tenant",
        "requests",
        "ok",
        "failed",
        "cut",
        "TTFT P50",
        "TTFT P99",
        "E2E P50",
        "E2E P99",
        "tokens served",
        "busy",
        "in engine queue (mean / max)",
    ]
    rows = []
    for setup in setups:
        for tenant, numbers in setup.tenants.items():
            engine = [f"{setup.busy:.3f}", f"{maybe(setup.engine_waiting_mean, '.2f')} / {setup.engine_waiting_max}"]
            rows.append([setup.name, tenant, *_tenant_cells(numbers), str(numbers.tokens), *engine])
    return md_table(header, rows)


def ratios(result: Result) -> list[str]:
    """B's P99 ratios against its solo run, and the busy fractions' ratio."""
    solo = _b(result.setups, "solo")
    rows = []
    for name in ("fair", "fifo", "b-first"):
        other = _b(result.setups, name)
        rows.append([f"{name} / solo", f"{p99_ratio(other, solo, 'ttft'):.2f}x", f"{p99_ratio(other, solo, 'e2e'):.2f}x"])
    busy = ratio(_busy(result.setups, "fair"), _busy(result.setups, "fifo"))
    return [*md_table(["B's P99", "TTFT", "E2E"], rows), "", f"Busy fraction fair / fifo: {busy:.3f}.", "", where_b_waits(result)]


def where_b_waits(result: Result) -> str:
    """Whether B's extra wait is inside the engine or in tailguard's queue, against the seat turnover."""
    solo = _b(result.setups, "solo")
    most = max((s.engine_waiting_max for s in result.setups), default=0)
    mean = max((s.engine_waiting_mean for s in result.setups if not math.isnan(s.engine_waiting_mean)), default=math.nan)
    extra = []
    for setup in result.setups:
        b = setup.tenants.get("B")
        if setup.name != "solo" and b is not None and solo is not None:
            extra.append(f"{setup.name} +{b.ttft_ms['p50'] - solo.ttft_ms['p50']:.0f} / +{b.ttft_ms['p99'] - solo.ttft_ms['p99']:.0f}")
    return (
        f"Where B waits: the engine's own queue held at most {most} request(s) (mean <= {mean:.2f}) in every set-up, its seats"
        " being the pool's, so B's TTFT beyond its solo run is time in tailguard's queue (GPU ms, P50 / P99: "
        f"{', '.join(extra) or '-'}); with every seat busy a seat frees every ~{result.seat_turnover_ms:.0f} GPU ms on average,"
        " the wait no order of the queue removes without preempting (b-first)."
    )


def render(result: Result) -> str:
    lines = ["# bench tenants: fair shares between two API keys on one small pool", ""]
    lines += [f"Command: `{' '.join(result.command)}`", "", f"Code: {result.code}", ""]
    lines += ["## Parameters", "", *md_table(["parameter", "value"], ([k, v] for k, v in result.parameters.items())), ""]
    lines += [
        "## Scenario 1: B steady, A bursting", "",
        "Latencies in GPU ms (real divided by the time scale) of the requests that finished; `failed` counts"
        " 429/503/504 and broken streams, `cut` those still running at the run's end. `busy`: the engine's running sequences over"
        " its seats, mean of its /metrics looks in the window.", "",
        *setup_table(result.setups), "", *ratios(result), "",
    ]  # fmt: skip
    for setup in result.setups:
        failures = {t: c for t, c in setup.outcome_codes.items() if c}
        if failures:
            lines.append(f"- {setup.name} failures: {failures}")
    if result.weighted is not None:
        w = result.weighted
        lines += ["", "## Scenario 2: weights, both backlogged", "", w.description + ".", "", *setup_table([w]), ""]
    lines += ["## Targets", "", *targets_table(result.targets), "", f"Wall time {result.wall_s:.0f} s."]
    return "\n".join(lines)
