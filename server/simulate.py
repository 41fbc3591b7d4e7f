"""``--simulate``: a simulated vLLM engine behind every endpoint of the config.

Each endpoint's engine takes its pool's ``simulate_profile`` (latency for the
interactive pool, throughput for the batch pool). Only loopback endpoints can
be simulated; endpoints added by a reload get an engine too.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import trio

from bench.sim import PROFILES, EngineSpec, serve_engine
from router.config_types import Config

log = logging.getLogger("tailguard.simulate")

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class SimulatedFleet:
    """The engines started for a config, one per endpoint URL."""

    def __init__(self, nursery: trio.Nursery, *, time_scale: float = 1.0) -> None:
        self._nursery = nursery
        self._time_scale = time_scale
        self._running: set[str] = set()

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
                    raise ValueError(f"--simulate needs loopback endpoints with a port; {endpoint.url} is not one")
                spec = EngineSpec(
                    port=parts.port,
                    params=PROFILES[pool.simulate_profile],
                    host="127.0.0.1" if host == "localhost" else host,
                    model=pool.models[0],
                    time_scale=self._time_scale,
                    name=f"{pool.simulate_profile}@{parts.port}",
                )
                specs.append((endpoint.url, spec))
        started: list[trio.CancelScope] = []
        try:
            for url, spec in specs:
                try:
                    started.append(await self._nursery.start(_engine_in_scope, spec))
                except OSError as error:
                    raise ValueError(f"--simulate could not start an engine for {url}: {error}") from error
        except BaseException:
            for scope in started:
                scope.cancel()
            raise
        for url, spec in specs:
            self._running.add(url)
            log.info("simulated %s engine serving %s at %s", spec.name.split("@")[0], spec.model, url)


async def _engine_in_scope(spec: EngineSpec, *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
    """One engine, stoppable through the cancel scope it reports once it listens."""
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_engine, spec)
            task_status.started(scope)
