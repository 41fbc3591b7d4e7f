"""Each set-up replayed in virtual time, and the numbers advise predicts from its requests' fates.

One Trio run under a MockClock per set-up (``simulate``), seeded so advice
repeats; ``run_all`` runs set-ups in forked processes. ``stats_of`` turns
fates, simulated or measured, into short E2E and TTFT P99 (a failed short
request counts as infinitely slow) and long goodput. A run of many set-ups
can take minutes, so ``run_all`` reports each one done (``Progress``).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import multiprocessing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import trio
import trio.testing

from .replay.fleet import Arrival, Record, open_fleet
from .replay.mix import percentile
from .replay.point import GC_THRESHOLDS, play, seed_trio_scheduler
from .replay.setups import Setup

SEED = 1

Progress = Callable[[int, int], None]  # (set-ups replayed, of how many): called before the first and after each


@dataclass(frozen=True)
class Run:
    """One set-up's simulation: every arrival's record, and its engines' prefix-cache counters summed."""

    records: list[Record]
    prefix_queries: int  # prompt tokens looked up (vllm:prefix_cache_queries)
    prefix_hits: int  # of them, found cached


def simulate(setup: Setup, arrivals: Sequence[Arrival]) -> Run:
    """Every arrival's fate under ``setup``, in one Trio run under a MockClock (virtual time)."""

    async def run(clock: trio.testing.MockClock) -> Run:
        window_end = (arrivals[-1].at if arrivals else 0.0) + 1.0
        async with open_fleet(setup, SEED, clock) as fleet:
            books = await play(fleet, arrivals, setup.kinds, window_end)
            engines = [e.statistics() for e in fleet.engines.values()]
        return Run(books.records, sum(e.prefix_cache_queries for e in engines), sum(e.prefix_cache_hits for e in engines))

    seed_trio_scheduler(SEED)  # the same-instant wake-up order too: advice that repeats (fleet.seed_trio_scheduler)
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        clock = trio.testing.MockClock(autojump_threshold=0)
        return trio.run(run, clock, clock=clock)
    finally:
        gc.set_threshold(*thresholds)


@dataclass(frozen=True)
class Fate:
    """One request's outcome, GPU seconds from the trace's start."""

    kind: str
    at: float
    ok: bool
    ttft: float | None
    e2e: float | None


@dataclass(frozen=True)
class Stats:
    """A set-up's numbers on the trace, GPU seconds."""

    short_n: int
    short_failed: int
    short_e2e_p99: float  # inf when more than 1% of short requests failed
    short_ttft_p99: float
    long_n: int
    long_ok: int
    long_goodput: float  # long requests finished ok per second, from the trace's start to the last one's end
    prefix_queries: int = 0  # the engines' prompt tokens looked up in their prefix caches (simulated only)
    prefix_hits: int = 0  # of them, found cached
    long_e2e_p99: float = math.nan  # failed long requests count as infinitely slow (advise's threshold search judges by it)

    @property
    def prefix_hit_rate(self) -> float:
        """Cached prompt tokens over those looked up, all engines (vLLM's two counters); NaN if none."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else math.nan


def _p99(values: Iterable[float | None], failed: int) -> float:
    return percentile(sorted([v for v in values if v is not None] + [math.inf] * failed), 99)


def empty_stats() -> Stats:
    """The short-only ideal of traffic without a short request: every figure NaN, so no ratio bounds anything."""
    return stats_of([])


def stats_of(fates: Sequence[Fate]) -> Stats:
    """The numbers advise predicts, from fates simulated or measured (``bench tail --samples``)."""
    short = [f for f in fates if f.kind == "short"]
    ok_short = [f for f in short if f.ok]
    failed = len(short) - len(ok_short)
    ok_long = [f for f in fates if f.kind == "long" and f.ok and f.e2e is not None]
    end = max((f.at + (f.e2e or 0.0) for f in ok_long), default=0.0)
    return Stats(
        short_n=len(short),
        short_failed=failed,
        short_e2e_p99=_p99((f.e2e for f in ok_short), failed),
        short_ttft_p99=_p99((f.ttft for f in ok_short), failed),
        long_n=sum(1 for f in fates if f.kind == "long"),
        long_ok=len(ok_long),
        long_goodput=len(ok_long) / end if end > 0 else 0.0,
        long_e2e_p99=_p99((f.e2e for f in ok_long), sum(1 for f in fates if f.kind == "long") - len(ok_long)),
    )


def fates_of(records: Sequence[Record]) -> list[Fate]:
    return [Fate(r.kind, r.at, r.outcome == "ok", r.ttft, r.e2e) for r in records]


def _run_one(item: tuple[Setup, Sequence[Arrival]]) -> Stats:
    setup, arrivals = item
    run = simulate(setup, arrivals)
    return dataclasses.replace(stats_of(fates_of(run.records)), prefix_queries=run.prefix_queries, prefix_hits=run.prefix_hits)


def run_all(setups: Sequence[Setup], arrivals: Sequence[Arrival], jobs: int, progress: Progress | None = None) -> list[Stats]:
    """Each set-up's stats, in ``jobs`` processes (forked) when more than one; ``progress`` hears of each as it ends."""
    shorts = [dataclasses.replace(a, index=i) for i, a in enumerate(a for a in arrivals if a.kind == "short")]
    items = [(s, shorts if s.kinds == ("short",) else arrivals) for s in setups]
    report = progress or (lambda done, total: None)
    found: list[Stats] = []
    report(0, len(items))
    if jobs <= 1:
        for item in items:
            found.append(_run_one(item))
            report(len(found), len(items))
        return found
    with multiprocessing.get_context("fork").Pool(min(jobs, len(items))) as pool:
        for stats in pool.imap(_run_one, items, chunksize=1):  # in order, each as soon as it and those before it are done
            found.append(stats)
            report(len(found), len(items))
    return found
