"""The gate on open gRPC completion calls: as many as the process relays while calls still get picked up.

Where calls wait. grpc core holds each call until grpc.aio asks for it, and
grpc.aio asks for a method's next call only once the previous one has been
handed over, a chain of several turns of the asyncio loop and a wake-up of
grpc's poller thread. A call not yet asked for is invisible here, and core
cancels it once it has waited ``grpc.server_max_unrequested_time_in_server``
(30 s; checked when the next call is asked for): CANCELLED, no details, no
access line, no metric. How fast calls are picked up is how fast that chain
turns, and it slows with the streams the loop relays (each message is a
batch in core and a wake-up here). Measured on 2 cores with the simulated
engines at ~60 tokens a second a stream (client and engines on the same
cores): a timer on the loop fired 0.8 ms late with 25 streams relayed, 1.6 ms
with 50, 5-10 ms with 100 and 17-25 ms with 200; the loop picked up ~1,000
calls a second with no stream relayed, 35-60 with 100. With the shipped 512
seats and a fixed gate of 1,000, a flood of 2,000 calls on one channel was
never refused: the loop picked calls up too slowly for the open calls to
reach 1,000, and served calls waited up to 10 s in grpc unseen (bigger floods
met the 30 s cancel). What one process relays depends on its cores, the
engines' token rate and what else it serves: no fixed number is right.

So the gate is measured. grpc core counts the calls it has started and
finished (channelz); what it holds beyond the calls inside tailguard's
handlers is waiting to be picked up (:class:`Backlog`). Divided by the rate
at which calls are picked up, that is how long the newest of them will wait.
:class:`CallGate` moves its limit the way TCP moves its window: while that
wait is over ``WAIT_TARGET`` it backs off to ``BACKOFF`` of the calls open, so
the loop relays less and picks up (and refuses) faster; while the limit binds
and nothing waits, it grows by ``GROWTH`` a tick. It never goes above its
ceiling (``server.grpc_max_calls``, or less where the pools are small) nor
below ``FLOOR``, where it starts: a cold process takes what any process
relays, and the rest of a burst hears ``server_busy`` with a retry hint,
instead of waiting in grpc for a loop it has swamped. Clients that keep
more calls open than the gate allows keep their excess coming back; while
the loop picks those up within a quarter of the target they let the gate
grow, and where it does not (a loop saturated by what it relays) they are
refused, each with its retry hint. Measured with ``python -m bench
grpc_overhead --streams-open 0`` (200 streams restarted as they end, an
instant engine, a loaded 2-core machine): 9 refusals in its 10 s window,
5,687 chunks a second relayed (5,319 with the fixed gate, which refused none).

What it cannot do: a refusal still needs the call picked up, so a burst on
one connection is answered at the rate refusals are picked up (~300 a second
on the machine above with the engines and the client beside it, ~2,000 alone;
``bench chaos``'s gRPC flood measures it). The HTTP/2 stream limit
(``api.streams_bound``) keeps what one connection can put in core at once to
what that rate answers well inside grpc's 30 s; a client's further calls wait
in the client.

Asyncio side only; :class:`CallGate` itself is clock-free (it is told what
waits and how fast calls are picked up).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from grpc._cython import cygrpc  # channelz: grpcio-channelz serves the same functions as a service

log = logging.getLogger("tailguard.grpc")

# Seconds the newest call may wait inside grpc before the gate backs off (grpc cancels at 30).
WAIT_TARGET = 1.0
# Calls waiting in grpc that never make the gate back off: a few calls in flight between
# core and a handler, and health Watch streams (inside grpc, outside tailguard's handlers).
MIN_BACKLOG = 32
# Open calls the gate always allows, and starts with: measured above, ~50-60 relayed streams
# leave this loop picking up hundreds of calls a second.
FLOOR = 64
GROWTH = 1.25  # per tick while the gate binds and nothing waits: x2.4 a second
BACKOFF = 0.8  # of the calls open, per tick while calls wait too long
TICK_SECONDS = 0.25  # one look at grpc's counts (~0.35 ms of the loop each)
IDLE_SECONDS = 1.0  # how often an idle front end looks whether calls are open again
# Calls picked up since the front end was last idle that make a burst: once it is idle again,
# the allocator's free pages go back to the system (server/malloc.py).
BURST_CALLS = 1000


@dataclass(frozen=True)
class GateStatistics:
    """The gate now: its limit and ceiling, and what it last saw waiting in grpc (calls, and seconds for the newest)."""

    limit: int
    ceiling: int
    waiting: int
    wait: float


class CallGate:
    """The limit on completion calls open at once (see the module's docstring)."""

    def __init__(self, ceiling: int, *, floor: int = FLOOR, target: float = WAIT_TARGET) -> None:
        self._ceiling = ceiling
        self._floor = floor
        self._target = target
        self._limit = min(floor, ceiling)
        self._waiting = 0
        self._wait = 0.0
        self._refused = False  # a call was refused since the last tick

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def ceiling(self) -> int:
        return self._ceiling

    def admit(self, open_calls: int) -> bool:
        """Whether one more call may open now, with ``open_calls`` open."""
        if open_calls < self._limit:
            return True
        self._refused = True
        return False

    def set_ceiling(self, ceiling: int) -> None:
        """The most the gate may allow (what the pools can hold changed)."""
        self._ceiling = ceiling
        self._limit = max(min(self._floor, ceiling), min(self._limit, ceiling))

    def tick(self, waiting: int, picked_per_second: float, open_calls: int) -> None:
        """One decision: ``waiting`` calls wait in grpc, calls are picked up at ``picked_per_second``, ``open_calls`` are open."""
        self._waiting = waiting
        self._wait = waiting / picked_per_second if picked_per_second > 0 else float("inf") if waiting else 0.0
        backlog = waiting >= MIN_BACKLOG
        if backlog and self._wait > self._target:
            self._limit = max(min(self._floor, self._ceiling), int(min(self._limit, open_calls) * BACKOFF))
        elif (not backlog or self._wait <= self._target / 4) and (self._refused or open_calls >= self._limit - max(1, self._limit // 10)):
            self._limit = min(self._ceiling, max(self._limit + 1, int(self._limit * GROWTH)))
        self._refused = False

    def statistics(self) -> GateStatistics:
        return GateStatistics(self._limit, self._ceiling, self._waiting, self._wait)


class Backlog:
    """Calls grpc core holds that no handler has picked up yet, from core's own counts (channelz).

    Build it around the server's creation (:meth:`around`): the server is the
    one channelz node that appeared meanwhile. Where channelz cannot say
    (another server created at the same moment, a grpcio without it),
    :meth:`waiting` is None and the gate is a fixed one, at its ceiling.
    """

    def __init__(self, server_id: int | None) -> None:
        self._server_id = server_id

    @staticmethod
    def server_ids() -> set[int]:
        """The channelz ids of the grpc servers in this process now."""
        try:
            listed = json.loads(cygrpc.channelz_get_servers(0)).get("server", [])
            return {int(server["ref"]["serverId"]) for server in listed}
        except (AttributeError, ValueError, KeyError, TypeError):  # a grpcio whose channelz differs: no measure
            return set()

    @classmethod
    def around(cls, before: set[int]) -> Backlog:
        """The backlog of the server created since ``before`` (from :meth:`server_ids`) was taken."""
        new = cls.server_ids() - before
        if len(new) != 1:
            log.warning("gRPC: grpc's channelz does not single out this server; the gate on open calls is fixed at its ceiling")
        return cls(new.pop() if len(new) == 1 else None)

    def waiting(self, inside: int) -> int | None:
        """Calls grpc holds (started, not finished) beyond the ``inside`` tailguard's handlers hold now."""
        if self._server_id is None:
            return None
        try:
            data = json.loads(cygrpc.channelz_get_server(self._server_id))["server"]["data"]
            held = int(data.get("callsStarted", 0)) - int(data.get("callsSucceeded", 0)) - int(data.get("callsFailed", 0))
        except (AttributeError, ValueError, KeyError, TypeError):
            return None
        return max(0, held - inside)


async def follow_grpc(
    gate: CallGate,
    backlog: Backlog,
    open_calls: Callable[[], int],
    inside: Callable[[], int],
    picked: Callable[[], int],
    after_burst: Callable[[], None] = lambda: None,
) -> NoReturn:
    """On the asyncio loop, until cancelled: each tick while calls are open, tell the gate what waits in grpc.

    ``open_calls``: completion calls open; ``inside``: calls inside any of
    tailguard's handlers (open or being refused); ``picked``: calls picked up
    so far (a running count). ``after_burst`` runs once the front end is idle
    after ``BURST_CALLS`` or more calls.
    """
    loop = asyncio.get_running_loop()
    last_at, last_picked = loop.time(), picked()
    burst_from = last_picked
    while True:
        await asyncio.sleep(TICK_SECONDS if open_calls() else IDLE_SECONDS)
        now, now_picked = loop.time(), picked()
        rate = (now_picked - last_picked) / max(now - last_at, 1e-3)
        last_at, last_picked = now, now_picked
        if not open_calls():
            if now_picked - burst_from >= BURST_CALLS and rate == 0:
                after_burst()
            if rate == 0:
                burst_from = now_picked
            continue
        waiting = backlog.waiting(inside())
        gate.tick(0 if waiting is None else waiting, rate, open_calls())  # no measure: nothing seen waiting
