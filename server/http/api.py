"""The OpenAI-compatible HTTP front end, as an ASGI app (served by ``server/http/server.py``).

Translation only: read and cap the body, parse it into a RouterRequest,
relay the backend's bytes, render errors. Everything else a completion goes
through -- request id, key, deadline, telemetry finished exactly once --
is its ``router.session``. A watch (``server/http/caller_watch.py``) tells the
session when the client disconnects, which cancels the request and closes
the backend stream; ``run`` must be running beside the server for it.

A stream that ends badly ends with a last ``data: {"error": ...}`` event --
except after the backend's own error event, which the caller already has.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal

import trio

from tailguard.router import ClientLeft, Completion, Router, Session, Sessions, checked_header
from tailguard.router.admission import RequestKind
from tailguard.router.config import limits_document
from tailguard.router.dispatch import UtilityAnswer
from tailguard.router.errors import BackendStreamError, BodyTooLarge, InternalError, InvalidRequest, ModelNotFound, TailguardError
from tailguard.router.observe import RepeatedIds, Telemetry, attainment_document
from tailguard.router.quotas import check_token, one_authorization

if TYPE_CHECKING:  # imported only while [tracing] is on
    from tailguard.router.observe.tracing import Tracing

from ..errors_map import Dialect, HttpError, http_error, no_route, wrong_method
from ..logs import AccessLog
from ..metrics import CONTENT_TYPE, Metrics
from ..timing import server_timing
from .caller_watch import CallerWatch, Watch
from .openai_wire import parse_completion_body
from .settings import Receive, Scope, Send

log = logging.getLogger("tailguard.http")

_CLASS_HEADER = "x-tailguard-class"
_REPEATED = "\x00repeated"  # a header value no client can send (NUL): the header came more than once

# The routes that take a seat in their class's pool, with the caps, queues, fair shares and budgets of chat:
# those that generate, and the pooling ones (embeddings, rerank: classed by ``kinds``, no decode).
_COMPLETION_PATHS: dict[str, RequestKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
}
# Routes passed through to an engine serving the request's model, without a seat: they generate nothing
# (a tokenizer's answer), so they neither wait behind generations nor count as one (router/utility.py).
_UTILITY_PATHS = frozenset({"/v1/messages/count_tokens", "/tokenize", "/detokenize"})
# Every route and the methods it takes; a path not here is a 404, a method not listed a 405.
_ROUTES: dict[str, tuple[str, ...]] = {
    **{path: ("POST",) for path in (*_COMPLETION_PATHS, *_UTILITY_PATHS)},
    "/health": ("GET", "HEAD"),
    "/metrics": ("GET", "HEAD"),  # when the app has metrics; HEAD: the server sends GET's head alone
    "/v1/models": ("GET",),
    "/v1/limits": ("GET",),
}
# Anthropic's routes answer errors in Anthropic's shape (server/errors_map.py), every other route in OpenAI's.
_ANTHROPIC_PREFIX = "/v1/messages"
# A stored Responses API response: GET /v1/responses/{id} and POST /v1/responses/{id}/cancel, on the engine keeping it.
_RESPONSE_PATH = "/v1/responses/"
_RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")
# Which routes a listener has: all, the API's without /metrics, or /metrics alone ([server] metrics_listen).
Serves = Literal["all", "api", "metrics"]
_MODEL_PATH = "/v1/models/"  # + a model id, which may itself hold slashes ("org/name")
_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream")
_NO_CACHE = (b"cache-control", b"no-cache")
_NO_BUFFERING = (b"x-accel-buffering", b"no")  # nginx: relay each event as it comes


class HttpApi:
    """ASGI application, served by tailguard's own HTTP server (``server/http/server.py``).

    A path no route serves is a 404 in OpenAI's shape, whatever the method
    (so the openai SDK raises ``NotFoundError``, as it would against OpenAI);
    a route asked with a method it does not take is a 405 with ``Allow``.
    With API keys configured, every ``/v1/`` route needs ``Authorization:
    Bearer <key>``; ``/health`` stays open for load balancers, and
    ``/metrics`` too unless ``[metrics] token_env`` sets a token for it.
    ``serves`` says which routes this listener has: all of them, the API's
    without ``/metrics`` (``[server] metrics_listen`` gives it a listener of
    its own), or ``/metrics`` alone (that listener). ``tracing`` gives the
    tracer of each completion request (None: not traced); a ``traceparent``
    header makes its trace a child.
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
        tracing: Callable[[], Tracing | None] | None = None,
        serves: Serves = "all",
    ) -> None:
        self._router = router
        self._max_body_bytes = max_body_bytes
        self._metrics = metrics
        self.serves = serves
        self._completion_paths = {} if serves == "metrics" else _COMPLETION_PATHS
        # OpenAI's model objects carry a Unix time; this process's start is the honest one.
        self._created = int(time.time())
        self._sessions = Sessions(
            router,
            telemetry or Telemetry([router.judge]),
            "http",
            repeated_ids=repeated_ids,
            on_repeat=None if metrics is None else metrics.repeated_request_id,
            log_prompts=None if access_log is None else (lambda: access_log.log_prompts),
            tracing=tracing,
        )
        self._callers = CallerWatch()

    def refused(self, status: int, message: str) -> None:
        """A request the HTTP server answered itself (malformed, a head too large or too slow):
        its access-log line and count, as every request the app answers has."""
        request_id, _ = self._sessions.request_id(None)
        record = self._sessions.telemetry.start(request_id, "http")
        self._sessions.telemetry.finish(record, InvalidRequest(message), status=status)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """What the app needs running while it serves: the watch on callers who leave. Until cancelled."""
        await self._callers.run(task_status=task_status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if "authorization" in headers:  # a repeated one would name the last as the caller
            headers["authorization"] = one_authorization(
                [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"authorization"]
            ) or ""
        elif "x-api-key" in headers and path.startswith(_ANTHROPIC_PREFIX):
            # Anthropic's clients send the key as x-api-key (Claude-Code-style harnesses, curl from its docs): the same key.
            keys = [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"x-api-key"]
            headers["authorization"] = one_authorization([f"Bearer {key}" for key in keys]) or ""
        kind = self._completion_paths.get(path)
        if kind is not None and method == "POST":
            if _CLASS_HEADER in headers and sum(k.lower() == b"x-tailguard-class" for k, _ in scope["headers"]) > 1:
                headers[_CLASS_HEADER] = _REPEATED  # which one is meant depends on the proxy: refused, never guessed
            await self._completion(kind, path, headers, receive, send)
            return
        request_id, refused = self._sessions.request_id(headers.get("x-request-id"))
        dialect = _dialect(path)
        try:
            await self._other(path, method, scope.get("query_string", b""), headers, request_id, refused, receive, send)
        except Exception as error:  # a bug: a 500 in the route's shape, never an empty one
            log.error("%s %s failed unexpectedly (request %s)", method, path, request_id, exc_info=error)
            failed = InternalError(f"tailguard failed unexpectedly ({type(error).__name__})")
            await _send_error(send, http_error(failed, dialect), request_id)

    async def _other(
        self,
        path: str,
        method: str,
        query: bytes,
        headers: dict[str, str],
        request_id: str,
        refused: TailguardError | None,
        receive: Receive,
        send: Send,
    ) -> None:
        """Every route but the completions: small answers, no session."""
        dialect = _dialect(path)
        if refused is not None:
            await _send_error(send, http_error(refused, dialect), request_id)
            return
        allowed = self._methods(path)
        if allowed is None:
            await _send_error(send, no_route(method, path, dialect), request_id)
            return
        if method not in allowed:
            await _send_error(send, wrong_method(method, path, allowed, dialect), request_id)
            return
        if path in _UTILITY_PATHS:  # served here: _methods answered 404 on the metrics-only listener
            await self._relayed(path.rsplit("/", 1)[-1], request_id, dialect, send, self._utility(path, headers, request_id, receive))
            return
        if path.startswith(_RESPONSE_PATH):
            call = self._stored_response(path, method, query, headers, receive)
            await self._relayed("response_lookup", request_id, dialect, send, call)
            return
        if path == "/health":
            health = self._router.health()
            await _send_json(send, 503 if health["status"] == "unavailable" else 200, health, request_id)
            return
        if path == "/metrics" and self._metrics is not None:
            token = self._router.config.metrics.token_sha256
            try:
                if token is not None:
                    check_token(headers.get("authorization"), token)
            except TailguardError as error:
                await _send_error(send, http_error(error, dialect), request_id)
                return
            body = self._metrics.render()
            headers_out = [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers_out})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            self._router.authenticate(headers.get("authorization"))
        except TailguardError as error:
            await _send_error(send, http_error(error, dialect), request_id)
            return
        if path == "/v1/models":
            data = [self._model(model, max_model_len) for model, max_model_len in self._router.models().items()]
            await _send_json(send, 200, {"object": "list", "data": data}, request_id)
        elif path == "/v1/limits":
            document = {
                **limits_document(self._router.config),
                "assignment": self._router.assignment(),
                "attainment": attainment_document(self._router.attainment()),
            }
            await _send_json(send, 200, document, request_id)
        else:  # _MODEL_PATH + id
            model = path[len(_MODEL_PATH) :]
            max_model_len = self._router.models().get(model)
            if max_model_len is not None:
                await _send_json(send, 200, self._model(model, max_model_len), request_id)
            else:
                missing = ModelNotFound(f"The model {model!r} does not exist; GET /v1/models lists the models served", param="model")
                await _send_error(send, http_error(missing), request_id)

    async def _relayed(self, kind: str, request_id: str, dialect: Dialect, send: Send, call: Awaitable[UtilityAnswer]) -> None:
        """A call relayed without a seat: its answer as the engine gave it, or the error; an access-log line either way."""
        telemetry = self._sessions.telemetry
        record = telemetry.start(request_id, "http")
        record.kind = kind
        try:
            answer = await call
        except TailguardError as error:
            telemetry.finish(record, error, status=http_error(error, dialect).status)
            await _send_error(send, http_error(error, dialect), request_id)
            return
        record.endpoint = answer.endpoint
        telemetry.finish(record, None, status=answer.status)
        await _send_answer(send, answer, request_id)

    async def _stored_response(self, path: str, method: str, query: bytes, headers: dict[str, str], receive: Receive) -> UtilityAnswer:
        """A stored response's lookup (GET, its query kept) or cancellation (POST .../cancel), on the engine that keeps it."""
        self._router.authenticate(headers.get("authorization"))
        if re.search(rb"(?:^|&)stream=(?:true|1)(?:&|$)", query, re.IGNORECASE):
            # A background response's replay as a stream: tailguard relays no background response (openai_wire.py).
            raise InvalidRequest("a stored response is looked up whole here; ask without stream", param="stream")
        response_id = path[len(_RESPONSE_PATH) :].removesuffix("/cancel")
        body = await self._read_body(headers, receive) if method == "POST" else None
        target = path + ("?" + query.decode("latin-1") if query else "")
        return await self._router.at_response_home(response_id, method, target, body)

    async def _utility(self, path: str, headers: dict[str, str], request_id: str, receive: Receive) -> UtilityAnswer:
        """A tokenizer's route, relayed to an engine serving the model without a seat (router/utility.py); its answer as it came."""
        self._router.authenticate(headers.get("authorization"))
        body = await self._read_body(headers, receive)
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            raise InvalidRequest("the request body is not valid JSON") from None
        if not isinstance(payload, dict):
            raise InvalidRequest("the request body must be a JSON object")
        return await self._router.utility(path, payload, {"x-request-id": request_id})

    def _methods(self, path: str) -> tuple[str, ...] | None:
        """The methods ``path`` takes, or None when no route serves it."""
        if path == "/metrics" and (self._metrics is None or self.serves == "api"):
            return None
        if self.serves == "metrics" and path != "/metrics":
            return None
        if path.startswith(_MODEL_PATH):
            return ("GET",)
        if path.startswith(_RESPONSE_PATH) and self.serves != "metrics":
            response_id = path[len(_RESPONSE_PATH) :]
            if response_id.endswith("/cancel") and _RESPONSE_ID.fullmatch(response_id.removesuffix("/cancel")):
                return ("POST",)
            return ("GET",) if _RESPONSE_ID.fullmatch(response_id) else None
        return _ROUTES.get(path)

    def _model(self, model: str, max_model_len: int) -> dict[str, object]:
        """OpenAI's model object, with vLLM's ``max_model_len`` (clients size prompts by it)."""
        return {"id": model, "object": "model", "created": self._created, "owned_by": "tailguard", "max_model_len": max_model_len}

    # -- completions --------------------------------------------------------

    async def _completion(self, kind: RequestKind, path: str, headers: dict[str, str], receive: Receive, send: Send) -> None:
        session = self._sessions.start(headers.get("x-request-id"), carrier=headers, route=f"POST {path}")
        exchange = _ApiExchange(send, session, _dialect(path))
        watch: Watch | None = None
        try:
            async with session:
                caller = session.authenticate(headers.get("authorization"))
                if headers.get(_CLASS_HEADER) is _REPEATED:
                    raise InvalidRequest("x-tailguard-class was sent more than once; send it once", param=_CLASS_HEADER)
                body = await self._read_body(headers, receive)
                request = parse_completion_body(
                    kind,
                    body,
                    request_id=session.request_id,
                    forced_class=headers.get(_CLASS_HEADER),
                    caller=caller.name,
                    session=_session(headers, self._router.config.server.session_header),
                )
                watch = self._callers.watch(functools.partial(_watch_disconnect, receive, session, exchange))
                async with session.completion(request, caller) as completion:
                    await exchange.relay(completion)
        except TailguardError as error:  # recorded by the session; the caller still needs it
            await exchange.fail(error)
        finally:
            if watch is not None:
                await watch.stop()

    def _too_large(self) -> BodyTooLarge:
        return BodyTooLarge(f"the request body is over {self._max_body_bytes} bytes")

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The whole body, refusing (before buffering) anything over the cap."""
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body_bytes:
            raise self._too_large()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _dialect(path: str) -> Dialect:
    """Anthropic's shape of errors on its routes, OpenAI's everywhere else (a Responses stream's last event named ``error``)."""
    if path.startswith(_ANTHROPIC_PREFIX):
        return "anthropic"
    return "responses" if path == "/v1/responses" else "openai"


def _session(headers: dict[str, str], name: str) -> str | None:
    """The session header's value ([server] session_header, "" for none), a placement hint."""
    return headers.get(name) if name else None


class _ApiExchange:
    """One response in progress: whether its head went out, and whether it is complete."""

    __slots__ = ("_send", "_session", "_dialect", "started", "finished")

    def __init__(self, send: Send, session: Session, dialect: Dialect) -> None:
        self._send = send
        self._session = session
        self._dialect = dialect  # the shape of tailguard's own errors on this route
        self.started = False
        self.finished = False

    async def relay(self, completion: Completion) -> None:
        """Send the backend's answer. A stream's head waits for its first chunk,
        so ``server-timing`` can carry the time to first token."""
        session = self._session
        headers = [(name.encode(), value.encode()) for name, value in session.routing_facts(completion.routing)]
        if not completion.stream:
            body = await completion.read()
            # The body is whole: its length goes in the head, and the server checks the body against it.
            headers += [_JSON, (b"content-length", str(len(body)).encode()), _timing(session, total=True)]
            await self._start(200, headers)
            await self._body(body, more=False)
            return
        headers += [_SSE, _NO_CACHE, _NO_BUFFERING]
        async for chunk in completion.chunks():
            if not self.started:
                headers.append(_timing(session, total=False))
                await self._start(200, headers)
            await self._body(chunk, more=True)
        if not self.started:
            await self._start(200, headers)
        await self._body(b"", more=False)

    async def fail(self, error: TailguardError) -> None:
        """Send the error as a response, or end the stream that began with it as a last event.

        After the backend's own error event (BackendStreamError) the stream
        just ends: the caller has that event already.
        """
        if self.finished or self._session.client_gone:
            return
        if self.started:
            await self._body(b"" if isinstance(error, BackendStreamError) else http_error(error, self._dialect).sse_event(), more=False)
            return
        rendered = http_error(error, self._dialect)
        limits = [(name.encode(), value.encode()) for name, value in self._session.record.rate_limits]  # a budgeted key's, refused too
        await self._start(rendered.status, [*rendered.headers(), (b"x-request-id", self._session.request_id.encode()), *limits])
        await self._body(rendered.encoded(), more=False)

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        record = self._session.record
        if record.outcome is None:  # the status the caller sees, unless the record is already finished
            record.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, data: bytes, *, more: bool) -> None:
        if not more:
            self.finished = True
            record = self._session.record
            if record.outcome is None:
                # The caller's end-to-end time ends with its last byte, not when
                # the request's tasks have wound down.
                record.finished_at = trio.current_time()
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


def _timing(session: Session, *, total: bool) -> tuple[bytes, bytes]:
    return b"server-timing", checked_header("server-timing", server_timing(session.record, total=total)).encode()


async def _watch_disconnect(receive: Receive, session: Session, exchange: _ApiExchange) -> None:
    """Tell the session when the client goes away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not exchange.finished:  # a server may also say so once a response is complete
                session.left(stalled=bool(message.get("tailguard.stalled")))
            return


async def _send_answer(send: Send, answer: UtilityAnswer, request_id: str) -> None:
    """An engine's answer relayed as it came (status, content type, body), with the request id."""
    headers = [
        (b"content-type", answer.content_type.encode("latin-1")),
        (b"content-length", str(len(answer.body)).encode()),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


async def _send_json(send: Send, status: int, payload: object, request_id: str) -> None:
    body = json.dumps(payload).encode()
    headers = [_JSON, (b"content-length", str(len(body)).encode()), (b"x-request-id", request_id.encode("latin-1"))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, error: HttpError, request_id: str) -> None:
    """An error answer outside a completion's session (its request id is checked or fresh)."""
    await send({"type": "http.response.start", "status": error.status, "headers": [*error.headers(), (b"x-request-id", request_id.encode("latin-1"))]})
    await send({"type": "http.response.body", "body": error.encoded()})
