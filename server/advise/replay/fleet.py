"""The fleet in virtual time, as ``python -m bench sweep`` and ``tailguard advise`` run it: a set-up's engines and router opened, one request sent.

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
- points run in separate processes (one ``trio.run`` each, ``point``), with
  the cyclic garbage collector run rarely.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.admission import RouterRequest, message_text
from tailguard.router.config import TimeoutsConfig
from tailguard.router.errors import BackendError, BackendRejected, DeadlineExceeded, Overloaded, QueueFull
from tailguard.sim.canned import canned_transport
from tailguard.sim.engine import EngineRequestError
from tailguard.sim.params import PROFILES
from tailguard.sim.prefix_cache import BLOCK_SIZE, prompt_block_keys
from tailguard.sim.tokens import chat_prompt_key, count_chat_tokens

from .clock import Timeline
from .engine import SweepEngine, SweepSequence
from .mix import SHORT_SHARE, unique_body_for, unique_payload
from .rebalancing import RebalanceLoop, rebalances
from .setups import Setup

E2E_TIMEOUT = TimeoutsConfig().end_to_end_timeout  # 120 s: every set-up's caller gives up here


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
    tokens: int = 0  # output tokens generated


def _timings(sequence: SweepSequence, start: float, record: Record) -> None:
    """TTFT and E2E from the engine's own timestamps: the instants a streaming reader sees them."""
    if sequence.first_token_at is not None:
        record.ttft = sequence.first_token_at - start
    if sequence.finished_at is not None:
        record.e2e = sequence.finished_at - start
    record.outcome = "ok" if sequence.finish_reason == "length" else "error"
    record.tokens = sequence.produced


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
            # What a relay reading the stream would have noted, for the router's own measures at the end
            # (the lender's pace watch): no chunk passes here.
            seen = completion.record
            seen.first_token_at, seen.completion_tokens = sequence.first_token_at, sequence.produced

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
