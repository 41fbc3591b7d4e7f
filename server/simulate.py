"""``--simulate``: a simulated vLLM engine behind every endpoint of the config.

Each endpoint's engine takes its pool's ``simulate_profile`` (latency for the
interactive pool, throughput for the batch pool); a pool only classes of
embeddings and rerank go to runs pooling engines (``pooling_pool``). Only loopback endpoints can
be simulated; endpoints added by a reload get an engine too, and an endpoint
a reload removes has its engine stopped (its port closed), so reload cycles
leave no listener behind.

Under ``--workers`` worker 0 runs the engines and every other worker waits
for them (:func:`wait_for_engines`) before it asks them anything: a pool
without ``max_model_len`` asks its engines at start, and a worker that asked
before worker 0 had started them could not start at all.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import trio

from tailguard.router.config import POOLING_KINDS, Config
from tailguard.sim import PROFILES, EngineSpec, serve_engine

log = logging.getLogger("tailguard.simulate")

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class SimulateError(ValueError):
    """An endpoint ``--simulate`` cannot serve: not a loopback URL with a port, or its port cannot be bound.

    ``address`` and ``reason`` are set when binding failed (``reason`` is the
    system's, e.g. "Address already in use"), so the caller can name the port.
    """

    def __init__(self, message: str, url: str, *, address: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.url, self.address, self.reason = url, address, reason


def pooling_pool(config: Config, pool: str) -> bool:
    """Whether a pool serves an embedding model: some class routes to it and every such class takes only pooling kinds.

    Its engines are simulated as vLLM's ``--runner pooling`` (embeddings and
    rerank, no generation), as a real deployment runs an embedding model there.
    """
    classes = [klass for klass in config.classes if klass.pool == pool]
    return bool(classes) and all(klass.kinds <= POOLING_KINDS for klass in classes)


class SimulatedFleet:
    """The engines started for a config, one per endpoint URL."""

    def __init__(self, nursery: trio.Nursery, *, time_scale: float = 1.0) -> None:
        self._nursery = nursery
        self._time_scale = time_scale
        self._running: dict[str, _Running] = {}

    async def ensure(self, config: Config) -> None:
        """Start an engine for every endpoint that has none yet: all of them, or none.

        Every new endpoint is checked before any engine starts; if one fails
        to start (its port is taken), the engines started by this call are
        stopped again and the error is raised, naming the endpoint.
        """
        specs: list[tuple[str, EngineSpec]] = []
        for pool in config.pools:
            for endpoint in pool.endpoints:
                if endpoint.url in self._running:
                    continue
                parts = urlsplit(endpoint.url)
                host = parts.hostname or ""
                if host not in _LOOPBACK or parts.port is None:
                    raise SimulateError(f"--simulate needs loopback endpoints with a port; {endpoint.url} is not one", endpoint.url)
                runner = "pooling" if pooling_pool(config, pool.name) else "generate"
                spec = EngineSpec(
                    port=parts.port,
                    params=PROFILES[pool.simulate_profile],
                    host="127.0.0.1" if host == "localhost" else host,
                    model=pool.models[0],
                    time_scale=self._time_scale,
                    name=f"{pool.simulate_profile}@{parts.port}" if runner == "generate" else f"pooling@{parts.port}",
                    runner=runner,
                )
                specs.append((endpoint.url, spec))
        started: list[_Running] = []
        try:
            for url, spec in specs:
                try:
                    started.append(await self._nursery.start(_engine_in_scope, spec))
                except (OSError, BaseExceptionGroup) as error:  # the engine's bind fails inside its own nursery
                    failed = lone_os_error(error)
                    if failed is None:
                        raise
                    address = f"[{spec.host}]:{spec.port}" if ":" in spec.host else f"{spec.host}:{spec.port}"
                    reason = failed.strerror or str(failed)
                    raise SimulateError(
                        f"--simulate could not start an engine for {url} on {address}: {reason}", url, address=address, reason=reason
                    ) from failed
        except BaseException:
            for engine in started:
                engine.scope.cancel()
            raise
        for (url, spec), engine in zip(specs, started):
            self._running[url] = engine
            log.info("simulated %s engine serving %s at %s", spec.name.split("@")[0], spec.model, url)

    async def retire(self, config: Config) -> None:
        """Stop the engines of endpoints ``config`` no longer has, and wait until their ports are closed.

        Called once a reload applied ``config`` (not before: a reload refused
        later keeps the running config, and its engines). Requests still in
        flight on a removed endpoint end as a backend error.
        """
        kept = {endpoint.url for pool in config.pools for endpoint in pool.endpoints}
        gone = [url for url in self._running if url not in kept]
        for url in gone:
            self._running[url].scope.cancel()
        for url in gone:
            await self._running.pop(url).stopped.wait()
            log.info("simulated engine at %s stopped: its endpoint left the config", url)


def lone_os_error(error: BaseException) -> OSError | None:
    """The OSError that ``error`` is, or that a (nested) exception group holds alone, else None.

    A server that fails to bind inside its own nursery (the engine here)
    raises its OSError wrapped in groups.
    """
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error if isinstance(error, OSError) else None


async def wait_for_engines(config: Config, timeout: float) -> list[str]:
    """Wait until every loopback endpoint of ``config`` accepts connections; the URLs that still do not after ``timeout`` s.

    For a worker whose engines another worker starts: the answer is the
    listener's, not a guess at how long that takes. An endpoint that is not
    loopback with a port is left out (the worker that simulates refuses it).
    """
    waiting: dict[str, tuple[str, int]] = {}
    for pool in config.pools:
        for endpoint in pool.endpoints:
            parts = urlsplit(endpoint.url)
            if parts.hostname in _LOOPBACK and parts.port is not None:
                waiting[endpoint.url] = ("127.0.0.1" if parts.hostname == "localhost" else parts.hostname, parts.port)
    with trio.move_on_after(timeout):
        while waiting:
            for url, (host, port) in list(waiting.items()):
                try:
                    stream = await trio.open_tcp_stream(host, port)
                except OSError:
                    continue
                await stream.aclose()
                del waiting[url]
            if waiting:
                await trio.sleep(0.02)  # worker 0 binds them within a second or two of starting
    return list(waiting)


class _Running:
    """One engine's cancel scope, and an event set once it has stopped (its socket closed)."""

    __slots__ = ("scope", "stopped")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.stopped = trio.Event()


async def _engine_in_scope(spec: EngineSpec, *, task_status: trio.TaskStatus[_Running] = trio.TASK_STATUS_IGNORED) -> None:
    """One engine, stoppable through the handle it reports once it listens."""
    engine = _Running()
    try:
        with engine.scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_engine, spec)
                task_status.started(engine)
    finally:
        engine.stopped.set()
