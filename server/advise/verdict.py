"""advise's verdict: every candidate simulated beside the two baselines, judged against the bounds, one recommended.

The recommendation is the best long goodput among candidates whose short E2E
P99 is within ``E2E_BOUND`` x the short-only ideal's and short TTFT P99
within ``TTFT_BOUND`` x; if none is, the candidate that misses those bounds
by the least.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .candidates import Candidate, candidate_config, candidate_setup, candidates, shared_setup, stall_ms
from .fleet import Fleet
from .prefixes import Seen, Sharing, with_prefixes
from .replay.fleet import Arrival
from .simulate import Progress, Stats, empty_stats, run_all
from .traffic import fit

E2E_BOUND = 1.25  # short E2E P99 at most this times the ideal's
TTFT_BOUND = 2.0  # short TTFT P99 at most this times the ideal's


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    stats: Stats
    e2e_ratio: float  # short E2E P99 / the ideal's
    ttft_ratio: float
    goodput_ratio: float  # long goodput / shared round robin's
    stall_ms: float

    @property
    def meets(self) -> bool:
        """Within both bounds; traffic without a short request has nothing to bound (its ratios are NaN)."""
        if math.isnan(self.e2e_ratio) and math.isnan(self.ttft_ratio):
            return True
        return self.e2e_ratio <= E2E_BOUND and self.ttft_ratio <= TTFT_BOUND

    @property
    def miss(self) -> float:
        """How far outside the bounds, as a multiple of the tighter one (<= 1: within)."""
        return max(self.e2e_ratio / E2E_BOUND, self.ttft_ratio / TTFT_BOUND)


@dataclass
class Advice:
    fleet: Fleet
    arrivals: int
    dropped: int
    seconds: float  # of arrivals replayed
    ideal: Stats
    shared: Stats
    predictions: list[Prediction]
    recommended: Prediction
    met: bool  # the recommendation meets both bounds
    wall_s: float = 0.0
    source: str = ""
    sharing: Sharing | None = None  # what the replay modelled of the prefix cache; None: every prompt unique
    short_share: float = math.nan  # of the requests replayed, those short by the file's thresholds
    short_token_share: float = math.nan  # of their prompt + max_tokens (where the replay knows both)


def _ratio(value: float, base: float) -> float:
    if math.isnan(value) or math.isnan(base):
        return math.nan
    if base <= 0:
        return math.inf if value > 0 else 1.0
    return value / base


def recommend(predictions: Sequence[Prediction]) -> tuple[Prediction, bool]:
    """The best long goodput within the bounds (ties: lower short P99); else the least miss.

    A lending candidate whose lending changes nothing predicts the same as its
    static split; the static one is preferred then (it has fewer settings).
    """
    within = [p for p in predictions if p.meets]
    if within:
        best = max(within, key=lambda p: (round(p.stats.long_goodput, 9), -p.stats.short_e2e_p99, not p.candidate.lends))
        return best, True
    return min(predictions, key=lambda p: (p.miss, -p.stats.long_goodput, p.candidate.lends)), False


def replayable(fleet: Fleet, arrivals: Sequence[Arrival]) -> tuple[list[Arrival], list[int]]:
    """The arrivals every candidate replays (``traffic.fit``: those the router's caps take), and their places in ``arrivals``."""
    return fit(arrivals, candidate_config(fleet, Candidate(1, fleet.engines - 1, "static")))


def advise(
    fleet: Fleet,
    arrivals: Sequence[Arrival],
    *,
    seen: Sequence[Seen] | None = None,
    assume_tokens: int = 0,
    jobs: int = 1,
    seconds: float = math.nan,
    source: str = "",
    layouts: Callable[[Fleet], list[Candidate]] | None = None,
    progress: Progress | None = None,
) -> Advice:
    """Simulate the baselines and every candidate on ``arrivals``; pick one.

    ``seen`` (one per arrival: its prefix group and cached tokens) has the
    replay share prefixes as the log says they were shared (``prefixes``),
    ``assume_tokens`` per group that reported none; without it every prompt is unique.
    ``layouts`` gives the candidates (default ``candidates``); ``progress``
    hears of each set-up replayed (``simulate.run_all``).
    """
    started = time.perf_counter()
    kept, places = replayable(fleet, arrivals)
    dropped, sharing = len(arrivals) - len(kept), None
    if seen is not None:
        kept, sharing = with_prefixes(kept, [seen[i] for i in places], assume_tokens)
    found = (layouts or candidates)(fleet)
    setups = [shared_setup(fleet), dataclasses.replace(shared_setup(fleet, "short-only ideal"), kinds=("short",))]
    if not any(a.kind == "short" for a in kept):  # nothing to protect: the candidates differ by long goodput alone
        setups.pop()
    setups += [candidate_setup(fleet, c) for c in found]
    shared, *results = run_all(setups, kept, jobs, progress)
    ideal, rest = (results[0], results[1:]) if len(setups) == len(found) + 2 else (empty_stats(), results)
    predictions = [
        Prediction(
            c,
            s,
            _ratio(s.short_e2e_p99, ideal.short_e2e_p99),
            _ratio(s.short_ttft_p99, ideal.short_ttft_p99),
            _ratio(s.long_goodput, shared.long_goodput),
            stall_ms(fleet, c),
        )
        for c, s in zip(found, rest)
    ]
    best, met = recommend(predictions)
    span = kept[-1].at if kept else 0.0
    window = span if math.isnan(seconds) else min(span, seconds)
    advice = Advice(fleet, len(kept), dropped, window, ideal, shared, predictions, best, met, time.perf_counter() - started, source, sharing)
    advice.short_share, advice.short_token_share = class_shares(kept)
    return advice


def class_shares(arrivals: Sequence[Arrival]) -> tuple[float, float]:
    """The share of ``arrivals`` that are short, and of their tokens (prompt + max_tokens, where known; NaN if none is)."""
    if not arrivals:
        return math.nan, math.nan
    short = sum(a.kind == "short" for a in arrivals) / len(arrivals)
    sized = [(a.kind, a.prompt_tokens + a.max_tokens) for a in arrivals if a.prompt_tokens is not None and a.max_tokens is not None]
    total = sum(tokens for _, tokens in sized)
    return short, (sum(tokens for kind, tokens in sized if kind == "short") / total if total else math.nan)
