"""GPU pools: strict concurrency caps over their endpoints, leases and the wait queue (lending: lending.py).

A :class:`Pool` hands out :class:`Lease` objects, each one seat on one
endpoint. A lease is granted only while the pool is under its cap and some
healthy endpoint is under its own cap; the pool's ``policy`` picks which
(router/fleet/policies.py): by default the request's prefix home, by rendezvous
hashing of its prefix key within a load bound (``PrefixAffinity``), or the
least loaded (``LeastLoaded``, ``placement = "least_loaded"``); seats lent
to another pool's requests are packed together and kept apart from the
pool's own.
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

import math
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass

import trio

from ..config import PoolConfig
from ..errors import BackendAuthFailed, NoBackend
from ..queueing import NO_SHARE, SKIP, Share, Skip, WaitQueue, WaitQueueStatistics, whole_seconds
from ..quotas import Yielding
from .endpoint import Clients as Clients, Closable as Closable, Closer as Closer, Endpoint
from .lending import Lending
from .policies import EndpointPolicy, Placement, PlacementKind, policy_for


class Rerouted(Exception):
    """A reload removed the pool a request waited in, or left it no endpoint, or every endpoint of it
    refuses tailguard's key (the health check's verdict): decide the request again.

    Never reaches a caller: the request path admits it anew under the config
    in force (``RequestPath._seat``), its queue deadline unchanged.
    """


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
    prefix_key: bytes | None = None  # router/admission/prefix_keys.py, computed once at admission: where its prefix is cached
    # The tenant it is for (the caller's name) and its weight: its fair share of the queue (router/queueing/fair_share.py).
    share: Share = NO_SHARE
    # The sequences the engine runs for it (``n``): the seats it takes, together, on one endpoint.
    sequences: int = 1
    # The one endpoint it may run on (a Responses API turn continuing a response that engine keeps), or None.
    pinned: str | None = None

    @property
    def output_tokens(self) -> int:
        """The most it may generate: max_tokens for each of its sequences."""
        return self.max_tokens * self.sequences


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
    """A request's seats on one endpoint of one pool (``seats``: one per sequence, n); ``release`` is idempotent.

    ``pool`` is the pool whose seat it is. A borrowed seat (``borrower`` set)
    belongs to a lender pool and serves a request of ``borrower``'s.
    ``prefix_key`` is the request's (a retry follows its rendezvous order),
    ``placement`` how the endpoint it is on now was chosen. A borrowed seat
    is ``prefilling`` from its grant to its request's first byte (or its end),
    counted in its endpoint's ``borrowed_prefilling`` (``LendConfig.prefills``).
    """

    __slots__ = (
        "pool", "endpoint", "client", "granted_at", "request_class", "borrower", "prefix_key", "placement", "prefilling",
        "prefill_tokens", "seats", "_released", "called_at", "tokens_to_first_byte", "predicted_first_byte", "first_byte_seconds", "context_tokens",
    )

    def __init__(
        self,
        pool: Pool,
        endpoint: Endpoint,
        request_class: str,
        borrower: Pool | None = None,
        prefix_key: bytes | None = None,
        placement: PlacementKind = "least_loaded",
        seats: int = 1,
        context_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.seats = seats
        self.context_tokens = context_tokens  # in its endpoint's context_tokens while it holds the seat
        self.endpoint = endpoint
        self.request_class = request_class
        self.borrower = borrower
        self.prefix_key = prefix_key
        self.placement = placement
        self.prefilling = borrower is not None
        if self.prefilling:
            endpoint.borrowed_prefilling += 1
        self.prefill_tokens = 0  # in its endpoint's prefill_backlog from the call (streamed) to the first byte
        self.client = endpoint.client
        self.client.leases += 1
        self.granted_at = trio.current_time()
        self._released = False
        # A streamed call's prompt tokens to prefill before its first byte (its own and those queued ahead on
        # the endpoint), the seconds its engine's model predicted for them, and what it took.
        self.called_at: float | None = None
        self.tokens_to_first_byte = 0
        self.predicted_first_byte: float | None = None
        self.first_byte_seconds: float | None = None

    def calling(self, prompt_tokens: int, *, streamed: bool) -> None:
        """The call is about to go out: a streamed one's prompt joins its endpoint's prefill backlog until the first byte.

        A whole answer's first byte is its end, so its prefill cannot be
        seen end: it is left out rather than counted for its whole life.
        """
        if streamed and not self.prefill_tokens:
            self.prefill_tokens = max(1, prompt_tokens)
            endpoint = self.endpoint
            self.tokens_to_first_byte = endpoint.prefill_backlog + self.prefill_tokens
            self.predicted_first_byte = endpoint.first_byte_model.predict(self.tokens_to_first_byte)
            self.called_at = trio.current_time()
            endpoint.prefill_backlog += self.prefill_tokens

    def first_byte(self, *, stream: bool) -> None:
        """The engine's first byte came: a borrowed request's prefill is over, an own stream's wait is measured,
        and the engine's first-byte model learns what this call took."""
        if self.called_at is not None and self.first_byte_seconds is None:
            self.first_byte_seconds = trio.current_time() - self.called_at
            self.endpoint.first_byte_model.learn(self.tokens_to_first_byte, self.first_byte_seconds)
        self._prefill_seen()
        lending = self.pool.lending
        if stream and self.borrower is None and lending.watches_first_tokens:
            now = trio.current_time()
            self.endpoint.own_first_token.observe(now - self.granted_at, now)
        if self.prefilling:  # a borrowed request's prefill is over: the endpoint may take another borrowed request
            self.prefilling = False
            self.endpoint.borrowed_prefilling -= 1
            if self.pool.config.lend.prefills is not None:  # a borrower may be waiting on this bound alone
                for borrower in lending.borrowers:
                    borrower.queue.dispatch()
        elif lending.by_promise and self.called_at is not None:  # a shorter prefill queue: a prompt may fit the promise now
            for borrower in lending.borrowers:
                borrower.queue.dispatch()

    def _prefill_seen(self) -> None:
        """Its prompt leaves its endpoint's prefill backlog (first byte, or the end)."""
        if self.prefill_tokens:
            self.endpoint.prefill_backlog -= self.prefill_tokens
            self.prefill_tokens = 0

    def move(self, to: Placement) -> None:
        """Carry the seat to another endpoint of the pool (a retry); the pool's count is unchanged."""
        endpoint = to.endpoint
        self.placement = to.kind
        old = self.endpoint
        seats = self.seats
        old.in_flight -= seats
        endpoint.in_flight += seats
        old.context_tokens -= self.context_tokens
        endpoint.context_tokens += self.context_tokens
        if self.borrower is not None:
            old.borrowed -= seats
            endpoint.borrowed += seats
        if self.prefilling:  # the next endpoint prefills it afresh
            old.borrowed_prefilling -= 1
            endpoint.borrowed_prefilling += 1
        if self.prefill_tokens:
            old.prefill_backlog -= self.prefill_tokens
            self.tokens_to_first_byte = endpoint.prefill_backlog + self.prefill_tokens  # the call goes out afresh there
            self.predicted_first_byte = endpoint.first_byte_model.predict(self.tokens_to_first_byte)
            self.called_at = trio.current_time()
            endpoint.prefill_backlog += self.prefill_tokens
        old.seat_freed()
        old.lease_ended(self.client)
        self.endpoint = endpoint
        self.client = endpoint.client
        self.client.leases += 1
        self.pool.yield_freed_seat(old)
        self.pool.queue.dispatch()  # the old endpoint's seat may seat a waiter
        if old.pool_name is not None and not self.pool.holds(old):  # a reload moved it meanwhile
            self.pool.dispatch_at(old)

    def release(self, *, timed: bool = True) -> None:
        """Give the seat back; ``timed``: its time is a served request's, for the pool's drain rate
        (not a call the engine refused before any work)."""
        if self._released:
            return
        self._released = True
        pool = self.pool
        seats = self.seats
        pool.in_flight -= seats
        pool.seat_ended(self)
        self.endpoint.in_flight -= seats
        self.endpoint.context_tokens -= self.context_tokens
        if self.borrower is not None:
            self.endpoint.borrowed -= seats
        if self.prefilling:
            self.prefilling = False
            self.endpoint.borrowed_prefilling -= 1
        self._prefill_seen()
        self.endpoint.seat_freed()
        self.endpoint.lease_ended(self.client)
        if timed:
            pool.seat_time.observe(trio.current_time() - self.granted_at)
        pool.yield_freed_seat(self.endpoint)  # [cluster]: to a more urgent request on another replica
        if self.borrower is None and pool.in_flight == pool.lending.lent:
            pool.lending.own_seats_ended()
        own_first = pool.queue.most_urgent()
        if own_first is not None:  # a borrower's more urgent request (a lower priority number) before the pool's own
            for borrower in pool.lending.borrowers:
                theirs = borrower.queue.most_urgent()
                if theirs is not None and theirs < own_first:
                    borrower.queue.dispatch()
        pool.queue.dispatch()  # the pool's own requests next
        for borrower in pool.lending.borrowers:  # then, if a seat is still idle, the pools it lends to
            borrower.queue.dispatch()
        moved_to = self.endpoint.pool_name  # Pool.holds, inlined: this is every request's path
        if moved_to is not None and (moved_to != pool.name or pool.removed):
            pool.dispatch_at(self.endpoint)


class Pool:
    """A set of endpoints with a strict concurrency cap and a priority wait queue."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        pool_of: Callable[[Endpoint], Pool | None],
        rng: random.Random | None = None,
        policy: EndpointPolicy | None = None,
    ) -> None:
        self.name = config.name
        self.config = config
        self.removed = False  # a reload took it out: a pool of its name later is another Pool
        # The pool an endpoint serves now, from the table where the pools live (Fleet.pool_of).
        self._pool_of = pool_of
        self.endpoints: list[Endpoint] = []
        self.in_flight = 0
        self.seat_time = SeatTime()
        self.class_in_flight: dict[str, int] = {}  # seats of this pool held per class
        self.lending = Lending(self)  # whom it lends to and borrows from, and under which rules
        self.cap_moved = 0  # seats of endpoints moved in, less those moved out, since the last reload
        self.granted: int | None = None  # this replica's share of the cap ([cluster]); None: all of it
        self.yielding: Yielding | None = None  # [cluster]: a request waits for its seats on another replica
        # While a freed seat is offered: the request elsewhere it may go to; only one here that comes first may take it.
        self._serving_up_to: Yielding | None = None
        self._rng = rng or random.Random()
        # Which endpoint a seat goes to: config.placement's (prefix affinity by default), rebuilt when a reload changes it.
        self.policy: EndpointPolicy = policy or policy_for(config.placement, self._rng)
        self.queue: WaitQueue[Lease, Ticket] = WaitQueue(self._grant, max_waiting=config.max_queue, drain_rate=self._drain_rate)

    def holds(self, endpoint: Endpoint) -> bool:
        """``endpoint`` serves this pool now (not moved away, by a reload or rebalancing, nor this pool removed)."""
        return endpoint.pool_name == self.name and not self.removed

    def dispatch_at(self, endpoint: Endpoint) -> None:
        """A seat on ``endpoint`` freed: the waiters of the pool it serves now get it, if that pool is another."""
        now = self._pool_of(endpoint)
        if now is not None and now is not self:
            now.queue.dispatch()

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

    def reroute_waiters(self) -> int:
        """Send every request waiting here back to be decided again (``Rerouted``): the pool was removed or emptied,
        or no endpoint of it takes tailguard's key."""
        return self.queue.evict_all(Rerouted)

    def reconfigure(self, config: PoolConfig, endpoints: list[Endpoint]) -> None:
        """Adopt a new config and endpoint set (a reload: moves are undone); waiters get any room it opens."""
        if config.placement != self.config.placement:
            self.policy = policy_for(config.placement, self._rng)
        self.config = config
        self.cap_moved = 0
        self.endpoints = endpoints
        for endpoint in endpoints:
            endpoint.pool_name = self.name
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

    def retry_endpoint(self, lease: Lease, tried: Collection[Endpoint] = ()) -> Placement | None:
        """Another endpoint with room for a failed request's next try, none it was tried on, or None.

        The policy chooses as for a new seat, so a keyed request goes to the
        next endpoint in its key's rendezvous order within the load bound.
        """
        exclude = tried if lease.endpoint in tried else [*tried, lease.endpoint]
        if lease.borrower is not None:
            exclude = [*exclude, *self.lending.closed_to_borrowers(lease.prefill_tokens)]
        return self.policy.choose(
            self.endpoints, lease.prefix_key, borrowed=lease.borrower is not None, exclude=exclude, need=lease.seats
        )

    def _full_drain_rate(self) -> float | None:
        """Seats a second the pool frees when all are taken (Little's law), or None without an estimate.

        Over its cap after a reload lowered it, the pool frees the seats in
        use at that pace, not only the new cap's, hence the larger of the two.
        Its requests seated on lenders free seats for its queue too (a lender
        lends the seat again while it lends at all): without them, a pool that
        borrows half its service refused at arrival requests the lenders
        would have served in time (bench trace, ShareGPT 2 engines at 3x:
        3,632 long requests refused while the served ones ended by 73 s of
        their 120 s).
        """
        hold = self.seat_time.mean
        seats = max(self.seats, self.in_flight) + self.lending.borrowed
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
        for lender in self.lending.lenders:  # a lender lending ``when = "busier"`` whose engine is the less busy one comes first
            if lender.config.lend.when == "busier" and lender.lending.less_busy_than(self, ticket):
                lent = self.lending.borrow(lender, ticket)
                if isinstance(lent, Lease):
                    return lent
        own = self.seat(ticket, None)
        if isinstance(own, Lease):
            return own
        answer: Lease | Skip | None = own
        for lender in self.lending.lenders:
            lent = self.lending.borrow(lender, ticket)
            if isinstance(lent, Lease):
                return lent
            answer = answer or lent
        return answer

    def least_fill(self, tokens: int = 0, sequences: int = 1) -> float | None:
        """How busy the pool's idlest engine with room would be with one more request of ``sequences`` sequences of ``tokens`` context each (``Endpoint.fill``).

        A vLLM step costs more with every sequence it runs and every token
        they attend to, so a pool with a seat free may still be slower than
        a sibling's idle engine; None when no endpoint has room for all
        the sequences (they are seated together, as ``seat`` seats them).
        """
        return min((e.fill(sequences, sequences * tokens) for e in self.endpoints if e.room_for(sequences)), default=None)

    @property
    def isolates_lent(self) -> bool:
        """Whether seats lent from here are kept apart from the pool's own requests (packed onto few engines).

        A class promised a first token (``ttft``) loses it beside a borrowed
        long prefill, so its pool packs what it lends and keeps its own
        requests off those engines. A pool promised only an end (batch)
        places own and borrowed alike by load: a short borrowed request
        costs its long ones a step's share, as any of their own would, and
        keeping its own off the engines it lends from would crowd them onto
        the rest (origin's mix, 4 engines: long E2E P99 2.9x round robin).
        """
        return self.lending.promise is not None

    def seat(self, ticket: Ticket, borrower: Pool | None) -> Lease | Skip | None:
        """Seats on an endpoint of this pool with room (its ``policy`` picks which), within the pool's and the class's caps.

        A request of n sequences takes n seats on one endpoint, together:
        None until that many are free (the queue keeps its place, so the
        smaller requests behind it do not pass it for ever).
        """
        need = ticket.sequences
        if self.in_flight + need > self.max_concurrency:
            return None
        if self._serving_up_to is not None and not self._serving_up_to.before(ticket.priority, ticket.arrived):
            # A freed seat a request on another replica comes first for; the queue is in (priority, arrival)
            # order, so everyone behind this ticket comes later too: none of them gets it.
            return None
        limit = self.config.class_limit(ticket.request_class)
        if limit is not None and self.class_in_flight.get(ticket.request_class, 0) + need > limit:
            return SKIP
        exclude = self.lending.closed_to_borrowers(ticket.prompt_tokens) if borrower is not None else ()
        if ticket.pinned is not None:
            placement = self._pinned(ticket.pinned, need)
            if placement is None or isinstance(placement, Skip):
                return placement
        else:
            placement = self.policy.choose(self.endpoints, ticket.prefix_key, borrowed=borrower is not None, exclude=exclude, need=need, isolate=self.isolates_lent)
        if placement is None:
            # Closed to a prompt this long but not to a shorter one: a later, shorter waiter may still have the seat.
            return SKIP if exclude and self.lending.by_promise and len(self.lending.closed_to_borrowers()) < len(exclude) else None
        endpoint = placement.endpoint
        if placement.kind == "home":
            endpoint.home_placements += 1
        self.in_flight += need
        self.class_in_flight[ticket.request_class] = self.class_in_flight.get(ticket.request_class, 0) + need
        endpoint.in_flight += need
        context = need * (ticket.prompt_tokens + ticket.max_tokens)
        endpoint.context_tokens += context
        if borrower is not None:
            endpoint.borrowed += need
        else:
            self.lending.own_peak.observe(self.in_flight - self.lending.lent, trio.current_time())
        return Lease(self, endpoint, ticket.request_class, borrower, ticket.prefix_key, placement.kind, need, context)

    def _pinned(self, url: str, need: int) -> Placement | Skip | None:
        """The pinned endpoint when it is this pool's and has room; SKIP when it is not here, or full while a sibling
        has room (the requests behind it in the queue may take that room: no head-of-line wait for one engine);
        None while none has room."""
        endpoint = next((e for e in self.endpoints if e.url == url), None)
        if endpoint is None:
            return SKIP
        if endpoint.room_for(need):
            return Placement(endpoint, "pinned")
        return SKIP if any(e.room_for(need) for e in self.endpoints) else None

    def seat_ended(self, lease: Lease) -> None:
        """Book-keeping of a released lease's seats: its class's count, and the lent count."""
        left = self.class_in_flight.get(lease.request_class, 0) - lease.seats
        if left > 0:
            self.class_in_flight[lease.request_class] = left
        else:
            self.class_in_flight.pop(lease.request_class, None)
        if lease.borrower is not None:
            self.lending.lent -= lease.seats
            lease.borrower.lending.borrowed -= lease.seats

    async def admit(
        self, priority: int, deadline: float, ticket: Ticket, *, retry_after: float, recheck_in: float | None = None
    ) -> Lease:
        """A lease, waiting until ``deadline`` if need be.

        ``retry_after`` is the floor of every refusal's hint; ``recheck_in``
        the seconds to the next health check, when an endpoint may come back.

        Raises NoBackend at once when no endpoint is healthy and no lender
        with a healthy one would take the request (waiting would only rot: a
        dead pool borrows, under its lenders' rules, before it says so) --
        BackendAuthFailed instead when every endpoint is out because it
        refuses tailguard's key (no retry helps until the operator acts),
        QueueFull when the queue is at its bound, QueueTimeout at the
        deadline -- or at once, when the pool's drain rate says no seat
        would come within ``fail_fast_fraction`` of the time left to it.
        Endpoints no probe has judged yet (a start, a reload, a new DNS
        address) are waited for, until ``deadline``: their verdict is due
        within a health check timeout, and a 503 now would be wrong if they pass.
        """
        if not self.healthy and not self._lender_takes(ticket):
            await self._first_verdicts(deadline)
        if not self.healthy and not self._lender_takes(ticket):
            refused = self.keys_refused()
            if refused is not None:
                raise BackendAuthFailed(f"pool {self.name!r} has no endpoint that takes tailguard's key ({refused})")
            # Where the router knows why (an engine refusing tailguard's key), the caller's message says so.
            why = "; ".join(sorted({e.auth_failure for e in self.endpoints if e.auth_failure is not None}))
            if any(e.unknown for e in self.endpoints):
                why = "; ".join(filter(None, (why, "no health check has answered yet")))
            hint = self.queue.hints.spread(self._back_in(recheck_in), retry_after)
            raise NoBackend(
                f"pool {self.name!r} has no healthy endpoint{f' ({why})' if why else ''}; retry after {whole_seconds(hint)} s",
                retry_after=hint,
            )
        fraction = self.config.fail_fast_fraction
        max_wait = fraction * (deadline - trio.current_time()) if fraction > 0 else None
        return await self.queue.get(priority, deadline, ticket, retry_after=retry_after, max_wait=max_wait, share=self.share_of(ticket))

    def keys_refused(self) -> str | None:
        """Why, when every endpoint of the pool refuses tailguard's key (each one's reason); else None.

        Such a pool stays out of service whatever the health check finds until
        the key is fixed, so its callers get the error that says so, every
        time (502 upstream_auth, not retryable), not a 503 inviting retries
        that meet the same key. One endpoint out for anything else (down,
        ejected, unknown) may come back by itself: that pool answers NoBackend.
        """
        reasons = [(e.engine or e).auth_failure for e in self.endpoints]
        if not reasons or None in reasons:
            return None
        return "; ".join(sorted({reason for reason in reasons if reason is not None}))

    def _lender_takes(self, ticket: Ticket) -> bool:
        return any(lender.healthy and lender.lending.would_lend(ticket, self) for lender in self.lending.lenders)

    async def _first_verdicts(self, deadline: float) -> None:
        """Wait until none of the pool's endpoints is unknown (no probe has judged it yet), or a usable one came, or ``deadline``."""
        with trio.move_on_at(deadline):
            while not self.healthy:
                unknown = next((e for e in self.endpoints if e.unknown), None)
                if unknown is None:
                    return
                await (unknown.engine or unknown).probe_verdict.wait()

    def share_of(self, ticket: Ticket) -> Share:
        """The share ``ticket`` waits in: its tenant's, or none with ``queue_order = "arrival"``."""
        return ticket.share if self.config.queue_order == "fair" else NO_SHARE

    def _back_in(self, recheck_in: float | None) -> float:
        """Seconds until an endpoint may take requests again: an ejected one at its ejection's end, any other at the next health check."""
        now = trio.current_time()
        recheck = 0.0 if recheck_in is None else recheck_in
        back = [e.ejected_until - now if e.ejected_until is not None and e.ejected_until > now else recheck for e in self.endpoints]
        return max(min(back, default=recheck), 0.0)

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

    def waiting_seats(self) -> int:
        """[cluster] Seats the waiting requests want: one each, and all of the first one's (its n sequences are seated together)."""
        first = self.queue.first()
        return self.queue.waiting + (0 if first is None else first[2].sequences - 1)

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
