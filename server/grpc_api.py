"""The gRPC front end: ``tailguard.v1.Completions`` on grpc.aio, the core in Trio.

Handlers run in asyncio and only translate: protobuf -> RouterRequest, then
the Trio side (through ``grpc_bridge.TrioPortal``) runs the request on the
router and turns the backend's OpenAI JSON/SSE into protobuf. Router errors
become status codes with retry hints in trailing metadata; a caller's
deadline or cancellation cancels the Trio scope, which aborts the backend
generation and releases the seat.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, NoReturn

import grpc
import trio
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from router.auth import Caller
from router.config_types import Config
from router.dispatch import Router
from router.errors import DeadlineExceeded, Draining, InvalidRequest, TailguardError
from router.request import RequestKind, Routing, RouterRequest
from router.telemetry import RepeatedIds, RequestRecord, Telemetry, is_valid_request_id

from .errors_map import grpc_error
from .grpc_bridge import AsyncioHost, TrioPortal
from .grpc_gen.tailguard.v1 import tailguard_pb2 as pb
from .grpc_gen.tailguard.v1 import tailguard_pb2_grpc as pb_grpc
from .sse import DONE, SseDecoder
from .timing import server_timing

log = logging.getLogger("tailguard.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Completions"].full_name
GRACE_SECONDS = 5.0
_SHUTTING_DOWN = Draining("tailguard is shutting down; retry on another instance", retry_after=1.0)


# -- the Trio side: the router, and OpenAI JSON -> protobuf ---------------------


@dataclasses.dataclass(frozen=True)
class _Call:
    """What the asyncio side hands the Trio side for one call."""

    request: RouterRequest | TailguardError  # the translated request, or why it could not be
    request_id: str
    supplied_id: bool  # the caller sent the id (so a repeat means a retry)
    authorization: str | None
    remaining: float | None  # the caller's deadline, in seconds from now


class _Timing(str):
    """The stream's last item: its ``server-timing`` value for the trailing metadata."""


class _TrioSide:
    """Runs requests on the router; everything here executes in Trio.

    Each call is finished exactly once on its telemetry record; a call
    cancelled from outside (the caller went away, or its deadline) counts as
    cancelled.
    """

    def __init__(self, router: Router, telemetry: Telemetry, repeated_ids: RepeatedIds | None, on_repeat: Callable[[], None]) -> None:
        self._router = router
        self._telemetry = telemetry
        self._repeated_ids = repeated_ids
        self._on_repeat = on_repeat

    async def unary(self, call: _Call) -> tuple[pb.CompletionResponse, str]:
        record = self._start(call)
        async with self._finishing(record) as outcome:
            request, caller = self._admit(call, record)
            with trio.CancelScope(deadline=self._router.deadline_for(request, record.arrival)):
                async with self._router.open(request, arrival=record.arrival, caller=caller, record=record) as completion:
                    body = json.loads(await completion.read())
                    response = _response(request.kind, body, completion.routing)
                outcome.ok = True
                return response, server_timing(record, total=True)
            raise DeadlineExceeded("the request did not finish within its deadline")
        raise AssertionError("unreachable")  # pragma: no cover

    async def stream(self, emit: Callable[[Any], Awaitable[None]], call: _Call) -> None:
        """Emit the Routing, then a list of chunks per backend read (one hand-off each), then the timing."""
        record = self._start(call)
        async with self._finishing(record) as outcome:
            request, caller = self._admit(call, record)
            with trio.CancelScope(deadline=self._router.deadline_for(request, record.arrival)):
                async with self._router.open(request, arrival=record.arrival, caller=caller, record=record) as completion:
                    await emit(_routing(completion.routing))
                    decoder = SseDecoder()
                    async for raw in completion.chunks():
                        chunks = [_chunk(request.kind, json.loads(data)) for data in decoder.feed(raw) if data != DONE]
                        if chunks:
                            await emit(chunks)
                outcome.ok = True
                await emit(_Timing(server_timing(record, total=True)))
                return
            raise DeadlineExceeded("the request did not finish within its deadline")

    def _start(self, call: _Call) -> RequestRecord:
        record = self._telemetry.start(call.request_id, "grpc")
        if not isinstance(call.request, TailguardError):
            record.kind, record.stream = call.request.kind, call.request.stream
        if call.supplied_id and self._repeated_ids is not None and self._repeated_ids.observe(call.request_id):
            self._on_repeat()
        return record

    def _admit(self, call: _Call, record: RequestRecord) -> tuple[RouterRequest, Caller]:
        """The caller and the request with its deadline, or the error that stops them."""
        caller = self._router.authenticate(call.authorization)
        record.caller = caller.name
        if isinstance(call.request, TailguardError):
            raise call.request
        request = call.request
        if call.remaining is not None:
            request = dataclasses.replace(request, deadline=record.arrival + call.remaining)
        return request, caller

    @asynccontextmanager
    async def _finishing(self, record: RequestRecord) -> AsyncIterator[_Finished]:
        outcome = _Finished()
        try:
            yield outcome
        except TailguardError as error:
            self._telemetry.finish(record, error, status=grpc_error(error).code.name)
            raise
        finally:
            if outcome.ok:
                self._telemetry.finish(record, None, status=grpc.StatusCode.OK.name)
            else:  # ignored when the error branch already finished it
                self._telemetry.finish(record, None, status=grpc.StatusCode.CANCELLED.name, client_gone=True)


class _Finished:
    """Set ``ok`` once the call's answer is complete."""

    ok = False


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


def _usage(payload: dict[str, Any] | None) -> pb.Usage | None:
    if not payload:
        return None
    return pb.Usage(
        prompt_tokens=int(payload.get("prompt_tokens") or 0),
        completion_tokens=int(payload.get("completion_tokens") or 0),
        total_tokens=int(payload.get("total_tokens") or 0),
    )


def _response(kind: RequestKind, body: dict[str, Any], routing: Routing) -> pb.CompletionResponse:
    choice = (body.get("choices") or [{}])[0]
    content = (choice.get("message") or {}).get("content") if kind == "chat" else choice.get("text")
    return pb.CompletionResponse(
        id=str(body.get("id", "")),
        model=str(body.get("model", "")),
        content=content or "",
        finish_reason=choice.get("finish_reason") or "",
        usage=_usage(body.get("usage")),
        routing=_routing(routing),
    )


def _chunk(kind: RequestKind, event: dict[str, Any]) -> pb.CompletionChunk:
    if "error" in event:  # a backend that reports a failure inside its stream
        error = event["error"]
        raise InvalidRequest(str(error.get("message", error)) if isinstance(error, dict) else str(error))
    chunk = pb.CompletionChunk()
    choices = event.get("choices") or []
    if choices:
        choice = choices[0]
        text = (choice.get("delta") or {}).get("content") if kind == "chat" else choice.get("text")
        chunk.content = text or ""
        chunk.finish_reason = choice.get("finish_reason") or ""
    usage = _usage(event.get("usage"))
    if usage is not None:
        chunk.usage.CopyFrom(usage)
    return chunk


# -- the asyncio side: grpc.aio handlers ------------------------------------------


class CompletionsService(pb_grpc.CompletionsServicer):  # type: ignore[misc]  # generated, untyped
    """``tailguard.v1.Completions``: translation only; the work runs in Trio."""

    def __init__(self, router: Router, portal: TrioPortal, observers: Observers) -> None:
        self._router = router
        self._portal = portal
        self._trio = _TrioSide(router, observers.telemetry, observers.repeated_ids, observers.on_repeat)

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:  # noqa: N802
        return await self._unary(_call(_chat_request, request, context), context)

    async def Complete(self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:  # noqa: N802
        return await self._unary(_call(_completion_request, request, context), context)

    # grpc.aio recognises streaming handlers by being async generator functions.
    async def ChatStream(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:  # noqa: N802
        async for chunk in self._stream(_call(_chat_request, request, context), context):
            yield chunk

    async def CompleteStream(  # noqa: N802
        self, request: pb.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CompletionChunk]:
        async for chunk in self._stream(_call(_completion_request, request, context), context):
            yield chunk

    async def GetLimits(self, request: pb.GetLimitsRequest, context: grpc.aio.ServicerContext) -> pb.Limits:  # noqa: N802
        return limits_message(self._router.config)

    async def _unary(self, call: _Call, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:
        try:
            response, timing = await self._portal.call(self._trio.unary, call)
        except TailguardError as error:
            await _abort(context, error, call.request_id)
        except ConnectionAbortedError:
            await _abort(context, _SHUTTING_DOWN, call.request_id)
        await context.send_initial_metadata(_routing_metadata(response.routing))
        context.set_trailing_metadata((("server-timing", timing),))
        return response

    async def _stream(self, call: _Call, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:
        if not isinstance(call.request, TailguardError):
            params = dict(call.request.params)
            params["stream_options"] = {"include_usage": True}
            call = dataclasses.replace(call, request=dataclasses.replace(call.request, params=params, stream=True))
        routing: pb.Routing | None = None
        try:
            async for item in self._portal.stream(self._trio.stream, call):
                if isinstance(item, pb.Routing):
                    routing = item
                    await context.send_initial_metadata(_routing_metadata(item))
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
            await _abort(context, error, call.request_id)
        except ConnectionAbortedError:
            await _abort(context, _SHUTTING_DOWN, call.request_id)


@dataclasses.dataclass(frozen=True)
class Observers:
    """Where the gRPC front end reports finished calls and repeated request ids."""

    telemetry: Telemetry
    repeated_ids: RepeatedIds | None = None
    on_repeat: Callable[[], None] = lambda: None


_Build = Callable[[Any, str, grpc.aio.ServicerContext], "RouterRequest | TailguardError"]


def _call(build: _Build, message: Any, context: grpc.aio.ServicerContext) -> _Call:
    """Translate one call's message and metadata (asyncio side)."""
    metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
    supplied = message.options.request_id or metadata.get("x-request-id") or ""
    request_id = supplied or uuid.uuid4().hex
    request: RouterRequest | TailguardError
    if supplied and not is_valid_request_id(supplied):
        request_id = uuid.uuid4().hex
        request = InvalidRequest("the request id must be 1 to 128 printable ASCII characters without spaces", param="request_id")
    else:
        request = build(message, request_id, context)
    return _Call(request, request_id, bool(supplied), metadata.get("authorization"), context.time_remaining())


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


def _chat_request(request: pb.ChatRequest, request_id: str, context: grpc.aio.ServicerContext) -> RouterRequest | TailguardError:
    try:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        return RouterRequest(kind="chat", model=request.model or None, messages=messages, **_common(request.options, request_id))
    except TailguardError as error:
        return error


def _completion_request(
    request: pb.CompletionRequest, request_id: str, context: grpc.aio.ServicerContext
) -> RouterRequest | TailguardError:
    try:
        return RouterRequest(kind="completion", model=request.model or None, prompt=request.prompt, **_common(request.options, request_id))
    except TailguardError as error:
        return error


def _routing_metadata(routing: pb.Routing) -> tuple[tuple[str, str], ...]:
    return (
        ("x-request-id", routing.request_id),
        ("x-tailguard-class", routing.request_class),
        ("x-tailguard-pool", routing.pool),
        ("x-tailguard-max-tokens", str(routing.max_tokens)),
        ("x-tailguard-queue-ms", f"{routing.queue_ms:.1f}"),
    )


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


def limits_message(config: Config) -> pb.Limits:
    """The limits in force, as protobuf (HTTP's /v1/limits, same facts)."""
    limits = config.limits
    return pb.Limits(
        input_cap_tokens=limits.input_cap_tokens,
        default_max_tokens=limits.default_max_tokens,
        output_cap_tokens=limits.output_cap_tokens,
        over_cap=limits.over_cap,
        estimate=pb.EstimateRule(
            chars_per_token=config.estimate.chars_per_token,
            cjk_chars_per_token=config.estimate.cjk_chars_per_token,
            per_message_tokens=config.estimate.per_message_tokens,
        ),
        end_to_end_timeout_s=config.timeouts.end_to_end_timeout,
        classes=[
            pb.ClassLimits(
                name=c.name,
                max_prompt_tokens=c.max_prompt_tokens,
                max_output_tokens=c.max_output_tokens,
                queue_timeout_s=c.queue_timeout,
                priority=c.priority,
                pool=c.pool,
            )
            for c in config.classes
        ],
        pools=[pb.PoolLimits(name=p.name, max_model_len=p.max_model_len, models=list(p.models)) for p in config.pools],
    )


# -- the server's lifecycle ----------------------------------------------------------


class GrpcServer:
    """The grpc.aio server with tailguard's service, health and reflection (asyncio side)."""

    def __init__(self, router: Router, portal: TrioPortal, observers: Observers) -> None:
        self._router = router
        self._portal = portal
        self._observers = observers
        self._server: grpc.aio.Server | None = None
        self._health = HealthServicer()
        self._health_task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        server = grpc.aio.server(
            options=[
                # grpc core silently CANCELs calls beyond this many pending (default 1000).
                ("grpc.server.max_pending_requests", 100_000),
                ("grpc.max_concurrent_streams", 100_000),
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_CompletionsServicer_to_server(CompletionsService(self._router, self._portal, self._observers), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound: int = server.add_insecure_port(address)
        if not bound:
            raise OSError(f"gRPC could not listen on {address}")
        await server.start()
        self._server = server
        await self._update_health()
        self._health_task = asyncio.get_running_loop().create_task(self._watch_health())
        return bound

    async def _update_health(self) -> None:
        ready = self._router.health()["status"] == "ready"
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            await self._update_health()

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones finish up to ``grace`` s, then cancel them."""
        if self._health_task is not None:
            self._health_task.cancel()
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
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """From Trio: run the gRPC server until ``shutdown``; reports the bound port."""
    async with trio.open_nursery() as calls:
        grpc_server = GrpcServer(router, TrioPortal(calls, host.loop), observers or Observers(Telemetry()))
        port = await host.run(lambda: grpc_server.start(*listen))
        log.info("gRPC listening on %s:%s", listen[0], port)
        task_status.started(port)
        await shutdown.wait()
        with trio.CancelScope(shield=True):
            await host.run(lambda: grpc_server.stop(GRACE_SECONDS))
        calls.cancel_scope.cancel()
