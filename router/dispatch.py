"""The request's path through the core: caps -> class -> admission -> backend.

:meth:`Router.open` is the one entry point both front ends use. It yields a
:class:`Completion` whose body the front end relays; leaving the ``async
with`` block -- normally, by error, by cancellation -- closes the backend
stream (vLLM aborts the generation) and releases the seat, always.

The front end owns the request's end-to-end cancel scope (its deadline comes
from :meth:`Router.deadline_for`) and cancels it when the caller goes away;
everything here unwinds through ``async with`` blocks.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from .assemble import assemblable, assemble, events
from .auth import ANONYMOUS, Authenticator, Caller
from .backend import BackendClient, BackendResponse, ModelLenUnknown
from .backend_load import BackendLoad, scrape
from .classify import classify, forced
from .cluster import NO_WAITER, ClusterStatus, Demand, LedgerStore, SharedBudget, Yielding
from .config_types import Config, EndpointConfig, PoolConfig
from .discovery import Discovery, Found
from .errors import (
    BackendAuthFailed,
    BackendBusy,
    BackendError,
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    BadBackendReply,
    CallerOverLimit,
    Draining,
    Forbidden,
    ModelNotFound,
)
from .health_thresholds import HealthStreaks
from .ids import IdSource
from .limits import check_context, check_prompt, effective_max_tokens, estimate_prompt_tokens
from .loop_lag import LoopLag
from .model_len import context_fits
from .pool import Clients, Closable, Endpoint, Lease, Pool, PoolStatistics, Ticket
from .rebalance import Rebalancer
from .request import RouterRequest, Routing
from .telemetry import RequestRecord

log = logging.getLogger("tailguard.router")

TransportFactory = Callable[[EndpointConfig], "httpx.AsyncBaseTransport | None"]

_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}

# Body fields a caller may send but the router decides (docs/request-path.md).
# ``model``, ``messages``/``prompt``, ``max_tokens`` and ``stream`` are written
# over; these are removed first: ``max_completion_tokens`` (its value became
# ``max_tokens``), ``priority`` (the class's, on a ``vllm_priority`` pool),
# and ``request_id`` (vLLM's own id for the request: one per attempt). A
# stream's ``stream_options.include_usage`` is always true (the caller's
# other options are kept; without ``stream`` they go as sent, for vLLM to
# refuse as OpenAI does).
ROUTER_OWNED = frozenset({"max_completion_tokens", "priority", "request_id"})



@dataclass
class Completion:
    """An admitted request with its backend response open."""

    routing: Routing
    response: BackendResponse
    stream: bool
    record: RequestRecord
    relay_interval: float = 0.0  # the class's: seconds between reads of the stream (0: as events come)
    # The usage event tailguard asked for on the caller's behalf (stream_options.include_usage) is not relayed.
    drop_usage: bool = False
    # "chat" / "completion": a whole answer asked of vLLM as a stream, put together by ``read``.
    assemble_as: str | None = None
    _assembled: dict[str, Any] | None = field(default=None, init=False, repr=False)

    async def read(self) -> bytes:
        """The whole body of a non-streaming response; ``payload`` is then its parsed form.

        Raises BadBackendReply (not a completion, or over
        ``server.max_backend_body_bytes``) or BackendUnavailable (broken).
        """
        if self.assemble_as is None:
            body = await self.response.read()
        else:
            body = await self._assemble(self.assemble_as)
        usage = self.payload.get("usage")
        if not isinstance(usage, dict):
            usage = {}
        self.record.input_tokens = _count(usage.get("prompt_tokens"))
        self.record.saw_answer(_count(usage.get("completion_tokens")))
        return body

    async def _assemble(self, kind: str) -> bytes:
        """The stream read to its end and folded into the whole answer (router/assemble.py), within the body cap."""
        limit = self.response.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        async for chunk in self.response.chunks(self.record.saw_chunk):
            size += len(chunk)
            if size > limit:
                raise BadBackendReply(f"the backend's answer is over {limit} bytes (server.max_backend_body_bytes)")
            chunks.append(chunk)
        payload = assemble(kind, events(chunks))
        if not payload["choices"] or not all(choice.get("finish_reason") for choice in payload["choices"]):
            raise BadBackendReply("the backend's stream did not add up to a completion (no choice with a finish reason)")
        self._assembled = payload
        return json.dumps(payload).encode()

    @property
    def payload(self) -> dict[str, Any]:
        """The parsed body (after ``read``): the front ends need not parse it again."""
        payload = self.response.payload if self._assembled is None else self._assembled
        if payload is None:
            raise RuntimeError("Completion.payload before read()")
        return payload

    def chunks(self, *, check: bool = True) -> AsyncIterator[bytes]:
        """The SSE bytes of a streaming response, relayed as they arrive, in whole events.

        Every byte is yielded before the stream's verdict: it may then end
        with BackendStreamError (the backend's own error event was among the
        bytes), BadBackendReply (an event that is not JSON, no ``[DONE]`` or
        finish reason) or BackendUnavailable (the connection broke). A reader
        that parses every event itself (gRPC's) passes ``check=False``: each
        event is then parsed once, there. The request's record sees each
        chunk on the way (no generator of its own: one layer less a chunk).
        """
        return self.response.chunks(self.record.saw_chunk, self.relay_interval, drop_usage=self.drop_usage, check=check)


@dataclass(frozen=True)
class EndpointStatistics:
    """One endpoint as the router sees it, next to what the engine says of itself."""

    url: str
    pool: str
    in_flight: int
    max_concurrency: int
    healthy: bool
    load: BackendLoad | None
    ejected: bool = False  # taken out by outlier detection for now
    ejections: int = 0  # times ejected since the process started
    failures_in_a_row: int = 0
    busy_answers: int = 0  # 503s before any byte (the engine's own queue full), ever
    key_refused: bool = False  # the engine refuses tailguard's key now (down until it takes it)


@dataclass(frozen=True)
class RouterStatistics:
    pools: tuple[PoolStatistics, ...]
    endpoints: tuple[EndpointStatistics, ...]
    requests_total: int
    config_digest: str
    draining: bool
    open_requests: int
    caller_in_flight: dict[str, int]
    retries: dict[str, int] | None = None  # per pool: failed calls tried again on another endpoint
    backend_clients: int = 0  # open HTTP clients to backends, the retired ones still closing included
    moves: dict[tuple[str, str], int] = field(default_factory=dict)  # (from, to) -> endpoints moved by rebalancing
    moving: dict[str, tuple[str, str]] = field(default_factory=dict)  # endpoint URL -> (from, to), while it drains
    lent: dict[str, int] = field(default_factory=dict)  # per pool: its seats serving other pools' requests now
    borrowed: dict[tuple[str, str], int] = field(default_factory=dict)  # (pool, lender) -> requests seated, ever
    cluster: ClusterStatus | None = None  # [cluster]: the shared ledger's mode and this replica's grants

    @property
    def in_flight(self) -> int:
        return sum(p.in_flight for p in self.pools)

    @property
    def waiting(self) -> int:
        return sum(p.queue.waiting for p in self.pools)

    def pool(self, name: str) -> PoolStatistics:
        return next(p for p in self.pools if p.name == name)


class Router:
    """Classifies, caps, queues and routes requests over the configured pools."""

    def __init__(
        self,
        config: Config,
        *,
        transport_factory: TransportFactory | None = None,
        seed: int | None = None,
        model_lens: Mapping[str, int | None] | None = None,
    ) -> None:
        """``model_lens``: what endpoints reported in GET /v1/models (router/model_len.py's ``Asked.reported``)."""
        self._transport_factory = transport_factory or (lambda _: None)
        self._rng = random.Random(seed)
        self._endpoints: dict[str, Endpoint] = {}
        self._pools: dict[str, Pool] = {}
        self._requests_total = 0
        self._draining = False
        self._open_requests = 0
        self._idle = trio.Event()
        self._idle.set()
        self._caller_in_flight: dict[str, int] = {}
        self._authenticator = Authenticator(config.auth)
        self._retired_endpoints: dict[str, Endpoint] = {}
        self._retries: Counter[str] = Counter()
        self._to_close: list[Closable] = []
        self._close_wanted = trio.Event()
        self._rebalancer = Rebalancer()
        self._budget: SharedBudget | None = None  # [cluster]: this replica's share of every cap
        self._assignment_epoch = 0  # a reload starts a new one: moves begun before it are dropped
        self._moves: Counter[tuple[str, str]] = Counter()
        self._moving: dict[str, tuple[str, str]] = {}
        self._discovered: dict[str, tuple[Found, ...]] = {}  # per pool: its endpoints_dns addresses now
        self._model_lens: dict[str, int | None] = dict(model_lens or {})  # URL -> its last max_model_len report
        self._upstream_ids = IdSource()  # the id each attempt goes to vLLM under (never the caller's)
        self.loop_lag = LoopLag()  # how late this loop runs: verdicts about engines discount its stalls (read-only outside)
        self._health_streaks = HealthStreaks()  # probe results in a row, against each pool's thresholds

        self.discovery = Discovery(self)
        self.config = config
        self.apply(config)

    # -- configuration ------------------------------------------------

    def apply(self, config: Config) -> None:
        """Swap to a validated config at once (synchronously: no request sees half of it).

        All or nothing: everything that can fail (new endpoints and their
        clients) is built first, then the swap changes plain fields only. If
        building raises, nothing has changed.

        Endpoints are kept by URL, pools by name, so in-flight counts carry
        over: a moved endpoint's running requests finish where they started
        and still count against its cap. A removed endpoint is retired: no
        new requests, its client closed when its last seat is released.

        A pool's endpoints from DNS (``endpoints_dns``) stay as last resolved,
        under the new file's caps, and discovery resolves again at once.
        """
        discovered = self._discovered_under(config)
        wanted = {p.name: [*p.endpoints, *(source.endpoint(a) for source, a in discovered.get(p.name, ()))] for p in config.pools}
        built, clients = self._build((e for p in config.pools for e in wanted[p.name]), config)
        pools_built = {p.name: Pool(p, rng=self._rng) for p in config.pools if p.name not in self._pools}

        # -- the swap: nothing below raises ------------------------------------
        endpoints: dict[str, Endpoint] = {}
        for pool_config in config.pools:
            for endpoint_config in wanted[pool_config.name]:
                endpoints[endpoint_config.url] = self._take(endpoint_config, built, clients, config)
        pools = {p.name: self._pools.get(p.name) or pools_built[p.name] for p in config.pools}
        for url, endpoint in self._endpoints.items():
            if url not in endpoints:
                self._retire(endpoint)
        for pool in self._pools.values():
            if pool.name not in pools:
                pool.reconfigure(pool.config, [])  # removed: its waiters time out
        for pool in pools.values():  # who lends to whom, as the file says now
            pool.lenders, pool.borrowers = [], []
        for pool_config in config.pools:
            for name in pool_config.lend.to:
                pools[pool_config.name].borrowers.append(pools[name])
                pools[name].lenders.append(pools[pool_config.name])
        for pool_config in config.pools:
            for endpoint_config in wanted[pool_config.name]:  # before any waiter is seated on it
                self._gate(endpoints[endpoint_config.url], pool_config)
            pools[pool_config.name].reconfigure(pool_config, [endpoints[e.url] for e in wanted[pool_config.name]])
        for pool in pools.values():  # room a new lender opened
            pool.queue.dispatch()
        self._endpoints = endpoints
        self._pools = pools
        self._assignment_epoch += 1  # the file's assignment stands again: moves in progress end here
        self._moving.clear()
        self._rebalancer.reset()
        self._authenticator = Authenticator(config.auth)
        self._discovered = discovered
        self.config = config
        self.discovery.wake()  # a reload resolves the pools' DNS names again at once

    def _build(self, configs: Iterable[EndpointConfig], config: Config) -> tuple[dict[str, Endpoint], dict[str, Clients]]:
        """New endpoints, and new clients for known ones, for ``configs``; nothing changes yet (may raise)."""
        built: dict[str, Endpoint] = {}
        clients: dict[str, Clients] = {}
        for endpoint_config in configs:
            url = endpoint_config.url
            known = self._endpoints.get(url) or self._retired_endpoints.get(url)
            if known is None:
                built[url] = endpoint = self._new_endpoint(endpoint_config, config)
                if self._budget is not None:
                    endpoint.granted = 0  # [cluster]: none of its seats until the ledger grants this replica some
            else:
                clients[url] = known.clients_for(endpoint_config)
        if built and self._budget is not None:
            self._budget.wake()
        return built, clients

    def _take(self, endpoint_config: EndpointConfig, built: dict[str, Endpoint], clients: dict[str, Clients], config: Config) -> Endpoint:
        """The endpoint for ``endpoint_config`` after ``_build``: the new one, or the known one adopting it (never raises)."""
        url = endpoint_config.url
        endpoint = built.get(url)
        if endpoint is None:
            # A removed endpoint that comes back keeps its in-flight count.
            endpoint = self._endpoints.get(url) or self._retired_endpoints.pop(url)
            endpoint.adopt(endpoint_config, clients[url], max_body_bytes=config.server.max_backend_body_bytes)
        return endpoint

    def _retire(self, endpoint: Endpoint) -> None:
        """Out of every pool: running requests finish (and hold its seats), nobody new."""
        endpoint.retire()
        if endpoint.in_flight:
            self._retired_endpoints[endpoint.url] = endpoint

    def _discovered_under(self, config: Config) -> dict[str, tuple[Found, ...]]:
        """The addresses resolved so far, for the pools and ``endpoints_dns`` entries ``config`` still has.

        Each keeps its entry's new settings (a changed per-endpoint cap
        applies now); an address that is already another endpoint is left out.
        """
        claimed = {e.url for p in config.pools for e in p.endpoints}
        kept: dict[str, tuple[Found, ...]] = {}
        for pool_config in config.pools:
            sources = {source.key: source for source in pool_config.endpoints_dns}
            found: list[Found] = []
            for old, address in self._discovered.get(pool_config.name, ()):
                source = sources.get(old.key)
                if source is None:
                    continue  # the entry left the file
                url = source.endpoint(address).url
                if url not in claimed:
                    claimed.add(url)
                    found.append((source, address))
            if found:
                kept[pool_config.name] = tuple(found)
        return kept

    def replace_discovered(self, pool_name: str, found: Sequence[Found]) -> None:
        """One pool's endpoints from DNS are now ``found`` (router/discovery.py calls this each round).

        The difference is applied as a reload applies it: a new address is
        a new endpoint with its entry's cap; a vanished one is retired (its
        running requests finish and still count against its cap, its client
        closes with its last seat); one that comes back while those run gets
        that same endpoint and count. The pool's own cap does not change,
        so it holds through the change. All or nothing, like ``apply``.
        """
        pool = self._pools.get(pool_name)
        if pool is None:
            return  # a reload removed the pool meanwhile
        config = self.config
        static = {e.url for p in config.pools for e in p.endpoints}
        current = {e.url: e for e in pool.endpoints if e.url not in static}  # its endpoints from DNS now
        sources = {source.key: source for source in pool.config.endpoints_dns}
        wanted: dict[str, EndpointConfig] = {}
        kept: list[Found] = []
        for old, address in found:
            source = sources.get(old.key)
            if source is None:
                continue  # the entry left the file meanwhile
            endpoint_config = source.endpoint(address)
            other = self._endpoints.get(endpoint_config.url)
            if endpoint_config.url in static or (other is not None and other.pool is not pool):
                log.warning("pool %s: %s (from %s) is already an endpoint elsewhere; left there", pool_name, endpoint_config.url, source.name)
                continue
            wanted[endpoint_config.url] = endpoint_config
            kept.append((source, address))
        changed = [c for url, c in wanted.items() if url not in current or current[url].max_concurrency != c.max_concurrency]
        gone = [endpoint for url, endpoint in current.items() if url not in wanted]
        if changed or gone:
            built, clients = self._build(changed, config)
            # -- the swap: nothing below raises ------------------------------------
            added = [self._take(c, built, clients, config) for c in changed if c.url not in current]
            for c in changed:
                if c.url in current:
                    self._take(c, built, clients, config)  # a new per-endpoint cap
            for endpoint in gone:
                del self._endpoints[endpoint.url]
                self._retire(endpoint)
            for endpoint in added:
                self._gate(endpoint, pool.config)  # a new address of a discovered max_model_len waits to be asked
                endpoint.pool = pool
                self._endpoints[endpoint.url] = endpoint
                if self._budget is not None:
                    endpoint.granted = 0  # [cluster]: none of its seats until the ledger grants this replica some
            if added and self._budget is not None:
                self._budget.wake()
            pool.endpoints = [*(e for e in pool.endpoints if e not in gone), *added]
            log.info(
                "pool %s: endpoints from DNS now %d (added %s; removed %s)",
                pool_name, len(wanted), ", ".join(e.url for e in added) or "none", ", ".join(e.url for e in gone) or "none",
            )
            pool.queue.dispatch()  # room the new endpoints opened
        self._discovered[pool_name] = tuple(kept)

    def _new_endpoint(self, endpoint_config: EndpointConfig, config: Config) -> Endpoint:
        endpoint = Endpoint(
            endpoint_config,
            connect_timeout=config.timeouts.connect_timeout,
            transport=self._transport_factory(endpoint_config),
            closer=self._close_later,
            max_body_bytes=config.server.max_backend_body_bytes,
            keep_alive_timeout=config.timeouts.backend_keep_alive_timeout,
        )
        endpoint.max_model_len = self._model_lens.get(endpoint.url)
        return endpoint

    # -- context length (router/model_len.py) -----------------------------

    def note_model_lens(self, reported: Mapping[str, int | None]) -> None:
        """What endpoints just reported in GET /v1/models (a reload's round of asking); kept for endpoints to come."""
        self._model_lens.update(reported)
        for url, value in reported.items():
            endpoint = self._endpoints.get(url)
            if endpoint is not None:
                news = value != endpoint.max_model_len
                endpoint.max_model_len = value
                if endpoint.pool is not None:
                    self._gate(endpoint, endpoint.pool.config, news=news)

    def _gate(self, endpoint: Endpoint, pool: PoolConfig, *, news: bool = False) -> None:
        """Let ``endpoint`` take ``pool``'s requests only if its context length is known to fit.

        Logged when that changes, and when an endpoint kept out says something new.
        """
        fits = context_fits(endpoint.max_model_len, pool)
        if fits == endpoint.fits_context and (fits or not news):
            return
        endpoint.fits_context = fits
        if fits:
            log.info("endpoint %s reports max_model_len %s: it serves pool %s", endpoint.url, endpoint.max_model_len, pool.name)
        elif endpoint.max_model_len is None:
            log.warning(
                "endpoint %s takes no requests of pool %s until it reports a max_model_len of at least %d (GET /v1/models)",
                endpoint.url, pool.name, pool.max_model_len,
            )
        else:
            log.warning(
                "endpoint %s reports max_model_len %d, less than pool %s's %d: it takes none of the pool's requests"
                " (start it with --max-model-len >= %d, or reload to ask every endpoint again)",
                endpoint.url, endpoint.max_model_len, pool.name, pool.max_model_len, pool.max_model_len,
            )

    async def _ask_unverified(self, timeout: float) -> None:
        """Ask every healthy endpoint kept out for its context length again (one health check turn)."""

        async def ask(endpoint: Endpoint) -> None:
            with trio.move_on_after(timeout):
                try:
                    value = await endpoint.probe.max_model_len()
                except ModelLenUnknown as error:
                    log.debug("endpoint %s: no max_model_len yet: %s", endpoint.url, error)
                    return
                self.note_model_lens({endpoint.url: value})

        async with trio.open_nursery() as nursery:
            for endpoint in list(self._endpoints.values()):
                if endpoint.pool is not None and endpoint.healthy and not endpoint.fits_context:
                    nursery.start_soon(ask, endpoint)

    async def _check_keys(self, timeout: float) -> None:
        """Ask every healthy endpoint whose key is unproven or refused whether a /v1 route takes it.

        vLLM leaves ``/health`` open under ``--api-key``, so a passing health
        check says nothing of the key; ``GET /v1/models`` does (cheap, and
        asked once an endpoint, then only while it is refused). A pool whose
        health check is a completion learns it from that probe instead.
        """

        async def ask(endpoint: Endpoint) -> None:
            with trio.move_on_after(timeout):
                self._note_credentials(endpoint, await endpoint.probe.status("GET", "/v1/models"))

        async with trio.open_nursery() as nursery:
            for endpoint in list(self._endpoints.values()):
                pool = endpoint.pool
                if pool is None or pool.config.health_check == "completion" or not endpoint.healthy:
                    continue
                if endpoint.auth_failure is not None or not endpoint.credentials_checked:
                    nursery.start_soon(ask, endpoint)

    def _close_later(self, client: Closable) -> None:
        """Hand an idle retired client to the closer task (closing is async; releases are not)."""
        self._to_close.append(client)
        self._close_wanted.set()
        if self._retired_endpoints:
            self._retired_endpoints = {u: e for u, e in self._retired_endpoints.items() if e.in_flight}

    def drain(self) -> None:
        """Stop admitting: new requests get 503 with Retry-After, /health turns unready."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    async def wait_idle(self) -> None:
        """Return once no request is inside :meth:`open` (queued or running)."""
        await self._idle.wait()

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` header names (anonymous when auth is off).

        Raises Unauthenticated for a missing or unknown key while keys are configured.
        """
        return self._authenticator.authenticate(authorization)

    # -- the request's path -----------------------------------------------

    def deadline_for(self, request: RouterRequest, arrival: float | None = None) -> float:
        """The request's end-to-end deadline: the configured one or the caller's, if sooner."""
        arrival = trio.current_time() if arrival is None else arrival
        deadline = arrival + self.config.timeouts.end_to_end_timeout
        return deadline if request.deadline is None else min(deadline, request.deadline)

    @asynccontextmanager
    async def open(
        self,
        request: RouterRequest,
        *,
        arrival: float | None = None,
        caller: Caller = ANONYMOUS,
        record: RequestRecord | None = None,
    ) -> AsyncIterator[Completion]:
        """Admit the request and open its backend response.

        Raises (before yielding) any RequestRejected or Overloaded error, or
        BackendError when the backend refuses or cannot be reached. ``record``
        (made by the front end) receives the decisions and timestamps.
        """
        arrival = trio.current_time() if arrival is None else arrival
        record = RequestRecord(request.request_id, "http", arrival) if record is None else record
        record.kind = request.kind
        record.stream = request.stream
        record.caller = caller.name
        record.requested_max_tokens = request.max_tokens
        config = self.config
        self._requests_total += 1
        if self._draining:
            raise Draining("tailguard is shutting down; retry on another instance", retry_after=config.timeouts.retry_after)
        prompt_tokens = estimate_prompt_tokens(request, config.estimate)
        record.prompt_tokens = prompt_tokens
        check_prompt(prompt_tokens, config.limits)
        max_tokens, clamped = effective_max_tokens(request.max_tokens, config.limits)
        record.max_tokens, record.clamped = max_tokens, clamped
        if request.forced_class is not None:
            if request.forced_class not in caller.may_force_classes:
                raise Forbidden(
                    f"the caller {caller.name!r} may not force the class {request.forced_class!r}", param="class"
                )
            klass = forced(request.forced_class, config.classes)
        else:
            klass = classify(prompt_tokens, max_tokens, config.classes)
        pool = self._pools[klass.pool]
        record.request_class, record.pool = klass.name, pool.name
        model = request.model or pool.config.models[0]
        if model not in pool.config.models:
            raise ModelNotFound(
                f"the model {model!r} is not served here (class {klass.name!r} routes to pool "
                f"{pool.name!r}, which serves {', '.join(pool.config.models)})",
                param="model",
            )
        check_context(prompt_tokens, max_tokens, pool.config.max_model_len, pool.name)
        record.model = model
        trace = record.trace

        queue_deadline = min(arrival + klass.queue_timeout, self.deadline_for(request, arrival))
        async with self._holding(caller, config.timeouts.retry_after, klass.priority, queue_deadline):
            ticket = Ticket(klass.name, model, prompt_tokens, max_tokens, klass.priority, arrival)
            if self._budget is not None and pool.in_flight >= pool.max_concurrency:
                self._budget.wake()  # this replica's share is used up: ask the ledger now, not at the next tick
            if trace is not None:
                trace.queued()
            try:
                lease = await pool.admit(klass.priority, queue_deadline, ticket, retry_after=config.timeouts.retry_after)
            except BaseException:
                # The access log's queue_ms of a refusal or a queue_timeout: never past the deadline it waited for.
                record.left_queue_at = min(trio.current_time(), queue_deadline)
                raise
            # When the seat was granted, not when this task ran again: on a busy host the
            # event loop's own delay is no wait for a seat (and no reason to move a GPU).
            record.left_queue_at = admitted = lease.granted_at
            try:
                record.admitted_at = admitted
                record.endpoint = lease.endpoint.url
                serving = lease.pool  # a lender's, when the seat is borrowed
                if serving is not pool:
                    record.lender = serving.name
                # A whole answer asked of vLLM as a stream has a first byte (router/assemble.py).
                assembled = not request.stream and serving.config.stream_upstream and assemblable(request.params)
                body, drop_usage = self._backend_body(request, model, max_tokens, stream=request.stream or assembled)
                if serving.config.vllm_priority:
                    body["priority"] = klass.priority
                try:
                    response = await self._start_call(serving, lease, request, body, record, stream=request.stream or assembled)
                except trio.Cancelled:
                    # The router's own deadline passed with no answer begun (not the
                    # caller leaving, nor a caller's shorter gRPC deadline): the
                    # endpoint failed this request, as a hung one does.
                    if trio.current_time() >= arrival + config.timeouts.end_to_end_timeout:
                        self._failed(serving, lease.endpoint, BackendTimeout(f"the backend {lease.endpoint.url} did not answer in time"))
                    raise
                try:
                    record.endpoint = lease.endpoint.url  # a retry may have moved it
                    routing = Routing(
                        request_id=request.request_id,
                        request_class=klass.name,
                        pool=pool.name,
                        endpoint=lease.endpoint.url,
                        prompt_tokens=prompt_tokens,
                        requested_max_tokens=request.max_tokens,
                        max_tokens=max_tokens,
                        clamped=clamped,
                        queue_seconds=admitted - arrival,
                    )
                    try:
                        yield Completion(
                            routing, response, request.stream, record, klass.relay_interval, drop_usage,
                            assemble_as=request.kind if assembled else None,
                        )

                    except BackendError as error:  # the body broke or was not a completion
                        self._failed(serving, lease.endpoint, error)
                        raise
                    serving.record_success(lease.endpoint)
                finally:
                    with trio.CancelScope(shield=True):  # hanging up must happen, and is quick
                        await response.aclose()
            finally:
                lease.release()

    async def _start_call(
        self, pool: Pool, lease: Lease, request: RouterRequest, body: dict[str, Any], record: RequestRecord, *, stream: bool
    ) -> BackendResponse:
        """Send the request and wait for its first byte, trying elsewhere if that fails.

        A failure of the engine (refused, reset, no first byte in the pool's
        ``first_byte_timeout``, an answered 5xx) is retried once on another
        endpoint of the pool that has room; the seat moves with it, so the
        pool's cap holds. Nothing has reached the caller yet, so a retry is
        invisible to it. An engine that is busy (503: its own queue is full)
        or refuses tailguard's key did no work and says nothing of its
        siblings: the request goes on to each other endpoint with room, in
        turn, within its deadline. A 4xx is never retried (the request's
        fault). Each attempt goes to vLLM under a fresh id (vLLM takes
        ``X-Request-Id`` as its own request id, which two callers could
        share); ``record.upstream_id`` keeps the last, and the caller's id goes
        as ``x-tailguard-request-id``. With tracing, each
        attempt has a span, named in the ``traceparent`` sent.
        """
        path = _PATHS[request.kind]
        trace = record.trace
        # vLLM sends a non-streaming answer whole when generation ends: only the
        # end-to-end deadline can tell a long answer from a hung engine there.
        timeout = pool.config.first_byte_timeout if stream else math.inf
        tried: list[Endpoint] = []
        retried = False  # a failure of the engine itself is tried once more, no further
        while True:
            endpoint = lease.endpoint
            tried.append(endpoint)
            record.upstream_id = self._upstream_ids.fresh()
            # The caller's own id rides beside it, for whatever logs headers on the way (vLLM ignores it).
            headers = {"x-request-id": record.upstream_id, "x-tailguard-request-id": request.request_id}
            if trace is not None:
                headers.update(trace.call(endpoint.url, request.kind, body["model"], body["max_tokens"]))
            try:
                return await _first_byte(lease.client, path, body, headers, stream=stream, timeout=timeout)
            except BackendRejected as error:
                if trace is not None:
                    trace.call_failed(error)
                pool.record_success(endpoint)  # it answered: the request was at fault
                raise
            except BackendError as error:
                if trace is not None:
                    trace.call_failed(error)
                retry_to: Endpoint | None = None
                if isinstance(error, BackendBusy):
                    self._busy(endpoint, error)
                    retry_to = pool.retry_endpoint(lease, tried)
                elif isinstance(error, BackendAuthFailed):
                    self._key_refused(endpoint, error.status)
                    retry_to = pool.retry_endpoint(lease, tried)
                else:
                    self._failed(pool, endpoint, error)
                    if _retryable(error) and not retried:
                        retried = True
                        retry_to = pool.retry_endpoint(lease, tried)
                if retry_to is None:
                    raise
                log.info("request %s: %s; trying again on %s", request.request_id, error.message, retry_to.url)
                self._retries[pool.name] += 1
                lease.move(retry_to)

    def _busy(self, endpoint: Endpoint, error: BackendBusy) -> None:
        """The engine's own queue is full: fewer seats there for a moment; not a failure (outlier detection never hears of it).

        When the moment ends nothing is released, so a timer offers the seats
        to the waiters then: a Trio system task (a sleep, then a dispatch, that
        cannot fail), since a busy answer comes on a request's path, which
        has no nursery to leave a timer in.
        """
        spell_begins = endpoint.busy_until == -math.inf
        endpoint.was_busy(error.retry_after)
        if spell_begins:  # once per busy spell, not once per refused request
            log.info(
                "endpoint %s is busy (its own queue is full): at most %d requests there for %g s",
                endpoint.url, endpoint.busy_cap, error.retry_after,
            )
            trio.lowlevel.spawn_system_task(self._busy_spell_ends, endpoint, name=f"busy spell of {endpoint.url}")

    @staticmethod
    async def _busy_spell_ends(endpoint: Endpoint) -> None:
        # A deadline, not a condition to poll: a later busy answer may have moved it on.
        while not endpoint.busy_spell_over(trio.current_time()):  # noqa: ASYNC110
            await trio.sleep_until(endpoint.busy_until)
        if endpoint.pool is not None:
            endpoint.pool.queue.dispatch()

    @staticmethod
    def _key_refused(endpoint: Endpoint, status: int) -> None:
        """The engine refuses tailguard's key: down until it accepts it (logged once, as ERROR: the operator must act)."""
        variable = endpoint.access.api_key_env
        reason = (
            f"upstream_auth: the engine answered {status} to tailguard's key (the environment variable {variable})"
            if variable is not None
            else f"upstream_auth: the engine answered {status}: it wants an API key (set api_key_env on the pool)"
        )
        if endpoint.auth_failure is None:
            log.error("endpoint %s takes no requests: %s", endpoint.url, reason)
        endpoint.auth_failure = reason

    def _note_credentials(self, endpoint: Endpoint, status: int | None) -> None:
        """What a probe of a /v1 route says of tailguard's key (None: no answer, nothing learnt)."""
        if status in (401, 403):
            self._key_refused(endpoint, status)
        elif status is not None:
            endpoint.credentials_checked = True
            if endpoint.auth_failure is not None:
                endpoint.auth_failure = None
                log.info("endpoint %s accepts tailguard's key again", endpoint.url)

    def _failed(self, pool: Pool, endpoint: Endpoint, error: BackendError) -> None:
        """Count a failed call for outlier detection; log an ejection."""
        if endpoint.pool is not pool:
            return  # moved or removed by a reload meanwhile: its new pool judges it
        # Read before the verdict: an ejection starts the endpoint's record afresh.
        in_a_row, failed, seen = endpoint.failures_in_a_row + 1, endpoint.recent_failures + 1, endpoint.outcomes + 1
        on_trial = endpoint.half_open
        seconds = pool.record_failure(endpoint)
        if seconds is not None:
            outlier = pool.config.outlier_detection
            if on_trial:
                why = "its first request back from an ejection failed"
            elif in_a_row >= outlier.consecutive_failures:
                why = f"{in_a_row} failures in a row"
            else:
                why = f"{failed} of its last {min(seen, outlier.failure_window)} requests failed"
            log.warning("endpoint %s ejected from pool %s for %g s: %s (last: %s)", endpoint.url, pool.name, seconds, why, error.message)

    @asynccontextmanager
    async def _holding(self, caller: Caller, retry_after: float, priority: int, deadline: float) -> AsyncIterator[None]:
        """Count the request against its caller's cap and the drain, from queue to end.

        With ``[cluster]`` the key's cap is shared: the request takes a seat of
        this replica's grant, or waits (until ``deadline``, in class priority
        order) for a sync to grant one; it is refused when the cap is full
        across the replicas (``cluster.KeySeats``).
        """
        held = self._caller_in_flight.get(caller.name, 0)
        limit = caller.max_concurrency
        seats = None if limit is None or self._budget is None else self._budget.key_seats(caller.name, limit)
        if seats is None and limit is not None and held >= limit:
            raise CallerOverLimit(
                f"the caller {caller.name!r} already has {held} requests in flight, its cap; "
                f"retry after {retry_after:g} s",
                retry_after=retry_after,
            )
        self._open_requests += 1
        if self._open_requests == 1:
            self._idle = trio.Event()
        try:
            if seats is not None:
                await seats.take(priority, deadline, retry_after)
            self._caller_in_flight[caller.name] = self._caller_in_flight.get(caller.name, 0) + 1
            try:
                yield
            finally:
                if seats is not None:
                    seats.release()
                left = self._caller_in_flight[caller.name] - 1
                if left:
                    self._caller_in_flight[caller.name] = left
                else:
                    del self._caller_in_flight[caller.name]
        finally:
            self._open_requests -= 1
            if self._open_requests == 0:
                self._idle.set()

    @staticmethod
    def _backend_body(request: RouterRequest, model: str, max_tokens: int, *, stream: bool) -> tuple[dict[str, Any], bool]:
        """The body sent to vLLM, and whether the stream's usage event is tailguard's alone (not to relay).

        The fields the router owns (``ROUTER_OWNED``) are its own whatever the
        caller sent: ``priority`` is removed (``open`` sets it from the class
        on a ``vllm_priority`` pool: a caller's own could jump vLLM's queue and
        dodge preemption, and older vLLM answers 400 to any non-zero value),
        ``request_id`` too (each attempt has its own id), and every stream asks
        for usage, so token counts stay exact when vLLM merges several
        tokens into one event.
        """
        body: dict[str, Any] = {name: value for name, value in request.params.items() if name not in ROUTER_OWNED}
        body["model"] = model
        if request.kind == "chat":
            body["messages"] = list(request.messages or ())
        else:
            body["prompt"] = request.prompt
        body["max_tokens"] = max_tokens
        body["stream"] = stream
        drop_usage = False
        if stream:
            options = request.params.get("stream_options")
            options = dict(options) if isinstance(options, Mapping) else {}
            if options.get("include_usage") is not True:
                drop_usage = True  # asked for tailguard's counts only
                options.pop("continuous_usage_stats", None)  # without include_usage it meant nothing
            options["include_usage"] = True
            body["stream_options"] = options
        return body, drop_usage


    # -- background work --------------------------------------------------

    async def run(self, *, ledger: LedgerStore | None = None, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background work, forever: health checks (``healthy`` is set only from
        here), backend load scrapes, closing clients that reloads retired,
        rebalancing, and -- with ``[cluster]`` and a ``ledger`` -- keeping this
        replica's share of every cap in step with the others (the first sync,
        or the fallback, happens before ``started``).

        A turn that fails is logged and the loop goes on: a broken probe must
        never stop health checking for the life of the process.
        """
        async with trio.open_nursery() as nursery:
            cluster = self.config.cluster
            if cluster is not None and ledger is not None:
                self._budget = SharedBudget(
                    cluster, ledger, self._cluster_demands, settle_after=self.config.timeouts.end_to_end_timeout
                )
                await nursery.start(self._budget.run)
            await nursery.start(self.loop_lag.run)  # measuring before the first probe, which asks it
            await nursery.start(self.discovery.run)  # pools' DNS names: the first answers come before started
            nursery.start_soon(
                _forever, "health check", self.check_health, lambda: self.config.timeouts.health_check_interval
            )
            nursery.start_soon(_forever, "backend load scrape", self._scrape_loads, self._scrape_interval)
            nursery.start_soon(self._close_retired_forever)
            nursery.start_soon(self._rebalance_forever, nursery)
            task_status.started()

    def _cluster_demands(self) -> list[Demand]:
        """Every capped resource as this replica sees it now: pools, endpoints, API keys."""
        demands: list[Demand] = []
        for pool in self._pools.values():
            first = pool.first_waiting()  # the most urgent waiting, the oldest of its class priority
            urgent, oldest = (NO_WAITER, math.inf) if first is None else first
            waiting = pool.queue.waiting
            demands.append(
                Demand(
                    f"pool:{pool.name}",
                    pool.cluster_cap,
                    pool.in_flight,
                    waiting,
                    urgent,
                    pool.set_grant,
                    _yielding_of(pool),
                    oldest,
                )
            )
            for endpoint in pool.endpoints:
                demands.append(
                    Demand(
                        f"endpoint:{endpoint.url}",
                        endpoint.max_concurrency,
                        endpoint.in_flight,
                        waiting,
                        urgent,  # so idle replicas give back their blocks of it
                        _endpoint_grant(endpoint, pool),
                        _yielding_of(endpoint),
                        oldest,
                    )
                )
        budget = self._budget
        for key in self.config.auth.keys:
            if key.max_concurrency is not None and budget is not None:
                demands.append(budget.key_seats(key.name, key.max_concurrency).demand())
        return demands

    async def _rebalance_forever(self, nursery: trio.Nursery) -> None:
        """Look at the pools' demand every ``rebalance.interval`` s; start the moves it calls for."""
        while True:
            await trio.sleep(self.config.rebalance.interval)
            try:
                self.rebalance_turn(nursery)
            except Exception:  # a bad turn must not end rebalancing, nor the process
                log.exception("a rebalancing turn failed")

    def rebalance_turn(self, nursery: trio.Nursery) -> None:
        """One look; a move that is due starts now and finishes in ``nursery``."""
        now = trio.current_time()
        choice = self._rebalancer.look(now, self._pools, self.config)
        if choice is None:
            return
        self._rebalancer.moved(now)
        endpoint, source, target = choice.endpoint, choice.source, choice.target
        source.endpoints = [e for e in source.endpoints if e is not endpoint]
        source.cap_moved -= endpoint.max_concurrency
        endpoint.pool = None  # no pool's new requests while its running ones finish
        self._moving[endpoint.url] = (source.name, target.name)
        log.info(
            "rebalancing: endpoint %s leaves pool %s (utilisation %.2f) for pool %s (%.2f); %d requests still run there",
            endpoint.url, source.name, choice.source_utilisation, target.name, choice.target_utilisation, endpoint.in_flight,
        )
        nursery.start_soon(self._finish_move, endpoint, source.name, target, self._assignment_epoch)

    async def _finish_move(self, endpoint: Endpoint, source: str, target: Pool, epoch: int) -> None:
        await endpoint.wait_idle()
        if epoch != self._assignment_epoch or endpoint.retired:
            return  # a reload came first: the file's assignment stands
        self._gate(endpoint, target.config)
        target.endpoints = [*target.endpoints, endpoint]
        target.cap_moved += endpoint.max_concurrency
        endpoint.pool = target
        self._moving.pop(endpoint.url, None)
        self._moves[(source, target.name)] += 1
        log.info("rebalancing: endpoint %s joined pool %s (from %s)", endpoint.url, target.name, source)
        target.queue.dispatch()

    def _scrape_interval(self) -> float:
        interval = self.config.metrics.backend_scrape_interval
        return interval if interval > 0 else self.config.timeouts.health_check_interval

    async def _scrape_loads(self) -> None:
        """Each endpoint's own /metrics (running, waiting, KV cache), for the dashboards.

        Read on every turn, so a reload can switch scraping on or off.
        """
        if self.config.metrics.backend_scrape_interval > 0:
            await scrape(list(self._endpoints.values()), timeout=self.config.timeouts.health_check_timeout)

    async def _close_retired_forever(self) -> None:
        while True:
            await self._close_wanted.wait()
            self._close_wanted = trio.Event()
            await self._close_retired()

    async def _close_retired(self) -> None:
        while self._to_close:
            client = self._to_close.pop()
            with trio.CancelScope(shield=True):
                try:
                    await client.aclose()
                except Exception:  # a client that fails to close must not stop the closer
                    log.exception("closing a retired backend client failed")

    async def check_health(self) -> None:
        """Probe every endpoint once, concurrently; wake waiters on recovery.

        A pool's ``health_check`` picks the probe: ``GET /health``, or a
        one-token completion, which also proves the engine can work (and so
        ends an ejection at once). An endpoint goes down after the pool's
        ``unhealthy_threshold`` failed probes in a row and up after
        ``healthy_threshold`` passed ones; a probe that timed out while this
        loop stalled (``LoopLag.excuses``) is no verdict. Every turn also re-offers each pool's
        seats to its waiters, since ejections run out by themselves, and
        closes keep-alive connections that have been idle too long.
        """
        timeout = self.config.timeouts.health_check_timeout

        def judge(endpoint: Endpoint, passed: bool | None) -> None:
            config = endpoint.pool.config if endpoint.pool is not None else None  # None: a reload took it out meanwhile
            down_at = PoolConfig.unhealthy_threshold if config is None else config.unhealthy_threshold
            up_at = PoolConfig.healthy_threshold if config is None else config.healthy_threshold
            was = endpoint.healthy
            endpoint.healthy = healthy = self._health_streaks.judge(endpoint, was, passed, unhealthy_threshold=down_at, healthy_threshold=up_at)
            if healthy and not was:
                log.info("endpoint %s is healthy again", endpoint.url)
            elif was and not healthy:
                log.warning("endpoint %s failed its health check %d times in a row: down", endpoint.url, down_at)
            elif passed is False and was:
                log.info("endpoint %s failed its health check (%d in a row; down at %d)", endpoint.url, self._health_streaks.streak(endpoint), down_at)

        async def probe(endpoint: Endpoint) -> None:
            pool = endpoint.pool
            completion = pool is not None and pool.config.health_check == "completion"
            started = trio.current_time()
            with trio.move_on_after(timeout):
                try:
                    if pool is not None and completion:
                        status = await endpoint.probe.completes(pool.config.models[0])
                        healthy = status == 200
                        self._note_credentials(endpoint, status)
                    else:
                        healthy = await endpoint.probe.health()
                except Exception:  # one broken probe must not stop the others
                    if endpoint.retired:
                        return  # a reload took it out (and closed its probe) meanwhile
                    log.exception("endpoint %s: its health probe failed", endpoint.url)
                    healthy = False
                if healthy and completion:
                    endpoint.end_ejection()
                judge(endpoint, healthy)
                return
            if self.loop_lag.excuses(started, timeout):
                log.warning(
                    "endpoint %s did not answer its health check in %.1f s, but tailguard's own loop stalled for %.2f s of it: not counted",
                    endpoint.url, timeout, self.loop_lag.stalled_since(started),
                )  # fmt: skip
                return
            if endpoint.healthy:
                log.warning("endpoint %s did not answer its health check in %.1f s", endpoint.url, timeout)
            judge(endpoint, False)

        async with trio.open_nursery() as nursery:
            for endpoint in list(self._endpoints.values()):
                nursery.start_soon(probe, endpoint)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ask_unverified, timeout)
            nursery.start_soon(self._check_keys, timeout)

        for pool in self._pools.values():
            pool.queue.dispatch()
        for endpoint in list(self._endpoints.values()):
            await endpoint.client.expire_idle()  # a pool that went quiet keeps no idle connections

    async def aclose(self) -> None:
        for endpoint in [*self._endpoints.values(), *self._retired_endpoints.values()]:
            await endpoint.aclose()
        await self._close_retired()

    # -- views ------------------------------------------------------------

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            pools=tuple(pool.statistics() for pool in self._pools.values()),
            endpoints=tuple(
                EndpointStatistics(
                    e.url,
                    pool.name,
                    e.in_flight,
                    e.max_concurrency,
                    e.healthy,
                    e.load,
                    ejected=e.ejected,
                    ejections=e.ejections,
                    failures_in_a_row=e.failures_in_a_row,
                    busy_answers=e.busy_answers,
                    key_refused=e.auth_failure is not None,
                )
                for pool in self._pools.values()
                for e in pool.endpoints
            ),
            requests_total=self._requests_total,
            config_digest=self.config.digest,
            draining=self._draining,
            open_requests=self._open_requests,
            caller_in_flight=dict(self._caller_in_flight),
            retries={name: self._retries[name] for name in self._pools},
            moves=dict(self._moves),
            moving=dict(self._moving),
            lent={name: pool.lent for name, pool in self._pools.items()},
            borrowed={(name, lender): n for name, pool in self._pools.items() for lender, n in pool.borrowed_total.items()},
            cluster=None if self._budget is None else self._budget.status(),
            backend_clients=sum(e.open_clients for e in [*self._endpoints.values(), *self._retired_endpoints.values()])
            + len(self._to_close),
        )

    def room(self) -> int:
        """Requests all pools could hold at once, seated or waiting (``Pool.room``): beyond it a newcomer is refused, or displaces a less urgent waiter."""
        return sum(pool.room for pool in self._pools.values())

    def health(self) -> dict[str, Any]:
        """Ready only when every pool has a healthy endpoint; says which are not."""
        pools: dict[str, dict[str, Any]] = {}
        for pool in self._pools.values():
            pools[pool.name] = {"healthy": pool.healthy, "endpoints": {e.url: _state(e) for e in pool.endpoints}}
            reasons = {e.url: e.auth_failure for e in pool.endpoints if e.auth_failure is not None}
            if reasons:
                pools[pool.name]["reasons"] = reasons  # why an endpoint is down, where the router knows better than "down"
        ready = not self._draining and all(p["healthy"] for p in pools.values())
        status = "ready" if ready else "unavailable"
        health: dict[str, Any] = {"status": status, "draining": self._draining, "pools": pools}
        if self._budget is not None:
            mode = self._budget.mode
            health["cluster"] = {"mode": mode, "replica": self._budget.replica}
            if ready and mode == "fallback":
                health["status"] = "degraded"  # serving, on static shares of the caps: not down
        return health

    def assignment(self) -> list[dict[str, Any]]:
        """Each pool's GPUs now, for ``/v1/limits`` (no URLs): rebalancing and lending show here."""
        moving_out = Counter(source for source, _ in self._moving.values())
        moving_in = Counter(target for _, target in self._moving.values())
        return [
            {
                "pool": pool.name,
                "endpoints": len(pool.endpoints),
                "max_concurrency": pool.max_concurrency,
                "configured_max_concurrency": pool.config.max_concurrency,
                "endpoints_leaving": moving_out[pool.name],
                "endpoints_joining": moving_in[pool.name],
                "seats_lent": pool.lent,
                "lends_to": list(pool.config.lend.to),
                "rebalance": pool.config.rebalance,
            }
            for pool in self._pools.values()
        ]

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for pool in self.config.pools:
            seen.update(dict.fromkeys(pool.models))
        return list(seen)


async def _first_byte(
    client: BackendClient, path: str, body: dict[str, Any], headers: dict[str, str], *, stream: bool, timeout: float
) -> BackendResponse:
    """Open the call and wait for the first byte of its body, at most ``timeout`` s."""
    if timeout == math.inf:  # no scope of its own: the request's deadline bounds it
        return await _open_started(client, path, body, headers, stream=stream)
    with trio.move_on_after(timeout):
        return await _open_started(client, path, body, headers, stream=stream)
    raise BackendTimeout(f"the backend {client.url} sent no first byte within {timeout:g} s")


async def _open_started(
    client: BackendClient, path: str, body: dict[str, Any], headers: dict[str, str], *, stream: bool
) -> BackendResponse:
    """Open the call and wait for its first byte; a failure or cancellation hangs it up."""
    response = await client.open(path, body, headers, stream=stream)
    try:
        await response.start()
    except BaseException:
        with trio.CancelScope(shield=True):
            await response.aclose()
        raise
    return response


def _count(value: object) -> int | None:
    """A token count from a usage object, if it is one."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _endpoint_grant(endpoint: Endpoint, pool: Pool) -> Callable[[int], None]:
    def apply(seats: int) -> None:
        endpoint.granted = seats
        pool.queue.dispatch()

    return apply


def _yielding_of(holder: Pool | Endpoint) -> Callable[[Yielding | None], None]:
    """Who waits for ``holder``'s seats on other replicas, as each sync finds it (``Pool.yield_freed_seat`` reads it)."""

    def apply(way: Yielding | None) -> None:
        holder.yielding = way

    return apply


def _retryable(error: BackendError) -> bool:
    """Failed before anything reached the caller (unreachable, reset, no first byte, an answered 5xx):
    a second endpoint may well succeed, and the caller never knows."""
    return isinstance(error, BackendUnavailable)


def _state(endpoint: Endpoint) -> str:
    """An endpoint's state for /health: up, down (health check, or its key refused), unverified (its context length) or ejected (outlier detection)."""
    if not endpoint.healthy or endpoint.auth_failure is not None:
        return "down"

    if not endpoint.fits_context:
        return "unverified"
    return "ejected" if endpoint.ejected else "up"


async def _forever(what: str, turn: Callable[[], Awaitable[None]], interval: Callable[[], float]) -> None:
    """Run ``turn`` every ``interval()`` seconds; a failing turn is logged, never fatal."""
    while True:
        try:
            await turn()
        except Exception:
            log.exception("%s failed; trying again in %g s", what, interval())
        await trio.sleep(interval())
