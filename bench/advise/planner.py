"""``tailguard advise``: how many GPUs go to which pool, and whether to lend, predicted in virtual time.

It replays a recorded trace (``bench tail --record-trace``) or tailguard's own
JSON access log against the virtual-time fleet model that ``bench sweep`` also runs
(``tailguard.sim.virtual``: the real router core, ``Router.open`` with its
caps, queues and lending, in front of modelled engines under a MockClock),
once per candidate assignment of the fleet's engines:

- every static split of the N engines between the interactive pool and the
  batch pool (1..N-1 interactive engines), as ``bench tail``'s
  ``disaggregated`` set-up runs them: interactive engines with that pool's
  profile and per-endpoint cap, batch engines with the batch pool's;
- each split again with the interactive pool lending idle seats to batch
  requests (``[pools.interactive.lend]``) under a few rules, once also with
  the batch pool lending its idle seats back to interactive requests, and
  under the config file's own rules;
- and two baselines: round robin over N batch-profile engines with no router
  (``shared``), and the same without the long requests (the short-only ideal).

For each it predicts short E2E P99, short TTFT P99 (failed short requests
count as infinitely slow) and long goodput: long requests finished ok per
second, from the trace's start to the last one's end, also as a fraction of
``shared``'s. The recommendation is the best long goodput among candidates
whose short E2E P99 is within 1.25x the ideal's and short TTFT P99 within
2x; if none is, the candidate that misses those bounds by the least.

An access log is replayed with a first line saying how much of it was used:
lines read, used, and skipped for each reason (not JSON, not an access line,
a rejected request, no size, an unparseable time, outside the window), so an
operator can tell advice on their traffic from advice on a tenth of it.

The engines cache prefixes: requests the log (``prefix_group``,
``cached_tokens``) says shared a prefix replay with a shared text, placed as
one key (``prefixes``), and each candidate's predicted prefix hit rate is
reported; ``--no-prefix-cache`` replays every prompt unique.

Everything is in GPU seconds (the trace's own). Simulated time costs
nothing; a candidate costs ~0.1-0.2 ms of CPU a request.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio
import trio.testing

from tailguard.router.config import AuthConfig, Config, ConfigError, EndpointConfig, LendConfig, PoolConfig, load_config
from tailguard.server import SHIPPED_CONFIG
from tailguard.server.logs import ACCESS_LOGGER
from tailguard.sim import PROFILES
from tailguard.sim.params import EngineParams
from tailguard.sim.virtual.fleet import GC_THRESHOLDS, Arrival, Record, Setup, open_fleet, play, seed_trio_scheduler
from tailguard.sim.virtual.mix import CLASSES, percentile
from tailguard.sim.virtual.trace import MAX_ARRIVALS, read_trace

from .prefixes import Seen, Sharing, seen_in, with_prefixes

DEFAULT_SECONDS = 120.0  # of arrivals replayed, by default
MAX_SECONDS = 3600.0
E2E_BOUND = 1.25  # short E2E P99 at most this times the ideal's
TTFT_BOUND = 2.0  # short TTFT P99 at most this times the ideal's
MAX_ENGINES = 16
SEED = 1


# -- the fleet -------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolPlan:
    """One pool of the file, per engine: what an engine put in it runs and may take."""

    config: PoolConfig
    profile: str  # tailguard.sim profile of its engines (the pool's simulate_profile)
    seats: int  # max_concurrency of each endpoint
    queue: int  # max_queue per endpoint

    @property
    def params(self) -> EngineParams:
        return PROFILES[self.profile]


@dataclass(frozen=True)
class Fleet:
    """N engines and the two pools they may be split between, from a config file."""

    engines: int
    interactive: PoolPlan  # the first class's pool (short requests)
    batch: PoolPlan  # the catch-all class's pool
    base: Config
    urls: tuple[str, ...]  # the file's endpoint URLs, interactive's first (for the snippet)

    @property
    def short_class(self) -> str:
        return self.base.classes[0].name


def _plan(pool: PoolConfig) -> PoolPlan:
    endpoints = len(pool.endpoints)
    seats = pool.endpoints[0].max_concurrency if endpoints else PROFILES[pool.simulate_profile].max_num_seqs
    queue = math.ceil(pool.max_queue / endpoints) if endpoints else pool.max_queue
    return PoolPlan(pool, pool.simulate_profile, seats, queue)


def fleet_from(config: Config, engines: int | None) -> Fleet:
    """The fleet a config describes: its first class's pool and its catch-all's, and their engines.

    Raises ValueError when the config has no such two pools, or classes routed elsewhere.
    """
    first, last = config.classes[0], config.classes[-1]
    if first.pool == last.pool:
        raise ValueError(
            f"classes {first.name!r} and {last.name!r} share pool {first.pool!r}: advise splits engines between two pools"
        )
    stray = [k.name for k in config.classes if k.pool not in (first.pool, last.pool)]
    if stray:
        raise ValueError(f"classes {', '.join(stray)} use a third pool; advise splits engines between {first.pool!r} and {last.pool!r}")
    interactive, batch = config.pool(first.pool), config.pool(last.pool)
    urls = tuple(e.url for e in interactive.endpoints) + tuple(e.url for e in batch.endpoints)
    count = engines if engines is not None else len(urls)
    if not 2 <= count <= MAX_ENGINES:
        raise ValueError(f"{count} engines: advise splits 2 to {MAX_ENGINES} engines (give --engines)")
    return Fleet(count, _plan(interactive), _plan(batch), config, urls)


# -- candidates --------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """An assignment: engines per pool, what the interactive pool lends to batch, and what batch lends back."""

    interactive: int
    batch: int
    rule: str  # "static", "shared", or which lending rule
    lend: LendConfig = LendConfig()
    lend_back: LendConfig = LendConfig()
    shared: bool = False  # one pool of every engine (the batch pool's tuning), every class in it, short ones first

    @property
    def name(self) -> str:
        return "shared pool" if self.shared else f"{self.interactive}:{self.batch} {self.rule}"

    @property
    def lends(self) -> bool:
        return bool(self.lend.to or self.lend_back.to)


def _scaled(value: int | None, factor: float, floor: int) -> int | None:
    return None if value is None else max(floor, round(value * factor))


Rule = tuple[str, LendConfig, LendConfig]  # label, interactive's lend, batch's lend (back)


def lending_rules(fleet: Fleet, interactive: int) -> list[Rule]:
    """The lending rules tried for a split with ``interactive`` engines in the interactive pool.

    Fractions are of the interactive pool's seats; the prefill budget is
    half the lender's step budget (a borrowed prefill then stalls a step by
    at most half what a full chunk does). One rule also has the batch pool
    lend its idle seats back to interactive requests. The file's own rules
    are scaled from its endpoints to this split's.
    """
    plan, to, back = fleet.interactive, (fleet.batch.config.name,), (fleet.interactive.config.name,)
    seats = plan.seats * interactive
    none = LendConfig()
    one_way = [
        (f"lend {seats // 8}, keep {seats // 2}", LendConfig(to, max_seats=max(1, seats // 8), reserve=seats // 2)),
        (f"lend {seats // 2}, keep {seats // 4}", LendConfig(to, max_seats=max(1, seats // 2), reserve=seats // 4)),
        (
            f"lend {seats // 2}, keep {seats // 4}, prompt <= {plan.params.max_num_batched_tokens // 2}",
            LendConfig(to, max_seats=max(1, seats // 2), reserve=seats // 4, max_prompt_tokens=plan.params.max_num_batched_tokens // 2),
        ),
        ("lend any idle", LendConfig(to)),
    ]
    rules: list[Rule] = [(label, lend, none) for label, lend in one_way]
    rules.append((f"lend any idle, keep {seats // 16}; batch lends back", LendConfig(to, reserve=seats // 16), LendConfig(back)))
    own = (
        _scaled_lend(plan.config.lend, to, interactive, len(plan.config.endpoints), seats),
        _scaled_lend(fleet.batch.config.lend, back, fleet.engines - interactive, len(fleet.batch.config.endpoints), fleet.batch.seats * (fleet.engines - interactive)),
    )
    if (own[0].to or own[1].to) and all((lend, lend_back) != own for _, lend, lend_back in rules):
        rules.append(("config's lend", *own))
    return rules


def _scaled_lend(lend: LendConfig, to: tuple[str, ...], engines: int, file_endpoints: int, seats: int) -> LendConfig:
    """The file's ``lend`` of one pool for ``engines`` engines (seat counts scaled); nothing unless it lends to ``to``."""
    if not set(to) <= set(lend.to):
        return LendConfig()
    factor = engines / max(1, file_endpoints)
    reserve = min(seats - 1, _scaled(lend.reserve, factor, 0) or 0)
    return dataclasses.replace(lend, to=to, max_seats=_scaled(lend.max_seats, factor, 1), reserve=reserve)


def shared_pool(fleet: Fleet) -> Candidate:
    """Every engine in the batch pool with its tuning, both classes in it, the interactive class queued first.

    No split: short requests gain only the queue order, long ones lose
    nothing to a smaller latency engine. On traffic that is mostly long
    (the Mooncake trace, ShareGPT lengths) it is the one layout measured
    never slower than round robin for either class (docs/pools.md).
    """
    return Candidate(0, fleet.engines, "shared", shared=True)


def candidates(fleet: Fleet) -> list[Candidate]:
    """The shared pool, every static split, and every split under every lending rule."""
    found: list[Candidate] = [shared_pool(fleet)]
    for interactive in range(1, fleet.engines):
        batch = fleet.engines - interactive
        found.append(Candidate(interactive, batch, "static"))
        found += [Candidate(interactive, batch, rule, lend, back) for rule, lend, back in lending_rules(fleet, interactive)]
    return found


def stall_ms(fleet: Fleet, candidate: Candidate) -> float:
    """The most one borrowed prefill adds to a step of the lender's engine (0: nothing lent).

    A prefill runs in chunks of at most the engine's step budget, so a
    borrower's prompt over it stalls several steps by the chunk's time each.
    """
    if not candidate.lend.to:
        return 0.0
    params = fleet.interactive.params
    budget = candidate.lend.max_prompt_tokens or params.max_num_batched_tokens
    return min(budget, params.max_num_batched_tokens) / params.prefill_tokens_per_ms


def engine_url(index: int) -> str:
    return f"http://gpu-{index}:8000"


def _pool_config(plan: PoolPlan, urls: Sequence[str], lend: LendConfig) -> PoolConfig:
    return dataclasses.replace(
        plan.config,
        endpoints=tuple(EndpointConfig(url, plan.seats) for url in urls),
        max_concurrency=plan.seats * len(urls),
        max_queue=plan.queue * len(urls),
        lend=lend,
        rebalance="off",
    )


def candidate_config(fleet: Fleet, candidate: Candidate) -> Config:
    """The file's config with its two pools replaced by the candidate's (no auth, nothing movable)."""
    urls = [engine_url(i) for i in range(fleet.engines)]
    if candidate.shared:
        pool = _pool_config(fleet.batch, urls, LendConfig())
        classes = tuple(dataclasses.replace(k, pool=pool.name) for k in fleet.base.classes)
        return dataclasses.replace(fleet.base, pools=(pool,), classes=classes, auth=AuthConfig(), digest="advise")
    pools = (
        _pool_config(fleet.interactive, urls[: candidate.interactive], candidate.lend),
        _pool_config(fleet.batch, urls[candidate.interactive :], candidate.lend_back),
    )
    return dataclasses.replace(fleet.base, pools=pools, auth=AuthConfig(), digest="advise")


def candidate_setup(fleet: Fleet, candidate: Candidate) -> Setup:
    urls = [engine_url(i) for i in range(fleet.engines)]
    engines = tuple((url, fleet.interactive.profile if i < candidate.interactive else fleet.batch.profile) for i, url in enumerate(urls))
    return Setup(candidate.name, engines, config=candidate_config(fleet, candidate), description=candidate.name)


def shared_setup(fleet: Fleet, name: str = "shared round robin") -> Setup:
    """Round robin over every engine, all with the batch pool's profile, no router."""
    urls = tuple(engine_url(i) for i in range(fleet.engines))
    return Setup(name, tuple((url, fleet.batch.profile) for url in urls), direct={kind: urls for kind in CLASSES})


# -- the traffic ---------------------------------------------------------------------------


def arrivals_from_trace(path: Path, seconds: float) -> list[Arrival]:
    """A ``bench tail --record-trace`` file (GPU seconds), its first ``seconds`` of arrivals."""
    rows = read_trace(path, 1.0, 0.0, seconds)
    return [Arrival(i, a.at, a.kind, True, a.prompt, a.max_tokens) for i, a in enumerate(rows)]


def seen_in_trace(path: Path, seconds: float) -> list[Seen]:
    """A trace's prefix fields (``prefix_group``, ``cached_tokens``) where its rows carry them, one per arrival
    of ``arrivals_from_trace`` and in its order (the rows it keeps, stably sorted by time)."""
    rows: list[tuple[float, Seen]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if float(row["at"]) >= seconds or len(rows) >= MAX_ARRIVALS:
            break
        rows.append((float(row["at"]), seen_in(row)))
    return [seen for _, seen in sorted(rows, key=lambda r: r[0])]


def _log_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


# Why an access log's line was not replayed, in the order the summary lists them.
NOT_JSON = "not JSON"
NOT_ACCESS = "not an access line"
REJECTED = "an error outcome no split would serve (rejected: the caller's mistake)"
NO_SIZE = "no prompt estimate or max_tokens (refused before they were read)"
BAD_TIME = "an unparseable time (ts or e2e_ms)"
OUTSIDE = "outside the window (--seconds after the first arrival)"
OVER_MAX = f"past the replay's {MAX_ARRIVALS} requests"
_WHY_ORDER = (NOT_JSON, NOT_ACCESS, REJECTED, NO_SIZE, BAD_TIME, OUTSIDE, OVER_MAX)


@dataclass(frozen=True)
class LogUsage:
    """How much of an access log was replayed, and why the rest was not: advice resting on a
    tenth of the log, or on none of the short requests, must say so.

    ``skipped`` is (why, lines, detail) for each reason that skipped any, in
    ``_WHY_ORDER``; the detail of the error outcomes is their reasons and counts.
    """

    lines: int  # read (blank ones not counted)
    used: int
    skipped: tuple[tuple[str, int, str], ...]

    def summary(self, source: str) -> str:
        head = f"{source}: {self.lines} lines read, {self.used} used"
        if not self.skipped:
            return head + ", none skipped"
        parts = [f"{n} {why}" + (f" [{detail}]" if detail else "") for why, n, detail in self.skipped]
        return f"{head}; {sum(n for _, n, _ in self.skipped)} skipped: " + "; ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {"lines": self.lines, "used": self.used, "skipped": [{"why": why, "lines": n, "detail": d} for why, n, d in self.skipped]}


def read_access_log(path: Path, short_class: str, seconds: float) -> tuple[list[Arrival], list[Seen], LogUsage]:
    """tailguard's JSON access lines: each request's arrival (its line's time less its E2E), shape and
    prefix (its ``prefix_group`` and ``cached_tokens``), and what the log held besides.

    Replayed: every access line with its size, whatever its outcome but
    ``rejected`` (a request refused for being busy, slow or failed upstream is
    demand a better split may serve; a malformed or unauthorized one is not).
    A request is short when its class was ``short_class``. Time starts at the
    first arrival; ``seconds`` of arrivals are kept, at most ``MAX_ARRIVALS``.
    """
    found: list[tuple[float, str, int, int, Seen]] = []
    skipped: dict[str, int] = {}
    reasons: dict[str, dict[str, int]] = {}
    lines = 0

    def skip(why: str, reason: object = None) -> None:
        skipped[why] = skipped.get(why, 0) + 1
        if reason is not None:
            by = reasons.setdefault(why, {})
            by[str(reason)] = by.get(str(reason), 0) + 1

    with path.open(encoding="utf-8", errors="replace") as text:
        for line in text:
            if not line.strip():
                continue
            lines += 1
            try:
                row = json.loads(line)
            except ValueError:
                skip(NOT_JSON)
                continue
            if not isinstance(row, dict):
                skip(NOT_JSON)
                continue
            if row.get("logger") != ACCESS_LOGGER:
                skip(NOT_ACCESS)
                continue
            if row.get("outcome") == "rejected":
                skip(REJECTED, row.get("reason") or "no reason")
                continue
            prompt, max_tokens, stamp = row.get("prompt_tokens_est"), row.get("max_tokens"), row.get("ts")
            if not (isinstance(prompt, int) and isinstance(max_tokens, int)) or prompt < 1 or max_tokens < 1:
                skip(NO_SIZE, row.get("reason") or row.get("outcome") or None)
                continue
            try:
                if not isinstance(stamp, str):
                    raise ValueError(stamp)
                at = _log_time(stamp) - float(row.get("e2e_ms") or 0.0) / 1000
            except (ValueError, TypeError):
                skip(BAD_TIME)
                continue
            found.append((at, "short" if row.get("class") == short_class else "long", prompt, max_tokens, seen_in(row)))
    found.sort(key=lambda row: row[:4])  # by time, then shape, as ever
    origin = found[0][0] if found else 0.0
    window = [row for row in found if row[0] - origin < seconds]
    kept = window[:MAX_ARRIVALS]
    skipped[OUTSIDE], skipped[OVER_MAX] = len(found) - len(window), len(window) - len(kept)
    arrivals = [Arrival(i, at - origin, kind, True, prompt, out) for i, (at, kind, prompt, out, _) in enumerate(kept)]
    details = {why: ", ".join(f"{reason} {n}" for reason, n in sorted(by.items(), key=lambda item: (-item[1], item[0]))) for why, by in reasons.items()}
    usage = LogUsage(lines, len(kept), tuple((why, skipped[why], details.get(why, "")) for why in _WHY_ORDER if skipped.get(why)))
    return arrivals, [row[4] for row in kept], usage


def arrivals_from_access_log(path: Path, short_class: str, seconds: float) -> list[Arrival]:
    """``read_access_log``'s arrivals alone."""
    return read_access_log(path, short_class, seconds)[0]


def fit(arrivals: Sequence[Arrival], config: Config) -> tuple[list[Arrival], list[int]]:
    """The arrivals the router would take, max_tokens clamped as it would; and their places in ``arrivals``.

    Dropped: prompts over the input cap (with a margin for the router's own
    estimate of the replayed text), max_tokens over the output cap in reject
    mode, or more than the pools' context.
    """
    limits = config.limits
    context = min(pool.max_model_len for pool in config.pools)
    kept: list[Arrival] = []
    places: list[int] = []
    for place, a in enumerate(arrivals):
        prompt, out = a.prompt_tokens or 0, a.max_tokens or 0
        if out > limits.output_cap_tokens:
            if limits.over_cap == "reject":
                continue
            out = limits.output_cap_tokens
        if prompt + 16 > limits.input_cap_tokens or prompt + out > context or prompt < 8:
            continue
        kept.append(dataclasses.replace(a, index=len(kept), measured=True, prompt_tokens=prompt, max_tokens=out))
        places.append(place)
    return kept, places


# -- the simulation --------------------------------------------------------------------------


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


def _nothing() -> Stats:
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


def fates_from_samples(path: Path, time_scale: float) -> list[Fate]:
    """``bench tail --samples`` JSONL (real seconds) as fates in GPU seconds."""
    fates = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)

        def gpu(key: str) -> float | None:
            value = row.get(key)
            return None if value is None else float(value) / time_scale

        fates.append(Fate(str(row["kind"]), float(row["at"]) / time_scale, row["outcome"] == "ok", gpu("ttft"), gpu("e2e")))
    return fates


def _run_one(item: tuple[Setup, Sequence[Arrival]]) -> Stats:
    setup, arrivals = item
    run = simulate(setup, arrivals)
    return dataclasses.replace(stats_of(fates_of(run.records)), prefix_queries=run.prefix_queries, prefix_hits=run.prefix_hits)


def run_all(setups: Sequence[Setup], arrivals: Sequence[Arrival], jobs: int) -> list[Stats]:
    """Each set-up's stats, in ``jobs`` processes (forked) when more than one."""
    shorts = [dataclasses.replace(a, index=i) for i, a in enumerate(a for a in arrivals if a.kind == "short")]
    items = [(s, shorts if s.kinds == ("short",) else arrivals) for s in setups]
    if jobs <= 1:
        return [_run_one(item) for item in items]
    with multiprocessing.get_context("fork").Pool(min(jobs, len(items))) as pool:
        return pool.map(_run_one, items, chunksize=1)


# -- the verdict ------------------------------------------------------------------------------


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
) -> Advice:
    """Simulate the baselines and every candidate on ``arrivals``; pick one.

    ``seen`` (one per arrival: its prefix group and cached tokens) has the
    replay share prefixes as the log says they were shared (``prefixes``),
    ``assume_tokens`` per group that reported none; without it every prompt is unique.
    ``layouts`` gives the candidates (default ``candidates``).
    """
    started = time.perf_counter()
    kept, places = fit(arrivals, candidate_config(fleet, Candidate(1, fleet.engines - 1, "static")))
    dropped, sharing = len(arrivals) - len(kept), None
    if seen is not None:
        kept, sharing = with_prefixes(kept, [seen[i] for i in places], assume_tokens)
    found = (layouts or candidates)(fleet)
    setups = [shared_setup(fleet), dataclasses.replace(shared_setup(fleet, "short-only ideal"), kinds=("short",))]
    if not any(a.kind == "short" for a in kept):  # nothing to protect: the candidates differ by long goodput alone
        setups.pop()
    setups += [candidate_setup(fleet, c) for c in found]
    shared, *results = run_all(setups, kept, jobs)
    ideal, rest = (results[0], results[1:]) if len(setups) == len(found) + 2 else (_nothing(), results)
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


# -- the report --------------------------------------------------------------------------------


def _s(value: float) -> str:
    return "fail" if math.isinf(value) else "-" if math.isnan(value) else f"{value:.3f}"


def _x(value: float) -> str:
    return "inf" if math.isinf(value) else "-" if math.isnan(value) else f"{value:.2f}"


def _rate(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def table(advice: Advice) -> str:
    """Markdown: the baselines, then every candidate, the recommended one marked."""
    rows = [
        "| set-up | lending | borrowed prefill stall per step, ms | short E2E P99 s | x ideal | short TTFT P99 s | x ideal "
        "| short failed | long finished/s | x round robin | prefix hit rate | within bounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in (("short-only ideal", advice.ideal), ("shared round robin", advice.shared)):
        rows.append(
            f"| {name} | - | - | {_s(s.short_e2e_p99)} | - | {_s(s.short_ttft_p99)} | - | {s.short_failed} "
            f"| {s.long_goodput:.2f} | - | {_rate(s.prefix_hit_rate)} | - |"
        )
    for p in advice.predictions:
        s, c = p.stats, p.candidate
        mark = " **<- recommended**" if p is advice.recommended else ""
        split = "shared" if c.shared else f"{c.interactive}:{c.batch}"
        rows.append(
            f"| {split}{mark} | {c.rule} | {p.stall_ms:.0f} | {_s(s.short_e2e_p99)} | {_x(p.e2e_ratio)} | {_s(s.short_ttft_p99)} "
            f"| {_x(p.ttft_ratio)} | {s.short_failed} | {s.long_goodput:.2f} | {_x(p.goodput_ratio)} | {_rate(s.prefix_hit_rate)} "
            f"| {'yes' if p.meets else 'no'} |"
        )
    return "\n".join(rows)


def _lend_lines(lend: LendConfig) -> list[str]:
    lines = [f"to = {json.dumps(list(lend.to))}"]
    if lend.to:
        if lend.max_seats is not None:
            lines.append(f"max_seats = {lend.max_seats}")
        lines.append(f"reserve = {lend.reserve}")
        if lend.max_prompt_tokens is not None:
            lines.append(f"max_prompt_tokens = {lend.max_prompt_tokens}")
        if lend.max_imbalance is not None:
            lines.append(f"max_imbalance = {lend.max_imbalance:g}")
        if lend.max_output_tokens is not None:
            lines.append(f"max_output_tokens = {lend.max_output_tokens}")
        if lend.prefills is not None:
            lines.append(f"prefills = {lend.prefills}")
        if lend.ttft_budget is not None:
            lines.append(f"ttft_budget = {lend.ttft_budget:g}")
        lines.append(f'when = "{lend.when}"')
    return lines


def _profile_note(name: str, plan: PoolPlan) -> str:
    p = plan.params
    return f"# {name}: vLLM --max-num-seqs {p.max_num_seqs} --max-num-batched-tokens {p.max_num_batched_tokens} (the {plan.profile!r} profile)"


def snippet(fleet: Fleet, candidate: Candidate) -> str:
    """The config.toml lines that make ``candidate``: both pools' endpoints and caps, and the lend table.

    The file's endpoint URLs are used in order (its interactive pool's
    first); engines beyond them get placeholder URLs to fill in.
    """
    urls = list(fleet.urls[: fleet.engines]) + [engine_url(i) for i in range(len(fleet.urls), fleet.engines)]
    if candidate.shared:
        return _shared_snippet(fleet, urls)
    out = [
        f"# tailguard advise: {candidate.interactive} engine(s) interactive, {candidate.batch} batch; {candidate.rule}.",
        "# Keys not shown stay as they are in your config.",
        _profile_note("interactive engines", fleet.interactive),
        _profile_note("batch engines", fleet.batch),
    ]
    parts = (
        (fleet.interactive, urls[: candidate.interactive], candidate.lend),
        (fleet.batch, urls[candidate.interactive :], candidate.lend_back),
    )
    for plan, mine, lend in parts:  # both lend tables, empty ones too: the file may lend where this does not
        out += [
            f"[pools.{plan.config.name}]",
            f"max_concurrency = {plan.seats * len(mine)}",
            f"max_queue = {plan.queue * len(mine)}",
            "endpoints = [",
            *(f'    {{ url = "{url}", max_concurrency = {plan.seats} }},' for url in mine),
            "]",
            "",
        ]
        out += [f"[pools.{plan.config.name}.lend]", *_lend_lines(lend), ""]
    return "\n".join(out).rstrip() + "\n"


def _shared_snippet(fleet: Fleet, urls: Sequence[str]) -> str:
    """The config.toml lines of the shared pool: every engine in the batch pool, every class routed to it."""
    plan, name = fleet.batch, fleet.batch.config.name
    out = [
        f"# tailguard advise: all {fleet.engines} engines in one pool, every class in it, the interactive class queued first.",
        "# Keys not shown stay as they are in your config; remove the other pool's table.",
        _profile_note("every engine", plan),
        f"[pools.{name}]",
        f"max_concurrency = {plan.seats * len(urls)}",
        f"max_queue = {plan.queue * len(urls)}",
        "endpoints = [",
        *(f'    {{ url = "{url}", max_concurrency = {plan.seats} }},' for url in urls),
        "]",
        "",
        f"[pools.{name}.lend]",
        "to = []",
        "",
    ]
    out += [line for k in fleet.base.classes for line in (f"[classes.{k.name}]", f'pool = "{name}"', "")]
    return "\n".join(out).rstrip() + "\n"


def report(advice: Advice) -> str:
    fleet, best = advice.fleet, advice.recommended
    s = best.stats
    head = (
        f"{advice.source}: {advice.arrivals} requests over {advice.seconds:.1f} s (GPU time)"
        + (f", {advice.dropped} dropped (over the router's caps)" if advice.dropped else "")
        + f"; {fleet.engines} engines: interactive pool {fleet.interactive.profile!r} (cap {fleet.interactive.seats} each), "
        f"batch pool {fleet.batch.profile!r} (cap {fleet.batch.seats} each); {len(advice.predictions)} candidates "
        f"simulated in {advice.wall_s:.1f} s (wall) on this CPU. Bounds: short E2E P99 <= {E2E_BOUND:g}x and short TTFT P99 <= "
        f"{TTFT_BOUND:g}x the short-only ideal's. Long finished/s: long requests finished ok per second from the "
        "trace's start to the last one's end."
    )
    verdict = (
        f"Recommended: {best.candidate.name} -- short E2E P99 {_s(s.short_e2e_p99)} s ({_x(best.e2e_ratio)}x ideal), "
        f"short TTFT P99 {_s(s.short_ttft_p99)} s ({_x(best.ttft_ratio)}x), long {s.long_goodput:.2f}/s "
        f"({_x(best.goodput_ratio)}x round robin)."
    )
    if not advice.met:
        verdict = (
            f"No candidate meets both bounds. Best trade-off (the least over them, then the most long goodput): {verdict[len('Recommended: ') :]}"
        )
    mix = f"Short by the file's thresholds: {advice.short_share:.0%} of the requests" + (
        "" if math.isnan(advice.short_token_share) else f", {advice.short_token_share:.0%} of their prompt and output tokens"
    ) + "."
    if advice.short_share < 0.5:  # the real traces' case (docs/pools.md): a split's latency engines idle while batch queues
        mix += (
            " Most requests are long here: a split gives the few short ones whole engines that long ones then lack;"
            " compare the shared pool's row."
        )
    head = f"{head}\n\n{mix}"
    unmodelled = "Prefix cache: not modelled (--no-prefix-cache): every prompt is unique."
    cache = (unmodelled if advice.sharing is None else advice.sharing.summary()) + " Prefix hit rate: cached prompt tokens over those looked up, all engines."
    return "\n\n".join([head, cache, table(advice), verdict, "```toml\n" + snippet(fleet, best.candidate) + "```"]) + "\n"


def advice_json(advice: Advice) -> dict[str, Any]:
    def pred(p: Prediction) -> dict[str, Any]:
        return {"candidate": p.candidate.name, "lend": dataclasses.asdict(p.candidate.lend),
                "lend_back": dataclasses.asdict(p.candidate.lend_back), "stats": dataclasses.asdict(p.stats),
                "e2e_vs_ideal": p.e2e_ratio, "ttft_vs_ideal": p.ttft_ratio, "goodput_vs_shared": p.goodput_ratio,
                "stall_ms": p.stall_ms, "meets": p.meets, "prefix_hit_rate": p.stats.prefix_hit_rate}

    def safe(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: safe(v) for k, v in value.items()}
        if isinstance(value, list):
            return [safe(v) for v in value]
        return value

    found: dict[str, Any] = safe({
        "source": advice.source,
        "engines": advice.fleet.engines,
        "arrivals": advice.arrivals,
        "dropped": advice.dropped,
        "seconds": advice.seconds,
        "wall_s": advice.wall_s,
        "ideal": dataclasses.asdict(advice.ideal),
        "shared": dataclasses.asdict(advice.shared),
        "candidates": [pred(p) for p in advice.predictions],
        "recommended": advice.recommended.candidate.name,
        "meets_bounds": advice.met,
        "prefix_sharing": None if advice.sharing is None else dataclasses.asdict(advice.sharing),
    })
    return found


# -- checking a prediction against bench tail ----------------------------------------------------

TAIL_TIME_SCALE = 4.0  # bench tail's default --time-scale
TAIL_DRAIN_GPU_S = 120.0  # the caller's deadline: no request outlasts it, so bench tail's drain never cuts one


def tail_setup(candidate: Candidate) -> str:
    """The ``bench tail`` set-up that runs ``candidate``: ``priority`` for the shared pool, ``disaggregated`` when static, ``lend`` when lending."""
    if candidate.shared:
        return "priority"
    return "lend" if candidate.lends else "disaggregated"


def _lend_rule(lend: LendConfig) -> str:
    rule = [f"reserve={lend.reserve}"]
    rule += [f"seats={lend.max_seats}"] if lend.max_seats is not None else []
    rule += [f"prompt={lend.max_prompt_tokens}"] if lend.max_prompt_tokens is not None else []
    rule += [f"output={lend.max_output_tokens}"] if lend.max_output_tokens is not None else []
    rule += [f"prefills={lend.prefills}"] if lend.prefills is not None else []
    rule += [f"when={lend.when}"] if lend.when != "full" else []
    rule += [f"ttft={round(lend.ttft_budget * 1000)}"] if lend.ttft_budget is not None else []  # GPU ms, as advise's times are
    rule += [f"imbalance={lend.max_imbalance:g}"] if lend.max_imbalance is not None else []
    return ",".join(rule)


def tail_command(advice: Advice, candidate: Candidate, trace: Path, samples: Path, time_scale: float = TAIL_TIME_SCALE) -> str | None:
    """The real-time ``bench tail`` run of ``candidate`` on ``trace`` (None: bench tail cannot express it).

    bench tail's lending set-up lends interactive -> batch under one rule,
    the batch pool lending back any idle seat unless ``--no-lend-back``.
    """
    back = candidate.lend_back
    if back.to and (back != LendConfig(back.to) or not candidate.lend.to):
        return None
    window = math.ceil(advice.seconds * time_scale) + 1
    split = "" if candidate.shared else f" --split {candidate.interactive}:{candidate.batch}"
    words = [
        "python -m bench tail",
        f"--engines {advice.fleet.engines}{split}",
        f"--trace {trace} --time-scale {time_scale:g} --warmup 0 --seconds {window} --drain {TAIL_DRAIN_GPU_S * time_scale:g}",
        f"--setup shared --setup short-only --setup {tail_setup(candidate)}",
    ]
    if candidate.lend.to:
        words.append(f"--lend-rule {_lend_rule(candidate.lend)}" + ("" if back.to else " --no-lend-back"))
    words.append(f"--samples {samples}")
    return " ".join(words)


@dataclass(frozen=True)
class Check:
    """Predicted against measured for one candidate, from ``bench tail --samples`` files."""

    candidate: Candidate
    predicted: Stats
    measured: Stats
    measured_ideal: Stats
    measured_shared: Stats


def _one(directory: Path, setup: str) -> Path:
    found = sorted(directory.glob(f"*-{setup}-load*.jsonl"))
    if len(found) != 1:
        raise ValueError(f"{directory}: expected one *-{setup}-load*.jsonl (bench tail --samples), found {len(found)}")
    return found[0]


def compare(advice: Advice, name: str | None, directory: Path, time_scale: float) -> Check:
    """A candidate's prediction (default: the recommended one) beside bench tail's samples of it, shared and short-only."""
    chosen = advice.recommended if name is None else next((p for p in advice.predictions if p.candidate.name == name), None)
    if chosen is None:
        raise ValueError(f"no candidate is named {name!r}; the names are the table's split and lending columns, e.g. '1:3 static'")

    def measured(setup: str) -> Stats:
        return stats_of(fates_from_samples(_one(directory, setup), time_scale))

    return Check(chosen.candidate, chosen.stats, measured(tail_setup(chosen.candidate)), measured("short-only"), measured("shared"))


def check_table(check: Check, advice: Advice) -> str:
    def row(name: str, predicted: float, measured: float, fmt: str = "{:.3f}") -> str:
        off = (predicted - measured) / measured if measured and math.isfinite(measured) and math.isfinite(predicted) else math.nan
        return f"| {name} | {fmt.format(predicted)} | {fmt.format(measured)} | {off:+.1%} |"

    p, m = check.predicted, check.measured
    return "\n".join([
        f"| {check.candidate.name}, GPU s | predicted (virtual time) | measured (bench tail, real time) | predicted vs measured |",
        "|---|---|---|---|",
        row("short E2E P99", p.short_e2e_p99, m.short_e2e_p99),
        row("short TTFT P99", p.short_ttft_p99, m.short_ttft_p99),
        row("long finished/s", p.long_goodput, m.long_goodput, "{:.2f}"),
        row("short-only ideal: short E2E P99", advice.ideal.short_e2e_p99, check.measured_ideal.short_e2e_p99),
        row("short-only ideal: short TTFT P99", advice.ideal.short_ttft_p99, check.measured_ideal.short_ttft_p99),
        row("shared round robin: long finished/s", advice.shared.long_goodput, check.measured_shared.long_goodput, "{:.2f}"),
        row("shared round robin: short E2E P99", advice.shared.short_e2e_p99, check.measured_shared.short_e2e_p99),
    ])


# -- the command line ----------------------------------------------------------------------------


def default_config() -> Path:
    local = Path("config.toml")
    return local if local.exists() else SHIPPED_CONFIG


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailguard advise", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="a bench tail --record-trace JSONL (at in GPU s, prompt_tokens, max_tokens, class)")
    source.add_argument("--access-log", type=Path, help="tailguard's own JSON log; its tailguard.access lines are replayed")
    add = parser.add_argument
    add("--config", type=Path, default=None, help="the pools, endpoints and caps (default: ./config.toml, else the shipped one)")
    add("--engines", type=int, default=None, help="engines to split (default: the endpoints of the config's two pools)")
    add("--seconds", type=float, default=DEFAULT_SECONDS, help=f"replay at most this many seconds of arrivals (default %(default)g, at most {MAX_SECONDS:g})")
    add("--jobs", type=int, default=1, help="processes to simulate candidates in (default %(default)s)")
    add("--json", type=Path, default=None, help="also write every prediction as JSON here")
    add("--compare-samples", type=Path, default=None, help="a bench tail --samples folder of a run of the printed command: measured beside predicted")
    add("--compare-candidate", default=None, help="which candidate that run was, e.g. '1:3 static' (default: the recommended one)")
    add("--time-scale", type=float, default=TAIL_TIME_SCALE, help="that run's --time-scale (default %(default)g)")
    add("--no-prefix-cache", action="store_true", help="replay every prompt unique, ignoring the log's prefix_group and cached_tokens (for comparison)")
    add("--keep-thresholds", action="store_true", help="with --access-log: do not search class thresholds (keep the file's)")
    add("--assume-shared-tokens", type=int, default=0, help="a prefix group's shared tokens where no line reported cached_tokens (default %(default)s: none)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= MAX_SECONDS or args.jobs < 1 or args.time_scale <= 0 or args.assume_shared_tokens < 0:
        parser.error(f"--seconds must be in (0, {MAX_SECONDS:g}], --jobs and --time-scale positive, --assume-shared-tokens not negative")
    path: Path = args.config or default_config()
    try:
        config = load_config(path)
    except ConfigError as error:
        print(f"tailguard: {path}: invalid config\n{error}", file=sys.stderr)
        return 2
    usage: LogUsage | None = None
    try:
        fleet = fleet_from(config, args.engines)
        if args.trace is not None:
            arrivals, source = arrivals_from_trace(args.trace, args.seconds), str(args.trace)
            seen = seen_in_trace(args.trace, args.seconds)
        else:
            arrivals, seen, usage = read_access_log(args.access_log, fleet.short_class, args.seconds)
            source = str(args.access_log)
            print(usage.summary(source), file=sys.stderr if len(arrivals) < 2 else sys.stdout)
        if len(arrivals) < 2:
            raise ValueError(f"{source}: fewer than two requests to replay")
        modelled = None if args.no_prefix_cache else seen
        result = advise(
            fleet, arrivals, seen=modelled, assume_tokens=args.assume_shared_tokens, jobs=args.jobs, seconds=args.seconds, source=source
        )
    except (OSError, ValueError) as error:
        print(f"tailguard advise: {error}", file=sys.stderr)
        return 2
    print(("\n" if usage is not None else "") + report(result), end="")
    thresholds = None
    if usage is not None and not args.keep_thresholds:
        from .joint import search, search_json, section  # joint builds on this module

        thresholds = search(fleet, arrivals, seen=modelled, assume_tokens=args.assume_shared_tokens, jobs=args.jobs, seconds=args.seconds, file_advice=result)
        print("\n" + section(thresholds), end="")
    if args.trace is not None:
        command = tail_command(result, result.recommended.candidate, args.trace, Path("samples"))
        note = command and f"Check it in real time (bench tail; then --compare-samples samples): `{command}`"
        print("\n" + (note or "bench tail has no set-up for this lending rule: check it by hand."))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = advice_json(result)
        if usage is not None:
            document["access_log"] = usage.as_json()
        if thresholds is not None:
            document["thresholds"] = search_json(thresholds)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.compare_samples is not None:
        try:
            check = compare(result, args.compare_candidate, args.compare_samples, args.time_scale)
        except (OSError, ValueError) as error:
            print(f"tailguard advise: {error}", file=sys.stderr)
            return 2
        print("\n" + check_table(check, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
