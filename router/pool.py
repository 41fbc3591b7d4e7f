"""GPU pools: endpoints, strict concurrency caps, health, and the choice of endpoint.

A :class:`Pool` hands out :class:`Lease` objects, each one seat on one
endpoint. A lease is granted only while the pool is under its cap and some
healthy endpoint is under its own cap; the least-loaded such endpoint wins
(ties broken at random), except that seats lent to another pool's requests
are packed together and kept apart from the pool's own (``Pool._place``).
Requests that cannot get a lease at once wait in the pool's
:class:`~router.queue.WaitQueue`, ordered by (class priority, arrival).

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

import collections
import math
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import httpx
import trio

from .backend import BackendClient, BackendProbe
from .backend_load import BackendLoad
from .cluster import Yielding
from .config_types import BackendAccess, EndpointConfig, OutlierDetectionConfig, PoolConfig, ServerConfig, TimeoutsConfig
from .errors import NoBackend
from .queue import SKIP, Skip, WaitQueue, WaitQueueStatistics


class Closable(Protocol):
    async def aclose(self) -> None: ...


Closer = Callable[[Closable], None]


class Clients(NamedTuple):
    """What an endpoint needs built to take a new config: None where it keeps its own."""

    client: BackendClient | None
    probe: BackendProbe | None


class Endpoint:
    """One inference server: its cap, its load, its health, its HTTP client.

    Two verdicts decide whether it gets new requests. ``healthy`` is the
    active health check's (only it sets it). ``ejected_until`` is outlier
    detection's, from live traffic: ``consecutive_failures`` failed requests
    in a row take it out for a while (see :meth:`Pool.record_failure`); the
    time out ends by itself.

    A client replaced by a reload (a new cap means a new connection pool) is
    handed to ``closer`` as soon as the last seat that holds it is released,
    so a reload never leaves connections behind.
    """

    def __init__(
        self,
        config: EndpointConfig,
        *,
        connect_timeout: float,
        transport: httpx.AsyncBaseTransport | None,
        closer: Closer,
        max_body_bytes: int = ServerConfig.max_backend_body_bytes,
        keep_alive_timeout: float = TimeoutsConfig.backend_keep_alive_timeout,
    ) -> None:
        self.url = config.url
        self.max_concurrency = config.max_concurrency
        self.movable = config.movable
        self.access = config.access  # tailguard's key and CA for this engine
        # Set while the engine refuses that key (401/403): why, for /health. Cleared
        # when it accepts the key again (the health check asks) or a reload changes it.
        self.auth_failure: str | None = None
        self.credentials_checked = False  # a /v1 route answered with tailguard's key (health checks ask until one does)
        # vLLM's own queue was full (a 503 before any byte): until ``busy_until`` the
        # endpoint takes at most ``busy_cap`` requests, what it held when it said so.
        self.busy_until = -math.inf
        self.busy_cap = 0
        self.busy_answers = 0  # 503s before any byte, since the process started (for /metrics)
        self.granted: int | None = None  # its seats this replica may use ([cluster]); None: all
        self.yielding: Yielding | None = None  # [cluster]: a request waits for its seats on another replica
        self.in_flight = 0
        self.borrowed = 0  # of those, seats serving another pool's request (a lease with a borrower)
        self._idle: trio.Event | None = None  # set when in_flight falls to 0 (a move waits on it)
        self.healthy = True
        # Context length: what GET /v1/models said last (None: not asked, or no
        # answer), and whether that is enough for its pool (router/model_len.py).
        self.max_model_len: int | None = None
        self.fits_context = True
        self.pool: Pool | None = None
        self.load: BackendLoad | None = None  # vLLM's own queue, set by backend_load.scrape
        self.failures_in_a_row = 0
        # The last requests' verdicts (True: failed), at most the pool's failure_window: the
        # failure-ratio rule reads them, and placement counts each failure as load.
        self._outcomes: collections.deque[bool] = collections.deque()
        self.recent_failures = 0
        self.failure_load = 0  # what placement adds for them (0 until the window is big enough to judge)
        # Half-open, as a circuit breaker: an ejection that ran out lets one request in at a
        # time until one succeeds; a failure then ejects again at once. A half-dead engine
        # costs one request per readmission, not a run of them.
        self.half_open = False
        self.ejections = 0  # times ejected in all, for /metrics
        self._ejections_in_a_row = 0  # times ejected lately: the ejection time's multiplier
        self.ejected_until: float | None = None
        self._ejection_ended_at = -math.inf
        self._connect_timeout = connect_timeout
        self._transport = transport
        self._closer = closer
        self._max_body_bytes = max_body_bytes
        self._keep_alive_timeout = keep_alive_timeout
        self.retired = False  # left the config; kept only while seats still hold it
        self.client = self._new_client(config.max_concurrency, config.access)
        self._client_closed = False
        self.probe = self._new_probe(config.access)
        self._replaced: set[BackendClient] = set()  # old clients that seats still hold

    def _new_client(self, max_concurrency: int, access: BackendAccess) -> BackendClient:
        return BackendClient(
            self.url,
            max_concurrency=max_concurrency,
            connect_timeout=self._connect_timeout,
            transport=self._transport,
            max_body_bytes=self._max_body_bytes,
            access=access,
            keep_alive_timeout=self._keep_alive_timeout,
        )

    def _new_probe(self, access: BackendAccess) -> BackendProbe:
        return BackendProbe(self.url, connect_timeout=self._connect_timeout, transport=self._transport, access=access)

    def clients_for(self, config: EndpointConfig) -> Clients:
        """The clients this endpoint needs to take ``config``, built now; nothing changes yet.

        Building may fail (a TLS context, a transport): a reload builds every
        endpoint's before it changes any, so a failure leaves all as they were.
        """
        reopen = self.retired and self._client_closed
        resize = config.max_concurrency != self.max_concurrency
        rekey = config.access != self.access  # a rotated key or a new CA: new connections carry it
        client = self._new_client(config.max_concurrency, config.access) if reopen or resize or rekey else None
        return Clients(client, self._new_probe(config.access) if reopen or rekey else None)

    def adopt(self, config: EndpointConfig, clients: Clients, *, max_body_bytes: int) -> None:
        """Take ``config`` with the clients ``clients_for`` built (nothing here raises).

        A retired endpoint comes back (its running requests still count). A
        client replaced for a new cap is closed now if no seat holds it, else
        when its last seat is released.
        """
        self.retired = False
        if config.access != self.access:
            self.access = config.access
            self.auth_failure = None  # a new key deserves a try; the next refusal says so again
            self.credentials_checked = False
        if clients.probe is not None:
            old_probe, self.probe = self.probe, clients.probe
            if not self._client_closed:
                self._closer(old_probe)  # a closed endpoint's probe went to the closer with its client
        if clients.client is not None:
            old, self.client = self.client, clients.client
            if self._client_closed:
                self._client_closed = False  # ``old`` went to the closer when the endpoint retired
            elif old.leases:
                self._replaced.add(old)
            else:
                self._closer(old)
        self.max_concurrency = config.max_concurrency
        self.movable = config.movable
        self._max_body_bytes = self.client.max_body_bytes = max_body_bytes

    async def wait_idle(self) -> None:
        """Return once no request runs here (at once if none does)."""
        while self.in_flight:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    def seat_freed(self) -> None:
        """One of its requests ended (``in_flight`` already lowered)."""
        if not self.in_flight and self._idle is not None:
            self._idle.set()
            self._idle = None

    def lease_ended(self, client: BackendClient) -> None:
        """A seat holding ``client`` was released: close the client if it was replaced and is idle."""
        client.leases -= 1
        if client.leases:
            return
        if client is not self.client:
            self._replaced.discard(client)
            self._closer(client)
        elif self.retired and not self._client_closed:
            self._close_clients()

    def retire(self) -> None:
        """The endpoint left the config: nobody new; its clients close once no seat holds it."""
        self.pool = None
        self.retired = True
        if self.client.leases == 0 and not self._client_closed:
            self._close_clients()

    def _close_clients(self) -> None:
        self._client_closed = True
        self._closer(self.client)
        self._closer(self.probe)

    @property
    def open_clients(self) -> int:
        """HTTP clients of this endpoint not yet handed to the closer."""
        return (0 if self._client_closed else 1) + len(self._replaced)

    @property
    def ejected(self) -> bool:
        """Whether outlier detection has it out now (an ejection that has run out ends here)."""
        until = self.ejected_until
        if until is None:
            return False
        if trio.current_time() < until:
            return True
        self.ejected_until = None
        self._ejection_ended_at = until
        self.half_open = True  # back on trial: one request at a time until one succeeds
        return False

    @property
    def usable(self) -> bool:
        """Healthy, long enough for its pool, accepting tailguard's key, not ejected: may take new requests when it has room."""
        return self.healthy and self.fits_context and self.auth_failure is None and (self.ejected_until is None or not self.ejected)

    @property
    def seats(self) -> int:
        """Its cap here: all of it, or this replica's grant of it in a cluster, lowered for a moment after a busy answer."""
        seats = self.max_concurrency if self.granted is None else min(self.max_concurrency, self.granted)
        if self.half_open:
            seats = min(seats, 1)
        # No clock read here (metrics read it from another thread): the spell's own timer ends it.
        return seats if self.busy_until == -math.inf else min(seats, self.busy_cap)

    def was_busy(self, retry_after: float) -> None:
        """The engine answered 503 before any byte (its own queue is full): hold its cap at what
        it runs now, less the refused request, for ``retry_after`` seconds (the engine's hint)."""
        self.busy_answers += 1
        self.busy_cap = max(0, self.in_flight - 1)
        self.busy_until = max(self.busy_until, trio.current_time() + max(retry_after, 0.1))

    def busy_spell_over(self, now: float) -> bool:
        """End a busy spell whose time is up; True if one ended (its seats are back)."""
        if self.busy_until == -math.inf or now < self.busy_until:
            return False
        self.busy_until = -math.inf
        return True

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.seats and self.usable

    def eject(self, outlier: OutlierDetectionConfig) -> float:
        """Take it out for base x (times ejected), at most the maximum; returns the seconds.

        The multiplier forgets an endpoint's past once it has gone a whole
        ``max_ejection_time`` without an ejection.
        """
        now = trio.current_time()
        if now - self._ejection_ended_at > outlier.max_ejection_time:
            self._ejections_in_a_row = 0
        self._ejections_in_a_row += 1
        self.ejections += 1
        seconds = min(outlier.base_ejection_time * self._ejections_in_a_row, outlier.max_ejection_time)
        self.ejected_until = now + seconds
        self.failures_in_a_row = 0
        self._outcomes.clear()  # back from the ejection with a clean record
        self.recent_failures = self.failure_load = 0
        return seconds

    def note_outcome(self, failed: bool, window: int, evidence: int) -> None:
        """One request's verdict, into the window of the last ``window``; failures weigh on
        placement once the window holds ``evidence`` verdicts (one failure proves nothing)."""
        outcomes = self._outcomes
        outcomes.append(failed)
        self.recent_failures += failed
        while len(outcomes) > window:
            self.recent_failures -= outcomes.popleft()
        self.failure_load = self.recent_failures if len(outcomes) >= evidence else 0

    @property
    def outcomes(self) -> int:
        """Verdicts in the window now."""
        return len(self._outcomes)

    @property
    def placement_load(self) -> int:
        """What placement compares: requests in flight, and each recent failure as one more.

        An engine that fails fast frees its seats fast, so by requests in
        flight alone it would look the least loaded and draw ever more of the
        traffic it fails. A healthy engine has no recent failures: nothing changes.
        """
        return self.in_flight + self.failure_load

    def end_ejection(self) -> None:
        """A completion health probe proved it works: back in at once, no trial needed (the probe was one)."""
        self.half_open = False
        if self.ejected_until is not None:
            self.ejected_until = None
            self._ejection_ended_at = trio.current_time()

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.probe.aclose()


@dataclass(frozen=True, slots=True)
class Ticket:
    """What a request asks a pool for: enough to judge class seat limits and lending."""

    request_class: str
    model: str
    prompt_tokens: int
    max_tokens: int
    priority: int = 0  # the class's: a seat another replica's request waits for goes only to one as urgent
    # When the request came (trio.current_time()): between equally urgent ones on two replicas, the older first.
    arrived: float = -math.inf


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
    """One seat on one endpoint of one pool; ``release`` is idempotent.

    ``pool`` is the pool whose seat it is. A borrowed seat (``borrower`` set)
    belongs to a lender pool and serves a request of ``borrower``'s.
    """

    __slots__ = ("pool", "endpoint", "client", "granted_at", "request_class", "borrower", "_released")

    def __init__(self, pool: Pool, endpoint: Endpoint, request_class: str, borrower: Pool | None = None) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.request_class = request_class
        self.borrower = borrower
        self.client = endpoint.client
        self.client.leases += 1
        self.granted_at = trio.current_time()
        self._released = False

    def move(self, endpoint: Endpoint) -> None:
        """Carry the seat to another endpoint of the pool (a retry); the pool's count is unchanged."""
        old = self.endpoint
        old.in_flight -= 1
        endpoint.in_flight += 1
        if self.borrower is not None:
            old.borrowed -= 1
            endpoint.borrowed += 1
        old.seat_freed()
        old.lease_ended(self.client)
        self.endpoint = endpoint
        self.client = endpoint.client
        self.client.leases += 1
        self.pool.yield_freed_seat(old)
        self.pool.queue.dispatch()  # the old endpoint's seat may seat a waiter
        if old.pool is not None and old.pool is not self.pool:  # a reload moved it meanwhile
            old.pool.queue.dispatch()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        pool = self.pool
        pool.in_flight -= 1
        pool.seat_ended(self)
        self.endpoint.in_flight -= 1
        if self.borrower is not None:
            self.endpoint.borrowed -= 1
        self.endpoint.seat_freed()
        self.endpoint.lease_ended(self.client)
        pool.seat_time.observe(trio.current_time() - self.granted_at)
        pool.yield_freed_seat(self.endpoint)  # [cluster]: to a more urgent request on another replica
        pool.queue.dispatch()  # the pool's own requests first
        for borrower in pool.borrowers:  # then, if a seat is still idle, the pools it lends to
            borrower.queue.dispatch()
        moved_to = self.endpoint.pool
        if moved_to is not None and moved_to is not pool:
            moved_to.queue.dispatch()


class Pool:
    """A set of endpoints with a strict concurrency cap and a priority wait queue."""

    def __init__(self, config: PoolConfig, *, rng: random.Random | None = None) -> None:
        self.name = config.name
        self.config = config
        self.endpoints: list[Endpoint] = []
        self.in_flight = 0
        self.seat_time = SeatTime()
        self.lenders: list[Pool] = []  # pools that lend this one idle seats, in the order asked
        self.borrowers: list[Pool] = []  # pools this one lends to (``config.lend.to``)
        self.lent = 0  # seats of this pool serving other pools' requests now
        self.class_in_flight: dict[str, int] = {}  # seats of this pool held per class
        self.borrowed_total: dict[str, int] = {}  # this pool's requests seated by each lender, ever
        self.cap_moved = 0  # seats of endpoints moved in, less those moved out, since the last reload
        self.granted: int | None = None  # this replica's share of the cap ([cluster]); None: all of it
        self.yielding: Yielding | None = None  # [cluster]: a request waits for its seats on another replica
        # While a freed seat is offered: the request elsewhere it may go to; only one here that comes first may take it.
        self._serving_up_to: Yielding | None = None
        self._rng = rng or random.Random()
        self.queue: WaitQueue[Lease, Ticket] = WaitQueue(self._grant, max_waiting=config.max_queue, drain_rate=self._drain_rate)

    @property
    def cluster_cap(self) -> int:
        """The pool's cap across every replica: the configured one, plus what rebalancing moved in, less what it moved out."""
        return max(0, self.config.max_concurrency + self.cap_moved)

    @property
    def max_concurrency(self) -> int:
        """The pool's cap here: ``cluster_cap``, or this replica's grant of it ([cluster])."""
        cap = self.cluster_cap
        return cap if self.granted is None else min(cap, self.granted)

    def set_grant(self, seats: int | None) -> None:
        """This replica's share of the pool's cap changed: waiters get any room it opened."""
        self.granted = seats
        self.queue.dispatch()

    def yield_freed_seat(self, endpoint: Endpoint) -> None:
        """[cluster] A seat of this pool on ``endpoint`` just freed while a request waits for one on another replica.

        ``yielding`` (the pool's cap) and ``endpoint.yielding`` (the endpoint's)
        say, as of the last sync, how urgent the most urgent such request is.
        The seat goes at once to a request here that comes first (more
        urgent, or as urgent and not younger, ``Yielding.before``); the
        others here -- younger or less urgent, or another pool's borrowing this one's
        idle seats, which come after the pool's own requests wherever those
        wait -- get nothing: this replica's grant of each cap wanted
        elsewhere falls to the seats in use, and ``give_back`` syncs at once,
        so the ledger can grant the seat to the other replica. Nobody yields
        while Redis is away (``yielding`` is None then).
        """
        ways = [way for way in (self.yielding, endpoint.yielding) if way is not None]
        if not ways:
            return
        self._serving_up_to = min(ways, key=lambda way: (way.priority, way.since))
        try:
            self.queue.dispatch()  # only the requests that come first: ``_seat`` stops at the first that does not
        finally:
            self._serving_up_to = None
        if self.yielding is not None and self.granted is not None and self.in_flight < self.granted:
            self.granted = self.in_flight
            self.yielding.give_back(self.in_flight)
        if endpoint.yielding is not None and endpoint.granted is not None and endpoint.in_flight < endpoint.granted:
            endpoint.granted = endpoint.in_flight
            endpoint.yielding.give_back(endpoint.in_flight)

    def reconfigure(self, config: PoolConfig, endpoints: list[Endpoint]) -> None:
        """Adopt a new config and endpoint set (a reload: moves are undone); waiters get any room it opens."""
        self.config = config
        self.cap_moved = 0
        self.endpoints = endpoints
        for endpoint in endpoints:
            endpoint.pool = self
        self.queue.max_waiting = config.max_queue
        self.queue.dispatch()

    @property
    def healthy(self) -> bool:
        """Some endpoint may take requests (healthy and not ejected)."""
        return any(endpoint.usable for endpoint in self.endpoints)

    @property
    def room(self) -> int:
        """Requests the pool could ever hold at once, seated or waiting: its cap (or its endpoints' caps, if fewer) and its queue.

        Health aside: an upper bound on what it can take, for front ends
        that refuse the excess before it costs anything (the gRPC gate).
        """
        return min(self.cluster_cap, sum(e.max_concurrency for e in self.endpoints)) + self.queue.max_waiting

    @property
    def seats(self) -> int:
        """Requests the pool may run at once now: its cap, or its usable endpoints' caps if fewer."""
        usable = sum(e.seats for e in self.endpoints if e.usable)
        return min(self.max_concurrency, usable)

    # -- outlier detection ----------------------------------------------------

    def record_success(self, endpoint: Endpoint) -> None:
        """The endpoint answered properly (a 4xx included): its run of failures ends, and a trial passes."""
        endpoint.failures_in_a_row = 0
        if endpoint.half_open:
            endpoint.half_open = False
            self.queue.dispatch()  # its full cap is back
        outlier = self.config.outlier_detection
        if outlier.failure_ratio:
            endpoint.note_outcome(False, outlier.failure_window, outlier.failure_min_requests)

    def record_failure(self, endpoint: Endpoint) -> float | None:
        """Count a failed request; eject the endpoint after enough in a row.

        Returns the ejection's length in seconds, or None when the endpoint
        stays in: not enough failures yet, or the pool already has its
        ``max_ejection_percent`` of endpoints ejected (rounded down, so the
        only endpoint of a pool is never ejected by live traffic alone).
        """
        outlier = self.config.outlier_detection
        if endpoint.ejected:
            return None  # requests that were running when it was ejected say nothing new
        endpoint.failures_in_a_row += 1
        if outlier.failure_ratio:
            endpoint.note_outcome(True, outlier.failure_window, outlier.failure_min_requests)
        on_trial, endpoint.half_open = endpoint.half_open, False
        if not on_trial and endpoint.failures_in_a_row < outlier.consecutive_failures and not self._fails_more_than_the_rest(endpoint):
            return None
        allowed = math.floor(len(self.endpoints) * outlier.max_ejection_percent / 100 + 1e-9)
        if sum(e.ejected for e in self.endpoints) + 1 > allowed:
            return None
        return endpoint.eject(outlier)

    def _fails_more_than_the_rest(self, endpoint: Endpoint) -> bool:
        """The failure-ratio rule: at least ``failure_ratio`` of its recent requests failed, and
        more than twice the share of the pool's other endpoints (a fault of the traffic, or of
        something all share, is not this engine's)."""
        outlier = self.config.outlier_detection
        if not outlier.failure_ratio or endpoint.outcomes < outlier.failure_min_requests:
            return False
        share = endpoint.recent_failures / endpoint.outcomes
        if share < outlier.failure_ratio:
            return False
        others = [e for e in self.endpoints if e is not endpoint and not e.ejected]
        seen = sum(e.outcomes for e in others)
        rest = sum(e.recent_failures for e in others) / seen if seen else 0.0
        return share > 2 * rest

    def retry_endpoint(self, lease: Lease, tried: Collection[Endpoint] = ()) -> Endpoint | None:
        """Another endpoint with room for a failed request's next try, none it was tried on, or None."""
        return self._place(
            [e for e in self.endpoints if e is not lease.endpoint and e not in tried and e.has_room], lease.borrower is not None
        )

    def _place(self, candidates: list[Endpoint], borrowed: bool) -> Endpoint | None:
        """Where a new seat goes among ``candidates`` (endpoints with room), or None.

        A borrowed seat's request runs beside its lender's own: a short
        request lent a batch seat shares every step with that engine's long
        prefills. So borrowed seats are packed onto the endpoint that already
        holds the most of them, and the pool's own requests go to an endpoint
        holding none when one has room; ties to the least loaded. Any
        endpoint with room beats none (work-conserving).
        """
        if borrowed:
            most = max((e.borrowed for e in candidates), default=0)
            return self._least_loaded([e for e in candidates if e.borrowed == most])
        return self._least_loaded([e for e in candidates if not e.borrowed] or candidates)

    def _least_loaded(self, candidates: list[Endpoint]) -> Endpoint | None:
        """The endpoint with the fewest requests in flight, recent failures counted as such (ties at random), or None."""
        if not candidates:
            return None
        least = min(e.placement_load for e in candidates)
        return self._rng.choice([e for e in candidates if e.placement_load == least])

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

    def _grant(self, ticket: Ticket) -> Lease | Skip | None:
        """A seat for ``ticket``: the pool's own, else one a lender has idle.

        SKIP when a seat is free but not for this ticket (its class at its
        limit here, or over what the lenders with room take), so the queue
        goes on to the next waiter; None when no seat is free at all.
        """
        own = self._seat(ticket, None)
        if isinstance(own, Lease):
            return own
        answer: Lease | Skip | None = own
        for lender in self.lenders:
            lent = lender.lend(ticket, self)
            if isinstance(lent, Lease):
                self.borrowed_total[lender.name] = self.borrowed_total.get(lender.name, 0) + 1
                return lent
            answer = answer or lent
        return answer

    def _seat(self, ticket: Ticket, borrower: Pool | None) -> Lease | Skip | None:
        """A seat on an endpoint of this pool with room (``_place``), within the pool's and the class's caps."""
        if self.in_flight >= self.max_concurrency:
            return None
        if self._serving_up_to is not None and not self._serving_up_to.before(ticket.priority, ticket.arrived):
            # A freed seat a request on another replica comes first for; the queue is in (priority, arrival)
            # order, so everyone behind this ticket comes later too: none of them gets it.
            return None
        limit = self.config.class_limit(ticket.request_class)
        if limit is not None and self.class_in_flight.get(ticket.request_class, 0) >= limit:
            return SKIP
        endpoint = self._place([e for e in self.endpoints if e.has_room], borrower is not None)
        if endpoint is None:
            return None
        self.in_flight += 1
        self.class_in_flight[ticket.request_class] = self.class_in_flight.get(ticket.request_class, 0) + 1
        endpoint.in_flight += 1
        if borrower is not None:
            endpoint.borrowed += 1
        return Lease(self, endpoint, ticket.request_class, borrower)

    def lend(self, ticket: Ticket, borrower: Pool) -> Lease | Skip | None:
        """An idle seat of this pool for another pool's request, under ``config.lend``'s rules.

        None while any request of this pool's own waits (its class wins the
        next seat), while the seats lent are at ``max_seats``, or while
        taking one would leave fewer than ``reserve`` free. SKIP when a seat
        could be lent but not to this request: a model this pool does not
        serve, a prompt over the prefill budget, max_tokens over its bound,
        or more than the engines' context.
        """
        lend = self.config.lend
        if self.queue.waiting or (lend.max_seats is not None and self.lent >= lend.max_seats):
            return None
        if self.in_flight + lend.reserve >= self.seats:
            return None
        if not self.would_lend(ticket):
            return SKIP
        lease = self._seat(ticket, borrower)
        if isinstance(lease, Lease):
            self.lent += 1
        return lease

    def would_lend(self, ticket: Ticket) -> bool:
        """Whether ``config.lend``'s rules let this pool's seats serve ``ticket`` at all (room aside):
        a model it serves, a prompt within the prefill bound, max_tokens within its bound, the engines' context."""
        lend = self.config.lend
        return not (
            ticket.model not in self.config.models
            or (lend.max_prompt_tokens is not None and ticket.prompt_tokens > lend.max_prompt_tokens)
            or (lend.max_output_tokens is not None and ticket.max_tokens > lend.max_output_tokens)
            or ticket.prompt_tokens + ticket.max_tokens > self.config.max_model_len
        )

    def seat_ended(self, lease: Lease) -> None:
        """Book-keeping of a released seat: its class's count, and the lent count."""
        left = self.class_in_flight.get(lease.request_class, 0) - 1
        if left > 0:
            self.class_in_flight[lease.request_class] = left
        else:
            self.class_in_flight.pop(lease.request_class, None)
        if lease.borrower is not None:
            self.lent -= 1

    async def admit(self, priority: int, deadline: float, ticket: Ticket, *, retry_after: float) -> Lease:
        """A lease, waiting until ``deadline`` if need be.

        Raises NoBackend at once when no endpoint is healthy and no lender
        with a healthy one would take the request (waiting would only rot: a
        dead pool borrows, under its lenders' rules, before it says so),
        QueueFull when the queue is at its bound, QueueTimeout at the
        deadline -- or at once, when the pool's drain rate says no seat
        would come within ``fail_fast_fraction`` of the time left to it.
        """
        if not self.healthy and not any(lender.healthy and lender.would_lend(ticket) for lender in self.lenders):
            # Where the router knows why (an engine refusing tailguard's key), the caller's message says so.
            why = "; ".join(sorted({e.auth_failure for e in self.endpoints if e.auth_failure is not None}))
            raise NoBackend(
                f"pool {self.name!r} has no healthy endpoint{f' ({why})' if why else ''}; retry after {retry_after:g} s",
                retry_after=retry_after,
            )
        fraction = self.config.fail_fast_fraction
        max_wait = fraction * (deadline - trio.current_time()) if fraction > 0 else None
        return await self.queue.get(priority, deadline, ticket, retry_after=retry_after, max_wait=max_wait)

    def first_waiting(self) -> tuple[int, float] | None:
        """[cluster] (priority, arrival) of the request the next seat goes to, to compare with the other replicas.

        Its arrival is when it came to the router (``Ticket.arrived``, before
        any wait for its key's seat), else when it joined this queue.
        """
        first = self.queue.first()
        if first is None:
            return None
        priority, since, ticket = first
        return priority, min(ticket.arrived, since) if math.isfinite(ticket.arrived) else since

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            name=self.name,
            in_flight=self.in_flight,
            max_concurrency=self.max_concurrency,
            healthy_endpoints=sum(e.usable for e in self.endpoints),
            endpoints=len(self.endpoints),
            queue=self.queue.statistics(),
            seat_seconds=self.seat_time.mean,
            drain_rate=self._full_drain_rate(),
        )
