"""tailguard with its gRPC front end, run by ``trio.run`` in a background thread.

The whole service (and its simulated engines) runs in a thread of its own
(its gRPC server on one more, as in production), so gRPC tests are plain
synchronous tests using the generated blocking clients over a real socket.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from tailguard.router.config import Config
from tailguard.server.app import Running, serve
from tailguard.sim import Engine, EngineParams, SimApp, SimResponse
from tailguard.sim.http import serve as serve_sim
from tests.helpers.engines import MODEL


class Switchable:
    """An engine that can be turned off (``up``), or made to fail only its completions."""

    def __init__(self, engine: Engine) -> None:
        self.app = SimApp(engine, model=MODEL)
        self.up = True
        self.fail_completions = False

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        if not self.up or (self.fail_completions and path.endswith("completions")):
            return SimResponse(500 if self.up else 503, [("content-type", "application/json")], b'{"error": {"message": "engine failure"}}')
        return await self.app.handle(method, path, headers, body)

@dataclass
class Service:
    running: Running
    engines: list[Engine]
    switches: list[Switchable]
    urls: list[str]
    token: trio.lowlevel.TrioToken
    _shutdown: trio.Event = field(repr=False)

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.running.grpc_port}"

    @property
    def http_url(self) -> str:
        return self.running.http_url

ServiceMain = Callable[[threading.Event, dict[str, object]], Awaitable[None]]


@contextmanager
def service_thread(trio_main: ServiceMain, name: str) -> Iterator[dict[str, object]]:
    """Run ``trio_main(ready, box)`` under ``trio.run`` on a thread of its own.

    Yields ``box`` once ``ready`` is set (what the service put there); on
    exit, after the caller told the service to stop, waits for the thread and
    raises what it failed with.
    """
    ready = threading.Event()
    box: dict[str, object] = {}

    def thread_main() -> None:
        try:
            trio.run(trio_main, ready, box)
        except BaseException as error:
            box["error"] = error
            ready.set()

    thread = threading.Thread(target=thread_main, name=name, daemon=True)
    thread.start()
    if not ready.wait(60) or "error" in box:
        raise RuntimeError(f"the service did not start: {box.get('error')!r}")
    try:
        yield box
    finally:
        thread.join(30)
        assert not thread.is_alive(), "the service did not stop"
        error = box.get("error")
        if isinstance(error, BaseException):
            raise RuntimeError("the service failed") from error


@contextmanager
def grpc_service(engine_params: list[EngineParams], make_config: Callable[[list[str]], Config]) -> Iterator[Service]:
    """Engines on free ports, then tailguard (HTTP + gRPC) configured by ``make_config(urls)``."""

    async def trio_main(ready: threading.Event, box: dict[str, object]) -> None:
        shutdown = trio.Event()
        engines = [Engine(params) for params in engine_params]
        switches = [Switchable(engine) for engine in engines]
        async with trio.open_nursery() as nursery:
            urls = []
            for engine, switch in zip(engines, switches):
                await nursery.start(engine.run)
                port = await nursery.start(serve_sim, switch.handle, "127.0.0.1", 0)
                urls.append(f"http://127.0.0.1:{port}")
            config = make_config(urls)

            async def run_service(task_status: trio.TaskStatus[Running]) -> None:
                await serve(config, None, http_port=0, grpc_port=0, grpc=True, shutdown=shutdown, task_status=task_status)

            async with trio.open_nursery() as service_nursery:
                running = await service_nursery.start(run_service)
                box["service"] = Service(running, engines, switches, urls, trio.lowlevel.current_trio_token(), shutdown)
                ready.set()
            # serve() returned: it shut down gracefully; now the engines can go.
            nursery.cancel_scope.cancel()

    with service_thread(trio_main, "tailguard-service") as box:
        service = box["service"]
        assert isinstance(service, Service)
        try:
            yield service
        finally:
            try:
                service.token.run_sync_soon(service._shutdown.set)
            except trio.RunFinishedError:
                pass  # the test shut it down itself, and it already stopped

def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Bounded wait for a condition another thread makes true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)
