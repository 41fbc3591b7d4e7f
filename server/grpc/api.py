"""The gRPC front end: ``tailguard.v1.Completions`` on grpc.aio, the core in Trio.

Translation only. Handlers run in asyncio: they read the call's metadata,
hand the message to the Trio side (through ``grpc_bridge.TrioPortal``) and
render what comes back -- routing metadata, protobuf, or an error status
with retry hints in trailing metadata (``server/errors_map.py``). The Trio
side runs each call in a ``router.session`` (request id, key, deadline,
telemetry, the cap on open calls) and turns the backend's OpenAI JSON/SSE
into protobuf; a reply that is not a valid completion is BadBackendReply,
never OK with empty content. A caller's deadline or cancellation cancels the
Trio scope, which aborts the backend generation and releases the seat.

A flood must not starve the process. grpc core holds the calls the process
has not yet picked up, and cancels them (CANCELLED, no details) past
``grpc.server.max_pending_requests`` or after
``grpc.server_max_unrequested_time_in_server`` (30 s): the only answer it has
for calls it may not hand over is the silent one. grpc.aio's
``maximum_concurrent_rpcs`` does not help: it *blocks* the loop that picks
calls up (an asyncio.Condition) until one ends, so the excess waits in core
for exactly that cancel. So the defences are, in order:

- HTTP/2 itself: at most ``streams_bound(max_calls)`` streams on one
  connection (``grpc.max_concurrent_streams``: the calls served and as many
  being refused); a client's further calls wait in the client, where they
  cost this process nothing;
- every call core has is picked up promptly, and one over the gate is refused
  on the asyncio side at once, before it costs the router anything: no Trio
  hop, no session, no parse (``CompletionsService``'s gate: RESOURCE_EXHAUSTED
  ``server_busy`` with its retry hint); its access-log line and metrics are
  posted to Trio after the answer, batched. The gate is ``max_calls``, or
  less where the pools are small: twice what they can seat and queue, plus
  ``_ROOM_SLACK`` (``_gate``): the Trio side would refuse those calls anyway,
  at twice the cost;
- a caller (connection and credentials) most of whose calls in the last
  second were refused for overload is shed there too, by the SRE book's
  adaptive throttling (``router.shed``): about twice its accepted rate still
  reaches the router. A flood's refusals then cost what grpc itself costs:
  without it each went through the Trio side, at ~2.5x the CPU of a server
  that refuses everything (``bench chaos``, the gRPC flood, and its floor);
- core's pending bound is far above what the loop picks up in a second, so
  core never cancels a call the process would have answered;
- what the asyncio side hands Trio is run in bounded slices
  (``grpc_bridge``), so a burst of calls cannot stall the Trio loop, whose
  lateness the router measures (``router.loop_lag``) and never blames on the
  engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import trio
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_v1alpha_pb2

from tailguard.router.auth import Caller
from tailguard.router.config_limits import limits_of
from tailguard.router.config_types import Config, ServerConfig, TlsConfig
from tailguard.router.dispatch import Router
from tailguard.router.errors import (
    BackendStreamError,
    BadBackendReply,
    Draining,
    InternalError,
    InvalidRequest,
    Overloaded,
    ServerBusy,
    TailguardError,
)
from tailguard.router.ids import IdSource
from tailguard.router.request import RequestKind, RouterRequest, Routing
from tailguard.router.session import Session, Sessions, checked_header
from tailguard.router.shed import WINDOW_SECONDS, AdaptiveShed
from tailguard.router.telemetry import RepeatedIds, Telemetry, is_valid_request_id
from tailguard.router.tls import read_pem

if TYPE_CHECKING:  # imported only while [tracing] is on
    from tailguard.router.tracing import Tracing

from ..errors_map import grpc_error
from ..timing import server_timing
from .bridge import AsyncioHost, TrioPortal
from .gen.grpc.reflection.v1 import reflection_pb2 as reflection_v1_pb2
from .gen.tailguard.v1 import tailguard_pb2 as pb
from .gen.tailguard.v1 import tailguard_pb2_grpc as pb_grpc
from .sse import DONE, SseDecoder

log = logging.getLogger("tailguard.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Completions"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE_NAMES = (reflection_v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name, reflection.SERVICE_NAME)
GRACE_SECONDS = 5.0
# How often the Trio side looks at the router's readiness for the health service.
HEALTH_CHECK_SECONDS = 0.25
# Completion calls open at once by default; beyond it RESOURCE_EXHAUSTED (config: server.grpc_max_calls).
MAX_CONCURRENT_CALLS = ServerConfig.grpc_max_calls
_SHUTTING_DOWN = Draining("tailguard is shutting down; retry on another instance", retry_after=1.0)
_INT32_MAX = 2**31 - 1


def streams_bound(max_calls: int) -> int:
    """Streams one HTTP/2 connection may hold open: ``max_calls`` served, as many again answered RESOURCE_EXHAUSTED."""
    return max_calls + max(max_calls, 100)


# Calls let past the gate beyond twice the pools' room: so pools with no room yet (no endpoints) still get the router's verdict.
_ROOM_SLACK = 64


def _gate(max_calls: int, room: int | None) -> int:
    """Completion calls open at once, beyond which a call is refused on the asyncio side.

    ``room`` is what the pools can seat and queue (``Router.room``). Past it a
    call can only be refused or displace a less urgent waiter: twice that
    leaves room for the displacing ones and for calls that have let go of
    their seats and are still sending their last bytes.
    """
    return max_calls if room is None else min(max_calls, 2 * room + _ROOM_SLACK)


def pending_bound(max_calls: int) -> int:
    """Calls grpc core may hold before the process picks them up: any burst it can pick up and refuse in time.

    Beyond it core cancels calls silently, so it is generous: picking a call
    up and refusing it costs the asyncio side ~0.1-0.3 ms, so even 10 x
    ``max_calls`` arriving at once is picked up well inside grpc's 30 s.
    """
    return max(10 * max_calls, 10_000)


# -- the Trio side: the session, and OpenAI JSON -> protobuf ---------------------------


@dataclasses.dataclass
class _Call:
    """What the asyncio side hands the Trio side for one call (and reads back)."""

    kind: RequestKind
    message: Any  # pb.ChatRequest or pb.CompletionRequest
    supplied_id: str  # the caller's request id, or ""
    authorization: str | None
    remaining: float | None  # the caller's deadline, in seconds from now
    stream: bool
    request_id: str | None = None  # set by the Trio side: the id the call goes by
    trace_context: dict[str, str] | None = None  # the caller's traceparent and tracestate, if it sent them
    caller: tuple[str, str | None] = ("", None)  # its connection and credentials: whose calls the shed counts it among

    @property
    def route(self) -> str:
        """The call's full method name, as its span is named."""
        return f"tailguard.v1.Completions/{'Chat' if self.kind == 'chat' else 'Complete'}{'Stream' if self.stream else ''}"


@dataclasses.dataclass(frozen=True)
class _Head:
    """A stream's first item: the routing facts, as protobuf and as initial metadata."""

    routing: pb.Routing
    metadata: tuple[tuple[str, str], ...]


class _Timing(str):
    """The stream's last item: its ``server-timing`` value for the trailing metadata."""


class _TrioSide:
    """Runs calls in sessions on the router; everything here executes in Trio."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    def refused(self, request_id: str, error: ServerBusy) -> None:
        """Record a call the asyncio side refused over the cap (already answered): its access-log line and metrics."""
        telemetry = self._sessions.telemetry
        telemetry.finish(telemetry.start(request_id, "grpc"), error)

    async def unary(self, call: _Call) -> tuple[pb.CompletionResponse, tuple[tuple[str, str], ...], str]:
        session = self._sessions.start(call.supplied_id, carrier=call.trace_context, route=call.route)
        call.request_id = session.request_id
        async with session:
            request, caller = self._admit(call, session)
            async with session.completion(request, caller) as completion:
                await completion.read()  # checked and parsed once, by the core
                response = _response(request.kind, completion.payload, completion.routing)
                metadata = session.routing_facts(completion.routing)
            return response, metadata, checked_header("server-timing", server_timing(session.record, total=True))
        raise AssertionError("the session ended without an answer")  # pragma: no cover

    async def stream(self, emit: Callable[[Any], Awaitable[None]], call: _Call) -> None:
        """Emit a _Head, then a list of chunks per backend read (one hand-off each), then the _Timing."""
        session = self._sessions.start(call.supplied_id, carrier=call.trace_context, route=call.route)
        call.request_id = session.request_id
        async with session:
            request, caller = self._admit(call, session)
            kind = request.kind
            async with session.completion(request, caller) as completion:
                await emit(_Head(_routing(completion.routing), session.routing_facts(completion.routing)))
                decoder = SseDecoder()
                ended = False  # [DONE] or a finish reason seen: the answer is complete
                async for raw in completion.chunks(check=False):  # the decoder below parses every event: once is enough
                    chunks = []
                    for data in decoder.feed(raw):
                        if data == DONE:
                            ended = True
                            continue
                        chunk = _chunk(kind, _json(data))
                        if chunk.finish_reason:
                            ended = True
                        chunks.append(chunk)
                    if chunks:
                        await emit(chunks)
                if not ended:
                    raise BadBackendReply("the backend's stream ended without [DONE] or a finish reason")
            await emit(_Timing(checked_header("server-timing", server_timing(session.record, total=True))))

    @staticmethod
    def _admit(call: _Call, session: Session) -> tuple[RouterRequest, Caller]:
        """The caller and the translated request with its deadline, or the error that stops them."""
        caller = session.authenticate(call.authorization)
        # Built once, complete: a RouterRequest checks itself on every construction.
        common = _common(call.message.options, session.request_id)
        if call.stream:
            common["params"]["stream_options"] = {"include_usage": True}
        common["stream"] = call.stream
        common["deadline"] = None if call.remaining is None else session.record.arrival + call.remaining
        message = call.message
        if call.kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in message.messages]
            return RouterRequest(kind="chat", model=message.model or None, messages=messages, **common), caller
        return RouterRequest(kind="completion", model=message.model or None, prompt=message.prompt, **common), caller


def _routing(routing: Routing) -> pb.Routing:
    return pb.Routing(
        request_id=routing.request_id,
        request_class=routing.request_class,
        pool=routing.pool,
        max_tokens=routing.max_tokens,
        max_tokens_clamped=routing.clamped,
        estimated_prompt_tokens=routing.prompt_tokens,
        queue_ms=routing.queue_seconds * 1000,
    )


# -- reading the backend's JSON: anything unexpected is the backend's fault ----------


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit number
        raise BadBackendReply("the backend's reply is not valid JSON") from None


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadBackendReply(f"the backend's reply is not a completion: {what} is not an object")
    return value


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadBackendReply(f"the backend's reply is not a completion: {what} is not a string")
    return value


def _count(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32_MAX:
        raise BadBackendReply("the backend's reply is not a completion: a usage count is not a token count")
    return value


def _usage(payload: Any) -> pb.Usage | None:
    if not payload:
        return None
    usage = _object(payload, "usage")
    return pb.Usage(
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        total_tokens=_count(usage.get("total_tokens")),
    )


def _first_choice(body: dict[str, Any]) -> dict[str, Any] | None:
    choices = body.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list):
        raise BadBackendReply("the backend's reply is not a completion: choices is not a list")
    return _object(choices[0], "choices[0]") if choices else None


def _response(kind: RequestKind, payload: Any, routing: Routing) -> pb.CompletionResponse:
    body = _object(payload, "the body")
    if "error" in body:
        raise BadBackendReply(f"the backend answered 200 with an error: {str(body['error'])[:500]}")
    choice = _first_choice(body)
    if choice is None:
        raise BadBackendReply("the backend's reply is not a completion: it has no choices")
    if kind == "chat":
        content = _text(_object(choice.get("message"), "choices[0].message").get("content"), "the message's content")
    else:
        content = _text(choice.get("text"), "choices[0].text")
    finish_reason = _text(choice.get("finish_reason"), "finish_reason")
    if not finish_reason:
        raise BadBackendReply("the backend's reply is not a complete completion: it has no finish reason")
    return pb.CompletionResponse(
        id=_text(body.get("id"), "id"),
        model=_text(body.get("model"), "model"),
        content=content,
        finish_reason=finish_reason,
        usage=_usage(body.get("usage")),
        routing=_routing(routing),
    )


def _chunk(kind: RequestKind, payload: Any) -> pb.CompletionChunk:
    """One stream event as protobuf (per relayed event: checks inline, fields set only when present)."""
    event = _object(payload, "a stream event")
    if "error" in event:  # the backend reports a failure inside its stream
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise BackendStreamError(f"the backend failed the stream: {str(message)[:500]}")
    chunk = pb.CompletionChunk()
    choices = event.get("choices")
    if choices:
        choice = choices[0] if type(choices) is list else None
        if type(choice) is not dict:
            raise BadBackendReply("the backend's stream is not a completion: choices[0] is not an object")
        if kind == "chat":
            delta = choice.get("delta")
            if delta is not None and type(delta) is not dict:
                raise BadBackendReply("the backend's stream is not a completion: delta is not an object")
            text = None if delta is None else delta.get("content")
        else:
            text = choice.get("text")
        if text:
            chunk.content = _text(text, "the content")
        finish_reason = choice.get("finish_reason")
        if finish_reason:
            chunk.finish_reason = _text(finish_reason, "finish_reason")
    usage = event.get("usage")
    if usage:
        chunk.usage.CopyFrom(_usage(usage))
    return chunk


# -- the asyncio side: grpc.aio handlers ------------------------------------------


class CompletionsService(pb_grpc.CompletionsServicer):  # type: ignore[misc]  # generated, untyped
    """``tailguard.v1.Completions``: translation only; the work runs in Trio.

    The gate on open calls is kept here, on the asyncio side: a call over
    ``max_calls`` is refused before anything else is done for it (see the
    module's docstring), so a flood is refused at the rate the asyncio loop
    picks calls up, whatever the Trio side is doing.
    """

    def __init__(self, router: Router, portal: TrioPortal, observers: Observers, *, max_calls: int = MAX_CONCURRENT_CALLS) -> None:
        self._router = router
        self._portal = portal
        self._max_calls = max_calls
        self._open = 0  # completion calls open (asyncio side only)
        self._room: int | None = None  # what the pools can seat and queue (Router.room), as the Trio side last said
        self._gate = max_calls
        self._shed = AdaptiveShed()  # asyncio side only
        self._ids = IdSource()  # refused calls' ids (asyncio side only; the Trio side has its own)
        sessions = Sessions(
            router,
            observers.telemetry,
            "grpc",
            repeated_ids=observers.repeated_ids,
            on_repeat=observers.on_repeat,
            max_open=max_calls,
            log_prompts=observers.log_prompts,
            request_id_field="request_id",
            tracing=observers.tracing,
        )
        self._trio = _TrioSide(sessions)

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:
        call = await self._admit("chat", request, context, stream=False)
        try:
            return await self._unary(call, context)
        finally:
            self._open -= 1

    async def Complete(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:
        call = await self._admit("completion", request, context, stream=False)
        try:
            return await self._unary(call, context)
        finally:
            self._open -= 1

    # grpc.aio recognises streaming handlers by being async generator functions.
    async def ChatStream(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:
        call = await self._admit("chat", request, context, stream=True)
        try:
            async for chunk in self._stream(call, context):
                yield chunk
        finally:
            self._open -= 1

    async def CompleteStream(
        self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CompletionChunk]:
        call = await self._admit("completion", request, context, stream=True)
        try:
            async for chunk in self._stream(call, context):
                yield chunk
        finally:
            self._open -= 1

    async def _admit(self, kind: RequestKind, message: Any, context: grpc.aio.ServicerContext, *, stream: bool) -> _Call:
        """The call, counted as open; or refused at once (RESOURCE_EXHAUSTED server_busy) over the gate or by the shed.

        A request that did not decode is INVALID_ARGUMENT here (grpc's own answer
        would be UNKNOWN, with Python's exception text).
        """
        if isinstance(message, _Malformed):
            await _abort(context, InvalidRequest(f"the request is not a valid {message.type_name} message", param="request"))
        call = _call(kind, message, context, stream=stream)
        call.caller = (context.peer(), call.authorization)
        retry_after = self._router.config.timeouts.retry_after  # a frozen config, swapped whole: safe to read here
        if self._open >= self._gate:
            why = "its cap" if self._gate == self._max_calls else f"more than its pools can seat and queue ({self._room})"
            busy = ServerBusy(f"tailguard has {self._open} grpc calls open, {why}; retry after {retry_after:g} s", retry_after=retry_after)
        elif not self._shed.admit(call.caller, time.monotonic()):
            busy = ServerBusy(
                f"tailguard sheds {self._shed.chance(call.caller, time.monotonic()):.0%} of this caller's calls now: most of its calls "
                f"in the last {WINDOW_SECONDS:g} s were refused for overload; retry after {retry_after:g} s",
                retry_after=retry_after,
            )
        else:
            self._open += 1
            return call
        request_id = call.supplied_id if is_valid_request_id(call.supplied_id) else self._ids.fresh()
        self._portal.post(self._trio.refused, request_id, busy)  # recorded in Trio, batched
        await _abort(context, busy, request_id)

    def _refused_inside(self, call: _Call, error: TailguardError) -> None:
        """The shed hears of the call's refusal for overload (queue full, a cap, no room): its caller's next calls may be shed."""
        if isinstance(error, Overloaded):
            self._shed.refused(call.caller, time.monotonic())

    def set_room(self, room: int) -> None:
        """On the asyncio side: the pools' room changed (a reload, discovery, rebalancing); the gate follows."""
        self._room = room
        self._gate = _gate(self._max_calls, room)

    async def GetLimits(self, request: pb.GetLimitsRequest, context: grpc.aio.ServicerContext) -> pb.Limits:
        """The limits in force; with API keys configured it needs one, as HTTP's /v1/limits does."""
        if isinstance(request, _Malformed):
            await _abort(context, InvalidRequest(f"the request is not a valid {request.type_name} message", param="request"))
        try:
            self._router.authenticate(_metadata(context).get("authorization"))
        except TailguardError as error:
            await _abort(context, error)
        return limits_message(self._router.config)

    async def _unary(self, call: _Call, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:
        try:
            response, metadata, timing = await self._portal.call(self._trio.unary, call)
        except TailguardError as error:
            self._refused_inside(call, error)
            await _abort(context, error, call.request_id)
        except ConnectionAbortedError:
            await _abort(context, _SHUTTING_DOWN, call.request_id)
        except Exception as error:  # a bug outside the session (it logs and counts the ones inside)
            await _abort_bug(context, error, call.request_id)
        await context.send_initial_metadata(metadata)
        context.set_trailing_metadata((("server-timing", timing),))
        return response

    async def _stream(self, call: _Call, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:
        routing: pb.Routing | None = None
        try:
            async for item in self._portal.stream(self._trio.stream, call):
                if isinstance(item, _Head):
                    routing = item.routing
                    await context.send_initial_metadata(item.metadata)
                    continue
                if isinstance(item, _Timing):
                    context.set_trailing_metadata((("server-timing", str(item)),))
                    continue
                for chunk in item:
                    if routing is not None:
                        chunk.routing.CopyFrom(routing)
                        routing = None
                    yield chunk
        except TailguardError as error:
            self._refused_inside(call, error)
            await _abort(context, error, call.request_id)
        except ConnectionAbortedError:
            await _abort(context, _SHUTTING_DOWN, call.request_id)
        except Exception as error:  # a bug outside the session
            await _abort_bug(context, error, call.request_id)


@dataclasses.dataclass(frozen=True)
class Observers:
    """Where the gRPC front end reports finished calls and repeated request ids."""

    telemetry: Telemetry
    repeated_ids: RepeatedIds | None = None
    on_repeat: Callable[[], None] = lambda: None
    log_prompts: Callable[[], bool] = lambda: False
    tracing: Callable[[], Tracing | None] | None = None  # the tracer of each call, if any


_TRACE_CONTEXT = ("traceparent", "tracestate")  # W3C trace context, as gRPC metadata carries it


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}


def _call(kind: RequestKind, message: Any, context: grpc.aio.ServicerContext, *, stream: bool) -> _Call:
    """What the Trio side needs of one call (asyncio side: metadata and deadline are read here)."""
    metadata = _metadata(context)
    supplied = message.options.request_id or metadata.get("x-request-id") or ""
    trace_context = {key: metadata[key] for key in _TRACE_CONTEXT if key in metadata} or None
    return _Call(kind, message, supplied, metadata.get("authorization"), context.time_remaining(), stream, trace_context=trace_context)


def _params(options: pb.Options) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if options.HasField("extra"):
        params.update({k: _integral(v) for k, v in json_format.MessageToDict(options.extra).items()})
    for name in ("temperature", "top_p", "seed", "n"):
        if options.HasField(name):
            params[name] = getattr(options, name)
    if options.stop:
        params["stop"] = list(options.stop)
    return params


def _integral(value: Any) -> Any:
    """Struct numbers are doubles; give vLLM integers where they are whole."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _common(options: pb.Options, request_id: str) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "max_tokens": options.max_tokens if options.HasField("max_tokens") else None,
        "params": _params(options),
        "forced_class": options.request_class or None,
    }


@dataclasses.dataclass(frozen=True)
class _Malformed:
    """A request body that is not the message its method takes (what the lenient deserializer gives instead of raising)."""

    type_name: str


def _lenient(message_type: Any) -> Callable[[bytes], Any]:
    """A deserializer that never raises: grpc.aio answers a raising one with UNKNOWN and the exception's text."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception:  # protobuf's DecodeError and kin: the caller's bytes, not a bug here
            return _Malformed(name)

    return parse


def _add_completions(service: CompletionsService, server: grpc.aio.Server) -> None:
    """The generated registration, but with deserializers that never raise (``_lenient``): bad bytes are INVALID_ARGUMENT."""
    unary, streaming = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    methods = {
        "Chat": unary(service.Chat, _lenient(pb.ChatRequest), pb.CompletionResponse.SerializeToString),
        "ChatStream": streaming(service.ChatStream, _lenient(pb.ChatRequest), pb.CompletionChunk.SerializeToString),
        "Complete": unary(service.Complete, _lenient(pb.CompletionRequest), pb.CompletionResponse.SerializeToString),
        "CompleteStream": streaming(service.CompleteStream, _lenient(pb.CompletionRequest), pb.CompletionChunk.SerializeToString),
        "GetLimits": unary(service.GetLimits, _lenient(pb.GetLimitsRequest), pb.Limits.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, methods),))
    server.add_registered_method_handlers(SERVICE_NAME, methods)


async def _abort(context: grpc.aio.ServicerContext, error: TailguardError, request_id: str | None = None) -> NoReturn:
    if context.done():
        # The caller's own deadline passed or it cancelled: grpc has already
        # answered it; nothing more can be sent.
        raise asyncio.CancelledError()
    rendered = grpc_error(error)
    metadata = rendered.trailing_metadata
    if request_id:
        metadata = (*metadata, ("x-request-id", request_id))
    await context.abort(rendered.code, rendered.details, metadata)
    raise AssertionError("context.abort returned")  # pragma: no cover


async def _abort_bug(context: grpc.aio.ServicerContext, error: Exception, request_id: str | None) -> NoReturn:
    log.error("gRPC call %s failed unexpectedly: %s", request_id, type(error).__name__, exc_info=error)
    await _abort(context, InternalError(f"tailguard failed unexpectedly ({type(error).__name__})"), request_id)


def limits_message(config: Config) -> pb.Limits:
    """The limits in force, as protobuf: the record HTTP's /v1/limits serves as JSON."""
    limits = limits_of(config)
    estimate = limits.estimate
    return pb.Limits(
        input_cap_tokens=limits.input_cap_tokens,
        default_max_tokens=limits.default_max_tokens,
        output_cap_tokens=limits.output_cap_tokens,
        over_cap=limits.over_cap,
        estimate=pb.EstimateRule(
            chars_per_token=estimate.chars_per_token,
            cjk_chars_per_token=estimate.cjk_chars_per_token,
            per_message_tokens=estimate.per_message_tokens,
        ),
        end_to_end_timeout_s=limits.end_to_end_timeout,
        classes=[
            pb.ClassLimits(
                name=c.name,
                max_prompt_tokens=c.max_prompt_tokens,
                max_output_tokens=c.max_output_tokens,
                queue_timeout_s=c.queue_timeout,
                priority=c.priority,
                pool=c.pool,
            )
            for c in limits.classes
        ],
        pools=[pb.PoolLimits(name=p.name, max_model_len=p.max_model_len, models=list(p.models)) for p in limits.pools],
    )


# -- the server's lifecycle ----------------------------------------------------------


def enable_reflection(server: grpc.aio.Server, services: tuple[str, ...]) -> None:
    """Server reflection under both its names, ``grpc.reflection.v1`` and ``v1alpha``.

    grpcurl and Postman ask for v1 first; grpcio-reflection implements only
    v1alpha. The two protocols' messages are the same on the wire (field for
    field; only the package differs), so grpcio-reflection's servicer answers
    both: it is registered under each service name with v1alpha's codecs.
    v1's proto is vendored (``proto/grpc/reflection/v1``) so that its
    descriptor is in the pool and a client can describe every service listed.
    """
    servicer = reflection.aio.ReflectionServicer((*services, *REFLECTION_SERVICE_NAMES))
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": method}) for name in REFLECTION_SERVICE_NAMES]
    )


class GrpcTls:
    """The gRPC listener's certificate, key and client CA, replaceable while it serves.

    grpc's dynamic credentials ask :meth:`_fetch` for a new configuration at
    every handshake, from grpc's own threads: a reload's new files are
    offered once (under a lock) and serve every connection after it;
    connections already open keep theirs. Whether client certificates are
    required is fixed when the port opens (``server.grpc_tls`` on or off,
    with or without ``client_ca_file``, needs a restart).
    """

    def __init__(self, tls: TlsConfig) -> None:
        self.require_client_auth = tls.client_ca_file is not None
        self._initial = self.configuration(tls)
        self._lock = threading.Lock()
        self._offered: Any = None

    @staticmethod
    def configuration(tls: TlsConfig) -> Any:
        """grpc's certificate configuration from the files as they are now (raises ``TlsFileError``)."""
        pem = read_pem(tls)
        return grpc.ssl_server_certificate_configuration([(pem.private_key, pem.cert_chain)], root_certificates=pem.client_ca)

    def offer(self, configuration: Any) -> None:
        """New connections get ``configuration`` (one from :meth:`configuration`)."""
        with self._lock:
            self._offered = configuration

    def credentials(self) -> Any:
        return grpc.dynamic_ssl_server_credentials(self._initial, self._fetch, require_client_authentication=self.require_client_auth)

    def _fetch(self) -> Any:
        """grpc's question at a handshake: a new configuration, or None to keep the one it has."""
        with self._lock:
            offered, self._offered = self._offered, None
        return offered


class GrpcServer:
    """The grpc.aio server with tailguard's service, health and reflection (asyncio side)."""

    def __init__(
        self,
        router: Router,
        portal: TrioPortal,
        observers: Observers,
        *,
        max_calls: int = MAX_CONCURRENT_CALLS,
        reuse_port: bool = False,
        tls: GrpcTls | None = None,
    ) -> None:
        self._router = router
        self._portal = portal
        self._observers = observers
        self._max_calls = max_calls
        self._reuse_port = reuse_port
        self._tls = tls
        self._server: grpc.aio.Server | None = None
        self._service: CompletionsService | None = None
        self._health = HealthServicer()

    async def start(self, host: str, port: int) -> int:
        pending = pending_bound(self._max_calls)
        server = grpc.aio.server(
            options=[
                # Calls core holds that the process has not picked up yet: beyond
                # the bound core cancels them (CANCELLED, silently), so it is far
                # above what the asyncio side picks up and refuses in time.
                ("grpc.server.max_pending_requests", pending),
                ("grpc.server.max_pending_requests_hard_limit", pending),
                # Streams on one connection: the cap, and as many again refused at
                # once; a client queues the rest itself, where they cost nothing here.
                ("grpc.max_concurrent_streams", streams_bound(self._max_calls)),
                ("grpc.so_reuseport", int(self._reuse_port)),  # on only for --workers
            ]
        )
        service = self._service = CompletionsService(self._router, self._portal, self._observers, max_calls=self._max_calls)
        _add_completions(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        enable_reflection(server, (SERVICE_NAME, HEALTH_SERVICE_NAME))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound: int = server.add_insecure_port(address) if self._tls is None else server.add_secure_port(address, self._tls.credentials())
        if not bound:
            raise OSError(f"gRPC could not listen on {address}")
        await server.start()
        self._server = server
        return bound

    async def set_serving(self, serving: bool) -> None:
        """The health service's answer, for the whole server and for the completions service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)

    async def set_room(self, room: int) -> None:
        """What the pools can seat and queue now, for the completions service's gate."""
        if self._service is not None:
            self._service.set_room(room)

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones finish up to ``grace`` s, then cancel them."""
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)


async def serve_grpc(
    router: Router,
    host: AsyncioHost,
    listen: tuple[str, int],
    shutdown: trio.Event,
    observers: Observers | None = None,
    *,
    max_calls: int = MAX_CONCURRENT_CALLS,
    reuse_port: bool = False,
    tls: GrpcTls | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """From Trio: run the gRPC server until ``shutdown``; reports the bound port.

    ``max_calls`` bounds the completion calls open at once (see the module's
    docstring); with ``tls`` the port speaks TLS only.
    """
    async with trio.open_nursery() as calls:
        grpc_server = GrpcServer(
            router, TrioPortal(calls, host.loop), observers or Observers(Telemetry()), max_calls=max_calls, reuse_port=reuse_port, tls=tls
        )
        port = await host.run(lambda: grpc_server.start(*listen))
        shown = "" if tls is None else " (TLS, client certificates required)" if tls.require_client_auth else " (TLS)"
        log.info("gRPC listening on %s:%s%s", listen[0], port, shown)
        await calls.start(_push_state, router, host, grpc_server)
        task_status.started(port)
        await shutdown.wait()
        with trio.CancelScope(shield=True):
            await host.run(lambda: grpc_server.stop(GRACE_SECONDS))
        calls.cancel_scope.cancel()


async def _push_state(
    router: Router, host: AsyncioHost, grpc_server: GrpcServer, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Tell the asyncio side when readiness or the pools' room changes (and only then).

    Both are read on the Trio side, where the router lives, every
    ``HEALTH_CHECK_SECONDS``; the asyncio side hears of a change, not of
    every check.
    """
    serving = router.health()["status"] != "unavailable"
    await host.run(lambda: grpc_server.set_serving(serving))
    room = router.room()
    await host.run(lambda: grpc_server.set_room(room))
    task_status.started()
    while True:
        await trio.sleep(HEALTH_CHECK_SECONDS)
        now_serving = router.health()["status"] != "unavailable"
        if now_serving != serving:
            serving = now_serving
            await host.run(lambda: grpc_server.set_serving(now_serving))
        now_room = router.room()
        if now_room != room:
            room = now_room
            await host.run(lambda: grpc_server.set_room(now_room))
