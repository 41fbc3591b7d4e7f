"""What the cluster benchmark watches: every capped engine's running count against its cap, the replicas' pages."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.client import HOST, ProtocolError, engine_counts
from bench.harness.open_loop import TokenClient


@dataclass
class CapWatch:
    """One capped engine as its own /metrics tells it, looked at every ``interval``."""

    role: str
    port: int
    cap: int
    looks: int = 0
    failed_looks: int = 0
    max_running: int = 0
    max_in_engine: int = 0  # running + waiting: every request the routers have sent it
    over_cap_looks: int = 0
    first_over_s: float | None = None
    longest_gap_ms: float = 0.0  # between two successful looks
    seconds: float = 0.0


async def watch_engine(watch: CapWatch, interval: float, origin: float) -> None:
    """Scrape the engine every ``interval`` s until cancelled (a look slower than that starts the next at once)."""
    client = TokenClient(watch.port)
    scrape = f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{watch.port}\r\n\r\n".encode()
    start = last = trio.current_time()
    try:
        while True:
            with trio.move_on_after(1.0):
                try:
                    reply = await client.exchange(scrape)
                except (OSError, trio.BrokenResourceError, ProtocolError):
                    reply = None
            now = trio.current_time()
            if reply is None or reply.status != 200:
                watch.failed_looks += 1
            else:
                running, waiting = engine_counts(client.last_piece)
                watch.looks += 1
                watch.max_running = max(watch.max_running, running)
                watch.max_in_engine = max(watch.max_in_engine, running + waiting)
                if running + waiting > watch.cap:
                    watch.over_cap_looks += 1
                    if watch.first_over_s is None:
                        watch.first_over_s = round(time.perf_counter() - origin, 3)
                watch.longest_gap_ms = max(watch.longest_gap_ms, (now - last) * 1000)
                last = now
            watch.seconds = now - start
            await trio.sleep_until(max(now, start + (watch.looks + watch.failed_looks) * interval))
    finally:
        await client.aclose()


def watch_summary(watches: Sequence[CapWatch]) -> dict[str, Any]:
    return {w.role: asdict(w) | {"mean_interval_ms": round(w.seconds / max(w.looks, 1) * 1000, 2)} for w in watches}


async def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """A replica's /metrics, parsed by prometheus_client: family -> labels -> value."""
    client = TokenClient(port)
    try:
        await client.exchange(f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode())
        text = client.last_piece.decode()
    finally:
        await client.aclose()
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found
