"""GPU pools: endpoints, strict concurrency caps, health, and the choice of endpoint.

A :class:`Pool` hands out :class:`Lease` objects, each one seat on one
endpoint. A lease is granted only while the pool is under its cap and some
healthy endpoint is under its own cap; the least-loaded such endpoint wins
(ties broken at random). Requests that cannot get a lease at once wait in the
pool's :class:`~router.queue.WaitQueue`, ordered by (class priority, arrival).

Endpoints outlive pools across config reloads: an endpoint moved from one
pool to another keeps its in-flight count (its running requests finish where
they started), so neither pool can oversubscribe the GPU during the move.

A pool also measures how fast it frees seats, so that under sustained
overload it can refuse at arrival a request that could not be seated within
its queue deadline (fail fast), instead of letting it wait the deadline out.
By Little's law a full pool frees ``seats / mean seat-hold time`` seats a
second; the mean hold time is measured on every release (:class:`SeatTime`),
and the seats are read live, so a reload that changes a cap changes the rate
at once. Hold times measured at light load are shorter than at full load
(smaller batches run faster), so the estimate errs towards admitting.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx
import trio

from .backend import BackendClient
from .backend_load import BackendLoad
from .config_types import EndpointConfig, PoolConfig
from .errors import NoBackend
from .queue import WaitQueue, WaitQueueStatistics


class Endpoint:
    """One inference server: its cap, its load, its health, its HTTP client."""

    def __init__(self, config: EndpointConfig, *, connect_timeout: float, transport: httpx.AsyncBaseTransport | None) -> None:
        self.url = config.url
        self.max_concurrency = config.max_concurrency
        self.in_flight = 0
        self.healthy = True
        self.pool: Pool | None = None
        self.load: BackendLoad | None = None  # vLLM's own queue, set by backend_load.scrape
        self._connect_timeout = connect_timeout
        self._transport = transport
        self.client = self._new_client()
        self._retired: list[BackendClient] = []

    def _new_client(self) -> BackendClient:
        return BackendClient(
            self.url, max_concurrency=self.max_concurrency, connect_timeout=self._connect_timeout, transport=self._transport
        )

    def reconfigure(self, config: EndpointConfig) -> None:
        """Take a new cap; a new client sized to it serves new requests."""
        if config.max_concurrency != self.max_concurrency:
            self.max_concurrency = config.max_concurrency
            self._retired.append(self.client)
            self.client = self._new_client()

    @property
    def has_room(self) -> bool:
        return self.healthy and self.in_flight < self.max_concurrency

    def mark_down(self) -> None:
        """Live traffic saw a failure; only the health check brings it back."""
        self.healthy = False

    async def aclose(self) -> None:
        for client in [self.client, *self._retired]:
            await client.aclose()


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a pool for tests, /health and metrics.

    ``seat_seconds`` is the measured mean seat-hold time (None until enough
    releases were seen); ``drain_rate`` the seats a second the pool frees when
    full, ``seats / seat_seconds`` (None likewise).
    """

    name: str
    in_flight: int
    max_concurrency: int
    healthy_endpoints: int
    endpoints: int
    queue: WaitQueueStatistics
    seat_seconds: float | None = None
    drain_rate: float | None = None


class SeatTime:
    """The mean time a seat is held, over recent releases.

    The plain mean of the first ``1 / WEIGHT`` releases, then an exponentially
    weighted one (each release counts ``WEIGHT``): about the last 64 releases
    matter, which a busy pool sees in seconds and which averages a mix of
    short and long requests to within ~10%. Too few releases mean no
    estimate at all: a cold pool must not refuse anyone on a guess.
    """

    WEIGHT = 1 / 64
    MIN_SAMPLES = 32

    def __init__(self) -> None:
        self.samples = 0
        self._mean = 0.0

    def observe(self, seconds: float) -> None:
        self.samples += 1
        self._mean += max(self.WEIGHT, 1 / self.samples) * (seconds - self._mean)

    @property
    def mean(self) -> float | None:
        """Seconds, or None while fewer than MIN_SAMPLES releases were seen."""
        return self._mean if self.samples >= self.MIN_SAMPLES and self._mean > 0 else None


class Lease:
    """One seat on one endpoint of one pool; ``release`` is idempotent."""

    __slots__ = ("pool", "endpoint", "client", "granted_at", "_released")

    def __init__(self, pool: Pool, endpoint: Endpoint) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.client = endpoint.client
        self.granted_at = trio.current_time()
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.pool.in_flight -= 1
        self.endpoint.in_flight -= 1
        self.pool.seat_time.observe(trio.current_time() - self.granted_at)
        self.pool.queue.dispatch()
        moved_to = self.endpoint.pool
        if moved_to is not None and moved_to is not self.pool:
            moved_to.queue.dispatch()


class Pool:
    """A set of endpoints with a strict concurrency cap and a priority wait queue."""

    def __init__(self, config: PoolConfig, *, rng: random.Random | None = None) -> None:
        self.name = config.name
        self.config = config
        self.endpoints: list[Endpoint] = []
        self.in_flight = 0
        self.seat_time = SeatTime()
        self._rng = rng or random.Random()
        self.queue: WaitQueue[Lease] = WaitQueue(self._grant, max_waiting=config.max_queue, drain_rate=self._drain_rate)

    def reconfigure(self, config: PoolConfig, endpoints: list[Endpoint]) -> None:
        """Adopt a new config and endpoint set; waiters get any room it opens."""
        self.config = config
        self.endpoints = endpoints
        for endpoint in endpoints:
            endpoint.pool = self
        self.queue.max_waiting = config.max_queue
        self.queue.dispatch()

    @property
    def healthy(self) -> bool:
        return any(endpoint.healthy for endpoint in self.endpoints)

    @property
    def seats(self) -> int:
        """Requests the pool may run at once now: its cap, or its healthy endpoints' caps if fewer."""
        healthy = sum(e.max_concurrency for e in self.endpoints if e.healthy)
        return min(self.config.max_concurrency, healthy)

    def _full_drain_rate(self) -> float | None:
        """Seats a second the pool frees when all are taken (Little's law), or None without an estimate.

        Over its cap after a reload lowered it, the pool frees the seats in
        use at that pace, not only the new cap's, hence the larger of the two.
        """
        hold = self.seat_time.mean
        seats = max(self.seats, self.in_flight)
        return None if hold is None or seats == 0 else seats / hold

    def _drain_rate(self) -> float | None:
        """The queue's ``drain_rate``: None while a seat is free, so nobody is refused then."""
        return None if self.in_flight < self.seats else self._full_drain_rate()

    def _grant(self) -> Lease | None:
        if self.in_flight >= self.config.max_concurrency:
            return None
        candidates = [e for e in self.endpoints if e.has_room]
        if not candidates:
            return None
        least = min(e.in_flight for e in candidates)
        endpoint = self._rng.choice([e for e in candidates if e.in_flight == least])
        self.in_flight += 1
        endpoint.in_flight += 1
        return Lease(self, endpoint)

    async def admit(self, priority: int, deadline: float, *, retry_after: float) -> Lease:
        """A lease, waiting until ``deadline`` if need be.

        Raises NoBackend at once when no endpoint is healthy (waiting would
        only rot), QueueFull when the queue is at its bound, QueueTimeout at
        the deadline -- or at once, when the pool's drain rate says no seat
        would come within ``fail_fast_fraction`` of the time left to it.
        """
        if not self.healthy:
            raise NoBackend(
                f"pool {self.name!r} has no healthy endpoint; retry after {retry_after:g} s",
                retry_after=retry_after,
            )
        fraction = self.config.fail_fast_fraction
        max_wait = fraction * (deadline - trio.current_time()) if fraction > 0 else None
        return await self.queue.get(priority, deadline, retry_after=retry_after, max_wait=max_wait)

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            name=self.name,
            in_flight=self.in_flight,
            max_concurrency=self.config.max_concurrency,
            healthy_endpoints=sum(e.healthy for e in self.endpoints),
            endpoints=len(self.endpoints),
            queue=self.queue.statistics(),
            seat_seconds=self.seat_time.mean,
            drain_rate=self._full_drain_rate(),
        )
