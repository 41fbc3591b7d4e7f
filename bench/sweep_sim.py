"""One point of ``python -m bench sweep``: a fleet, open-loop traffic, virtual time.

The router core and the simulated engines run in one process under
``trio.testing.MockClock(autojump_threshold=0)``, joined by the in-process
httpx transport (no sockets). Simulated time costs nothing, so the numbers
are the policy's alone: no client lag, no scheduler noise, and the same seed
gives the same table on every run.

Two economies keep a sweep affordable in Python, neither of which changes
what is measured:

- a client reads the first content chunk (its TTFT), then sleeps on the
  engine's finish hook instead of waking on every token, and drains the rest
  of the stream in one read when the sequence ends (its E2E): the engine
  never waits for readers, so the timings are the same as a token-by-token
  reader's, for ~5 wakes per request instead of ~150;
- points run in separate processes (one ``trio.run`` each).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

import httpx
import trio
import trio.testing

from bench.quick_mixed import LONG_MAX_TOKENS, SHORT_MAX_TOKENS, SHORT_SHARE, TOKEN_MARKER, payloads
from bench.router_overhead import percentile
from bench.sim import DEFAULT_MODEL, PROFILES, Engine, SimApp, SimTransport
from bench.sim import Sequence as EngineSequence
from router.config_types import (
    ClassConfig,
    Config,
    EndpointConfig,
    EstimateConfig,
    LimitsConfig,
    PoolConfig,
    ServerConfig,
    TimeoutsConfig,
)
from router.dispatch import Router
from router.errors import BackendError, DeadlineExceeded, Overloaded, QueueFull
from router.request import RouterRequest

CLASSES = ("short", "long")
MAX_TOKENS = {"short": SHORT_MAX_TOKENS, "long": LONG_MAX_TOKENS}
E2E_TIMEOUT = TimeoutsConfig().end_to_end_timeout  # 120 s: every set-up's caller gives up here
INTERACTIVE_QUEUE_TIMEOUT = 3.0  # config.toml
BATCH_QUEUE_TIMEOUT = 30.0  # config.toml
INTERACTIVE_MAX_QUEUE = 256  # config.toml
BATCH_MAX_QUEUE = 512  # config.toml
SEATS = {name: params.max_num_seqs for name, params in PROFILES.items()}
OUTCOMES = ("ok", "429", "503", "timeout", "error", "unfinished")


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


# -- the fleet ----------------------------------------------------------------------


class Finishes:
    """Wakes a request's client once, when its sequence ends in whichever engine."""

    def __init__(self) -> None:
        self._events: dict[str, trio.Event] = {}

    def watch(self, engine: Engine) -> None:
        engine.add_finish_hook(self._on_finish)

    def expect(self, request_id: str) -> trio.Event:
        event = self._events[request_id] = trio.Event()
        return event

    def forget(self, request_id: str) -> None:
        self._events.pop(request_id, None)

    def _on_finish(self, sequence: EngineSequence) -> None:
        event = self._events.pop(sequence.request_id, None)
        if event is not None:
            event.set()


class _Direct:
    """Requests straight to engines over the in-process transport."""

    def __init__(self, routes: Mapping[str, tuple[str, ...]], clients: Mapping[str, httpx.AsyncClient]) -> None:
        self._routes = routes
        self._clients = clients
        bodies = payloads()
        for body in bodies.values():
            body["model"] = DEFAULT_MODEL
        self._bodies = {kind: json.dumps(body).encode() for kind, body in bodies.items()}

    @asynccontextmanager
    async def open(self, arrival: Arrival, request_id: str) -> AsyncIterator[AsyncIterator[bytes]]:
        urls = self._routes[arrival.kind]
        client = self._clients[urls[arrival.index % len(urls)]]
        headers = {"content-type": "application/json", "x-request-id": request_id}
        request = client.build_request("POST", "/v1/chat/completions", content=self._bodies[arrival.kind], headers=headers)
        response = await client.send(request, stream=True)
        try:
            if response.status_code != 200:
                raise BackendError(f"engine answered {response.status_code}")
            yield response.aiter_raw()
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()


class _Routed:
    """Requests through the Router core, as a front end would send them."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self._payloads = payloads()

    @asynccontextmanager
    async def open(self, arrival: Arrival, request_id: str) -> AsyncIterator[AsyncIterator[bytes]]:
        body = self._payloads[arrival.kind]
        request = RouterRequest(
            kind="chat",
            request_id=request_id,
            messages=body["messages"],  # type: ignore[arg-type]
            max_tokens=body["max_tokens"],  # type: ignore[arg-type]
            stream=True,
        )
        async with self._router.open(request) as completion:
            yield completion.chunks()

    async def aclose(self) -> None:
        await self._router.aclose()


@dataclass
class Fleet:
    engines: dict[str, Engine]
    target: _Direct | _Routed
    finishes: Finishes


@asynccontextmanager
async def open_fleet(setup: Setup, seed: int) -> AsyncIterator[Fleet]:
    """Start the set-up's engines (and its router) in this Trio run; stop them on exit."""
    engines = {url: Engine(PROFILES[profile], seed=seed, name=url) for url, profile in setup.engines}
    transports = {url: SimTransport(SimApp(engine, model=DEFAULT_MODEL)) for url, engine in engines.items()}
    finishes = Finishes()
    for engine in engines.values():
        finishes.watch(engine)
    target: _Direct | _Routed
    if setup.config is not None:
        target = _Routed(Router(setup.config, transport_factory=lambda e: transports[e.url], seed=seed))
    else:
        assert setup.direct is not None
        clients = {url: httpx.AsyncClient(base_url=url, transport=transports[url], timeout=None) for url in engines}
        target = _Direct(setup.direct, clients)
    async with trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        try:
            yield Fleet(engines, target, finishes)
        finally:
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await target.aclose()


# -- one request ----------------------------------------------------------------------


@dataclass
class Record:
    """One request's fate, seconds of simulated time."""

    kind: str
    measured: bool
    outcome: str = "unfinished"
    ttft: float | None = None
    e2e: float | None = None


async def _stream(chunks: AsyncIterator[bytes], done: trio.Event, start: float, record: Record) -> None:
    """TTFT at the first content chunk; then one wake at the end instead of one per token."""
    last = b""
    async for chunk in chunks:
        last = chunk
        if TOKEN_MARKER in chunk:
            record.ttft = trio.current_time() - start
            break
    await done.wait()
    async for chunk in chunks:
        last = chunk
    record.e2e = trio.current_time() - start
    record.outcome = "ok" if record.ttft is not None and last.rstrip().endswith(b"[DONE]") else "error"


async def send(fleet: Fleet, arrival: Arrival, record: Record) -> None:
    """One streaming request with the caller's 120 s end-to-end deadline."""
    request_id = f"r{arrival.index}"
    done = fleet.finishes.expect(request_id)
    start = trio.current_time()
    try:
        with trio.move_on_at(start + E2E_TIMEOUT):
            try:
                async with fleet.target.open(arrival, request_id) as raw, aclosing(raw) as chunks:  # type: ignore[type-var]
                    await _stream(chunks, done, start, record)
            except QueueFull:
                record.outcome = "429"
            except Overloaded:
                record.outcome = "503"
            except DeadlineExceeded:
                record.outcome = "timeout"
            except (BackendError, httpx.HTTPError):
                record.outcome = "error"
            return
        record.outcome = "timeout"
    finally:
        fleet.finishes.forget(request_id)


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
    arrivals: int
    simulated_s: float
    wall_s: float
    preemptions: int
    classes: list[ClassStats] = field(default_factory=list)

    def stats(self, kind: str) -> ClassStats | None:
        return next((c for c in self.classes if c.kind == kind), None)


class _Books:
    """Records, and how many measured requests are still running."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.open_measured = 0
        self.settled = trio.Event()

    async def run(self, fleet: Fleet, arrival: Arrival) -> None:
        record = Record(arrival.kind, arrival.measured)
        if arrival.measured:
            self.records.append(record)
            self.open_measured += 1
        try:
            await send(fleet, arrival, record)
        finally:
            if arrival.measured:
                self.open_measured -= 1


async def play(fleet: Fleet, arrivals: Iterable[Arrival], kinds: tuple[str, ...], window_end: float) -> list[Record]:
    """Send arrivals on time until the window has passed and every measured request has ended.

    Traffic keeps flowing after the window (unmeasured), so the window's last
    requests finish under the same load as its first; a finite schedule (a
    replay) simply ends, as the real-time run did.
    """
    books = _Books()
    base = trio.current_time()
    async with trio.open_nursery() as nursery:
        for arrival in arrivals:
            if arrival.at >= window_end and books.open_measured == 0:
                break
            await trio.sleep_until(base + arrival.at)
            if arrival.kind in kinds:
                nursery.start_soon(books.run, fleet, arrival)
        while books.open_measured:
            await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    return books.records


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


async def _run_point(point: Point) -> PointResult:
    arrivals: Iterable[Arrival] = point.arrivals or poisson(point.rate, point.warmup, point.seconds, point.seed)
    start = trio.current_time()
    async with open_fleet(point.setup, point.seed) as fleet:
        records = await play(fleet, arrivals, point.setup.kinds, point.warmup + point.seconds)
        preemptions = sum(e.statistics().preemptions for e in fleet.engines.values())
    return PointResult(
        setup=point.setup.name,
        load=point.load,
        rate=point.rate,
        warmup_s=point.warmup,
        window_s=point.seconds,
        seed=point.seed,
        arrivals=len(records),
        simulated_s=trio.current_time() - start,
        wall_s=0.0,
        preemptions=preemptions,
        classes=[summarize(records, kind, point.seconds) for kind in point.setup.kinds],
    )


def run_point(point: Point) -> PointResult:
    """Run one point in its own Trio run under a fresh MockClock (a process pool calls this)."""
    started = time.perf_counter()
    result = trio.run(_run_point, point, clock=trio.testing.MockClock(autojump_threshold=0))
    result.wall_s = time.perf_counter() - started
    return result


def is_nan(value: float) -> bool:
    return isinstance(value, float) and math.isnan(value)
