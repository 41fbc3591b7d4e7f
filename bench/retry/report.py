"""The retry report: a table a set-up, the ratios computed / fixed, the synchronization of the retries, the arrival histogram, the verdicts."""

from __future__ import annotations

from collections.abc import Sequence

from bench.harness.report import Target, md_table, targets_table
from bench.retry.measure import Result
from bench.retry.stats import SetupNumbers, Synchrony, ratio

BINS_PER_ROW = 4  # the histogram's rows: one a second of 250 ms bins


def _setup(setups: Sequence[SetupNumbers], name: str) -> SetupNumbers | None:
    return next((s for s in setups if s.name == name), None)


def comparisons(setups: Sequence[SetupNumbers]) -> dict[str, float]:
    """computed / fixed of each figure the targets read; empty where either set-up is missing."""
    computed, fixed = _setup(setups, "computed"), _setup(setups, "fixed")
    if computed is None or fixed is None or computed.retry_synchrony is None or fixed.retry_synchrony is None:
        return {}
    return {
        "second rejections per admitted": ratio(computed.second_rejections_per_admitted, fixed.second_rejections_per_admitted),
        "attempts per logical request": ratio(computed.attempts_per_logical, fixed.attempts_per_logical),
        "succeeded": ratio(computed.succeeded, fixed.succeeded),
        "time to success P50": ratio(computed.success_p50_s, fixed.success_p50_s),
        "time to success P99": ratio(computed.success_p99_s, fixed.success_p99_s),
        "retries' peak / mean per bin": ratio(computed.retry_synchrony.peak_to_mean, fixed.retry_synchrony.peak_to_mean),
        "retries' index of dispersion": ratio(computed.retry_synchrony.dispersion, fixed.retry_synchrony.dispersion),
        "retries' Allan factor": ratio(computed.retry_synchrony.allan, fixed.retry_synchrony.allan),
    }


def targets(setups: Sequence[SetupNumbers]) -> list[Target]:
    """The issue's three comparisons (it gives no bound): each met where computed does better than fixed."""
    computed, fixed = _setup(setups, "computed"), _setup(setups, "fixed")
    if computed is None or fixed is None or computed.retry_synchrony is None or fixed.retry_synchrony is None:
        return []
    cs, fs = computed.retry_synchrony, fixed.retry_synchrony
    return [
        Target(
            "second rejections per admitted request", "computed < fixed",
            f"{computed.second_rejections_per_admitted:.3f} vs {fixed.second_rejections_per_admitted:.3f} "
            f"({ratio(computed.second_rejections_per_admitted, fixed.second_rejections_per_admitted):.2f}x)",
            computed.second_rejections_per_admitted < fixed.second_rejections_per_admitted,
        ),
        Target(
            "P99 time to success", "computed <= fixed",
            f"{computed.success_p99_s:.2f} s vs {fixed.success_p99_s:.2f} s ({ratio(computed.success_p99_s, fixed.success_p99_s):.2f}x)",
            computed.success_p99_s <= fixed.success_p99_s,
        ),
        Target(
            "no synchronized retry waves", "computed's retries less bunched than fixed's (Allan factor per bin, 1 = Poisson)",
            f"Allan factor {cs.allan:.2f} vs {fs.allan:.2f}; echo {cs.echo:.2f} at {cs.echo_lag_s:g} s vs {fs.echo:.2f} at {fs.echo_lag_s:g} s",
            cs.allan < fs.allan,
        ),
    ]  # fmt: skip


def _synchrony_row(name: str, what: str, s: Synchrony | None) -> list[object]:
    if s is None:
        return [name, what, *["-"] * 7]
    return [name, what, f"{s.mean:.2f}", f"{s.peak_to_mean:.2f}", f"{s.cv:.2f}", f"{s.dispersion:.2f}", f"{s.allan:.2f}",
            f"{s.autocorrelation:.2f}", f"{s.echo:.2f} at {s.echo_lag_s:g} s"]  # fmt: skip


def histogram_lines(setups: Sequence[SetupNumbers], start: float, width: float) -> list[str]:
    """One row a second: each set-up's first attempts + retried attempts in each of its bins."""
    rows: list[list[object]] = []
    longest = max((len(s.first_bins) for s in setups), default=0)
    for at in range(0, longest, BINS_PER_ROW):
        row: list[object] = [f"{start + at * width:g}"]
        for s in setups:
            row.append(
                " ".join(
                    f"{f}+{r}" for f, r in zip(s.first_bins[at : at + BINS_PER_ROW], s.retry_bins[at : at + BINS_PER_ROW], strict=True)
                )
            )
        rows.append(row)
    return md_table(["t (s)", *(f"{s.name}: first+retried per {width * 1000:g} ms bin" for s in setups)], rows)


def render(result: Result) -> str:
    """The markdown report (printed, and written beside the JSON)."""
    lines = ["# bench retry: clients that honour Retry-After, 1.5x overload, computed vs fixed hint", ""]
    lines += ["Command: `" + " ".join(result.command) + "`", "", f"Code: {result.code}; wall {result.wall_s:.0f} s; "
              f"load average (1/5/15 min) start {_loads(result, 'start')}, end {_loads(result, 'end')} (2 shared cores)", ""]  # fmt: skip
    lines += ["## Parameters", "", *md_table(["", "value"], result.parameters.items()), ""]
    rows = [
        [s.name, s.logical, s.succeeded, s.gave_up, s.errors, s.cut, f"{s.attempts_per_logical:.2f}", s.admitted, s.first_rejections,
         s.second_rejections, f"{s.second_rejections_per_admitted:.3f}", f"{s.success_p50_s:.2f}", f"{s.success_p99_s:.2f}",
         ", ".join(f"{k}: {v}" for k, v in s.refusals.items()), ", ".join(f"{k} s: {v}" for k, v in s.hints.items())]
        for s in result.setups
    ]  # fmt: skip
    header = ["set-up", "logical", "succeeded", "gave up", "errors", "cut", "attempts / logical", "admitted", "1st rejections",
              "2nd rejections", "2nd rej. / admitted", "success P50 s", "success P99 s", "refusals by status", "Retry-After given"]  # fmt: skip
    lines += ["## Per set-up (logical requests arriving in the counted window; times real s)", "", *md_table(header, rows), ""]
    lines += ["Admitted: attempts answered 200; 2nd rejections: retried attempts refused (429 / 503). `Retry-After` goes out in whole "
              "seconds, rounded up: the last column shows where the hints' spread lands.", ""]  # fmt: skip
    lines += [
        "## computed / fixed",
        "",
        *md_table(["figure", "ratio"], ((k, f"{v:.2f}") for k, v in comparisons(result.setups).items())),
        "",
    ]
    sync = [
        row
        for s in result.setups
        for row in (_synchrony_row(s.name, "retried", s.retry_synchrony), _synchrony_row(s.name, "all", s.all_synchrony))
    ]
    lines += ["## Synchronization (attempts per bin in the counted window)", "",
              *md_table(["set-up", "attempts", "mean / bin", "peak / mean", "CV", "var / mean", "Allan factor", "autocorr. at 1 s", "echo (detrended)"], sync), ""]  # fmt: skip
    lines += ["## Targets", "", *targets_table(result.targets), ""]
    lines += ["## Arrival histogram (attempts leaving the clients)", "", *histogram_lines(result.setups, result.window_start, result.bin_s)]
    return "\n".join(lines)


def _loads(result: Result, when: str) -> str:
    return "/".join(f"{v:.2f}" for v in result.load_average.get(when, []))
