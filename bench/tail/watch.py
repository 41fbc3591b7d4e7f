"""What the tail benchmark watches while a set-up runs: the router's process, queues and log, the engines' counts."""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.harness.client import HOST, ProtocolError, engine_counts
from bench.harness.open_loop import Sample, TokenClient
from bench.harness.procs import process_cpu_seconds
from bench.tail.model import ENGINE_PROBE_S, PROBE_S, EngineWatch, Options, Probe
from bench.tail.router import RunningRouter


async def watch_router(router: RunningRouter, origin: float, into: list[Probe]) -> None:
    """Every PROBE_S: the router's memory, CPU, open descriptors and queue (from /metrics)."""
    pid = router.process.pid
    client = TokenClient(router.port)
    scrape = f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{router.port}\r\n\r\n".encode()
    health = f"GET /health HTTP/1.1\r\nHost: {HOST}:{router.port}\r\n\r\n".encode()
    last_cpu, last_wait, last_t = sum(process_cpu_seconds(pid)), _runqueue_seconds(pid), time.perf_counter()
    try:
        while True:
            try:
                rss, peak = _memory_mib(pid)
                cpu, fds = sum(process_cpu_seconds(pid)), len(os.listdir(f"/proc/{pid}/fd"))
                wait = _runqueue_seconds(pid)
            except OSError:
                return
            now = time.perf_counter()
            health_ms = await _answer_ms(client, health)
            waiting, in_flight, gc_pauses, sharing = await _queue_gauges(client, scrape)
            cores, cpu_wait = (cpu - last_cpu) / (now - last_t), (wait - last_wait) / (now - last_t)
            into.append(
                Probe(
                    round(now - origin, 2), rss, peak, cores, cpu_wait, fds, waiting, in_flight, health_ms, gc_pauses,
                    assignment=sharing.assignment if sharing else None,
                    moving=sharing.moving if sharing else 0,
                    lent=sharing.lent if sharing else 0.0,
                    borrowed=sharing.borrowed if sharing else math.nan,
                )
            )
            last_cpu, last_wait, last_t = cpu, wait, now
            await trio.sleep(PROBE_S)
    finally:
        await client.aclose()


def _runqueue_seconds(pid: int) -> float:
    """Seconds the process's main thread (tailguard's event loop) has spent runnable but waiting for a CPU.

    From /proc/PID/schedstat (run time, run-queue wait, time slices; ns): on a
    shared machine this is how much of the router's latency is someone else's CPU.
    """
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def _memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    found: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


async def _answer_ms(client: TokenClient, request: bytes) -> float | None:
    """Milliseconds the router takes to answer ``request`` on a warm connection; None past 1 s or on error."""
    start = time.perf_counter()
    with trio.move_on_after(1.0):
        try:
            await client.exchange(request)
        except (OSError, trio.BrokenResourceError, ProtocolError):
            return None
        return (time.perf_counter() - start) * 1000
    return None


_GAUGES = {
    "waiting": b"tailguard_pool_queue_length{",
    "in_flight": b"tailguard_pool_in_flight{",
    "gc_count": b"tailguard_gc_pause_seconds_count{",
    "gc_fast": b'tailguard_gc_pause_seconds_bucket{generation="',  # only the le="0.01" buckets, below
    "gc_seconds": b"tailguard_gc_pause_seconds_sum{",
    "moving": b"tailguard_endpoint_moving{",
    "lent": b"tailguard_pool_lent_seats{",
    "borrowed": b"tailguard_pool_borrowed_total{",
}


@dataclass(frozen=True)
class _Sharing:
    """Lending and rebalancing as the router's /metrics tells them."""

    assignment: dict[str, int]  # pool -> endpoints now
    moving: int
    lent: float
    borrowed: float


_ASSIGNED = re.compile(rb'^tailguard_endpoint_assignment\{[^}]*pool="([^"]*)"')


async def _queue_gauges(
    client: TokenClient, scrape: bytes
) -> tuple[float | None, float | None, tuple[float, float, float] | None, _Sharing | None]:
    """Requests waiting and holding a seat, summed over pools, the GC pauses so far, and the sharing, from the router's /metrics."""
    with trio.move_on_after(1.0):
        try:
            reply = await client.exchange(scrape)
        except (OSError, trio.BrokenResourceError, ProtocolError):
            return None, None, None, None
        if reply.status != 200:
            return None, None, None, None
        sums = dict.fromkeys(_GAUGES, 0.0)
        assignment: dict[str, int] = {}
        for line in client.last_piece.splitlines():
            for name, prefix in _GAUGES.items():
                if line.startswith(prefix) and (name != "gc_fast" or b'le="0.01"' in line):
                    sums[name] += float(line.rsplit(b" ", 1)[1])
            if match := _ASSIGNED.match(line):
                pool = match.group(1).decode()
                assignment[pool] = assignment.get(pool, 0) + 1
        gc_pauses = (sums["gc_count"], sums["gc_count"] - sums["gc_fast"], sums["gc_seconds"])
        sharing = _Sharing(assignment, int(sums["moving"]), sums["lent"], sums["borrowed"])
        return sums["waiting"], sums["in_flight"], gc_pauses, sharing
    return None, None, None, None


async def watch_engines(watch: EngineWatch, origin: float, keep: bool) -> None:
    """Every ENGINE_PROBE_S: each engine's own running and waiting counts; the most seen; all of them if ``keep``."""
    clients = {port: TokenClient(int(port)) for port in watch.caps}
    try:
        while True:
            look: dict[str, tuple[int, int]] = {}
            for port, client in clients.items():
                scrape = f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
                with trio.move_on_after(1.0):
                    try:
                        if (await client.exchange(scrape)).status == 200:
                            look[port] = engine_counts(client.last_piece)
                    except (OSError, trio.BrokenResourceError, ProtocolError):
                        pass
            for port, (running, waiting) in look.items():
                watch.max_running[port] = max(watch.max_running.get(port, 0), running)
                watch.max_sent[port] = max(watch.max_sent.get(port, 0), running + waiting)
            watch.looks += 1
            if keep:
                watch.timeline.append((round(time.perf_counter() - origin, 2), look))
            await trio.sleep(ENGINE_PROBE_S)
    finally:
        for client in clients.values():
            await client.aclose()


def join_access_log(router: RunningRouter, samples: Sequence[Sample]) -> float:
    """Put the router's own end-to-end time and TTFT (its access log) on each sample; the share of measured ones found."""
    times = dict(router.log_rows(b'"tailguard.access"', lambda row: (str(row["request_id"]), (_seconds(row["e2e_ms"]), _seconds(row["ttft_ms"])))))
    measured = [s for s in samples if s.measured]
    for s in samples:
        s.router_e2e, s.router_ttft = times.get(s.request_id, (None, None))
    return sum(1 for s in measured if s.router_e2e is not None) / len(measured) if measured else math.nan


def _seconds(ms: float | None) -> float | None:
    """An access log's milliseconds (null when not measured) as seconds."""
    return None if ms is None else float(ms) / 1000


def rss_summary(timeline: Sequence[Probe], options: Options) -> dict[str, float]:
    """RSS at the start, at the end of the warm-up, at the last arrival, at the end; the peak; the window's slope."""
    if not timeline:
        return {}

    def at(t: float) -> float:
        return min(timeline, key=lambda p: abs(p.t - t)).rss_mib

    window = [p for p in timeline if options.warmup <= p.t <= options.warmup + options.seconds]
    return {
        "start": timeline[0].rss_mib,
        "warmup_end": at(options.warmup),
        "window_end": at(options.warmup + options.seconds),
        "end": timeline[-1].rss_mib,
        "max": timeline[-1].peak_rss_mib,
        "window_slope_per_min": _slope([p.t for p in window], [p.rss_mib for p in window]) * 60,
    }


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (NaN with fewer than 3 points)."""
    if len(xs) < 3:
        return math.nan
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else math.nan
