"""One inference server as the router sees it: its cap, load, health, ejection state and HTTP clients.

An endpoint outlives pools across config reloads (``pool_name`` changes, its
in-flight count stays), and outlives the config that named it while seats
still hold it (``retired``). Outlier detection's rules live in
router/fleet/outlier.py; this is the state they read and write.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, Protocol

import trio

from ..backend import BackendClient, BackendLoad, BackendProbe, ConnectorTransport
from ..config import BackendAccess, EndpointConfig, ServerConfig, TimeoutsConfig
from ..quotas import Yielding
from .first_byte_model import FirstByteModel
from .lender_latency import RecentMean
from .seat_split import SeatSplit


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
    active health check's (only it sets it): an endpoint starts unknown
    (``probed`` False, not healthy) and takes nothing until a probe has
    passed -- an engine nobody has heard from is not up. ``ejected_until`` is outlier
    detection's, from live traffic: ``consecutive_failures`` failed requests
    in a row take it out for a while (router/fleet/outlier.py); the
    time out ends by itself.

    A client replaced by a reload (a new cap means a new connection pool) is
    handed to ``closer`` as soon as the last seat that holds it is released,
    so a reload never leaves connections behind.

    A *share* (``engine`` set) is seats of another endpoint's engine serving
    another pool (router/fleet/seat_split.py): it uses the engine's clients, is
    never probed, and is usable only while the engine is healthy, accepts
    tailguard's key and is not ejected. ``split`` is set on the engine and
    its shares while the engine's seats are split.
    """

    def __init__(
        self,
        config: EndpointConfig,
        *,
        connect_timeout: float,
        transport: ConnectorTransport | None,
        closer: Closer,
        max_body_bytes: int = ServerConfig.max_backend_body_bytes,
        keep_alive_timeout: float = TimeoutsConfig.backend_keep_alive_timeout,
        engine: Endpoint | None = None,
    ) -> None:
        self.url = config.url
        self.engine = engine  # a share: the endpoint whose engine's seats it holds
        self.split: SeatSplit[Endpoint] | None = None  # the engine's seats split between pools (rebalancing's seat moves)
        self.rendezvous_seed = url_seed(config.url)  # prefix affinity's weight of it for a key: router/fleet/policies.py
        self.max_concurrency = config.max_concurrency
        self.movable = config.movable
        self.access = config.access  # tailguard's key and CA for this engine
        # Set while the engine refuses that key (401/403): why, for /health. Cleared
        # when it accepts the key again (the health check asks) or a reload changes it.
        self.auth_failure: str | None = None
        self.credentials_checked = False  # a /v1 route answered with tailguard's key since it was last down (probes ask until one does)
        # vLLM's own queue was full (a 503 before any byte): until ``busy_until`` the
        # endpoint takes at most ``busy_cap`` requests, what it held when it said so.
        self.busy_until = -math.inf
        self.busy_cap = 0
        self.busy_answers = 0  # 503s before any byte, since the process started (for /metrics)
        self.granted: int | None = None  # its seats this replica may use ([cluster]); None: all
        self.yielding: Yielding | None = None  # [cluster]: a request waits for its seats on another replica
        self.in_flight = 0
        self.borrowed = 0  # of those, seats serving another pool's request (a lease with a borrower)
        # Of those, requests whose first byte has not come yet: still in prefill (LendConfig.prefills bounds them).
        self.borrowed_prefilling = 0
        # Estimated prompt tokens of its requests still before their first byte: the prefill queued on the engine.
        self.prefill_backlog = 0
        # Tokens of context its requests in flight attend to (prompt and max_tokens, each sequence): what a step costs
        # beyond the sequences it runs (``fill``).
        self.context_tokens = 0
        self.own_first_token = RecentMean()  # its pool's own streams lately (LendConfig.ttft_budget)
        # The same recent mean of its pool's own streams' seconds a token after the first (lending by promise).
        self.own_token_gap = RecentMean()
        # Its engine's time to a stream's first byte, learnt from its calls (a share's is its engine's).
        self.first_byte_model: FirstByteModel = engine.first_byte_model if engine is not None else FirstByteModel()
        # Seats given to it as their prefix key's home, ever: how warm its prefix cache is for its pool
        # (rebalancing moves the coldest; the count of a recent window is the rebalancer's).
        self.home_placements = 0
        self._idle: trio.Event | None = None  # set when in_flight falls to 0 (a move waits on it)
        # The health check's verdict. An engine is unknown until its first probe gives one (a
        # share follows its engine's: never probed itself); ``probe_verdict`` is set then.
        self.healthy = engine is not None
        self.probed = engine is not None
        self.probe_verdict = trio.Event()
        self.probe_refused = False  # a completion probe was answered 4xx (not 401/403): warned once
        self.work_unproven = False  # a completion probe failed, none passed since: health_check "auto" asks with one again
        # Calls waiting for their first byte here (a share's wait on its engine), and since when:
        # cancelled at once when a probe finds the engine silent (``stop_waiting``), to be tried elsewhere.
        self._awaiting: dict[trio.CancelScope, float] = {}
        # Context length: what GET /v1/models said last (None: not asked, or no
        # answer), and whether that is enough for its pool (router/fleet/model_len.py).
        self.max_model_len: int | None = None
        self.fits_context = True
        # The pool it serves, by name (None: retired, or between pools on a rebalancing
        # move); the Pool itself is the fleet's to look up (Fleet.pool_of).
        self.pool_name: str | None = None
        self.load: BackendLoad | None = None  # vLLM's own queue, set by backend_load.scrape
        self._open_outlier_books()
        self._connect_timeout = connect_timeout
        self._transport = transport
        self._closer = closer
        self._max_body_bytes = max_body_bytes
        self._keep_alive_timeout = keep_alive_timeout
        self.retired = False  # left the config; kept only while seats still hold it
        if engine is None:
            self.client = self._new_client(config.max_concurrency, config.access)
            self.probe = self._new_probe(config.access)
        else:  # a share: the engine's connections (its cap bounds both), closed by the engine
            self.client, self.probe = engine.client, engine.probe
            self.max_model_len = engine.max_model_len
        self._client_closed = False
        self._replaced: set[BackendClient] = set()  # old clients that seats still hold

    def _open_outlier_books(self) -> None:
        """Outlier detection's books (router/fleet/outlier.py): failures in a row, the recent window, ejections."""
        self.failures_in_a_row = 0
        # The last requests' verdicts (True: failed), at most the pool's failure_window: the
        # failure-ratio rule reads them, and placement counts each failure as load.
        self.outcome_window: collections.deque[bool] = collections.deque()
        self.recent_failures = 0
        self.failure_load = 0  # what placement adds for them (0 until the window is big enough to judge)
        # Half-open, as a circuit breaker: an ejection that ran out lets one request in at a
        # time until one succeeds; a failure then ejects again at once. A half-dead engine
        # costs one request per readmission, not a run of them.
        self.half_open = False
        self.ejections = 0  # times ejected in all, for /metrics
        self.ejections_in_a_row = 0  # times ejected lately: the ejection time's multiplier
        self.ejected_until: float | None = None
        self.ejection_ended_at = -math.inf

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
        resize = config.max_concurrency != (self.max_concurrency if self.split is None else self.split.cap)  # a split's: the engine's
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

    def judged(self, healthy: bool) -> None:
        """A probe's verdict: the health check's state, and no longer unknown.

        Going down forgets that the engine took tailguard's key: what comes
        back on its port may be a restart with another ``--api-key``, asked
        again before it is trusted (``Upkeep._check_key``).
        """
        if self.healthy and not healthy:
            self.credentials_checked = False
        self.healthy = healthy
        if not self.probed:
            self.probed = True
            self.probe_verdict.set()

    @contextmanager
    def awaiting_answer(self) -> Iterator[trio.CancelScope]:
        """A scope around a call's wait for its first byte, cancelled if the engine is found silent meanwhile."""
        engine = self.engine or self
        scope = trio.CancelScope()
        engine._awaiting[scope] = trio.current_time()
        try:
            with scope:
                yield scope
        finally:
            del engine._awaiting[scope]

    def waiting_since(self) -> float:
        """When the oldest call still waiting for its first byte here was sent (inf: none waits)."""
        return min(self._awaiting.values(), default=math.inf)

    def stop_waiting(self) -> int:
        """The engine was found silent: every call still waiting for its first byte here gives up (returns how many)."""
        waiting = list(self._awaiting)
        for scope in waiting:
            scope.cancel()
        return len(waiting)

    async def wait_idle(self) -> None:
        """Return once no request runs here (at once if none does)."""
        while self.in_flight:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    def new_share(self) -> Endpoint:
        """A share of this engine's seats, with none yet (``SeatSplit`` gives it some)."""
        return Endpoint(
            EndpointConfig(self.url, 0, access=self.access),
            connect_timeout=self._connect_timeout,
            transport=self._transport,
            closer=self._closer,
            max_body_bytes=self._max_body_bytes,
            keep_alive_timeout=self._keep_alive_timeout,
            engine=self,
        )

    def seat_freed(self) -> None:
        """One of its requests ended (``in_flight`` already lowered); with its seats split, the other pools may use the seat."""
        if not self.in_flight and self._idle is not None:
            self._idle.set()
            self._idle = None
        if self.split is not None:
            self.split.freed(self)

    def lease_ended(self, client: BackendClient) -> None:
        """A seat holding ``client`` was released: close the client if it was replaced and is idle."""
        if self.engine is not None:  # a share's client is its engine's: the engine closes it
            self.engine.lease_ended(client)
            return
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
        self.pool_name = None
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
        self.ejection_ended_at = until
        self.half_open = True  # back on trial: one request at a time until one succeeds
        return False

    @property
    def unknown(self) -> bool:
        """No probe has given a verdict on its engine yet (requests wait for one: ``Pool.admit``)."""
        return not (self.engine or self).probed

    @property
    def usable(self) -> bool:
        """Healthy, long enough for its pool, accepting tailguard's key, not ejected: may take new requests when it has room."""
        own = self.healthy and self.fits_context and self.auth_failure is None and (self.ejected_until is None or not self.ejected)
        engine = self.engine
        return own and (engine is None or (engine.healthy and engine.auth_failure is None and not engine.ejected))

    @property
    def seats(self) -> int:
        """Its cap here: all of it, or this replica's grant of it in a cluster, lowered for a moment after a busy answer."""
        seats = self._cap()
        return min(seats, 1) if self.half_open else seats

    def _cap(self) -> int:
        """``seats`` but for a half-open trial's one request."""
        seats = self.max_concurrency if self.granted is None else min(self.max_concurrency, self.granted)
        if self.split is not None:  # the engine's seats split between pools: what the others leave it
            seats = min(seats, self.split.room_for(self))
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

    def room_for(self, need: int) -> bool:
        """Usable, with ``need`` seats free for one request (its n sequences).

        Half open, it takes one request at a time, whatever its size; else the
        request's sequences must all fit under its cap.
        """
        if need == 1:
            return self.has_room
        if self.half_open:
            return not self.in_flight and self.usable and need <= self._cap()
        return self.in_flight + need <= self.seats and self.usable

    @property
    def outcomes(self) -> int:
        """Verdicts in the window now."""
        return len(self.outcome_window)

    def fill(self, more_seats: int = 0, more_tokens: int = 0) -> float:
        """How busy its engine is, with ``more_seats`` seats holding ``more_tokens`` of context more: a share of its seats.

        A vLLM step costs per sequence and per token of context the
        sequences attend to, so twenty long documents load an engine more
        than twenty one-line questions: the larger of the seats taken and
        the context held, ``CONTEXT_TOKENS_A_SEAT`` tokens to a seat.
        Requests of short context count as seats, as they always did.
        """
        seats = self.in_flight + more_seats
        return max(seats, (self.context_tokens + more_tokens) / CONTEXT_TOKENS_A_SEAT) / self.seats

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
            self.ejection_ended_at = trio.current_time()

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.probe.aclose()


def url_seed(url: str) -> hashlib.blake2b:
    """An endpoint's rendezvous seed: blake2b having read its URL, kept by the endpoint so a request hashes only its key.

    Here, not beside the policies that weigh it (router/fleet/policies.py), so that they import endpoints and not the reverse.
    """
    return hashlib.blake2b(url.encode(), digest_size=8)


# Tokens of context that cost a step as much as one more sequence in it: the simulator's calibration of an 8B model
# on an H100 (0.033 ms a sequence, 0.00005 ms a token of context: docs/simulator.md), the one ratio tailguard has
# measured; an engine's own ratio differs by model and GPU, and only shifts how much a long context weighs.
CONTEXT_TOKENS_A_SEAT = 660.0
