"""OpenTelemetry traces of requests: one span tree each, the W3C ``traceparent`` passed on to the backend.

Imported only while ``[tracing]`` is enabled (``server/app.py`` imports it
then): with tracing off neither this module nor the OpenTelemetry SDK is
loaded, and a request pays a ``None`` check at each hook below.

One request's tree::

    POST /v1/chat/completions            SERVER    arrival -> last byte to the caller
    |-- queue wait                       INTERNAL  waiting for a seat in the pool
    |-- chat sim-llama-3.1-8b            CLIENT    one backend attempt (a retry elsewhere is a second)
    |   |-- time to first token          INTERNAL  streams: the call's start -> its first token
    |   |-- decode                       INTERNAL  streams: first token -> the end
    |   `-- (the engine's spans: the traceparent it was sent names this span)
    `-- relay                            INTERNAL  first byte relayed -> last byte to the caller

(gRPC names the root ``tailguard.v1.Completions/ChatStream`` and so on.)
The root carries the request's facts: class, pool, endpoint, effective
``max_tokens``, outcome and reason, and the OpenTelemetry GenAI attributes
(``gen_ai.operation.name``, ``gen_ai.request.model``,
``gen_ai.request.max_tokens``, ``gen_ai.usage.*``); a backend attempt has
``server.address``/``server.port`` too, and ``error.type`` when it failed.

Hooks, in the request's order: :meth:`Tracing.start` (the session, with the
caller's headers or metadata: a ``traceparent`` there is the root's parent),
:meth:`RequestTrace.queued`, :meth:`RequestTrace.call` and
:meth:`RequestTrace.call_failed` (the dispatcher, per attempt: the attempt's
span must exist before its request is sent, since its id goes in the
``traceparent`` header), and :meth:`RequestTrace.finish` (telemetry, once the
record is final). Everything else is built at the finish from the record's
timestamps, so a span says what the access log and the metrics say.

Span times are Unix nanoseconds, as OTLP wants: one wall-clock reading per
request anchors the Trio clock the record is kept in (under a test's virtual
clock the spans' durations are virtual too).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

import trio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from ..config import ConfigError, TracingConfig
from ..error_spec import outcome_and_reason
from ..errors import TailguardError
from .telemetry import UNKNOWN, RequestRecord

__all__ = ["INSTALL_TRACING", "RequestTrace", "Tracing"]

INSTALL_TRACING = "pip install 'tailguard[tracing]'"  # what brings the OTLP exporter

log = logging.getLogger("tailguard.tracing")

# OpenTelemetry GenAI semantic conventions: the operation of each request kind.
_OPERATIONS = {"chat": "chat", "completion": "text_completion"}
# Outcomes that are the service's failure, not the caller's (a 4xx) nor the caller leaving.
_FAILED = frozenset({"overloaded", "timeout", "backend_error", "internal_error"})
# gRPC status names (router/error_spec.py's) as the numbers rpc.grpc.status_code holds.
_GRPC_CODES = {
    name: code
    for code, name in enumerate((
        "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
        "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
        "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
    ))
}
_EXPORT_TIMEOUT = 10.0  # seconds one export may take (the exporter's default)


class Tracing:
    """The tracer of one ``[tracing]`` table: a provider, its sampler and where its spans go.

    ``processor`` replaces the default (a batch processor exporting over
    OTLP/HTTP to ``config.endpoint``): tests pass a simple processor over an
    in-memory exporter. Nothing here is global: the provider is not
    registered as OpenTelemetry's default, and the trace-context propagator
    is this object's own.
    """

    def __init__(self, config: TracingConfig, *, processor: SpanProcessor | None = None) -> None:
        self.config = config
        self._provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            resource=Resource.create({"service.name": config.service_name}),
            shutdown_on_exit=False,  # serve() shuts it down, flushing what is left
        )
        if processor is None:
            processor = BatchSpanProcessor(_exporter(config))
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("tailguard")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, record: RequestRecord, carrier: Mapping[str, str] | None, route: str) -> RequestTrace:
        """The trace of the request ``record`` is about, its root span begun at its arrival.

        ``carrier`` is the caller's headers or metadata (lower-case names): a
        valid ``traceparent`` there makes the root its child, and decides
        whether it is sampled. ``route`` names the root.
        """
        parent = self._propagator.extract(carrier) if carrier else None
        return RequestTrace(self, record, parent, route)

    def shutdown(self) -> None:
        """Export what is left and stop (blocks up to the export timeout: run it in a thread)."""
        self._provider.shutdown()


def _exporter(config: TracingConfig) -> SpanExporter:
    """OTLP/HTTP (protobuf) to ``config.endpoint``; without headers in the file the
    exporter reads ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``.

    The exporter is the ``tracing`` extra, not a dependency of every install
    (it brings ``requests`` and the OTLP protobufs): raises :exc:`ConfigError`
    naming the extra when it is not installed, so that a start fails in one
    line and a reload is refused, the running config kept.
    """
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as error:
        raise ConfigError(
            [f"tracing.enabled: the OTLP exporter is not installed ({error}); install it with: {INSTALL_TRACING}"],
            source="[tracing]",
        ) from None

    return OTLPSpanExporter(endpoint=config.endpoint, headers=dict(config.headers) or None, timeout=_EXPORT_TIMEOUT)


class RequestTrace:
    """One request's spans while it runs; :meth:`finish` completes and ends them all."""

    __slots__ = ("_tracing", "_route", "_wall", "_clock", "root", "_context", "_queued_at", "_calls", "_finished")

    def __init__(self, tracing: Tracing, record: RequestRecord, parent: Context | None, route: str) -> None:
        self._tracing = tracing
        self._route = route
        self._wall = time.time_ns()
        self._clock = trio.current_time()
        self.root: Span = tracing._tracer.start_span(
            route, context=parent, kind=SpanKind.SERVER, start_time=self._ns(record.arrival)
        )
        self._context = trace.set_span_in_context(self.root)
        self._queued_at: float | None = None
        self._calls: list[_Call] = []
        self._finished = False

    def _ns(self, at: float) -> int:
        """Trio clock seconds as Unix nanoseconds."""
        return self._wall + round((at - self._clock) * 1e9)

    @property
    def recording(self) -> bool:
        """Whether the trace is sampled (False: its spans are dropped, its traceparent still passed on)."""
        return self.root.is_recording()

    def queued(self) -> None:
        """The request starts waiting for a seat in its pool."""
        self._queued_at = trio.current_time()

    def call(self, url: str, kind: str, model: str, max_tokens: int) -> dict[str, str]:
        """A backend attempt begins: its span, and the headers that carry it to the backend.

        Named as the GenAI conventions name a model call: ``{operation} {model}``.
        """
        started = trio.current_time()
        operation = _OPERATIONS.get(kind, kind)
        attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens,
            "tailguard.endpoint": url,
            "tailguard.attempt": len(self._calls) + 1,
        }
        parts = urlsplit(url)
        if parts.hostname:
            attributes["server.address"] = parts.hostname
            attributes["server.port"] = parts.port or (443 if parts.scheme == "https" else 80)
        span = self._tracing._tracer.start_span(
            f"{operation} {model}", context=self._context, kind=SpanKind.CLIENT, attributes=attributes, start_time=self._ns(started)
        )
        self._calls.append(_Call(span, started))
        headers: dict[str, str] = {}
        self._tracing._propagator.inject(headers, context=trace.set_span_in_context(span))
        return headers

    def call_failed(self, error: TailguardError) -> None:
        """The attempt begun last failed before its answer began (a retry may follow)."""
        if not self._calls or self._calls[-1].ended:
            return
        attempt = self._calls[-1]
        _, reason = outcome_and_reason(error)
        _failed(attempt.span, reason, error.message)
        attempt.ended = True
        attempt.span.end(end_time=self._ns(trio.current_time()))

    def finish(self, record: RequestRecord) -> None:
        """Complete every span from the finished ``record`` and end them (once)."""
        if self._finished:
            return
        self._finished = True
        root = self.root
        end = self._ns(record.finished_at if record.finished_at is not None else trio.current_time())
        if not root.is_recording():
            for attempt in self._calls:
                if not attempt.ended:
                    attempt.span.end(end_time=end)
            root.end(end_time=end)
            return
        operation = _OPERATIONS.get(record.kind)
        self._children(record, end)
        root.set_attributes(_root_attributes(record, operation, self._route))
        if record.outcome in _FAILED:
            _failed(root, record.reason or str(record.outcome), record.error)
        elif record.outcome != "ok" and record.reason is not None:
            root.set_attribute("error.type", record.reason)
        root.end(end_time=end)

    def _children(self, record: RequestRecord, end: int) -> None:
        tracer, context = self._tracing._tracer, self._context
        if self._queued_at is not None and record.left_queue_at is not None:
            admitted = record.admitted_at is not None
            queue = tracer.start_span(
                "queue wait",
                context=context,
                attributes={"tailguard.class": record.request_class, "tailguard.pool": record.pool, "tailguard.admitted": admitted},
                start_time=self._ns(self._queued_at),
            )
            if not admitted and record.reason is not None:
                _failed(queue, record.reason, record.error)
            queue.end(end_time=self._ns(record.left_queue_at))
        first = record.first_token_at
        for attempt in self._calls:
            span = attempt.span
            if attempt.ended:
                continue
            # The attempt that answered (or was cut short): a stream's ends with the
            # relay, a whole answer's when its body was read.
            call_end = self._ns(first) if first is not None and not record.stream else end
            if record.completion_tokens is not None:
                span.set_attribute("gen_ai.usage.output_tokens", record.completion_tokens)
            if record.input_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", record.input_tokens)
            if record.cached_tokens is not None:
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", record.cached_tokens)
            if record.stream and first is not None:
                attempt_context = trace.set_span_in_context(span)
                ttft = tracer.start_span("time to first token", context=attempt_context, start_time=self._ns(attempt.started))
                ttft.end(end_time=self._ns(first))
                decode = tracer.start_span("decode", context=attempt_context, start_time=self._ns(first))
                decode.end(end_time=call_end)
            if record.outcome in _FAILED and record.reason is not None:
                _failed(span, record.reason, record.error)
            span.end(end_time=call_end)
        if first is not None:
            relay = tracer.start_span(
                "relay", context=context, attributes={"tailguard.stream": record.stream}, start_time=self._ns(first)
            )
            relay.end(end_time=end)


class _Call:
    """One backend attempt's span and when it began (Trio clock)."""

    __slots__ = ("span", "started", "ended")

    def __init__(self, span: Span, started: float) -> None:
        self.span = span
        self.started = started
        self.ended = False


def _failed(span: Span, error_type: str, message: str | None) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message))


def _root_attributes(record: RequestRecord, operation: str | None, route: str) -> dict[str, AttributeValue]:
    """The request's facts on its root span: GenAI conventions where they fit, ``tailguard.*`` for the rest."""
    attributes: dict[str, AttributeValue] = {
        "tailguard.request_id": record.request_id,
        "tailguard.api": record.api,
        "tailguard.caller": record.caller,
        "tailguard.stream": record.stream,
        "tailguard.outcome": str(record.outcome),
    }
    if record.api == "http":
        method, _, path = route.partition(" ")
        attributes["http.request.method"] = method
        attributes["url.path"] = path
        if isinstance(record.status, int):
            attributes["http.response.status_code"] = record.status
    else:
        service, _, method = route.rpartition("/")
        attributes["rpc.system"] = "grpc"
        attributes["rpc.service"] = service
        attributes["rpc.method"] = method
        code = _GRPC_CODES.get(str(record.status))
        if code is not None:
            attributes["rpc.grpc.status_code"] = code
    optional: dict[str, AttributeValue | None] = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": record.model,
        "gen_ai.request.max_tokens": record.max_tokens,
        "gen_ai.usage.input_tokens": record.input_tokens,
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,  # the engine's prefix cache
        "tailguard.class": None if record.request_class == UNKNOWN else record.request_class,
        "tailguard.pool": None if record.pool == UNKNOWN else record.pool,
        "tailguard.endpoint": record.endpoint,
        "tailguard.lender": record.lender,
        "tailguard.placement": record.placement,
        "tailguard.prompt_tokens_estimated": record.prompt_tokens,
        "tailguard.requested_max_tokens": record.requested_max_tokens,
        "tailguard.max_tokens_clamped": record.clamped if record.max_tokens is not None else None,
        "tailguard.reason": record.reason,
    }
    attributes.update({key: value for key, value in optional.items() if value is not None})
    return attributes
