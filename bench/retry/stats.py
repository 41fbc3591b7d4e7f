"""A set-up's numbers from its logical requests: fates, attempts, second rejections, time to success, the arrival histogram.

Synchronization is read off the per-bin counts of retried attempts in the
counted window: a Poisson stream has a variance-to-mean ratio (index of
dispersion) of 1 and no correlation between bins; retries that come back
together pile into a few bins (a high peak-to-mean and dispersion), and a
hint echoes each pile one hint later (correlation at that lag). A retry
rate that still grows in the window (long hints fill the retry population
slowly) inflates the variance without any wave, so the verdict reads the
Allan factor instead (the mean squared difference of neighbouring bins over
twice the mean: 1 for Poisson, blind to slow drift), and the echo is the
autocorrelation's peak after a moving average is taken out.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.retry.model import REFUSED
from bench.retry.sdk import Logical
from tailguard.server.advise.replay.mix import percentile


def histogram(times: Sequence[float], start: float, end: float, width: float) -> list[int]:
    """Counts of ``times`` per bin of ``width`` over [start, end) (the last bin may be partial); times outside are dropped."""
    bins = [0] * max(0, math.ceil((end - start) / width - 1e-9))
    for t in times:
        index = math.floor((t - start) / width)
        if start <= t < end and 0 <= index < len(bins):
            bins[index] += 1
    return bins


ECHO_LAGS_S = (0.5, 6.0)  # where an echo is looked for: past the next bins, up to the longest hint this pool gives
TREND_S = 5.0  # the moving average taken out before the echo is looked for


@dataclass(frozen=True)
class Synchrony:
    """How bunched a count series is: peak / mean, CV, variance / mean, the Allan factor, its correlation at a lag and its echo."""

    mean: float
    peak_to_mean: float
    cv: float
    dispersion: float  # variance / mean: 1 for Poisson
    allan: float  # mean (next bin - this bin)^2 / (2 mean): 1 for Poisson, blind to a slow trend
    lag_s: float
    autocorrelation: float  # between the counts and themselves ``lag_s`` later
    echo: float  # the detrended autocorrelation's peak over ECHO_LAGS_S
    echo_lag_s: float


def synchrony(counts: Sequence[int], width: float, lag_s: float) -> Synchrony:
    """``Synchrony`` of ``counts`` (bins of ``width`` s); NaN where there are no counts or too few bins for the lag."""
    n = len(counts)
    mean = sum(counts) / n if n else math.nan
    if not n or mean == 0:
        return Synchrony(mean, math.nan, math.nan, math.nan, math.nan, lag_s, math.nan, math.nan, math.nan)
    variance = sum((c - mean) ** 2 for c in counts) / n
    steps = [(b - a) ** 2 for a, b in itertools.pairwise(counts)]
    allan = sum(steps) / len(steps) / (2 * mean) if steps else math.nan
    residual = detrended(counts, round(TREND_S / width / 2))
    lags = range(max(1, round(ECHO_LAGS_S[0] / width)), round(ECHO_LAGS_S[1] / width) + 1)
    echoes = [(autocorrelation(residual, lag), lag * width) for lag in lags]
    echo, echo_lag = max(((e, at) for e, at in echoes if not math.isnan(e)), default=(math.nan, math.nan))
    return Synchrony(
        mean, max(counts) / mean, math.sqrt(variance) / mean, variance / mean, allan,
        lag_s, autocorrelation(counts, round(lag_s / width)), echo, echo_lag,
    )  # fmt: skip


def detrended(counts: Sequence[float], half: int) -> list[float]:
    """``counts`` less their centred moving average over ``half`` bins each side (fewer at the ends)."""
    out: list[float] = []
    for i, c in enumerate(counts):
        around = counts[max(0, i - half) : i + half + 1]
        out.append(c - sum(around) / len(around))
    return out


def autocorrelation(counts: Sequence[float], lag: int) -> float:
    """The sample autocorrelation of ``counts`` at ``lag`` bins; NaN for a flat series or a lag past its length."""
    n = len(counts)
    if lag <= 0 or lag >= n:
        return math.nan
    mean = sum(counts) / n
    variance = sum((c - mean) ** 2 for c in counts)
    if variance == 0:
        return math.nan
    return sum((counts[i] - mean) * (counts[i + lag] - mean) for i in range(n - lag)) / variance


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN where either is NaN or the denominator is 0."""
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator


@dataclass
class SetupNumbers:
    """One set-up's numbers over the logical requests that arrived in the counted window (times in real s)."""

    name: str
    logical: int
    succeeded: int
    gave_up: int
    errors: int
    cut: int
    attempts: int
    admitted: int  # attempts answered 200
    first_rejections: int  # first attempts refused (429/503)
    second_rejections: int  # retried attempts refused
    second_rejections_per_admitted: float
    attempts_per_logical: float
    success_p50_s: float
    success_p99_s: float
    hints: dict[str, int]  # Retry-After header value -> count, over the refusals
    refusals: dict[int, int]  # status (429 queue_full, 503 queue_timeout or refused at arrival) -> count
    first_bins: list[int] = field(default_factory=list)  # first attempts per bin of the counted window
    retry_bins: list[int] = field(default_factory=list)  # retried attempts per bin
    retry_synchrony: Synchrony | None = None
    all_synchrony: Synchrony | None = None  # of every attempt, first and retried


def summarise(name: str, logicals: Sequence[Logical], window: tuple[float, float], width: float, lag_s: float) -> SetupNumbers:
    """The numbers of the logical requests that arrived in ``window``; the histogram of every attempt sent in it."""
    counted = [r for r in logicals if window[0] <= r.arrived < window[1]]
    attempts = [a for r in counted for a in r.attempts]
    outcomes = Counter(r.outcome for r in counted)
    admitted = sum(a.status == 200 for a in attempts)
    second = sum(a.retry > 0 and a.status in REFUSED for a in attempts)
    to_success = sorted(r.ended - r.arrived for r in counted if r.outcome == "ok")
    everything = [a for r in logicals for a in r.attempts]
    first = histogram([a.sent for a in everything if a.retry == 0], *window, width)
    retried = histogram([a.sent for a in everything if a.retry > 0], *window, width)
    return SetupNumbers(
        name=name, logical=len(counted), succeeded=outcomes["ok"], gave_up=outcomes["gave_up"], errors=outcomes["error"],
        cut=outcomes["cut"], attempts=len(attempts), admitted=admitted,
        first_rejections=sum(a.retry == 0 and a.status in REFUSED for a in attempts), second_rejections=second,
        second_rejections_per_admitted=ratio(second, admitted), attempts_per_logical=ratio(len(attempts), len(counted)),
        success_p50_s=percentile(to_success, 50), success_p99_s=percentile(to_success, 99),
        hints=dict(sorted(Counter(str(a.retry_after) for a in attempts if a.status in REFUSED).items(), key=lambda kv: (len(kv[0]), kv[0]))),
        refusals=dict(sorted(Counter(a.status for a in attempts if a.status in REFUSED).items())),
        first_bins=first, retry_bins=retried, retry_synchrony=synchrony(retried, width, lag_s),
        all_synchrony=synchrony([f + r for f, r in zip(first, retried, strict=True)], width, lag_s),
    )  # fmt: skip
