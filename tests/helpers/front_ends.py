"""Both front ends over one router, on real sockets, with backends that misbehave on demand.

The service (HTTP on tailguard's own server, gRPC on grpc.aio with its
asyncio loop on one more thread) runs in a thread of its own, as in ``grpc_helpers``; tests are plain
synchronous code using httpx and the generated gRPC clients. Unlike
``server.app.serve`` the pieces are put together here, so a test can read
every finished record, set the cap on open gRPC calls, and plant a failing
telemetry sink. One health check runs before the front ends listen (an
endpoint takes requests once a probe has passed), none after: an endpoint
stays in its pool whatever it does (outlier detection never ejects a pool's
only one), even the port nobody listens on once that probe has passed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from tailguard.router import Router
from tailguard.router.config import Config
from tailguard.router.observe import RequestRecord, Telemetry
from tailguard.server.grpc.api import MAX_CONCURRENT_CALLS, Observers, serve_grpc
from tailguard.server.grpc.bridge import open_asyncio_host
from tailguard.server.http.api import HttpApi
from tailguard.server.http.server import HttpSettings, serve as serve_http
from tailguard.server.metrics import Metrics
from tailguard.sim import Engine, SimApp, SimResponse
from tailguard.sim.app import JSON_HEADERS, SSE_HEADERS
from tailguard.sim.http import serve as serve_sim
from tests.helpers.engines import MODEL
from tests.helpers.grpc_service import service_thread
from tests.helpers.sockets import QUICK

SINK_FAILS = "sink-fails"  # a request id starting so makes the planted sink raise


def _event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _delta(text: str, finish: str | None = None) -> bytes:
    return _event({"id": "c", "object": "chat.completion.chunk", "model": MODEL, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


class Faulty:
    """A backend whose completions fail the way ``mode`` says (``ok``: a real simulated engine).

    Modes: ``ok``, ``5xx``, ``garbage`` (200 that is neither JSON nor SSE),
    ``cut`` (a stream that ends cleanly without [DONE]), ``error_event`` (a
    stream with vLLM's in-stream error, then [DONE]), ``not_json``,
    ``binary`` and ``bad_utf8`` (a stream whose second framed event is not
    JSON, then [DONE]), ``junk_then_done`` (bytes outside any ``data:`` line
    run into ``data: [DONE]``: one line, no data), ``hang`` (no byte ever), ``slow`` (a stream of an
    event every 20 ms for 10 s), ``hold`` (the same for 60 s).
    """

    def __init__(self, mode: str = "ok") -> None:
        self.engine = Engine(QUICK)
        self.app = SimApp(self.engine, model=MODEL)
        self.mode = mode

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        mode = self.mode
        if mode == "ok" or not path.endswith("completions"):
            return await self.app.handle(method, path, headers, body)
        stream = bool(json.loads(body).get("stream"))
        if mode == "5xx":
            return SimResponse(500, list(JSON_HEADERS), b'{"error": {"message": "CUDA out of memory", "type": "InternalServerError"}}')
        if mode == "garbage":
            return SimResponse(200, list(SSE_HEADERS if stream else JSON_HEADERS), b"<html>upstream sent nonsense</html>\n")
        if mode == "hang":
            await trio.sleep_forever()
        events = {
            "cut": [_delta("Hello"), _delta(" there")],
            "error_event": [_delta("Hello"), _event({"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}), b"data: [DONE]\n\n"],
            "not_json": [_delta("Hello"), b"data: {not json\n\n", _delta(" there", "stop"), b"data: [DONE]\n\n"],
            "binary": [_delta("Hello"), b"data: \x00\x9c\xff\x01\x89PNG\r\n\n", _delta(" there", "stop"), b"data: [DONE]\n\n"],
            "bad_utf8": [_delta("Hello"), _delta("caf\xe9").replace(b"caf\\u00e9", b"caf\xe9"), _delta(" there", "stop"), b"data: [DONE]\n\n"],
            "junk_then_done": [_delta("Hello"), b"<junk>", b"data: [DONE]\n\n"],
        }.get(mode)
        if events is not None:
            return SimResponse(200, list(SSE_HEADERS), stream=_Events(events))
        if mode in ("slow", "hold"):  # hold: a minute, for a test that must keep the seat however slow the machine
            ticks = 500 if mode == "slow" else 3000
            return SimResponse(200, list(SSE_HEADERS), stream=_Events([_delta("tick ")] * ticks, pause=0.02))
        raise AssertionError(f"unknown mode {mode!r}")


class _Events:
    """A body stream of fixed events, optionally paced."""

    def __init__(self, events: list[bytes], *, pause: float = 0.0) -> None:
        self._events = events
        self._pause = pause

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self._events:
            if self._pause:
                await trio.sleep(self._pause)
            yield event

    async def aclose(self) -> None:
        return None


@dataclass
class FrontEnds:
    """Where the two front ends listen, what they recorded, and how to reach the service."""

    http_url: str
    grpc_target: str
    router: Router
    metrics: Metrics
    token: trio.lowlevel.TrioToken
    _records: dict[str, RequestRecord] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, request_id: str, timeout: float = 5.0) -> RequestRecord:
        """The finished record of a request (waiting, bounded, for the service thread)."""
        ready = threading.Event()
        deadline_checks = int(timeout / 0.005)
        for _ in range(deadline_checks):
            with self._lock:
                found = self._records.get(request_id)
            if found is not None:
                return found
            ready.wait(0.005)
        raise AssertionError(f"no record for {request_id!r}")

    def records(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records.values())

    def sink(self, record: RequestRecord) -> None:
        with self._lock:
            self._records[record.request_id] = record


def _planted_failure(record: RequestRecord) -> None:
    if record.request_id.startswith(SINK_FAILS):
        raise RuntimeError("a broken telemetry sink")


@contextmanager
def front_ends(
    backends: list[Faulty | None],
    make_config: Callable[[list[str]], Config],
    *,
    max_grpc_calls: int = MAX_CONCURRENT_CALLS,
) -> Iterator[FrontEnds]:
    """Backends on free ports (``None``: a port nothing listens on after the first probe), the router, both front ends.

    ``make_config`` gets the backends' URLs in order.
    """

    async def trio_main(ready: threading.Event, box: dict[str, object]) -> None:
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            urls = []
            async with trio.open_nursery() as gone:  # a None backend: up for the one probe, then nobody listens
                for backend in backends:
                    engine_nursery, server = (gone, Faulty()) if backend is None else (nursery, backend)
                    await engine_nursery.start(server.engine.run)
                    port = await engine_nursery.start(serve_sim, server.handle, "127.0.0.1", 0)
                    urls.append(f"http://127.0.0.1:{port}")
                config = make_config(urls)
                router = Router(config)
                modes = [(backend, backend.mode) for backend in backends if backend is not None]
                for backend, _ in modes:  # found well by the probe, failing as asked after it
                    backend.mode = "ok"
                await router.check_health()  # endpoints take requests once a probe has passed
                for backend, mode in modes:
                    backend.mode = mode
                gone.cancel_scope.cancel()
            metrics = Metrics(router)
            telemetry = Telemetry([metrics.observe, _planted_failure])
            http = HttpApi(router, max_body_bytes=config.server.max_body_bytes, telemetry=telemetry, metrics=metrics)
            await nursery.start(http.run)
            async with open_asyncio_host() as host, trio.open_nursery() as front:
                binds = await front.start(
                    lambda task_status: serve_http(http, "127.0.0.1", 0, settings=HttpSettings(), shutdown_trigger=shutdown.wait, task_status=task_status)
                )
                port = await front.start(
                    lambda task_status: serve_grpc(
                        router, host, ("127.0.0.1", 0), shutdown, Observers(telemetry), max_calls=max_grpc_calls, task_status=task_status
                    )
                )
                service = FrontEnds(binds[0], f"127.0.0.1:{port}", router, metrics, trio.lowlevel.current_trio_token())
                telemetry.add_sink(service.sink)
                box["service"] = service
                box["shutdown"] = shutdown
                ready.set()
            await router.aclose()
            nursery.cancel_scope.cancel()

    with service_thread(trio_main, "front-ends") as box:
        service = box["service"]
        shutdown = box["shutdown"]
        assert isinstance(service, FrontEnds) and isinstance(shutdown, trio.Event)
        try:
            yield service
        finally:
            service.token.run_sync_soon(shutdown.set)

