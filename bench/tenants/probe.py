"""The engine's own counts over time (vllm:num_requests_running and _waiting), for the pool's busy fraction."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

from bench.harness.client import HOST, ProtocolError, engine_counts
from bench.harness.open_loop import TokenClient

PROBE_S = 0.1  # real s between looks


@dataclass
class EngineLooks:
    """Every look: (real s after the origin, running, waiting)."""

    looks: list[tuple[float, int, int]] = field(default_factory=list)
    failed: int = 0


async def watch_engine(port: int, origin: float, into: EngineLooks) -> None:
    """Look at the engine's /metrics every PROBE_S until cancelled."""
    client = TokenClient(port)
    scrape = f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
    try:
        while True:
            with trio.move_on_after(1.0):
                try:
                    if (await client.exchange(scrape)).status == 200:
                        running, waiting = engine_counts(client.last_piece)
                        into.looks.append((time.perf_counter() - origin, running, waiting))
                    else:
                        into.failed += 1
                except (OSError, trio.BrokenResourceError, ProtocolError):
                    into.failed += 1
            await trio.sleep(PROBE_S)
    finally:
        await client.aclose()
