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
        """Start an engine for every endpoint that has none yet."""
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
                await self._nursery.start(serve_engine, spec)
                self._running.add(endpoint.url)
                log.info("simulated %s engine serving %s at %s", pool.simulate_profile, spec.model, endpoint.url)
