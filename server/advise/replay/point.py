"""One point of a replay: a set-up under a schedule of arrivals, in its own Trio run under a MockClock, and its numbers.

``play`` sends the arrivals on time through an open fleet; ``run_point``
runs a whole point (a process pool calls it) and ``summarize`` turns its
records into per-class figures.
"""

from __future__ import annotations

import functools
import gc
import importlib
import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

import trio
import trio.testing

from tailguard.router.config import ObjectiveConfig, load_config
from tailguard.server import SHIPPED_CONFIG

from .fleet import Arrival, Fleet, Record, open_fleet, poisson, send
from .mix import LONG_MAX_TOKENS, SHORT_MAX_TOKENS, percentile
from .rebalancing import Rebalancing
from .setups import Setup

MAX_TOKENS = {"short": SHORT_MAX_TOKENS, "long": LONG_MAX_TOKENS}
OUTCOMES = ("ok", "429", "503", "timeout", "error", "unfinished")
GC_THRESHOLDS = (50_000, 20, 1_000)  # gen0 allocations, gen1 and gen2 collection ratios


@dataclass(frozen=True)
class Point:
    """What to run: a set-up under a load, in which window, with which seed."""

    setup: Setup
    load: float
    rate: float  # req/s offered (all kinds; kinds not sent are skipped)
    warmup: float
    seconds: float
    seed: int
    arrivals: tuple[Arrival, ...] | None = None  # a fixed schedule (replays); else Poisson


@dataclass
class ClassStats:
    kind: str
    n: int
    ok: int
    outcomes: dict[str, int]
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    goodput_rps: float  # ok requests per simulated second of the window
    goodput_tokens_per_s: float  # their output tokens per simulated second
    # Requests that met their kind's objective (``shipped_objectives``): failures and refusals missed it.
    attained: int = 0

    @property
    def attainment(self) -> float:
        """The share of the class's requests that met its objective (NaN without requests)."""
        return self.attained / self.n if self.n else math.nan


@dataclass
class PointResult:
    setup: str
    load: float
    rate: float
    warmup_s: float
    window_s: float
    seed: int
    arrivals: int  # measured: arrived inside the window
    requests: int  # sent in all: warm-up, window and the traffic that goes on until the window's requests end
    simulated_s: float
    wall_s: float
    cpu_s: float
    preemptions: int
    classes: list[ClassStats] = field(default_factory=list)
    prefix_cache_queries: int = 0  # prompt tokens looked up, all engines (vllm:prefix_cache_queries)
    prefix_cache_hits: int = 0  # of them, found cached
    rebalancing: Rebalancing | None = None  # what rebalancing did, when the set-up rebalances

    def stats(self, kind: str) -> ClassStats | None:
        return next((c for c in self.classes if c.kind == kind), None)

    @property
    def prefix_hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens looked up (what vLLM's two counters give); NaN if none."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else math.nan


class _Books:
    """Records, and how many measured requests are still running."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.open_measured = 0
        self.sent = 0

    def book(self, arrival: Arrival) -> Record:
        """Count an arrival as it is due, before its task runs: ``play`` must not end while it waits to start."""
        self.sent += 1
        record = Record(arrival.kind, arrival.measured, at=arrival.at)
        if arrival.measured:
            self.records.append(record)
            self.open_measured += 1
        return record

    async def run(self, fleet: Fleet, arrival: Arrival, record: Record) -> None:
        try:
            await send(fleet, arrival, record)
        finally:
            if arrival.measured:
                self.open_measured -= 1


class _Feed:
    """Starts each arrival's request at its time, from a Timeline callback (no sleeping task)."""

    def __init__(self, fleet: Fleet, arrivals: Iterable[Arrival], kinds: tuple[str, ...], window_end: float, nursery: trio.Nursery) -> None:
        self._fleet = fleet
        self._arrivals = iter(arrivals)
        self._kinds = kinds
        self._window_end = window_end
        self._nursery = nursery
        self._base = trio.current_time()
        self.books = _Books()
        self.fed = trio.Event()

    def next(self) -> None:
        """Set a timer for the next arrival, or stop once the window has passed and its requests ended."""
        arrival = next(self._arrivals, None)
        if arrival is None or (arrival.at >= self._window_end and self.books.open_measured == 0):
            self.fed.set()
            return
        self._fleet.timeline.call_at(self._base + arrival.at, partial(self._due, arrival))

    def _due(self, arrival: Arrival) -> None:
        if arrival.kind in self._kinds:
            self._nursery.start_soon(self.books.run, self._fleet, arrival, self.books.book(arrival))
        self.next()


async def play(fleet: Fleet, arrivals: Iterable[Arrival], kinds: tuple[str, ...], window_end: float) -> _Books:
    """Send arrivals on time until the window has passed and every measured request has ended.

    Traffic keeps flowing after the window (unmeasured), so the window's last
    requests finish under the same load as its first; a finite schedule (a
    replay) simply ends, as the real-time run did. Every measured request
    ends within the caller's deadline, so this ends E2E_TIMEOUT after the window
    at the latest.
    """
    async with trio.open_nursery() as nursery:
        feed = _Feed(fleet, arrivals, kinds, window_end, nursery)
        feed.next()
        await feed.fed.wait()
        # Polled in 0.1 s steps of virtual time, not woken by an event: where a point stops (its
        # simulated_s, the unmeasured traffic its engines still served) is part of every recorded result.
        while feed.books.open_measured:  # noqa: ASYNC110
            await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    return feed.books


@functools.cache
def shipped_objectives() -> dict[str, ObjectiveConfig]:
    """Each kind of request judged by the shipped config's promise: short ones by its first class's (the
    interactive one), long ones by its catch-all's. The same for every placement compared."""
    classes = load_config(SHIPPED_CONFIG).classes
    return {"short": classes[0].objective, "long": classes[-1].objective}


def met(record: Record, objective: ObjectiveConfig) -> bool:
    """Whether a request met ``objective``: served, and within every target it states (as router/observe/attainment.py judges)."""
    if record.outcome != "ok" or record.e2e is None or record.e2e > objective.e2e:
        return False
    if objective.ttft is not None and (record.ttft is None or record.ttft > objective.ttft):
        return False
    if objective.itl is not None and record.ttft is not None and record.tokens >= 2:
        return (record.e2e - record.ttft) / (record.tokens - 1) <= objective.itl
    return True


def summarize(records: Sequence[Record], kind: str, seconds: float) -> ClassStats:
    mine = [r for r in records if r.kind == kind]
    objective = shipped_objectives()[kind]
    ok = [r for r in mine if r.outcome == "ok"]
    ttft = sorted(r.ttft for r in ok if r.ttft is not None)
    e2e = sorted(r.e2e for r in ok if r.e2e is not None)
    outcomes = {name: sum(r.outcome == name for r in mine) for name in OUTCOMES}
    return ClassStats(
        kind=kind,
        n=len(mine),
        ok=len(ok),
        outcomes={k: v for k, v in outcomes.items() if v},
        ttft_p50_ms=percentile(ttft, 50) * 1000,
        ttft_p99_ms=percentile(ttft, 99) * 1000,
        e2e_p50_ms=percentile(e2e, 50) * 1000,
        e2e_p99_ms=percentile(e2e, 99) * 1000,
        goodput_rps=len(ok) / seconds,
        goodput_tokens_per_s=len(ok) * MAX_TOKENS[kind] / seconds,
        attained=sum(met(r, objective) for r in ok),
    )


async def _run_point(point: Point, clock: trio.testing.MockClock) -> PointResult:
    arrivals: Iterable[Arrival] = point.arrivals or poisson(point.rate, point.warmup, point.seconds, point.seed)
    start = trio.current_time()
    async with open_fleet(point.setup, point.seed, clock) as fleet:
        books = await play(fleet, arrivals, point.setup.kinds, point.warmup + point.seconds)
        engine_stats = [e.statistics() for e in fleet.engines.values()]
        moved = None if fleet.rebalancing is None else fleet.rebalancing.result()
    records = books.records
    return PointResult(
        setup=point.setup.name,
        load=point.load,
        rate=point.rate,
        warmup_s=point.warmup,
        window_s=point.seconds,
        seed=point.seed,
        arrivals=len(records),
        requests=books.sent,
        simulated_s=trio.current_time() - start,
        wall_s=0.0,
        cpu_s=0.0,
        preemptions=sum(s.preemptions for s in engine_stats),
        classes=[summarize(records, kind, point.seconds) for kind in point.setup.kinds],
        prefix_cache_queries=sum(s.prefix_cache_queries for s in engine_stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in engine_stats),
        rebalancing=moved,
    )


def run_point(point: Point) -> PointResult:
    """Run one point in its own Trio run under a fresh MockClock (a process pool calls this).

    The cyclic garbage collector is set to run rarely: an hour's records are
    hundreds of thousands of live objects that every full collection would
    walk again, for the few cycles a run makes.
    """
    started, cpu = time.perf_counter(), time.process_time()
    seed_trio_scheduler(point.seed)
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        clock = trio.testing.MockClock(autojump_threshold=0)
        result = trio.run(_run_point, point, clock, clock=clock)
    finally:
        gc.set_threshold(*thresholds)
    result.wall_s = time.perf_counter() - started
    result.cpu_s = time.process_time() - cpu
    return result


def seed_trio_scheduler(seed: int) -> None:
    """Seed the private RNG Trio orders same-instant wake-ups by, so that a routed point repeats exactly.

    Trio reverses each batch of runnable tasks at random (so that no task
    relies on an order); in a benchmark that is noise between runs of one
    seed: tailguard shared's long E2E P99 on Mooncake moved 1.02x-1.26x
    round robin's over six runs. A Trio without that RNG is left as it is.
    """
    scheduler = getattr(importlib.import_module("trio._core._run"), "_r", None)
    if isinstance(scheduler, random.Random):
        scheduler.seed(seed)


def is_nan(value: float) -> bool:
    return isinstance(value, float) and math.isnan(value)
