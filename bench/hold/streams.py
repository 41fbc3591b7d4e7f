"""The hold's client: one raw Trio socket per stream, read slowly, tallied; and /health probes on a thread of their own.

A stream counts as open once its first SSE event arrived (routed, backend
connected, relayed end to end).
"""

from __future__ import annotations

import collections
import math
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from bench.harness.client import EVENT, HOST, KeepAliveClient, ProtocolError
from bench.harness.stats import percentile

PROBE_EVERY_S = 0.2
PROBE_TIMEOUT_S = 10.0
PROBES_MAX = 2_000  # a count bound on each probe loop besides the stop flag
READ_SIZE = 16 * 1024
_ERROR_CODE = re.compile(rb'"code":\s*"([a-z_]+)"')  # the OpenAI error body's code, when it came with the head


@dataclass
class HoldTally:
    started: int = 0
    waiting: int = 0  # sent, no response head yet
    first_event: int = 0  # ever got their first SSE event
    open: int = 0  # got their first event and still open
    ended: int = 0  # finished on their own while they should have been held
    failed: int = 0
    events: int = 0
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    head_s: list[float] = field(default_factory=list)  # connect + send to the response head
    first_event_s: list[float] = field(default_factory=list)  # connect + send to the first SSE event


async def hold_one(port: int, request: bytes, read_pause: float, tally: HoldTally) -> None:
    """One stream on its own socket, read slowly until cancelled (closing the socket) or it ends."""
    tally.started += 1
    tally.waiting += 1
    waiting, opened = True, False
    began = time.perf_counter()
    try:
        stream = await trio.open_tcp_stream(HOST, port)
        async with stream:
            await stream.send_all(request)
            data = b""
            while waiting:
                more = await stream.receive_some(READ_SIZE)
                if not more:
                    tally.failed += 1
                    tally.failures["closed before the head"] += 1
                    return
                data += more
                if b"\r\n" in data:
                    waiting = False
                    tally.waiting -= 1
                    tally.head_s.append(time.perf_counter() - began)
                    status = data.split(b" ", 2)[1].decode("ascii", "replace")
                    if status != "200":
                        code = _ERROR_CODE.search(data)
                        tally.failed += 1
                        tally.failures[f"HTTP {status} {code.group(1).decode() if code else ''}".strip()] += 1
                        return
            tail = b""
            while True:
                window = tail + data
                fresh = window.count(EVENT) - tail.count(EVENT)
                tally.events += fresh
                if fresh and not opened:
                    opened = True
                    tally.first_event_s.append(time.perf_counter() - began)
                    tally.first_event += 1
                    tally.open += 1
                tail = window[-(len(EVENT) - 1) :]
                await trio.sleep(read_pause)
                data = await stream.receive_some(READ_SIZE)
                if not data:
                    tally.ended += 1
                    return
    except (OSError, trio.BrokenResourceError) as error:
        tally.failed += 1
        tally.failures[type(error).__name__] += 1
    finally:
        if waiting:
            tally.waiting -= 1
        if opened:
            tally.open -= 1


@dataclass
class Latencies:
    """P50 / P99 / max of one kind of wait, ms."""

    what: str
    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    @staticmethod
    def of(what: str, seconds: Sequence[float]) -> Latencies:
        ordered = sorted(seconds)
        if not ordered:
            return Latencies(what, 0, math.nan, math.nan, math.nan)
        return Latencies(what, len(ordered), percentile(ordered, 50) * 1000, percentile(ordered, 99) * 1000, ordered[-1] * 1000)


class HealthProbes:
    """GET /health on each port every PROBE_EVERY_S, each answer's latency: a stalled event loop shows.

    The probes run in a thread with a Trio run of its own, so that the
    client's ten thousand tasks do not delay them: a slow answer is the
    server's (give or take the GIL's 5 ms switch interval).
    """

    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports
        self.latencies: dict[str, list[float]] = {name: [] for name in ports}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), name="bench-health-probes", daemon=True)

    async def __aenter__(self) -> HealthProbes:
        self._thread.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stop.set()
        await trio.to_thread.run_sync(self._thread.join, PROBE_TIMEOUT_S + 5.0)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            for name, port in self.ports.items():
                nursery.start_soon(self._probe, name, port)

    async def _probe(self, name: str, port: int) -> None:
        client = KeepAliveClient(port)
        request = f"GET /health HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
        try:
            for _ in range(PROBES_MAX):
                if self._stop.is_set():
                    return
                began = time.perf_counter()
                with trio.move_on_after(PROBE_TIMEOUT_S):
                    try:
                        await client.exchange(request)
                    except (OSError, trio.BrokenResourceError, ProtocolError):
                        pass
                self.latencies[name].append(time.perf_counter() - began)
                await trio.sleep(PROBE_EVERY_S)
        finally:
            await client.aclose()
