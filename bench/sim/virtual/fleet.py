"""The fleet in virtual time, as ``python -m bench sweep`` and ``tailguard advise`` run it: a fleet, open-loop traffic.

The router core and the simulated engines run in one process under
``trio.testing.MockClock``, with no sockets and no HTTP. Simulated time costs
nothing, so the numbers are the policy's alone: no client lag, no scheduler
noise, and the same seed gives the same table on every run.

What a routed request goes through is the router's own path: ``Router.open``
(limits, classification, the pool's caps and wait queue, the lease); only
the I/O layer under it, ``Endpoint.client``, is an in-process call into the
engine (``EngineClient``). An hour of traffic per point (~400,000 requests
at full load) is affordable because nothing costs CPU per token, and none of
the economies changes what is measured:

- the engine (``SweepEngine``) runs ``tailguard.sim.Engine``'s schedule with
  decoding sequences held in aggregate, so a decode step is O(1), and it is
  woken only at the end of a step that starts or ends a sequence (checked
  against ``tailguard.sim.Engine`` in ``bench/sweep/check.py``: identical timestamps);
- a request carries no bytes: its TTFT and E2E are the engine's own
  first-token and finish instants, which is when a token-by-token reader
  would have seen them (the engine never waits for readers); the caller
  waits once, for the end;
- arrivals and engine wake-ups are ``Timeline`` callbacks rather than Trio
  sleeps, which cost a cancel scope and an exception each;
- same-instant submissions queue in arrival order, not in the order Trio
  happens to run their tasks, so results are deterministic;
- points run in separate processes (one ``trio.run`` each), with the cyclic
  garbage collector run rarely.
"""

from __future__ import annotations

import gc
import importlib
import itertools
import math
import random
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.admission import RouterRequest, message_text
from tailguard.router.config import (
    ClassConfig,
    Config,
    EndpointConfig,
    EstimateConfig,
    LimitsConfig,
    PoolConfig,
    ServerConfig,
    TimeoutsConfig,
)
from tailguard.router.errors import BackendError, BackendRejected, DeadlineExceeded, Overloaded, QueueFull

from ..canned import canned_transport
from ..engine import EngineRequestError
from ..params import PROFILES
from ..prefix_cache import BLOCK_SIZE, prompt_block_keys
from ..server import DEFAULT_MODEL
from ..tokens import chat_prompt_key, count_chat_tokens
from .clock import Timeline
from .engine import SweepEngine, SweepSequence
from .mix import CLASSES, LONG_MAX_TOKENS, SHORT_MAX_TOKENS, SHORT_SHARE, percentile, unique_body_for, unique_payload
from .rebalancing import RebalanceLoop, Rebalancing, rebalances

MAX_TOKENS = {"short": SHORT_MAX_TOKENS, "long": LONG_MAX_TOKENS}
E2E_TIMEOUT = TimeoutsConfig().end_to_end_timeout  # 120 s: every set-up's caller gives up here
INTERACTIVE_QUEUE_TIMEOUT = 3.0  # config.toml
BATCH_QUEUE_TIMEOUT = 30.0  # config.toml
INTERACTIVE_MAX_QUEUE = 256  # config.toml
BATCH_MAX_QUEUE = 512  # config.toml
SEATS = {name: params.max_num_seqs for name, params in PROFILES.items()}
OUTCOMES = ("ok", "429", "503", "timeout", "error", "unfinished")
GC_THRESHOLDS = (50_000, 20, 1_000)  # gen0 allocations, gen1 and gen2 collection ratios


# -- set-ups ----------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """A fleet of engines and how requests reach them.

    ``direct`` sends each class straight to its engines, round robin by
    arrival index (no router); otherwise ``config`` puts a Router in front.
    ``kinds`` are the arrival kinds sent at all (short-only drops "long").
    """

    name: str
    engines: tuple[tuple[str, str], ...]  # (url, profile)
    direct: Mapping[str, tuple[str, ...]] | None = None
    config: Config | None = None
    kinds: tuple[str, ...] = CLASSES
    description: str = ""


def _urls(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"http://{prefix}-{i}:8000" for i in range(count))


def shared(engines: int, *, name: str = "shared", kinds: tuple[str, ...] = CLASSES) -> Setup:
    """Round robin straight to throughput engines: one FIFO batch per GPU, what people run today."""
    urls = _urls("tp", engines)
    return Setup(
        name,
        tuple((url, "throughput") for url in urls),
        direct={kind: urls for kind in CLASSES},
        kinds=kinds,
        description=f"no router, round robin over {engines} throughput engine(s)"
        + ("" if kinds == CLASSES else f", {'+'.join(kinds)} requests only"),
    )


def _classes(interactive_pool: str, batch_pool: str) -> tuple[ClassConfig, ...]:
    """The shipped classes: interactive = prompt <= 500 and max_tokens <= 128, batch the rest."""
    return (
        ClassConfig("interactive", interactive_pool, INTERACTIVE_QUEUE_TIMEOUT, 0, 500, 128),
        ClassConfig("batch", batch_pool, BATCH_QUEUE_TIMEOUT, 1),
    )


def _pool(name: str, urls: Sequence[str], profile: str, max_queue: int) -> PoolConfig:
    seats = SEATS[profile]
    endpoints = tuple(EndpointConfig(url, seats) for url in urls)
    return PoolConfig(name, endpoints, seats * len(urls), max_queue, 32768, (DEFAULT_MODEL,), profile)  # type: ignore[arg-type]


def _config(pools: tuple[PoolConfig, ...], classes: tuple[ClassConfig, ...]) -> Config:
    return Config(ServerConfig(), EstimateConfig(), LimitsConfig(), TimeoutsConfig(), pools, classes, digest="sweep")


def priority(engines: int) -> Setup:
    """The origin's fix: one pool of all engines, interactive (prio 0) queued ahead of batch (prio 1)."""
    urls = _urls("tp", engines)
    pool = _pool("shared", urls, "throughput", INTERACTIVE_MAX_QUEUE + BATCH_MAX_QUEUE)
    return Setup(
        "priority",
        tuple((url, "throughput") for url in urls),
        config=_config((pool,), _classes("shared", "shared")),
        description=f"router, one pool of {engines} throughput engines (cap = seats), short-first priority",
    )


def disaggregated(interactive: int, batch: int, *, name: str | None = None) -> Setup:
    """tailguard's answer: latency engines for the interactive class, throughput engines for batch."""
    fast, slow = _urls("lat", interactive), _urls("tp", batch)
    pools = (
        _pool("interactive", fast, "latency", INTERACTIVE_MAX_QUEUE),
        _pool("batch", slow, "throughput", BATCH_MAX_QUEUE),
    )
    return Setup(
        name or f"disaggregated {interactive}:{batch}",
        tuple((url, "latency") for url in fast) + tuple((url, "throughput") for url in slow),
        config=_config(pools, _classes("interactive", "batch")),
        description=f"router, interactive pool of {interactive} latency engine(s), batch pool of {batch} throughput engine(s)",
    )


def split_direct(interactive: int, batch: int) -> Setup:
    """The disaggregated fleet without the router: each class sent straight to its engines."""
    fast, slow = _urls("lat", interactive), _urls("tp", batch)
    return Setup(
        "split direct",
        tuple((url, "latency") for url in fast) + tuple((url, "throughput") for url in slow),
        direct={"short": fast, "long": slow},
        description="no router: short requests to the latency engine(s), long ones to the throughput engine(s)",
    )


# -- traffic ----------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    index: int
    at: float  # seconds after the start of the run
    kind: str  # "short" | "long"
    measured: bool  # inside the measurement window
    prompt_tokens: int | None = None  # a replayed request's own shape; None: the mix's request of its kind
    max_tokens: int | None = None
    text: str | None = None  # a replayed request's own prompt text (shared prefixes hit); None: unique filler
    prefix_hint: str | None = None  # sent as prompt_cache_key: a replayed prefix group placed as one key (advise)


def request_id(index: int) -> str:
    """The request id the sweep gives the arrival with this index."""
    return f"r{index}"


def arrival_index(request_id: str) -> int:
    """The arrival index back from a sweep request id (it ranks same-instant submissions)."""
    return int(request_id[1:])


def poisson(rate: float, warmup: float, seconds: float, seed: int) -> Iterator[Arrival]:
    """Open-loop Poisson arrivals, 80% short (seeded), forever; measured inside the window.

    The same seed gives every set-up the same arrivals, so set-ups differ by
    policy only (common random numbers).
    """
    rng = random.Random(seed)
    at = 0.0
    for index in itertools.count():
        at += rng.expovariate(rate)
        kind = "short" if rng.random() < SHORT_SHARE else "long"
        yield Arrival(index, at, kind, warmup <= at < warmup + seconds)


# -- a request's record -------------------------------------------------------------


@dataclass
class Record:
    """One request's fate, seconds of simulated time."""

    kind: str
    measured: bool
    outcome: str = "unfinished"
    ttft: float | None = None
    e2e: float | None = None
    at: float = math.nan  # arrival, seconds after the start of the run


def _timings(sequence: SweepSequence, start: float, record: Record) -> None:
    """TTFT and E2E from the engine's own timestamps: the instants a streaming reader sees them."""
    if sequence.first_token_at is not None:
        record.ttft = sequence.first_token_at - start
    if sequence.finished_at is not None:
        record.e2e = sequence.finished_at - start
    record.outcome = "ok" if sequence.finish_reason == "length" else "error"


# -- the fleet ----------------------------------------------------------------------


def prompt_of(body: Mapping[str, Any], *, keys: bool = True, block_size: int = BLOCK_SIZE) -> tuple[int, list[bytes]]:
    """A chat body's prompt as the simulator's API sees it: its token count and block keys.

    The keys come from the body's real text and its ``cache_salt``
    (``prefix_cache.prompt_block_keys`` of ``tokens.chat_prompt_key``, as
    ``tailguard.sim.Engine`` computes them), so equal text prefixes hit in
    the sweep's engines as they would in the simulator's.
    """
    texts = [message_text(m) for m in body["messages"]]
    tokens = count_chat_tokens(texts)
    if not keys:  # an engine without a prefix cache: nothing to look up
        return tokens, []
    salt = body.get("cache_salt")
    return tokens, prompt_block_keys(chat_prompt_key(texts), tokens, salt if isinstance(salt, str) else None, block_size)


class EngineResponse:
    """What a backend call yields in the sweep: the engine's sequence, no bytes."""

    content_type = "text/event-stream"

    def __init__(self, engine: SweepEngine, sequence: SweepSequence) -> None:
        self._engine = engine
        self.sequence = sequence

    async def start(self) -> None:
        """Return at the engine's first token, as an HTTP response's first byte would (the router's prefill bound reads it)."""
        await self.sequence.wait_first_token()

    async def aclose(self) -> None:
        self._engine.abort(self.sequence)  # nothing to do once it has finished


class EngineClient:
    """The router's backend client for one endpoint, calling its engine in-process.

    It stands in for ``router.backend.client.BackendClient`` (the same ``open``):
    no JSON, no HTTP, no bytes per token. The caller reads the sequence's own
    first-token and finish times, which are the instants a token-by-token
    reader would have seen them, and closing the response hangs up (aborts).
    """

    def __init__(self, engine: SweepEngine) -> None:
        self._engine = engine
        self.url = engine.name
        self.leases = 0
        self.max_body_bytes = 0
        self.heard = 0  # what a health probe reads (none runs once the engines are plugged)

    async def open(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], *, stream: bool) -> EngineResponse:
        """Submit the body's prompt; raises BackendRejected (400) when the engine refuses it.

        As vLLM 0.32's server (``tailguard.sim.request.render``): a prompt or
        a ``max_tokens`` over ``max_model_len`` is refused, and a prompt plus
        ``max_tokens`` over it is served, cut at the context.
        """
        try:
            request_id = headers["x-tailguard-request-id"]  # the sweep's own id (x-request-id is the router's, per attempt)
            params = self._engine.params
            tokens, keys = prompt_of(body, keys=params.prefix_caching, block_size=params.block_size)
            limit = self._engine.params.max_model_len
            requested = body["max_tokens"]
            if tokens > limit or requested > limit:
                raise EngineRequestError(f"{tokens} prompt tokens or max_tokens={requested} over max_model_len={limit}")
            sequence = self._engine.submit(
                tokens, min(requested, limit - tokens), block_keys=keys, request_id=request_id, rank=arrival_index(request_id)
            )
        except EngineRequestError as error:
            raise BackendRejected(str(error), status=400) from None
        return EngineResponse(self._engine, sequence)

    async def health(self) -> bool:
        return True

    async def expire_idle(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def plug_engines(router: Router, engines: Mapping[str, SweepEngine]) -> None:
    """Give each of the router's endpoints an EngineClient for its engine.

    The router keeps everything it decides (limits, classes, pools, caps,
    queue); only the I/O layer under it, ``Endpoint.client``, is replaced.
    Reads ``Router.endpoints`` (the endpoints now) and swaps each one's client.
    """
    for endpoint in list(router.endpoints):
        http_client = endpoint.client
        endpoint.client = EngineClient(engines[endpoint.url])  # type: ignore[assignment]
        await http_client.aclose()


class _Direct:
    """Requests straight to engines, round robin by arrival index (no router)."""

    def __init__(self, routes: Mapping[str, tuple[SweepEngine, ...]], seed: int) -> None:
        self._routes = routes
        self._seed = seed

    async def serve(self, arrival: Arrival, start: float, record: Record) -> None:
        """Run one request to its end; leaving early (cancelled) hangs up."""
        engines = self._routes[arrival.kind]
        engine = engines[arrival.index % len(engines)]
        body = body_of(arrival, self._seed)
        prompt, keys = prompt_of(body, keys=engine.params.prefix_caching, block_size=engine.params.block_size)
        sequence = engine.submit(prompt, body["max_tokens"], block_keys=keys, request_id=request_id(arrival.index), rank=arrival.index)  # type: ignore[arg-type]
        try:
            await sequence.wait_finished()
            _timings(sequence, start, record)
        finally:
            engine.abort(sequence)

    async def aclose(self) -> None:
        return None


class _Routed:
    """Requests through the Router core, as a front end sends them."""

    def __init__(self, router: Router, seed: int) -> None:
        self._router = router
        self._seed = seed

    async def serve(self, arrival: Arrival, start: float, record: Record) -> None:
        """Run one request to its end through ``Router.open``; raises what it raises."""
        body = body_of(arrival, self._seed)
        request = RouterRequest(
            kind="chat",
            request_id=request_id(arrival.index),
            messages=body["messages"],  # type: ignore[arg-type]
            max_tokens=body["max_tokens"],  # type: ignore[arg-type]
            stream=True,
            params={"ignore_eos": True, **({} if arrival.prefix_hint is None else {"prompt_cache_key": arrival.prefix_hint})},
        )
        async with self._router.open(request) as completion:
            sequence: SweepSequence = completion.response.sequence  # type: ignore[attr-defined]
            await sequence.wait_finished()
            _timings(sequence, start, record)

    async def aclose(self) -> None:
        await self._router.aclose()


def body_of(arrival: Arrival, seed: int) -> dict[str, object]:
    """The arrival's body, unique to it (``mix.unique_payload``): its own text if a replay gave one, else the mix's of its kind or shape."""
    if arrival.text is not None:
        hint = {} if arrival.prefix_hint is None else {"prompt_cache_key": arrival.prefix_hint}
        return {
            "messages": [{"role": "user", "content": arrival.text}],
            "max_tokens": arrival.max_tokens,
            "stream": True,
            "ignore_eos": True,
            **hint,
        }
    if arrival.prompt_tokens is None or arrival.max_tokens is None:
        return unique_payload(arrival.kind, arrival.index, seed=seed)
    return unique_body_for(arrival.prompt_tokens, arrival.max_tokens, arrival.index, seed=seed)


@dataclass
class Fleet:
    timeline: Timeline
    engines: dict[str, SweepEngine]
    target: _Direct | _Routed
    rebalancing: RebalanceLoop | None = None  # when the set-up rebalances (``rebalancing.rebalances``)


@asynccontextmanager
async def open_fleet(setup: Setup, seed: int, clock: trio.testing.MockClock) -> AsyncIterator[Fleet]:
    """Start the set-up's timeline and engines (and its router, rebalancing if it can move anything) in this Trio run; stop them on exit."""
    timeline = Timeline(clock)
    engines = {url: SweepEngine(PROFILES[profile], timeline, name=url) for url, profile in setup.engines}
    target: _Direct | _Routed
    router: Router | None = None
    if setup.config is not None:
        router = Router(setup.config, transport_factory=lambda _: canned_transport(_unplugged), seed=seed)
        await router.check_health()  # an endpoint takes requests once a probe has passed
        await plug_engines(router, engines)
        target = _Routed(router, seed)
    else:
        assert setup.direct is not None
        target = _Direct({kind: tuple(engines[url] for url in urls) for kind, urls in setup.direct.items()}, seed)
    async with trio.open_nursery() as nursery:
        await nursery.start(timeline.run)
        loop = None
        if router is not None and setup.config is not None and rebalances(setup.config):
            loop = RebalanceLoop(router, setup.config.rebalance.interval)
            nursery.start_soon(loop.run, nursery)
        try:
            yield Fleet(timeline, engines, target, loop)
        finally:
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await target.aclose()


def _unplugged(request: httpx.Request) -> httpx.Response:
    """The probes' answers (every engine of a sweep is well); a completion never comes this way."""
    if request.method == "GET" and request.url.path in ("/health", "/v1/models"):
        return httpx.Response(200, json={"object": "list", "data": []})
    raise AssertionError("the sweep's router calls its engines in-process, never over httpx")


# -- one request ----------------------------------------------------------------------


async def send(fleet: Fleet, arrival: Arrival, record: Record) -> None:
    """One streaming request with the caller's 120 s end-to-end deadline."""
    start = trio.current_time()
    with trio.move_on_at(start + E2E_TIMEOUT):
        try:
            await fleet.target.serve(arrival, start, record)
        except QueueFull:
            record.outcome = "429"
        except Overloaded:
            record.outcome = "503"
        except DeadlineExceeded:
            record.outcome = "timeout"
        except BackendError:
            record.outcome = "error"
        return
    record.outcome = "timeout"


# -- one point ----------------------------------------------------------------------


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
        while feed.books.open_measured:
            await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    return feed.books


def summarize(records: Sequence[Record], kind: str, seconds: float) -> ClassStats:
    mine = [r for r in records if r.kind == kind]
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
