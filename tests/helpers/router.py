"""Router set-ups over in-process simulated engines (no sockets, virtual time).

The router reaches each engine through production's transport
(``LeanTransport``'s bytes and parsing) over memory streams that the
simulator's own HTTP server answers (``bench/sim/memory.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import trio

from tailguard.router import Router
from tailguard.router.admission import RouterRequest, Routing
from tailguard.router.backend import ConnectorTransport
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
from tailguard.sim import PROFILES, Engine, EngineParams, SimApp
from tailguard.sim.canned import canned_transport
from tailguard.sim.memory import memory_connector
from tests.helpers.engines import MODEL

INTERACTIVE_URL = "http://interactive-0:8000"
BATCH_URL = "http://batch-0:8000"


def two_pool_config(
    *,
    interactive_cap: int = 8,
    batch_cap: int = 16,
    max_queue: int = 64,
    interactive_urls: Iterable[str] = (INTERACTIVE_URL,),
    batch_urls: Iterable[str] = (BATCH_URL,),
    limits: LimitsConfig | None = None,
    timeouts: TimeoutsConfig | None = None,
    interactive_timeout: float = 3.0,
    batch_timeout: float = 30.0,
    max_model_len: int = 32768,
) -> Config:
    """The shipped shape: an interactive pool and a batch pool, the origin's thresholds."""
    interactive = tuple(EndpointConfig(url, interactive_cap) for url in interactive_urls)
    batch = tuple(EndpointConfig(url, batch_cap) for url in batch_urls)
    return Config(
        server=ServerConfig(),
        estimate=EstimateConfig(),
        limits=limits or LimitsConfig(),
        timeouts=timeouts or TimeoutsConfig(),
        pools=(
            PoolConfig("interactive", interactive, interactive_cap * max(1, len(interactive)), max_queue, max_model_len, (MODEL,), "latency"),
            PoolConfig("batch", batch, batch_cap * max(1, len(batch)), max_queue, max_model_len, (MODEL,), "throughput"),
        ),
        classes=(
            ClassConfig("interactive", "interactive", interactive_timeout, 0, 500, 128),
            ClassConfig("batch", "batch", batch_timeout, 1),
        ),
        digest="test",
    )


def with_digest(config: Config, digest: str, **changes: object) -> Config:
    return dataclasses.replace(config, digest=digest, **changes)  # type: ignore[arg-type]


@dataclass
class Fleet:
    """Engines by endpoint URL, and the router in front of them."""

    engines: dict[str, Engine]
    router: Router

    def engine(self, url: str) -> Engine:
        return self.engines[url]


@asynccontextmanager
async def router_over_engines(
    config: Config,
    params: dict[str, EngineParams] | None = None,
    extra_urls: Iterable[str] = (),
    wrap: Callable[[str, httpx.AsyncBaseTransport], httpx.AsyncBaseTransport] | None = None,
    *,
    probe: bool = True,
    per_request_metrics: bool = False,
    responses_store: bool = False,
) -> AsyncIterator[Fleet]:
    """A Router whose endpoints are in-process engines (latency profile unless given), each probed once
    (``probe=False``: none is, and every endpoint is unknown: it takes no request until a probe passes).

    ``wrap(url, transport)`` puts a test's transport in front of an engine's
    (to see or refuse its calls): the router's transport seam, not a swap.
    It applies once the first probe passed, unless ``probe`` is False.
    ``per_request_metrics``: the engines run as vLLM's ``--enable-per-request-metrics``.
    """
    params = params or {}
    urls = {e.url for p in config.pools for e in p.endpoints} | set(extra_urls)
    engines = {url: Engine(params.get(url, PROFILES["latency"]), name=url) for url in sorted(urls)}
    async with trio.open_nursery() as nursery:  # the engines, and the server end of each connection
        for engine in engines.values():
            await nursery.start(engine.run)
        transports: dict[str, ConnectorTransport] = {
            url: ConnectorTransport(memory_connector(SimApp(engine, model=MODEL, enable_per_request_metrics=per_request_metrics, enable_responses_api_store=responses_store).handle, nursery))
            for url, engine in engines.items()
        }
        probing = probe
        if wrap is not None:
            wrapped = {url: wrap(url, transport) for url, transport in transports.items()}
            # The wrap applies from the first probe on (the engine found well first, failing later) ...
            transports = {url: _switch(lambda: probing, transports[url], wrapped[url]) for url in transports}

        def transport_for(endpoint: EndpointConfig) -> ConnectorTransport:
            return transports[endpoint.url]

        router = Router(config, transport_factory=transport_for, seed=0)
        if probe:
            await router.check_health()  # endpoints take requests once a probe has passed
            probing = False
        try:
            yield Fleet(engines, router)
        finally:
            await router.aclose()
            nursery.cancel_scope.cancel()


def _switch(before: Callable[[], bool], first: httpx.AsyncBaseTransport, then: httpx.AsyncBaseTransport) -> ConnectorTransport:
    """``first`` while ``before()``, ``then`` after: a wrapped engine that passed its first probe."""

    async def handle(request: httpx.Request) -> httpx.Response:
        return await (first if before() else then).handle_async_request(request)

    return canned_transport(handle)


def chat(text: str = "What is the capital of France?", *, max_tokens: int | None = 16, stream: bool = False, request_id: str = "r", **kwargs: object) -> RouterRequest:
    return RouterRequest(
        kind="chat",
        request_id=request_id,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        stream=stream,
        **kwargs,  # type: ignore[arg-type]
    )


async def run_to_end(router: Router, request: RouterRequest) -> tuple[bytes, Routing]:
    """Open, read everything, return (body, routing)."""
    with trio.CancelScope(deadline=router.deadline_for(request)):
        async with router.open(request) as completion:
            if request.stream:
                body = b"".join([chunk async for chunk in completion.chunks()])
            else:
                body = await completion.read()
            return body, completion.routing
    raise AssertionError("deadline passed")
