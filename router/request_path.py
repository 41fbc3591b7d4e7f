"""The request's path through the core: admit -> seat -> call -> relay.

:meth:`RequestPath.open` is what ``Router.open`` (the one entry point both
front ends use) runs. It yields a :class:`Completion` whose body the front
end relays; leaving the ``async with`` block -- normally, by error, by
cancellation -- closes the backend stream (vLLM aborts the generation) and
releases the seat, always.

The front end owns the request's end-to-end cancel scope (its deadline comes
from :meth:`RequestPath.deadline_for`) and cancels it when the caller goes
away; everything here unwinds through ``async with`` blocks.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Container, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from .admission import (
    MAX_TOKENS_FIELD,
    MESSAGE_KINDS,
    Admitted,
    ConversationMemory,
    KindRatio,
    PromptRatios,
    RouterRequest,
    Routing,
    caller_salt,
    decide,
)
from .backend import BackendClient, BackendResponse, assemblable, assemble, sse_objects
from .errors import (
    BackendAuthFailed,
    BackendBusy,
    BackendError,
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    BadBackendReply,
    Draining,
)
from .fleet import Endpoint, Fleet, Lease, Placement, Pool, Rerouted, ResponseHomes, key_refused, record_success, report_failure
from .ids import IdSource
from .observe import RequestRecord, ServiceTime, anthropic_prompt_tokens
from .quotas import BudgetGate, Caller, RateLimits, Traffic

log = logging.getLogger("tailguard.router")

_PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "embeddings": "/v1/embeddings",
    "rerank": "/v1/rerank",  # vLLM serves /rerank and /v2/rerank alike: one path for all three
}
# The kinds whose stream takes ``stream_options`` (OpenAI's chunks; the usage event tailguard asks for) and
# whose whole answer tailguard can put together from a stream (router/backend/whole_answer.py).
_CHUNKED = frozenset({"chat", "completion"})
# Kinds whose stream's first bytes come before the prefill (the Responses API's response.created and
# response.in_progress): their first token is their first output event (router/observe/telemetry.py).
_OPENS_EARLY = frozenset({"responses"})

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
    # Called once at the stream's first token where its first byte is not one (a Responses stream opens before
    # the prefill): what the seat learns at a first byte (prefill over, the first-byte model) waits for it.
    on_first_token: Callable[[], None] | None = None
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
        # OpenAI's usage names, or Anthropic's and the Responses API's (input_tokens, output_tokens).
        if self.record.kind == "messages":  # vLLM's Anthropic input_tokens leaves the cached part out
            self.record.input_tokens, self.record.cached_tokens = anthropic_prompt_tokens(usage)
        else:
            self.record.input_tokens = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
            details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
            self.record.cached_tokens = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        self.record.saw_answer(_count(usage.get("completion_tokens", usage.get("output_tokens"))))
        if self.record.kind == "responses" and isinstance(self.payload.get("id"), str):
            self.record.response_id = self.payload["id"]
        self.record.saw_engine_metrics(self.payload.get("metrics"))
        return body

    async def _assemble(self, kind: str) -> bytes:
        """The stream read to its end and folded into the whole answer (router/backend/whole_answer.py), within the body cap."""
        limit = self.response.max_body_bytes
        self.record.upstream_stream = True
        chunks: list[bytes] = []
        size = 0
        async for chunk in self.response.chunks(self.record.saw_chunk):
            size += len(chunk)
            if size > limit:
                raise BadBackendReply(f"the backend's answer is over {limit} bytes (server.max_backend_body_bytes)")
            chunks.append(chunk)
        payload = assemble(kind, sse_objects(chunks))
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
        on_chunk = self.record.saw_chunk if self.on_first_token is None else self._saw_chunk_until_first_token
        return self.response.chunks(on_chunk, self.relay_interval, drop_usage=self.drop_usage, check=check)

    def _saw_chunk_until_first_token(self, chunk: bytes) -> None:
        record = self.record
        record.saw_chunk(chunk)
        if record.first_token_at is not None and self.on_first_token is not None:
            first_token, self.on_first_token = self.on_first_token, None
            first_token()


class RequestPath:
    """Admits requests over ``fleet``'s pools and opens their backend calls, counting them in ``traffic``."""

    def __init__(self, fleet: Fleet, traffic: Traffic) -> None:
        self._fleet = fleet
        self._traffic = traffic
        self._upstream_ids = IdSource()  # the id each attempt goes to vLLM under (never the caller's)
        self._memory = ConversationMemory()  # where answered chats are warm, for classes that bound uncached tokens
        self._budgets = BudgetGate()  # each key's tokens and requests of the last minute, here or fleet-wide
        self._ratios = PromptRatios()  # each model's real/estimated prompt tokens by kind of text, from the engines' usage
        self.service = ServiceTime()  # each class's seated-to-end seconds per token asked, from the requests served
        self.homes = ResponseHomes()  # the engine keeping each Responses API response relayed lately

    def deadline_for(self, request: RouterRequest, arrival: float | None = None) -> float:
        """The request's end-to-end deadline: the configured one or the caller's, if sooner."""
        arrival = trio.current_time() if arrival is None else arrival
        deadline = arrival + self._fleet.config.timeouts.end_to_end_timeout
        return deadline if request.deadline is None else min(deadline, request.deadline)

    @asynccontextmanager
    async def open(self, request: RouterRequest, arrival: float | None, caller: Caller, record: RequestRecord | None) -> AsyncIterator[Completion]:
        """Admit the request and open its backend response (``Router.open`` says what it raises)."""
        arrival = trio.current_time() if arrival is None else arrival
        if record is None:  # no session around this call: the record is the path's, the caller's name too
            record = RequestRecord(request.request_id, "http", arrival)
            record.caller = caller.name
        record.kind = request.kind
        record.stream = request.stream
        record.requested_max_tokens = request.max_tokens
        fleet, traffic = self._fleet, self._traffic
        config = fleet.config
        traffic.requests_total += 1
        if traffic.draining:
            raise Draining("tailguard is shutting down; retry on another instance", retry_after=config.timeouts.retry_after)
        admitted = decide(request, caller, config, fleet.pools, record, arrival, self._memory, self._ratios, self.homes)
        klass, ticket = admitted.klass, admitted.ticket
        # Waiting past its deadline less the service it needs would only fail it after its engine did the work.
        end_by = min(arrival + klass.objective.e2e, self.deadline_for(request, arrival))
        service = self.service.predict(klass.name, ticket.max_tokens)
        record.service_predicted = service or None
        queue_deadline = min(arrival + klass.queue_timeout, end_by - service)
        grant = await self._budgets.reserve(
            caller, ticket.prompt_tokens + ticket.output_tokens, record, config, fleet.budget, priority=klass.priority, deadline=queue_deadline
        )
        try:
            async with self._served(request, caller, record, arrival, admitted, queue_deadline) as completion:
                yield completion
        finally:
            if grant is not None:  # what it cost: the backend's usage, or nothing when it got no seat
                served = record.admitted_at is not None
                grant.settle((record.input_tokens or ticket.prompt_tokens) + (record.completion_tokens or 0), served=served)
                record.budget_tokens = grant.tokens

    def prompt_ratios(self) -> tuple[KindRatio, ...]:
        """What the engines' usage taught of each model's prompts, by kind of text (``PromptRatios.statistics``)."""
        return self._ratios.statistics(self._fleet.config.estimate)

    def budgets_left(self) -> dict[str, RateLimits]:
        """Each caller with a budget that has sent here: what is left of it (``BudgetGate.left``)."""
        return self._budgets.left()

    @property
    def budget_callers(self) -> int:
        """Callers whose budget windows are kept now (``BudgetGate.callers``)."""
        return self._budgets.callers

    @property
    def ledger_keys(self) -> int:
        """[cluster] API keys with budget shares or seats kept for the ledger now."""
        budget = self._fleet.budget
        return self._budgets.shares + (0 if budget is None else budget.kept_keys)

    def forget_idle(self, known: Container[str]) -> Callable[[str], bool]:
        """Drop per-caller state that can no longer matter (the router's upkeep runs this every few seconds).

        A caller not ``known`` (its key gone in a reload) loses everything
        once its last request has ended; every caller loses its budget
        window a minute after its last admission (it would be empty), and a
        pool's fair clock forgets every tag when the pool is idle
        (``FairClock.forget``); with ``[cluster]``, a key's seats and
        budget shares go once the ledger holds nothing of them. So what is
        kept follows the callers in use, not every key ever seen. Returns
        the test of who is kept, for what else forgets with it.
        """
        in_flight = self._traffic.caller_in_flight

        def keep(name: str) -> bool:
            return name in known or name in in_flight

        self._budgets.forget(trio.current_time(), keep)
        for pool in self._fleet.pools.values():
            pool.queue.fair.forget(keep, idle=pool.in_flight == 0 and pool.queue.waiting == 0)
        if self._fleet.budget is not None:
            self._fleet.budget.forget_idle_keys()
        return keep

    @asynccontextmanager
    async def _served(
        self,
        request: RouterRequest,
        caller: Caller,
        record: RequestRecord,
        arrival: float,
        admitted: Admitted,
        queue_deadline: float,
    ) -> AsyncIterator[Completion]:
        """The admitted request from its pool's queue to its answer's end: the seat, the call, the release.

        An engine whose own queue is full (vLLM's 503, ``BackendBusy``) when no
        other endpoint with room would take the request sends it back to the
        pool's queue (``_back_in_line``) with its queue deadline unchanged: it
        was refused before any work, and its class may still wait. Its seat is
        released meanwhile, and the busy engine takes no more than it runs
        until its spell ends or a seat there frees (``Endpoint.was_busy``).
        """
        fleet, traffic = self._fleet, self._traffic
        trace = record.trace
        async with traffic.holding(caller, fleet.budget, fleet.config.timeouts.retry_after, admitted.klass.priority, queue_deadline):
            while True:
                if trace is not None:
                    trace.queued()
                try:
                    admitted, lease = await self._seat(request, caller, record, arrival, admitted, queue_deadline)
                except BaseException:
                    # The access log's queue_ms of a refusal or a queue_timeout: never past the deadline it waited for.
                    record.left_queue_at = min(trio.current_time(), queue_deadline)
                    raise
                klass, pool, ticket, history, size = admitted
                config = fleet.config
                # When the seat was granted, not when this task ran again: on a busy host the
                # event loop's own delay is no wait for a seat (and no reason to move a GPU).
                record.left_queue_at = record.admitted_at = lease.granted_at
                served = True  # the seat did the request's work (its time is a seat's time for the drain rate)
                try:
                    record.endpoint, record.placement = lease.endpoint.url, lease.placement
                    serving = lease.pool  # a lender's, when the seat is borrowed
                    if serving is not pool:
                        record.lender = serving.name
                    assembled = (
                        not request.stream and request.kind in _CHUNKED and assemblable(request.params) and _asked_as_stream(serving, lease)
                    )
                    body, drop_usage = _call_body(request, admitted, serving, caller, stream=request.stream or assembled)
                    hung_at = arrival + config.timeouts.end_to_end_timeout
                    lease.calling(ticket.prompt_tokens, streamed=request.stream or assembled)
                    try:
                        response = await self._start_call(
                            serving, lease, request, body, record, hung_at, stream=request.stream or assembled, pinned=ticket.pinned is not None
                        )
                    except BackendBusy as busy:
                        if not _back_in_line(request, busy, queue_deadline):
                            raise
                        served = False
                        continue  # the seat is released below first
                    try:
                        record.endpoint, record.placement = lease.endpoint.url, lease.placement  # a retry may have moved it
                        routing = routing_of(record)
                        try:
                            deferred = request.stream and request.kind in _OPENS_EARLY
                            yield Completion(
                                routing, response, request.stream, record, klass.relay_interval, drop_usage,
                                assemble_as=request.kind if assembled else None,
                                on_first_token=partial(_first_token, lease, record, stream=True) if deferred else None,
                            )
                        except BackendError as error:  # the body broke or was not a completion
                            report_failure(serving, lease.endpoint, error)
                            raise
                        record_success(serving, lease.endpoint)
                        if record.response_id is not None:  # its next turn, retrieval or cancellation must come here
                            self.homes.remember(record.response_id, lease.endpoint.url)
                        if record.input_tokens is not None:  # the engine's count of this very prompt: the estimate's truth
                            self._ratios.learn(ticket.model, size, record.input_tokens, fleet.config.estimate)
                        if history is not None:  # its next turn may count only what the warm engine must prefill
                            self._memory.remember(history.whole, lease.endpoint.url, ticket.prompt_tokens)
                    finally:
                        with trio.CancelScope(shield=True):  # hanging up must happen, and is quick
                            await response.aclose()
                    return
                finally:
                    record.finish_tokens()  # what it generated, if no usage said
                    if lease.borrower is None and served:
                        _paced(lease, record)
                    # Its tenant's fair share, settled: the max_tokens it did not generate are handed back.
                    pool.queue.fair.settle(pool.share_of(ticket), record.completion_tokens or 0, ticket.output_tokens)
                    lease.release(timed=served)

    async def _seat(
        self, request: RouterRequest, caller: Caller, record: RequestRecord, arrival: float, admitted: Admitted, queue_deadline: float
    ) -> tuple[Admitted, Lease]:
        """A lease in the admitted pool, waiting in its queue until ``queue_deadline`` (``Pool.admit`` says what it raises).

        A reload that removes the pool, or leaves it no endpoint, while the
        request waits there sends it back here (``Rerouted``): it is decided
        again under the config in force now -- the pool its class goes to
        now, or at once the error that pool answers -- with its queue
        deadline unchanged.
        """
        fleet = self._fleet
        while True:
            config = fleet.config
            pool = admitted.pool
            if fleet.budget is not None and pool.in_flight >= pool.max_concurrency:
                fleet.budget.wake()  # this replica's share is used up: ask the ledger now, not at the next tick
            try:
                lease = await pool.admit(
                    admitted.klass.priority,
                    queue_deadline,
                    admitted.ticket,
                    retry_after=config.timeouts.retry_after,
                    recheck_in=config.timeouts.health_check_interval,
                )
            except Rerouted:
                admitted = decide(request, caller, fleet.config, fleet.pools, record, arrival, self._memory, self._ratios, self.homes)
                continue
            return admitted, lease

    async def _start_call(
        self,
        pool: Pool,
        lease: Lease,
        request: RouterRequest,
        body: dict[str, Any],
        record: RequestRecord,
        hung_at: float,
        *,
        stream: bool,
        pinned: bool = False,
    ) -> BackendResponse:
        """Send the request and wait for its first byte, trying elsewhere if that fails.

        A failure of the engine (refused, reset, no first byte in the pool's
        ``first_byte_timeout``, an answered 5xx) is retried once on another
        endpoint of the pool that has room; the seat moves with it, so the
        pool's cap holds. Nothing has reached the caller yet, so a retry is
        invisible to it. An engine that is busy (503: its own queue is full)
        or refuses tailguard's key did no work and says nothing of its
        siblings: the request goes on to each other endpoint with room, in
        turn, within its deadline (with none left, BackendBusy sends it back
        to the queue: ``_served``; so does an engine failure after a busy
        refusal, when no endpoint is left to try). A 4xx is never retried (the request's
        fault), and a ``pinned`` request never moves (the state it continues
        lives on that engine alone: a busy one sends it back to the queue). Each attempt goes to vLLM under a fresh id (vLLM takes
        ``X-Request-Id`` as its own request id, which two callers could
        share); ``record.upstream_id`` keeps the last, and the caller's id goes
        as ``x-tailguard-request-id``. With tracing, each
        attempt has a span, named in the ``traceparent`` sent. Cancelled at the
        router's own deadline (``hung_at``) with no answer begun, the endpoint failed (as a
        hung one does).
        """
        path = _PATHS[request.kind]
        trace = record.trace
        # vLLM sends a non-streaming answer whole when generation ends: only the
        # end-to-end deadline can tell a long answer from a hung engine there.
        timeout = pool.config.first_byte_timeout if stream else math.inf
        try:
            tried: list[Endpoint] = []
            retried = False  # a failure of the engine itself is tried once more, no further
            retry_to: Placement | None = None
            while True:
                endpoint = lease.endpoint
                tried.append(endpoint)
                record.upstream_id = self._upstream_ids.fresh()
                # The caller's own id rides beside it, for whatever logs headers on the way (vLLM ignores it).
                headers = {"x-request-id": record.upstream_id, "x-tailguard-request-id": request.request_id}
                if trace is not None:
                    headers.update(trace.call(endpoint.url, request.kind, body["model"], body.get(MAX_TOKENS_FIELD.get(request.kind, ""), 0)))
                try:
                    wait = _first_byte_wait(timeout, lease.predicted_first_byte)
                    response = await _first_byte(lease.client, endpoint, path, body, headers, stream=stream, timeout=wait)
                    if not (stream and request.kind in _OPENS_EARLY):  # else at its first token (Completion.on_first_token)
                        _first_token(lease, record, stream=stream)
                    return response
                except BackendRejected as error:
                    if trace is not None:
                        trace.call_failed(error)
                    record_success(pool, endpoint)  # it answered: the request was at fault
                    raise
                except BackendError as error:
                    if trace is not None:
                        trace.call_failed(error)
                    retry_to = None
                    if pinned:  # nowhere else holds what it continues
                        if isinstance(error, BackendBusy):
                            self._busy(endpoint, error)  # its queue waits out the engine's busy spell, not a tight loop
                        elif isinstance(error, BackendAuthFailed):
                            key_refused(endpoint, error.status)
                        else:
                            report_failure(pool, endpoint, error)
                        raise
                    if isinstance(error, BackendBusy):
                        self._busy(endpoint, error)
                        retry_to = pool.retry_endpoint(lease, tried)
                    elif isinstance(error, BackendAuthFailed):
                        key_refused(endpoint, error.status)
                        retry_to = pool.retry_endpoint(lease, tried)
                    else:
                        report_failure(pool, endpoint, error)
                        if _retryable(error) and not retried:
                            retried = True
                            retry_to = pool.retry_endpoint(lease, tried)
                    if retry_to is None:
                        waiting_on = _busy_sibling(pool, endpoint) if _retryable(error) else None
                        if waiting_on is not None:
                            # No endpoint left to try, but one only said it was busy (it did no work, and says
                            # nothing of its health): back to the queue until it has room (``_served``), as a
                            # busy refusal alone does, not 502.
                            raise BackendBusy(
                                f"{error.log_text}; {waiting_on.url} is busy", retry_after=max(waiting_on.busy_until - trio.current_time(), 0.1),
                                endpoint=endpoint.url,
                            ) from error
                        raise
                    log.info("request %s: %s; trying again on %s", request.request_id, error.log_text, retry_to.endpoint.url)
                    self._traffic.retries[pool.name] += 1
                    lease.move(retry_to)
        except trio.Cancelled:
            # The router's own deadline passed with no answer begun (not the
            # caller leaving, nor a caller's shorter gRPC deadline): the
            # endpoint failed this request, as a hung one does.
            if trio.current_time() >= hung_at:
                report_failure(pool, lease.endpoint, BackendTimeout("the backend did not answer in time", endpoint=lease.endpoint.url))
            raise

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

    async def _busy_spell_ends(self, endpoint: Endpoint) -> None:
        # A deadline, not a condition to poll: a later busy answer may have moved it on.
        while not endpoint.busy_spell_over(trio.current_time()):  # noqa: ASYNC110
            await trio.sleep_until(endpoint.busy_until)
        pool = self._fleet.pool_of(endpoint)
        if pool is not None:
            pool.queue.dispatch()


def _call_body(request: RouterRequest, admitted: Admitted, serving: Pool, caller: Caller, *, stream: bool) -> tuple[dict[str, Any], bool]:
    """The engine's request body, with what the serving pool adds to it; and whether to drop the usage the caller did not ask for."""
    klass, pool, ticket = admitted.klass, admitted.pool, admitted.ticket
    body, drop_usage = backend_body(request, ticket.model, ticket.max_tokens, stream=stream)
    if serving.config.vllm_priority:
        body["priority"] = klass.priority
    if "caller" in (pool.config.placement.cache_salt, serving.config.placement.cache_salt):
        # Either pool asks for isolation: the tenant's prefixes stay its own on a lender's engines too.
        body["cache_salt"] = caller_salt(caller.name, request.params.get("cache_salt"))
    return body, drop_usage


def _busy_sibling(pool: Pool, failed: Endpoint) -> Endpoint | None:
    """An endpoint of ``pool`` other than ``failed`` in a busy spell (vLLM's own queue full), if any."""
    now = trio.current_time()
    return next((e for e in pool.endpoints if e is not failed and e.busy_until > now), None)


def _back_in_line(request: RouterRequest, busy: BackendBusy, queue_deadline: float) -> bool:
    """Whether a request every engine refused as busy waits for a seat again (its queue deadline not yet passed)."""
    left = queue_deadline - trio.current_time()
    if left <= 0:
        return False
    log.info("request %s: %s; back in the queue, %.1f s left to wait", request.request_id, busy.log_text, left)
    return True


def routing_of(record: RequestRecord) -> Routing:
    """What the front ends tell the caller of the decisions made for the request: read off its record, its one copy."""
    if record.endpoint is None or record.prompt_tokens is None or record.max_tokens is None or record.queue_seconds is None:
        raise AssertionError(f"request {record.request_id} has no routing before it is seated")  # pragma: no cover
    return Routing(
        request_id=record.request_id,
        request_class=record.request_class,
        pool=record.pool,
        endpoint=record.endpoint,
        prompt_tokens=record.prompt_tokens,
        requested_max_tokens=record.requested_max_tokens,
        max_tokens=record.max_tokens,
        clamped=record.clamped,
        queue_seconds=record.queue_seconds,
    )


def backend_body(request: RouterRequest, model: str, max_tokens: int, *, stream: bool) -> tuple[dict[str, Any], bool]:
    """The body sent to vLLM, and whether the stream's usage event is tailguard's alone (not to relay).

    The fields the router owns (``ROUTER_OWNED``) are its own whatever the
    caller sent: ``priority`` is removed (``RequestPath.open`` sets it from the class
    on a ``vllm_priority`` pool: a caller's own could jump vLLM's queue and
    dodge preemption, and older vLLM answers 400 to any non-zero value),
    ``request_id`` too (each attempt has its own id), and every stream asks
    for usage, so token counts stay exact when vLLM merges several
    tokens into one event.
    """
    body: dict[str, Any] = {name: value for name, value in request.params.items() if name not in ROUTER_OWNED}
    body["model"] = model
    if request.kind in MESSAGE_KINDS:
        body["messages"] = list(request.messages or ())
    elif request.kind == "completion":
        body["prompt"] = request.prompt
    # (A Responses request's input and instructions, a Messages request's system, a pooling request's
    # input, query and documents, are in its params.)
    field = MAX_TOKENS_FIELD.get(request.kind)
    if field is None:  # embeddings and rerank: no output bound, no stream
        return body, False
    body[field] = max_tokens
    body["stream"] = stream
    drop_usage = False
    if stream and request.kind in _CHUNKED:  # the other APIs' streams end with their usage already
        options = request.params.get("stream_options")
        options = dict(options) if isinstance(options, Mapping) else {}
        if options.get("include_usage") is not True:
            drop_usage = True  # asked for tailguard's counts only
            options.pop("continuous_usage_stats", None)  # without include_usage it meant nothing
        options["include_usage"] = True
        body["stream_options"] = options
    return body, drop_usage




def _first_token(lease: Lease, record: RequestRecord, *, stream: bool) -> None:
    """What a seat learns at its answer's first token: a borrowed prompt's prefill is over (LendConfig.prefills,
    ttft_budget), the engine's first-byte model learns the wait, and the record keeps it beside the prediction."""
    lease.first_byte(stream=stream)
    record.first_byte_seconds, record.first_byte_predicted = lease.first_byte_seconds, lease.predicted_first_byte


def _paced(lease: Lease, record: RequestRecord) -> None:
    """A stream of the pool's own that ended: its pace, where its pool lends by promise."""
    lending = lease.pool.lending
    if lending.watches_pace and (pace := record.seconds_a_token(trio.current_time())) is not None:
        lending.own_stream_ended(lease.endpoint, pace)


def _asked_as_stream(serving: Pool, lease: Lease) -> bool:
    """Whether a whole answer is asked of vLLM as a stream (router/backend/whole_answer.py), so that it has a first byte.

    The pool asks for it (``stream_upstream``), or the seat is borrowed from a
    pool bounding borrowed prefills (``lend.prefills``) or lending by its
    promise (its prefill queue counts the borrowed prompt until the first
    byte): what holds the bound is released at the first byte, which for a
    whole answer would be its end.
    """
    if serving.config.stream_upstream:
        return True
    return lease.borrower is not None and (serving.config.lend.prefills is not None or serving.lending.by_promise)


# A streamed call is taken for hung past the pool's first_byte_timeout, or past this many times what its
# engine's first-byte model predicts for the prompts queued ahead of it, whichever is later: an engine
# working through a long prefill queue (30k-token prompts under overload) is slow, not hung.
FIRST_BYTE_SLACK = 2.0


def _first_byte_wait(timeout: float, predicted: float | None) -> float:
    """How long a call may wait for its first byte: ``timeout``, stretched to ``FIRST_BYTE_SLACK`` x ``predicted``."""
    return timeout if predicted is None else max(timeout, FIRST_BYTE_SLACK * predicted)


async def _first_byte(
    client: BackendClient, endpoint: Endpoint, path: str, body: dict[str, Any], headers: dict[str, str], *, stream: bool, timeout: float
) -> BackendResponse:
    """Open the call and wait for the first byte of its body, at most ``timeout`` s.

    Raises BackendTimeout past ``timeout``, and BackendUnavailable as soon
    as a health probe finds the engine silent meanwhile (``Endpoint.stop_waiting``):
    nothing reached the caller, so the call is tried elsewhere.
    """
    with endpoint.awaiting_answer():
        if timeout == math.inf:  # no scope of its own: the request's deadline bounds it
            return await _open_started(client, path, body, headers, stream=stream)
        with trio.move_on_after(timeout):
            return await _open_started(client, path, body, headers, stream=stream)
        raise BackendTimeout(f"the backend sent no first byte within {timeout:g} s", endpoint=client.url)
    raise BackendUnavailable("the backend went silent (its health check timed out) before it answered", endpoint=client.url)


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


def _retryable(error: BackendError) -> bool:
    """Failed before anything reached the caller (unreachable, reset, no first byte, an answered 5xx):
    a second endpoint may well succeed, and the caller never knows."""
    return isinstance(error, BackendUnavailable)
