"""What happened to one request, where its time went, and who gets told.

A front end opens a :class:`RequestRecord` when the request arrives, the
router fills in its decisions and timestamps as the request moves, and the
front end finishes it exactly once with the error (or none) it answered.
:class:`Telemetry` then hands the finished record to its sinks: metrics and
the access log. Nothing here knows Prometheus, JSON or a wire format.

The origin's first question about a slow request -- did the time go to
queueing or to generation? -- is answered by ``queue_seconds`` against
``ttft_seconds`` and ``decode_seconds``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import trio

from .. import errors
from ..error_spec import CLIENT_CANCELLED, Ending, Outcome, grpc_status, http_status, outcome_and_reason

__all__ = [
    "UNKNOWN", "Api", "Outcome", "RepeatedIds", "RequestRecord", "Sink", "Telemetry", "Trace", "is_valid_request_id", "outcome_of",
    "status_of",
]

log = logging.getLogger("tailguard.telemetry")


class Trace(Protocol):
    """What the router calls on a request's trace (router/observe/tracing.py's RequestTrace); named here so telemetry needs no tracing import."""

    def queued(self) -> None: ...
    def call(self, url: str, kind: str, model: str, max_tokens: int) -> dict[str, str]: ...
    def call_failed(self, error: errors.TailguardError) -> None: ...
    def finish(self, record: RequestRecord) -> None: ...


Api = Literal["http", "grpc"]
UNKNOWN = "none"  # label value for a class or pool not yet decided

# One SSE event per engine step carrying output; vLLM emits one per token
# unless it batches several tokens into one step's delta.
# A Responses API stream's response id: its first event's response object (response.created) holds it first.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,200})"')
# A stream's usage: OpenAI's names, and Anthropic's and the Responses API's (message_delta, response.completed).
_USAGE = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
# Events a stream opens with that carry no token, by kind (for a count without usage: ``finish_tokens``).
_OPENING_EVENTS = {"chat": 1, "messages": 2, "responses": 4}
_PROMPT_USAGE = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
# vLLM's usage.prompt_tokens_details.cached_tokens (with --enable-prompt-tokens-details, and only when nonzero).
_CACHED_USAGE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
# vLLM's per-request metrics (--enable-per-request-metrics), on a stream's usage chunk: milliseconds.
_ENGINE_QUEUE = re.compile(rb'"queue_time_ms"\s*:\s*([0-9.eE+-]+)')
_ENGINE_TTFT = re.compile(rb'"time_to_first_token_ms"\s*:\s*([0-9.eE+-]+)')
_ENGINE_ITL = re.compile(rb'"mean_itl_ms"\s*:\s*([0-9.eE+-]+)')


# A caller's request id goes into headers, logs and the backend's request.
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def is_valid_request_id(request_id: str) -> bool:
    """1 to 128 printable ASCII characters, no spaces: safe in a header and a log line."""
    return _REQUEST_ID.fullmatch(request_id) is not None


def outcome_of(
    error: errors.TailguardError | None, *, client_gone: bool = False, ending: Ending = CLIENT_CANCELLED
) -> tuple[Outcome, str | None]:
    """The outcome label and, for anything but success, the reason it failed (``router/error_spec.py``).

    ``ending`` is how a request whose caller is gone ended: it left, or it stalled and was cut.
    """
    if client_gone:
        return ending.outcome, ending.reason
    if error is None:
        return "ok", None
    return outcome_and_reason(error)


def status_of(
    api: Api, error: errors.TailguardError | None, *, client_gone: bool = False, ending: Ending = CLIENT_CANCELLED
) -> int | str:
    """The HTTP status or gRPC status name that ending is answered with."""
    if api == "http":
        if client_gone:
            return ending.http_status
        return 200 if error is None else http_status(error)
    if client_gone:
        return ending.grpc_status
    return "OK" if error is None else grpc_status(error)


@dataclass
class RequestRecord:
    """One request's facts, filled in as it goes; times are Trio clock seconds."""

    request_id: str
    api: Api
    arrival: float
    caller: str = "anonymous"
    kind: str = UNKNOWN
    model: str | None = None  # as sent to the backend
    stream: bool = False
    # A whole answer tailguard assembled from a stream it asked for (a pool's stream_upstream): it has a first token.
    upstream_stream: bool = False
    request_class: str = UNKNOWN
    pool: str = UNKNOWN
    endpoint: str | None = None
    upstream_id: str | None = None  # the id the (last) attempt went to vLLM under: one per attempt, never the caller's
    lender: str | None = None  # the pool whose idle seat served it, when not its own
    # How its endpoint was chosen (router/fleet/policies.py PlacementKind): home, spilled, no_key, borrowed, least_loaded.
    placement: str | None = None

    prompt_tokens: int | None = None  # estimated
    # Of them, those its class counted as needing prefill on a warm conversation's home (prompt_bound = "uncached").
    uncached_tokens: int | None = None
    # A short digest of its prefix key (router/admission/prefix_keys.py): equal for requests that shared a prefix or hint; no text.
    prefix_group: str | None = None
    # A Responses API answer's id (router/fleet/response_homes.py: the engine that made it keeps it).
    response_id: str | None = None
    requested_max_tokens: int | None = None
    max_tokens: int | None = None  # effective, as sent to the backend
    clamped: bool = False
    admitted_at: float | None = None
    left_queue_at: float | None = None  # when it stopped waiting for a seat: admitted, refused or timed out
    first_token_at: float | None = None
    finished_at: float | None = None
    completion_tokens: int | None = None
    input_tokens: int | None = None  # the prompt's tokens as the backend's usage reports them
    cached_tokens: int | None = None  # of them, found in the engine's prefix cache, when its usage says
    # OpenAI's x-ratelimit-* headers of its caller's budgets after its admission (router/quotas/budgets.py); () without budgets.
    rate_limits: tuple[tuple[str, str], ...] = ()
    # When it was counted in its caller's budget (its minute there starts then), and what it counts for: its
    # reservation, settled at its end to what it cost (router/quotas/budgets.py); None without a budget.
    budget_at: float | None = None
    budget_tokens: int | None = None
    # A streamed call's seconds from being sent to the engine's first byte, and what its engine's model
    # predicted from the prompt tokens to prefill before it (router/fleet/first_byte_model.py).
    first_byte_seconds: float | None = None
    first_byte_predicted: float | None = None
    # The seconds from its seat to its end that its class's service time predicted at admission (None: nothing
    # learnt yet; router/observe/service_time.py): its queue deadline's share kept for running.
    service_predicted: float | None = None
    # What the engine itself reported (vLLM's --enable-per-request-metrics; None where it sends none), seconds:
    # in its own queue, scheduled to its first token, and its mean gap between tokens.
    engine_queue: float | None = None
    engine_ttft: float | None = None
    engine_itl: float | None = None
    # The longest wait between two relayed chunks of its stream, after the first (seconds; 0 until a second chunk).
    max_gap: float = 0.0
    # Whether it met its class's objective (router/observe/attainment.py); None: not judged.
    objective_met: bool | None = None
    outcome: Outcome | None = None
    reason: str | None = None
    status: int | str | None = None  # the HTTP status or gRPC code the caller saw
    error: str | None = None
    prompt_text: str | None = field(default=None, repr=False)  # only when log_prompts is on
    trace: Trace | None = field(default=None, repr=False)  # only while [tracing] is on
    _events: int = field(default=0, repr=False)
    _last_chunk_at: float = field(default=0.0, repr=False)
    _done_seen: bool = field(default=False, repr=False)

    # -- filled in by the router and the relay --------------------------------

    def saw_answer(self, completion_tokens: int | None) -> None:
        """A whole non-streaming answer, and the completion tokens its usage reports (an answer assembled
        from a stream keeps the time its first token came)."""
        if self.first_token_at is None:
            self.first_token_at = trio.current_time()
        if completion_tokens is not None:
            self.completion_tokens = completion_tokens

    def saw_chunk(self, chunk: bytes) -> None:
        """Some relayed SSE bytes: the first marks the first token (a Responses stream's first output event), each event
        counts, the gaps between them are timed."""
        now = trio.current_time()
        if self.first_token_at is None:
            # A Responses API stream opens with response.created and response.in_progress before the prefill:
            # its first token is its first output event.
            if self.kind != "responses" or b'"response.output_' in chunk:
                self.first_token_at = now
        elif now - self._last_chunk_at > self.max_gap:
            self.max_gap = now - self._last_chunk_at
        self._last_chunk_at = now
        self._events += chunk.count(b"data:")
        if self.response_id is None and self.kind == "responses":  # the stream's response.created event names it
            named = _RESPONSE_ID.search(chunk)
            if named is not None:
                self.response_id = named.group(1).decode()
        if b"[DONE]" in chunk:
            self._done_seen = True
        if b'_tokens"' not in chunk:  # no usage here: most reads (one literal search, not the patterns below)
            return
        if self.kind == "messages":
            self._saw_anthropic_usage(chunk)
            return
        match = _last(_USAGE, chunk)
        if match is not None:  # a usage chunk (stream_options.include_usage) is exact
            # The last in the chunk: a Responses stream's final event holds the count.
            self.completion_tokens = int(match.group(1))
            prompt = _last(_PROMPT_USAGE, chunk)
            if prompt is not None:
                self.input_tokens = int(prompt.group(1))
            cached = _CACHED_USAGE.search(chunk)
            if cached is not None:
                self.cached_tokens = int(cached.group(1))
            if b'"metrics"' in chunk:
                self.engine_queue, self.engine_ttft, self.engine_itl = (
                    _seconds(pattern.search(chunk)) for pattern in (_ENGINE_QUEUE, _ENGINE_TTFT, _ENGINE_ITL)
                )

    def _saw_anthropic_usage(self, chunk: bytes) -> None:
        """An Anthropic stream's usage: message_start's prompt, message_delta's final counts.

        message_start says 0 output tokens (a cut stream's count then comes
        from its events, ``finish_tokens``); vLLM's ``input_tokens`` leaves out
        the prompt's cached part (``cache_read_input_tokens``) and what it
        cached anew (``cache_creation_input_tokens``): the prompt is their sum.
        """
        for event in chunk.split(b"\n\n"):
            is_delta = b'"message_delta"' in event
            if not is_delta and b'"message_start"' not in event:
                continue
            usage = _event_usage(event)
            if usage is None:
                continue
            prompt, cached = anthropic_prompt_tokens(usage)
            if prompt is not None:
                self.input_tokens, self.cached_tokens = prompt, cached
            if is_delta:
                self.completion_tokens = _whole_count(usage.get("output_tokens"))

    def saw_engine_metrics(self, metrics: object) -> None:
        """A whole answer's ``metrics`` object (vLLM's per-request metrics), where the engine sends one."""
        if isinstance(metrics, dict):
            self.engine_queue, self.engine_ttft, self.engine_itl = (
                _ms_value(metrics.get(key)) for key in ("queue_time_ms", "time_to_first_token_ms", "mean_itl_ms")
            )

    # -- derived timings -----------------------------------------------------

    @property
    def queue_seconds(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.arrival

    @property
    def waited_seconds(self) -> float | None:
        """Arrival to leaving the pool's queue, admitted or not (a queue_timeout waited too)."""
        left = self.admitted_at if self.left_queue_at is None else self.left_queue_at
        return None if left is None else left - self.arrival

    @property
    def ttft_seconds(self) -> float | None:
        """Arrival to the first streamed token (None for requests tailguard did not get as a stream)."""
        if not (self.stream or self.upstream_stream) or self.first_token_at is None:
            return None
        return self.first_token_at - self.arrival

    @property
    def decode_seconds(self) -> float | None:
        """First token to the end: generation after the prefill."""
        if not (self.stream or self.upstream_stream) or self.first_token_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.first_token_at

    @property
    def generation_seconds(self) -> float | None:
        """Admission to the end: all the time the backend had the request."""
        if self.admitted_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.admitted_at

    @property
    def e2e_seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival

    @property
    def time_per_output_token(self) -> float | None:
        return None if self.finished_at is None else self.seconds_a_token(self.finished_at)

    @property
    def service_seconds(self) -> float | None:
        """Seconds from its seat to its end, for a request served whole (None otherwise)."""
        if self.outcome != "ok" or self.left_queue_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.left_queue_at

    def seconds_a_token(self, until: float) -> float | None:
        """A stream's mean seconds a token after the first, its tokens counted ``until`` then (None: not a stream, or under 2 tokens)."""
        tokens = self.completion_tokens
        if not (self.stream or self.upstream_stream) or self.first_token_at is None or tokens is None or tokens < 2:
            return None
        return (until - self.first_token_at) / (tokens - 1)

    def finish_tokens(self) -> None:
        """Settle the completion token count from the stream's events if no usage came."""
        if self.completion_tokens is None and self.stream and self._events:
            # The role-only first chunk of a chat stream and the [DONE] marker carry no token, nor the events
            # other APIs open with (Anthropic's message_start and content_block_start; the Responses API's
            # created, in_progress, output_item.added and content_part.added).
            overhead = int(self._done_seen) + _OPENING_EVENTS.get(self.kind, 0)
            self.completion_tokens = max(0, self._events - overhead)


Sink = Callable[[RequestRecord], None]


class Telemetry:
    """Finishes records exactly once and hands them to every sink."""

    def __init__(self, sinks: Sequence[Sink] = ()) -> None:
        self._sinks = list(sinks)

    def add_sink(self, sink: Sink) -> None:
        self._sinks.append(sink)

    def start(self, request_id: str, api: Api, *, arrival: float | None = None) -> RequestRecord:
        return RequestRecord(request_id, api, trio.current_time() if arrival is None else arrival)

    def finish(
        self,
        record: RequestRecord,
        error: errors.TailguardError | None,
        *,
        status: int | str | None = None,
        client_gone: bool = False,
        ending: Ending = CLIENT_CANCELLED,
    ) -> None:
        """Settle the outcome and report the record; a second call is ignored.

        ``status`` is what the caller saw; without it, what the error table
        says that ending is answered with on the record's wire.
        """
        if record.outcome is not None:
            return
        if record.finished_at is None:  # a front end may have stamped its last byte already
            record.finished_at = trio.current_time()
        record.outcome, record.reason = outcome_of(error, client_gone=client_gone, ending=ending)
        record.status = status_of(record.api, error, client_gone=client_gone, ending=ending) if status is None else status
        record.error = None if error is None else error.log_text  # the engine's URL too, never the caller's to read
        record.finish_tokens()
        for sink in self._sinks:
            try:
                sink(record)
            except Exception:  # a broken sink must never fail a request
                log.exception("telemetry sink %r failed", sink)
        if record.trace is not None:
            try:
                record.trace.finish(record)
            except Exception:  # nor a broken trace
                log.exception("finishing the trace of request %s failed", record.request_id)


class RepeatedIds:
    """Counts caller-supplied request ids seen again within a window.

    The same ``x-request-id`` twice in a few seconds is a client retrying
    (the origin's retry-storm warning: retries multiply load exactly when
    the fleet is slow). Memory is bounded: ids older than the window, and
    the oldest beyond ``max_ids``, are forgotten.
    """

    def __init__(self, window: float, *, max_ids: int = 100_000) -> None:
        self.window = window
        self._max_ids = max_ids
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.repeats = 0

    def observe(self, request_id: str, now: float | None = None) -> bool:
        """Remember the id; True when it was already seen within the window."""
        if self.window <= 0:
            return False
        now = trio.current_time() if now is None else now
        self._expire(now)
        repeated = request_id in self._seen
        if repeated:
            self.repeats += 1
            self._seen.move_to_end(request_id)
        self._seen[request_id] = now
        if len(self._seen) > self._max_ids:
            self._seen.popitem(last=False)
        return repeated

    def _expire(self, now: float) -> None:
        horizon = now - self.window
        seen = self._seen
        while seen:
            oldest, at = next(iter(seen.items()))
            if at >= horizon:
                return
            del seen[oldest]


def _seconds(match: re.Match[bytes] | None) -> float | None:
    """A matched number of milliseconds, in seconds (None: absent or not a number)."""
    if match is None:
        return None
    try:
        return _ms_value(float(match.group(1)))
    except ValueError:
        return None


def _ms_value(value: object) -> float | None:
    """A finite, non-negative number of milliseconds, in seconds; None otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value) / 1000


def anthropic_prompt_tokens(usage: Mapping[str, object]) -> tuple[int | None, int | None]:
    """The prompt's tokens and its cached ones from an Anthropic usage: vLLM's ``input_tokens`` is the uncached
    part, beside ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` (with prompt token details on)."""
    uncached = _whole_count(usage.get("input_tokens"))
    if uncached is None:
        return None, None
    read = _whole_count(usage.get("cache_read_input_tokens"))
    created = _whole_count(usage.get("cache_creation_input_tokens"))
    return uncached + (read or 0) + (created or 0), read


def _whole_count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _event_usage(event: bytes) -> Mapping[str, object] | None:
    """The ``usage`` object of one SSE event's data (Anthropic's message_start holds it in its message)."""
    data = next((line[5:] for line in event.split(b"\n") if line.startswith(b"data:")), None)
    if data is None:
        return None
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(payload, dict):
        return None
    holder = payload.get("message") if payload.get("type") == "message_start" else payload
    usage = holder.get("usage") if isinstance(holder, dict) else None
    return usage if isinstance(usage, dict) else None


def _last(pattern: re.Pattern[bytes], chunk: bytes) -> re.Match[bytes] | None:
    """The last match of ``pattern`` in ``chunk`` (None: none)."""
    match = None
    for match in pattern.finditer(chunk):  # noqa: B007 -- the loop keeps the last
        pass
    return match
