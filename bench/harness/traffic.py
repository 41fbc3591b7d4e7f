"""Open-loop arrivals: Poisson schedules, and an HTTP open loop that never waits for a connection.

An open loop sends each request at its due time whatever the earlier ones
are doing, as real clients do; a closed loop (``router_overhead.run``)
would slow down with the server and hide its queueing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from bench.harness.client import CALL_TIMEOUT_S, ConnectionPool, ProtocolError, Source
from tailguard.server.advise.replay.mix import SHORT_SHARE


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start, real time
    kind: str  # "short" or "long"
    measured: bool  # arrived after the warm-up


def schedule(rate: float, warmup: float, seconds: float, seed: int) -> list[Arrival]:
    """Poisson arrivals over warm-up + window, each short with probability 0.8 (seeded)."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    at = rng.expovariate(rate)
    while at < warmup + seconds:
        kind = "short" if rng.random() < SHORT_SHARE else "long"
        arrivals.append(Arrival(at, kind, at >= warmup))
        at += rng.expovariate(rate)
    return arrivals

START_DELAY_S = 0.05  # between drawing the schedule's origin and its first arrival


def poisson_offsets(rate: float, seconds: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of a Poisson process at ``rate``; the same seed gives the same arrivals."""
    rng = random.Random(seed)
    offsets: list[float] = []
    t = rng.expovariate(rate)
    limit = int(rate * seconds * 2) + 100  # a bound besides the horizon
    while t < seconds and len(offsets) < limit:
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


@dataclass
class OpenTally:
    """One open-loop run as the client saw it (seconds)."""

    latencies: list[float] = field(default_factory=list)  # completion - scheduled send time
    lags: list[float] = field(default_factory=list)  # actual send start - scheduled send time
    errors: int = 0
    dropped: int = 0  # no connection could be had (HTTP pool at MAX_CONNECTIONS)
    connections: int = 0  # connections opened (HTTP) or channels used (gRPC)


async def _http_call(pool: ConnectionPool, request: Source, due: float, tally: OpenTally) -> None:
    client = pool.try_take()
    if client is None:
        tally.dropped += 1
        return
    tally.lags.append(time.perf_counter() - due)
    try:
        reply = await client.exchange(request())
    except (OSError, trio.BrokenResourceError, ProtocolError):
        tally.errors += 1
    else:
        if reply.status == 200:
            tally.latencies.append(time.perf_counter() - due)
        else:
            tally.errors += 1
    finally:
        pool.give_back(client)  # a failed client closed itself and reconnects on its next use


async def http_open_loop(pool: ConnectionPool, request: Source, offsets: Sequence[float]) -> OpenTally:
    """Send ``request()``'s bytes at ``offsets`` (s from now) whatever the server does; wait for the stragglers (bounded)."""
    tally = OpenTally()
    opened_before = pool.opened
    start = time.perf_counter() + START_DELAY_S
    horizon = offsets[-1] if offsets else 0.0
    with trio.move_on_after(START_DELAY_S + horizon + CALL_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for offset in offsets:
                due = start + offset
                delay = due - time.perf_counter()
                if delay > 0:
                    await trio.sleep(delay)
                nursery.start_soon(_http_call, pool, request, due, tally)
    tally.connections = pool.opened - opened_before
    return tally
