"""The ``tailguard.v1.Completions`` handlers: the gate on open calls on the asyncio side, sessions on the Trio side.

See :mod:`server.grpc.api` for why calls are refused where they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from tailguard.router import Router, Session, Sessions, checked_header
from tailguard.router.admission import RequestKind, RouterRequest
from tailguard.router.config import ServerConfig
from tailguard.router.errors import BadBackendReply, Draining, InternalError, InvalidRequest, Overloaded, ServerBusy, TailguardError
from tailguard.router.ids import IdSource
from tailguard.router.observe import RepeatedIds, Telemetry, is_valid_request_id
from tailguard.router.quotas import ANONYMOUS, WINDOW_SECONDS, AdaptiveShed, Caller

if TYPE_CHECKING:  # imported only while [tracing] is on
    from tailguard.router.observe.tracing import Tracing

from ..errors_map import grpc_error
from ..malloc import trimmer
from ..timing import server_timing
from .bridge import TrioPortal
from .gate import Backlog, CallGate, GateStatistics, follow_grpc
from .gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from .sse import DONE, SseDecoder
from .translate import (
    chunk_message,
    embed_fields,
    embed_message,
    limits_message,
    parse_json,
    request_fields,
    response_message,
    routing_message,
)

log = logging.getLogger("tailguard.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Completions"].full_name
# Completion calls open at once by default; beyond it RESOURCE_EXHAUSTED (config: server.grpc_max_calls).
MAX_CONCURRENT_CALLS = ServerConfig.grpc_max_calls
_SHUTTING_DOWN = Draining("tailguard is shutting down; retry on another instance", retry_after=1.0)


# Calls let past the gate beyond twice the pools' room: so pools with no room yet (no endpoints) still get the router's verdict.
_ROOM_SLACK = 64


def gate_ceiling(max_calls: int, room: int | None) -> int:
    """The most completion calls the gate lets open at once (the ceiling of ``server.grpc.gate``'s limit).

    ``room`` is what the pools can seat and queue (``Router.room``). Past it a
    call can only be refused or displace a less urgent waiter: twice that
    leaves room for the displacing ones and for calls that have let go of
    their seats and are still sending their last bytes.
    """
    return max_calls if room is None else min(max_calls, 2 * room + _ROOM_SLACK)



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
    caller: tuple[str, str] = ("", "")  # whose calls the shed counts it among: ("key", name) or ("peer", connection)
    session: str | None = None  # the session header's value ([server] session_header), a placement hint
    rate_limits: tuple[tuple[str, str], ...] = ()  # set by the Trio side: a budgeted key's x-ratelimit-* (errors carry them too)

    @property
    def route(self) -> str:
        """The call's full method name, as its span is named."""
        if self.kind == "embeddings":
            return "tailguard.v1.Completions/Embed"
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

    async def unary(self, call: _Call) -> tuple[Any, tuple[tuple[str, str], ...], str]:
        """A whole answer (pb.CompletionResponse, or pb.EmbedResponse for Embed), its routing metadata and server-timing."""
        session = self._sessions.start(call.supplied_id, carrier=call.trace_context, route=call.route)
        call.request_id = session.request_id
        async with session:
            request, caller = self._admit(call, session)
            async with self._limits_told(call, session), session.completion(request, caller) as completion:
                await completion.read()  # checked and parsed once, by the core
                response: Any
                if request.kind == "embeddings":
                    response = embed_message(completion.payload, completion.routing)
                else:
                    response = response_message(request.kind, completion.payload, completion.routing)
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
            async with self._limits_told(call, session), session.completion(request, caller) as completion:
                await emit(_Head(routing_message(completion.routing), session.routing_facts(completion.routing)))
                decoder = SseDecoder()
                ended = False  # [DONE] or a finish reason seen: the answer is complete
                async for raw in completion.chunks(check=False):  # the decoder below parses every event: once is enough
                    chunks = []
                    for data in decoder.feed(raw):
                        if data == DONE:
                            ended = True
                            continue
                        chunk = chunk_message(kind, parse_json(data))
                        if chunk.finish_reason:
                            ended = True
                        chunks.append(chunk)
                    if chunks:
                        await emit(chunks)
                if not ended:
                    raise BadBackendReply("the backend's stream ended without [DONE] or a finish reason")
            await emit(_Timing(checked_header("server-timing", server_timing(session.record, total=True))))

    @staticmethod
    @asynccontextmanager
    async def _limits_told(call: _Call, session: Session) -> AsyncIterator[None]:
        """However the call ends, the asyncio side learns the key's x-ratelimit-* for its answer."""
        try:
            yield
        finally:
            call.rate_limits = session.record.rate_limits

    @staticmethod
    def _admit(call: _Call, session: Session) -> tuple[RouterRequest, Caller]:
        """The caller and the translated request with its deadline, or the error that stops them."""
        caller = session.authenticate(call.authorization)
        if call.kind == "embeddings":
            fields = embed_fields(call.message, session.request_id)
            deadline = None if call.remaining is None else session.record.arrival + call.remaining
            return RouterRequest(kind="embeddings", deadline=deadline, session=call.session, **fields), caller
        # Built once, complete: a RouterRequest checks itself on every construction.
        common = request_fields(call.message.options, session.request_id)
        if call.stream:
            common["params"]["stream_options"] = {"include_usage": True}
        common["stream"] = call.stream
        common["deadline"] = None if call.remaining is None else session.record.arrival + call.remaining
        common["session"] = call.session
        message = call.message
        if call.kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in message.messages]
            return RouterRequest(kind="chat", model=message.model or None, messages=messages, **common), caller
        return RouterRequest(kind="completion", model=message.model or None, prompt=message.prompt, **common), caller



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
        self._inside = 0  # completion calls inside a handler: open, or being refused
        self._picked = 0  # completion calls picked up so far
        self._room: int | None = None  # what the pools can seat and queue (Router.room), as the Trio side last said
        self._gate = CallGate(max_calls)
        self._release_memory = trimmer()  # after a burst of calls (server/malloc.py)
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
            self._close()

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        call = await self._admit("embeddings", request, context, stream=False)
        try:
            response: pb.EmbedResponse = await self._unary(call, context)
            return response
        finally:
            self._close()

    async def Complete(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:
        call = await self._admit("completion", request, context, stream=False)
        try:
            return await self._unary(call, context)
        finally:
            self._close()

    # grpc.aio recognises streaming handlers by being async generator functions.
    async def ChatStream(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:
        call = await self._admit("chat", request, context, stream=True)
        try:
            async for chunk in self._stream(call, context):
                yield chunk
        finally:
            self._close()

    async def CompleteStream(
        self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CompletionChunk]:
        call = await self._admit("completion", request, context, stream=True)
        try:
            async for chunk in self._stream(call, context):
                yield chunk
        finally:
            self._close()

    async def _admit(self, kind: RequestKind, message: Any, context: grpc.aio.ServicerContext, *, stream: bool) -> _Call:
        """The call, counted as open; or refused at once (RESOURCE_EXHAUSTED server_busy) over the gate or by the shed.

        A request that did not decode is INVALID_ARGUMENT here (grpc's own answer
        would be UNKNOWN, with Python's exception text).
        """
        self._picked += 1
        self._inside += 1
        try:
            return await self._open_call(kind, message, context, stream=stream)
        except BaseException:
            self._inside -= 1
            raise

    async def _open_call(self, kind: RequestKind, message: Any, context: grpc.aio.ServicerContext, *, stream: bool) -> _Call:
        if isinstance(message, _Malformed):
            await _abort(context, InvalidRequest(f"the request is not a valid {message.type_name} message", param="request"))
        call = _call(kind, message, context, stream=stream, session_header=self._router.config.server.session_header)
        call.caller = self._shed_key(call.authorization, context)
        retry_after = self._router.config.timeouts.retry_after  # a frozen config, swapped whole: safe to read here
        if not self._gate.admit(self._open):
            busy = ServerBusy(f"tailguard has {self._open} grpc calls open, {self._why_full()}; retry after {retry_after:g} s", retry_after=retry_after)
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

    def _close(self) -> None:
        """An admitted call has ended."""
        self._open -= 1
        self._inside -= 1

    def _why_full(self) -> str:
        """Why the gate is where it is, for a refusal's message."""
        gate = self._gate.statistics()
        if gate.limit < gate.ceiling:
            return f"all its gate lets open now (at most {gate.ceiling}; it grows while no call waits inside grpc to be picked up)"
        if gate.ceiling == self._max_calls:
            return "its cap"
        return f"more than its pools can seat and queue ({self._room})"

    def _shed_key(self, authorization: str | None, context: grpc.aio.ServicerContext) -> tuple[str, str]:
        """Whose calls the shed counts this one among: the key's name once it authenticates, else the connection.

        Never the raw ``Authorization`` value: a caller can send a new one with
        every call (and without keys configured it means nothing), so each call
        would be a caller of its own that the shed never sees flood.
        """
        try:
            caller = self._router.authenticate(authorization)  # a hash and a lookup; ANONYMOUS while keys are off
        except TailguardError:  # refused as unauthenticated inside: counted with its connection's calls
            return ("peer", context.peer())
        return ("peer", context.peer()) if caller is ANONYMOUS else ("key", caller.name)

    def _refused_inside(self, call: _Call, error: TailguardError) -> None:
        """The shed hears of the call's refusal for overload (queue full, a cap, no room): its caller's next calls may be shed."""
        if isinstance(error, Overloaded):
            self._shed.refused(call.caller, time.monotonic())

    def set_room(self, room: int) -> None:
        """On the asyncio side: the pools' room changed (a reload, discovery, rebalancing); the gate's ceiling follows."""
        self._room = room
        self._gate.set_ceiling(gate_ceiling(self._max_calls, room))

    async def follow(self, backlog: Backlog) -> NoReturn:
        """On the asyncio side, until cancelled: the gate follows what waits in grpc (``server.grpc.gate``)."""
        await follow_grpc(self._gate, backlog, lambda: self._open, lambda: self._inside, lambda: self._picked, self._release_memory)

    def gate_statistics(self) -> GateStatistics:
        return self._gate.statistics()

    async def GetLimits(self, request: pb.GetLimitsRequest, context: grpc.aio.ServicerContext) -> pb.Limits:
        """The limits in force; with API keys configured it needs one, as HTTP's /v1/limits does."""
        if isinstance(request, _Malformed):
            await _abort(context, InvalidRequest(f"the request is not a valid {request.type_name} message", param="request"))
        try:
            self._router.authenticate(_metadata(context).get("authorization"))
        except TailguardError as error:
            await _abort(context, error)
        return limits_message(self._router.config)

    async def _unary(self, call: _Call, context: grpc.aio.ServicerContext) -> Any:
        try:
            response, metadata, timing = await self._portal.call(self._trio.unary, call)
        except TailguardError as error:
            self._refused_inside(call, error)
            await _abort(context, error, call.request_id, call.rate_limits)
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
            await _abort(context, error, call.request_id, call.rate_limits)
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


def _call(kind: RequestKind, message: Any, context: grpc.aio.ServicerContext, *, stream: bool, session_header: str) -> _Call:
    """What the Trio side needs of one call (asyncio side: metadata and deadline are read here)."""
    metadata = _metadata(context)
    given = message.request_id if kind == "embeddings" else message.options.request_id  # an EmbedRequest has no options
    supplied = given or metadata.get("x-request-id") or ""
    trace_context = {key: metadata[key] for key in _TRACE_CONTEXT if key in metadata} or None
    session = metadata.get(session_header) if session_header else None
    return _Call(
        kind, message, supplied, metadata.get("authorization"), context.time_remaining(), stream,
        trace_context=trace_context, session=session or None,
    )



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


def add_completions(service: CompletionsService, server: grpc.aio.Server) -> None:
    """The generated registration, but with deserializers that never raise (``_lenient``): bad bytes are INVALID_ARGUMENT."""
    unary, streaming = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    methods = {
        "Chat": unary(service.Chat, _lenient(pb.ChatRequest), pb.CompletionResponse.SerializeToString),
        "ChatStream": streaming(service.ChatStream, _lenient(pb.ChatRequest), pb.CompletionChunk.SerializeToString),
        "Complete": unary(service.Complete, _lenient(pb.CompletionRequest), pb.CompletionResponse.SerializeToString),
        "CompleteStream": streaming(service.CompleteStream, _lenient(pb.CompletionRequest), pb.CompletionChunk.SerializeToString),
        "GetLimits": unary(service.GetLimits, _lenient(pb.GetLimitsRequest), pb.Limits.SerializeToString),
        "Embed": unary(service.Embed, _lenient(pb.EmbedRequest), pb.EmbedResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, methods),))
    server.add_registered_method_handlers(SERVICE_NAME, methods)


async def _abort(
    context: grpc.aio.ServicerContext, error: TailguardError, request_id: str | None = None, extra: tuple[tuple[str, str], ...] = ()
) -> NoReturn:
    if context.done():
        # The caller's own deadline passed or it cancelled: grpc has already
        # answered it; nothing more can be sent.
        raise asyncio.CancelledError()
    rendered = grpc_error(error)
    metadata = rendered.trailing_metadata
    if request_id:
        metadata = (*metadata, ("x-request-id", request_id))
    await context.abort(rendered.code, rendered.details, (*metadata, *extra))
    raise AssertionError("context.abort returned")  # pragma: no cover


async def _abort_bug(context: grpc.aio.ServicerContext, error: Exception, request_id: str | None) -> NoReturn:
    log.error("gRPC call %s failed unexpectedly: %s", request_id, type(error).__name__, exc_info=error)
    await _abort(context, InternalError(f"tailguard failed unexpectedly ({type(error).__name__})"), request_id)

