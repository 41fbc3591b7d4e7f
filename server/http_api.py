"""The OpenAI-compatible HTTP front end, as an ASGI app for hypercorn's Trio worker.

Translation only: authenticate, read and cap the body, build a
RouterRequest, open it on the router, relay the backend's bytes, map errors.
Each request runs in its own cancel scope with the router's end-to-end
deadline; a watcher task cancels it when the client disconnects, which
closes the backend stream. Every completion request is finished exactly
once on its telemetry record (metrics, access log), whatever its path.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

from router.config import limits_document
from router.dispatch import Completion, Router
from router.errors import DeadlineExceeded, InvalidRequest, TailguardError
from router.request import RequestKind, Routing
from router.telemetry import RepeatedIds, RequestRecord, Telemetry, is_valid_request_id

from .errors_map import HttpError, http_error, invalid
from .logs import AccessLog
from .metrics import CONTENT_TYPE, Metrics
from .openai_wire import parse_completion_body
from .timing import server_timing

log = logging.getLogger("tailguard.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_COMPLETION_PATHS: dict[str, RequestKind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
_JSON = (b"content-type", b"application/json")


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class HttpApi:
    """ASGI application: ``await hypercorn.trio.serve(HttpApi(router, ...), config)``.

    With API keys configured, every ``/v1/`` route needs ``Authorization:
    Bearer <key>``; ``/health`` and ``/metrics`` stay open for load balancers
    and Prometheus.
    """

    def __init__(
        self,
        router: Router,
        *,
        max_body_bytes: int,
        telemetry: Telemetry | None = None,
        metrics: Metrics | None = None,
        repeated_ids: RepeatedIds | None = None,
        access_log: AccessLog | None = None,
    ) -> None:
        self._router = router
        self._max_body_bytes = max_body_bytes
        self._telemetry = telemetry or Telemetry()
        self._metrics = metrics
        self._repeated_ids = repeated_ids
        self._access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        supplied_id = headers.get("x-request-id")
        request_id = supplied_id or uuid.uuid4().hex
        if supplied_id is not None and not is_valid_request_id(supplied_id):
            request_id = uuid.uuid4().hex
            message = "x-request-id must be 1 to 128 printable ASCII characters without spaces"
            await _send_error(send, invalid(message, param="x-request-id"), request_id)
            return
        if supplied_id is not None and self._repeated_ids is not None and self._repeated_ids.observe(supplied_id):
            if self._metrics is not None:
                self._metrics.repeated_request_id()
        kind = _COMPLETION_PATHS.get(path)
        if kind is not None:
            if method != "POST":
                await _send_error(send, invalid(f"use POST for {path}", status=405), request_id)
                return
            await self._completion(kind, headers, request_id, receive, send)
            return
        if method != "GET":
            await _send_error(send, invalid(f"use GET for {path}", status=405), request_id)
            return
        if path == "/health":
            health = self._router.health()
            await _send_json(send, 200 if health["status"] == "ready" else 503, health, request_id)
            return
        if path == "/metrics" and self._metrics is not None:
            body = self._metrics.render()
            headers_out = [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers_out})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            self._router.authenticate(headers.get("authorization"))
        except TailguardError as error:
            await _send_error(send, http_error(error), request_id)
            return
        if path == "/v1/models":
            data = [{"id": m, "object": "model", "owned_by": "tailguard"} for m in self._router.models()]
            await _send_json(send, 200, {"object": "list", "data": data}, request_id)
        elif path == "/v1/limits":
            await _send_json(send, 200, limits_document(self._router.config), request_id)
        else:
            await _send_error(send, invalid(f"no route for {path}", status=404), request_id)

    # -- completions --------------------------------------------------------

    async def _completion(self, kind: RequestKind, headers: dict[str, str], request_id: str, receive: Receive, send: Send) -> None:
        record = self._telemetry.start(request_id, "http")
        record.kind = kind
        exchange = _Exchange(send, request_id, record)
        error: TailguardError | None = None
        try:
            error = await self._run_completion(kind, headers, record, exchange, receive)
        finally:
            gone = not exchange.finished
            self._telemetry.finish(record, error, status=exchange.status if not gone else 499, client_gone=gone)

    async def _run_completion(
        self, kind: RequestKind, headers: dict[str, str], record: RequestRecord, exchange: _Exchange, receive: Receive
    ) -> TailguardError | None:
        """Serve one completion; returns the error the caller was answered with, if any."""
        try:
            caller = self._router.authenticate(headers.get("authorization"))
            record.caller = caller.name
        except TailguardError as error:
            await exchange.fail(http_error(error))
            return error
        try:
            body = await self._read_body(headers, receive)
        except _BodyTooLarge:
            message = f"the request body is over {self._max_body_bytes} bytes"
            await exchange.fail(invalid(message, status=413, code="body_too_large"))
            return InvalidRequest(message)
        except _ClientGone:
            exchange.client_gone = True
            return None
        try:
            request = parse_completion_body(
                kind, body, request_id=record.request_id, forced_class=headers.get("x-tailguard-class"), caller=caller.name
            )
        except TailguardError as error:
            await exchange.fail(http_error(error))
            return error
        record.stream = request.stream
        if self._access_log is not None and self._access_log.log_prompts:
            record.prompt_text = "\n".join(request.texts())
        failure: TailguardError | None = None
        async with trio.open_nursery() as nursery:
            with trio.CancelScope(deadline=self._router.deadline_for(request, record.arrival)) as scope:
                nursery.start_soon(_watch_disconnect, receive, scope, exchange)
                try:
                    async with self._router.open(request, arrival=record.arrival, caller=caller, record=record) as completion:
                        await exchange.relay(completion)
                except TailguardError as error:
                    failure = error
                    await exchange.fail(http_error(error))
            if scope.cancelled_caught and not exchange.client_gone:
                failure = DeadlineExceeded("the request did not finish within its end-to-end deadline")
                await exchange.fail(http_error(failure))
            nursery.cancel_scope.cancel()
        return failure

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The whole body, refusing (before buffering) anything over the cap."""
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body_bytes:
            raise _BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _Exchange:
    """One response in progress: remembers its status and whether headers went out."""

    def __init__(self, send: Send, request_id: str, record: RequestRecord) -> None:
        self._send = send
        self._request_id = request_id
        self._record = record
        self.status: int = 0
        self.started = False
        self.finished = False
        self.client_gone = False

    async def relay(self, completion: Completion) -> None:
        """Send the backend's answer. A stream's headers wait for its first chunk,
        so ``server-timing`` can carry the time to first token."""
        headers = [(b"content-type", completion.content_type.encode("latin-1")), *_routing_headers(completion.routing, self._request_id)]
        if not completion.stream:
            body = await completion.read()
            # A length lets h11 frame the body without chunking (one write fewer).
            headers.append((b"content-length", str(len(body)).encode()))
            headers.append((b"server-timing", server_timing(self._record, total=True).encode()))
            await self._start(200, headers)
            await self._body(body, more=False)
            return
        headers.append((b"cache-control", b"no-cache"))
        headers.append((b"x-accel-buffering", b"no"))  # nginx: relay each event as it comes
        async for chunk in completion.chunks():
            if not self.started:
                headers.append((b"server-timing", server_timing(self._record, total=False).encode()))
                await self._start(200, headers)
            await self._body(chunk, more=True)
        if not self.started:
            await self._start(200, headers)
        await self._body(b"", more=False)

    async def fail(self, error: HttpError) -> None:
        """Send the error as a response, or as the stream's last event if it began."""
        if self.finished or self.client_gone:
            return
        if self.started:
            await self._body(error.sse_event(), more=False)
            return
        await self._start(error.status, [*error.headers(), (b"x-request-id", self._request_id.encode("latin-1"))])
        await self._body(error.encoded(), more=False)

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, data: bytes, *, more: bool) -> None:
        if not more:
            self.finished = True
            # The caller's end-to-end time ends with its last byte, not when
            # the request's tasks have wound down.
            self._record.finished_at = trio.current_time()
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


def _routing_headers(routing: Routing, request_id: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-request-id", request_id.encode("latin-1")),
        (b"x-tailguard-class", routing.request_class.encode()),
        (b"x-tailguard-pool", routing.pool.encode()),
        (b"x-tailguard-max-tokens", str(routing.max_tokens).encode()),
        (b"x-tailguard-queue-ms", f"{routing.queue_seconds * 1000:.1f}".encode()),
    ]


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope, exchange: _Exchange) -> None:
    """Cancel the request's scope when the client goes away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not exchange.finished:  # hypercorn also says so once a response is complete
                exchange.client_gone = True
                scope.cancel()
            return


async def _send_json(send: Send, status: int, payload: object, request_id: str) -> None:
    body = json.dumps(payload).encode()
    headers = [_JSON, (b"content-length", str(len(body)).encode()), (b"x-request-id", request_id.encode("latin-1"))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, error: HttpError, request_id: str) -> None:
    await send({"type": "http.response.start", "status": error.status, "headers": [*error.headers(), (b"x-request-id", request_id.encode("latin-1"))]})
    await send({"type": "http.response.body", "body": error.encoded()})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
