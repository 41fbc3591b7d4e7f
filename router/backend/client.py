"""Calls to one inference server: where httpx's errors become the router's.

Completion requests go to an httpx transport directly
(``router/backend/lean_transport.py`` by default: keep-alive connections whose pool
costs O(1) a request, where httpcore's scans every connection on each request
and release); probes and scrapes use an httpx client of their own. httpx's
exceptions are mapped here, at the boundary, into the router's error tree.

Callers never read an engine's address: the router's messages say "the
backend", and the URL and what the transport said go in the error's
``endpoint`` and ``detail``, for the logs. Every word of an engine passed
on -- an error body's fields, a relayed stream's bytes -- is first cleared
of the pool's own key (router/backend/redaction.py), which an engine or a proxy may
echo from the ``Authorization`` header it was sent.

A reply is trusted only as far as it is checked: a status that is neither
2xx, 4xx nor 5xx, a 2xx that is not the JSON or SSE asked for, a body over
its cap, a stream event that is not JSON, a stream that ends without
``[DONE]`` or a finish reason -- each is an error here, never a 200 with an
empty body further up. Bodies are read only up to their caps.

Read timeouts are deliberately absent: the request's end-to-end cancel scope
bounds every call (and the caller's first-byte scope its start), and
cancelling it closes the backend stream, which is what makes vLLM abort the
generation.
"""

from __future__ import annotations

import json
import math
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import httpx

from ..config import BackendAccess, ServerConfig, TimeoutsConfig
from ..error_spec import CONTEXT_LENGTH_EXCEEDED
from ..errors import BackendAuthFailed, BackendBusy, BackendRejected, BackendStreamError, BackendUnavailable, BadBackendReply
from .events import EventFilter, first_error_event, stream_ended
from .lean_transport import ConnectorTransport, LeanTransport
from .redaction import Redactor
from .transport import BackendBody, BackendTransport

ERROR_BODY_LIMIT = 64 * 1024
# vLLM's /metrics is ~100 KB; a URL that serves something else must not make
# the router buffer an arbitrary download every scrape.
METRICS_BODY_LIMIT = 4 * 1024 * 1024

_END_WINDOW = 256  # bytes of the relayed chunk before the last that may hold the end event's start
# What the router asks of every backend: no compression (a relayed stream is
# bytes as they come), its own content types.
_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
# Statuses that mean the engine refused tailguard's own key (vLLM --api-key answers 401).
AUTH_STATUSES = (401, 403)
# OpenAI's error types: an engine's 4xx keeps one of these; vLLM's own ("BadRequestError", FastAPI's
# "Bad Request") become the one OpenAI gives for the status, so SDKs and callers read one vocabulary.
_OPENAI_ERROR_TYPES = frozenset(
    {"invalid_request_error", "authentication_error", "permission_error", "not_found_error", "rate_limit_error", "insufficient_quota", "server_error"}
)
_OPENAI_TYPE_FOR_STATUS = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}  # else invalid_request_error
# vLLM names a prompt over the context by these params: the caller gets tailguard's own code for it.
_CONTEXT_PARAMS = frozenset({"input_tokens", "input_text"})
NO_ACCESS = BackendAccess()  # no key, the system's CA roots
# A probe's answer when the engine's host refused the connection: nothing listens on its port.


def tls_context(url: str, access: BackendAccess) -> ssl.SSLContext | None:
    """The TLS context of an ``https://`` engine (its pool's ``tls_ca_file``, else the system's roots); None for http://.

    A plain http:// endpoint needs none (building one loads the CA roots:
    ~1 MB and ~10 ms, paid again by every reload that resizes it).
    """
    if not url.startswith("https:"):
        return None
    if access.tls_ca_file is not None:
        return ssl.create_default_context(cafile=access.tls_ca_file)
    return httpx.create_ssl_context()


class BackendResponse:
    """An open 2xx response from the backend, checked for what was asked.

    ``start`` waits for the first byte of the body; then ``read`` gives the
    whole body and its parsed ``payload``, or ``chunks`` the SSE bytes as they
    arrive. ``aclose`` hangs up, which makes vLLM abort a generation still
    running.
    """

    def __init__(
        self, response: httpx.Response, client: BackendClient, url: str, *, stream: bool, max_body_bytes: int, redactor: Redactor
    ) -> None:
        self._response = response
        self._client = client
        self._url = url
        self._redactor = redactor
        self.max_body_bytes = max_body_bytes  # the read cap (an assembled answer has it too)
        self.payload: dict[str, Any] | None = None  # the parsed body, once ``read``
        self._body: bytes | None = None
        self._first: bytes | None = None
        self._closed = False
        encoding = response.headers.get("content-encoding", "identity").lower()
        # Bytes are relayed raw unless the backend compressed them anyway.
        self._raw = encoding in ("", "identity")
        # One pass over the body, shared by start, read and chunks; a body already
        # in memory (an in-process transport) can only be re-read decoded. Raw
        # bytes are read from the transport's body itself: one layer of async
        # generator less than httpx's ``aiter_raw`` for every relayed chunk.
        self._body_stream = body_stream = cast(BackendBody, response.stream)
        raw = self._raw and not response.is_stream_consumed
        self._iterator: AsyncGenerator[bytes, None] = body_stream.__aiter__() if raw else response.aiter_bytes()  # type: ignore[assignment]

    async def start(self) -> None:
        """Wait for the first byte of the body (an empty body counts as its end).

        Raises BackendUnavailable when the connection breaks.
        """
        with self._errors_mapped():
            async for chunk in self._iterator:
                if chunk:
                    self._client.heard += 1
                    self._first = chunk
                    return
        self._first = b""

    async def read(self) -> bytes:
        """The whole body of a non-streaming response, checked to be a completion.

        Raises BadBackendReply for a body over its cap (reading stops there)
        or one that is not a completion (a JSON object with a non-empty list
        of ``choices``, each with a finish reason, and no ``error``), and
        BackendUnavailable for a broken one. Parsed once: ``payload`` keeps it.
        """
        if self._body is None:
            self._body = await self._read_all()
        return self._body

    async def chunks(
        self,
        on_chunk: Callable[[bytes], None] = lambda chunk: None,
        interval: float = 0.0,
        *,
        drop_usage: bool = False,
        check: bool = True,
    ) -> AsyncIterator[bytes]:
        """The SSE bytes as they arrive, in whole events, the first (read by ``start``) included; ``on_chunk`` sees each read first.

        With ``interval`` the stream is read at most once per that many
        seconds: what arrived meanwhile is one chunk (the events of several
        engine steps, one read and one send instead of one each). With
        ``drop_usage`` the usage event (``"choices": []``) is not yielded:
        tailguard asked for it, the caller did not (``on_chunk`` still sees it).
        An event is relayed once its end has come (:class:`EventFilter`), so a
        caller never holds half of one when the stream ends in an error event.

        Ends with BackendStreamError when the backend sent an error event (the
        bytes were relayed first), BadBackendReply when an event's data is not
        a JSON object (nor ``[DONE]``; the events before it relayed) or the
        stream ended without ``[DONE]`` or a finish reason, BackendUnavailable
        when the connection broke. Whether it ended is read from the events'
        data, as the gRPC front end's decoder reads it: bytes outside any
        ``data:`` line that merely end in ``data: [DONE]`` are no end.
        A chunk that holds the pool's backend key is relayed with it
        redacted (with or without ``check``: both wires relay these bytes).
        """
        # The verdict comes from the stream's end, whatever its reads' sizes: the
        # last relayed chunk holds the last whole event, which must be [DONE] (or,
        # for a backend that sends none, the end must hold a finish reason). Per
        # relayed chunk of whole events: each event checked, and one substring
        # search for an error event.
        error_event: bytes | None = None
        last = previous = b""
        events = EventFilter(drop_usage=drop_usage, check=check)
        redact = self._redactor.data if self._redactor else None
        first, self._first = self._first, None
        if first:
            on_chunk(first)
            relayed = events.feed(first)
            if relayed:
                if redact is not None:
                    relayed = redact(relayed)
                last = relayed
                error_event = first_error_event(relayed)
                yield relayed
        if events.refused is None:
            with self._errors_mapped():
                client = self._client
                async for chunk in self._iterator:
                    client.heard += 1
                    on_chunk(chunk)
                    relayed = events.feed(chunk)
                    if relayed:
                        if redact is not None:
                            relayed = redact(relayed)
                        previous, last = last, relayed
                        if error_event is None and b'"error"' in relayed:
                            error_event = first_error_event(relayed)
                        yield relayed
                    if events.refused is not None:
                        break
                    if interval:
                        await self._body_stream.pause(interval)
        url = self._url
        if error_event is not None:  # the caller has the backend's own word (gRPC stops at it too)
            raise BackendStreamError(f"the backend reported an error in its stream: {_event_message(error_event)}", endpoint=url)
        if events.refused is not None:
            raise BadBackendReply(f"the backend sent a stream event that {self._redactor.text(events.refused)}", endpoint=url)
        held = events.flush()
        if held:
            if redact is not None:
                held = redact(held)
            previous, last = last, held
            yield held
        if not stream_ended(previous[-_END_WINDOW:] + last):
            raise BadBackendReply("the backend ended its stream without [DONE] or a finish reason", endpoint=url)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.in_flight -= 1
        try:
            await self._iterator.aclose()
        finally:
            await self._response.aclose()

    @contextmanager
    def _errors_mapped(self) -> Iterator[None]:
        """httpx's errors while reading the body, as the router's."""
        try:
            yield
        except httpx.DecodingError as error:
            raise BadBackendReply(
                f"the backend sent a body that does not decode ({type(error).__name__})", endpoint=self._url, detail=describe(error)
            ) from None
        except httpx.TransportError as error:
            raise BackendUnavailable(
                f"the backend broke the response ({type(error).__name__})", endpoint=self._url, detail=describe(error)
            ) from None

    async def _read_all(self) -> bytes:
        # Chunks joined once: a growing buffer would reallocate and copy a big
        # body over and over, and leave the process's memory larger after it.
        chunks = [self._first] if self._first else []
        size = len(self._first or b"")
        self._first = None
        with self._errors_mapped():
            async for chunk in self._iterator:
                self._client.heard += 1
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise BadBackendReply(
                        f"the backend sent a body over {self.max_body_bytes} bytes (server.max_backend_body_bytes)", endpoint=self._url
                    )
                chunks.append(chunk)
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            payload = None
        problem = _not_a_completion(payload)
        if problem is not None:
            raise BadBackendReply(f"the backend answered 200 with a body that is not a completion: {problem}", endpoint=self._url)
        self.payload = payload
        return body


class BackendClient:
    """POSTs completion requests to one endpoint and opens their responses.

    Requests go through one ``post`` (``router/backend/transport.py``) -- by
    default a :class:`~router.lean_transport.LeanTransport`'s, whose keep-alive
    pool costs O(1) a request however many connections are open (over TCP,
    or a ``ConnectorTransport``'s streams: an in-process engine, a test's
    canned answers, ``tailguard.sim.canned``); a benchmark may pass a
    ``backend_transport`` of its own instead.
    httpx's client layer (redirects, auth, cookies, hooks) has no work to
    do for a router and is skipped. ``leases`` counts the seats that hold this client;
    a client replaced by a reload is closed once it drops to zero (see
    ``router.fleet.pool.Endpoint``).
    """

    def __init__(
        self,
        url: str,
        *,
        max_concurrency: int,
        connect_timeout: float,
        transport: ConnectorTransport | None = None,
        max_body_bytes: int = ServerConfig.max_backend_body_bytes,
        access: BackendAccess = NO_ACCESS,
        keep_alive_timeout: float = TimeoutsConfig.backend_keep_alive_timeout,
        backend_transport: BackendTransport | None = None,
    ) -> None:
        self.url = url
        self.leases = 0
        self.in_flight = 0
        # Reads that brought bytes from the engine, ever: a health probe that timed out while
        # this grew waited behind work the engine was doing, not on a dead engine.
        self.heard = 0
        self.max_body_bytes = max_body_bytes
        self._headers = {**_HEADERS, **access.authorization}  # tailguard's own key, never a caller's
        self._redactor = Redactor(access.api_key)  # that key, out of whatever the engine says back
        self._transport: BackendTransport = backend_transport if backend_transport is not None else LeanTransport(  # over TCP or a connector
            url,
            connect_timeout=connect_timeout,
            max_idle=max_concurrency,
            ssl_context=tls_context(url, access),
            keepalive_expiry=keep_alive_timeout,
            connect=None if transport is None else transport.connect,
        )

    @property
    def transport(self) -> BackendTransport:
        """What this client posts through (tests read its counters)."""
        return self._transport

    async def exchange(self, path: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, str, bytes]:
        """POST a small request and read its whole answer, whatever its status: (status, content type, body).

        For routes relayed as the engine answers them (a tokenizer's count,
        its 4xx included), read up to ``max_body_bytes``. Raises
        BackendUnavailable when the engine cannot be reached or breaks the
        answer, BadBackendReply when the answer is over the cap.
        """
        self.in_flight += 1
        try:
            try:
                response = await self._transport.post(path, body, {**self._headers, **headers})
            except httpx.TransportError as error:
                raise BackendUnavailable(
                    f"the backend could not be reached ({type(error).__name__})", endpoint=self.url, detail=describe(error)
                ) from None
            try:
                try:
                    content = await read_capped(response, self.max_body_bytes)
                except httpx.TransportError as error:
                    raise BackendUnavailable(
                        f"the backend broke the response ({type(error).__name__})", endpoint=self.url, detail=describe(error)
                    ) from None
            finally:
                await response.aclose()
            if content is None:
                raise BadBackendReply(f"the backend sent a body over {self.max_body_bytes} bytes (server.max_backend_body_bytes)", endpoint=self.url)
            if self._redactor:  # the pool's key, out of whatever the engine says back (as every relayed byte)
                content = self._redactor.data(content)
            return response.status_code, response.headers.get("content-type", "application/json"), content
        finally:
            self.in_flight -= 1

    async def open(self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], *, stream: bool) -> BackendResponse:
        """Send the request and return its open 2xx response; the caller must ``aclose`` it.

        Raises BackendRejected for 4xx (the caller's fault, passed through),
        BackendUnavailable for 5xx and for refused or broken connections
        (BackendBusy for a 503, BackendAuthFailed for 401/403), and
        BadBackendReply for any other status or a 2xx of the wrong content type. Error bodies
        are read up to ``ERROR_BODY_LIMIT`` bytes, no further.
        """
        content = json.dumps(body).encode()
        self.in_flight += 1
        try:
            response = await self._transport.post(path, content, {**self._headers, **headers})
        except httpx.TransportError as error:
            self.in_flight -= 1
            raise BackendUnavailable(
                f"the backend could not be reached ({type(error).__name__})", endpoint=self.url, detail=describe(error)
            ) from None
        except BaseException:
            self.in_flight -= 1
            raise
        opened = BackendResponse(response, self, self.url, stream=stream, max_body_bytes=self.max_body_bytes, redactor=self._redactor)
        try:
            status = response.status_code
            if not 200 <= status < 300:
                await _raise_for_status(response, self.url, self._redactor)
            content_type = response.headers.get("content-type", "")
            expected = "text/event-stream" if stream else "application/json"
            if not content_type.lower().startswith(expected):
                shown = self._redactor.text(content_type[:80])
                raise BadBackendReply(f"the backend answered {status} with content-type {shown!r}, not {expected}", endpoint=self.url)
        except BaseException:
            await opened.aclose()
            raise
        return opened

    async def expire_idle(self) -> None:
        """Close keep-alive connections idle too long (also when no request comes to do it)."""
        await self._transport.expire()

    async def aclose(self) -> None:
        await self._transport.aclose()


def _not_a_completion(payload: object) -> str | None:
    """Why a non-streaming body is not a completion, or None when it is one.

    A completion as each API shapes it: OpenAI's choices, each finished; an
    Anthropic message (``"type": "message"``) with its ``stop_reason``; a
    Responses API response (``"object": "response"``) that did not fail;
    embeddings' ``data`` and a rerank's ``results``.
    """
    if not isinstance(payload, dict):
        return "not a JSON object"
    if "error" in payload and payload.get("object") != "response":  # a response always has the key (null unless it failed)
        return "it holds an error"
    if payload.get("type") == "message":
        return None if "stop_reason" in payload and isinstance(payload.get("content"), list) else "a message without content or stop_reason"
    if payload.get("object") == "response":
        return "the response failed" if payload.get("status") == "failed" else None
    if "choices" not in payload and isinstance(payload.get("data"), list):  # embeddings
        return None
    if "choices" not in payload and isinstance(payload.get("results"), list):  # rerank
        return None
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices:
        return "no choices"
    if not all(isinstance(choice, dict) and choice.get("finish_reason") for choice in choices):
        return "a choice without a finish reason"
    return None


def _event_message(event: bytes) -> str:
    """The message of an error event's data (relayed bytes: already redacted)."""
    message, _, _, _ = _error_fields(event.split(b"\n", 1)[0], 500, Redactor(None))
    return message


async def read_capped(response: httpx.Response, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of the body, or None once it goes over (reading stops there)."""
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


async def _raise_for_status(response: httpx.Response, url: str, redactor: Redactor) -> None:
    status = response.status_code
    raw = b""
    try:
        async for chunk in response.aiter_bytes():
            raw += chunk
            if len(raw) >= ERROR_BODY_LIMIT:
                raw = raw[:ERROR_BODY_LIMIT]
                break  # the rest is never read: closing the response drops it
    except (httpx.TransportError, httpx.DecodingError):
        pass
    message, error_type, code, param = _error_fields(raw, status, redactor)
    if status in AUTH_STATUSES:  # tailguard's own key, never the caller's: not theirs to fix
        raise BackendAuthFailed(
            f"the backend refused tailguard's credentials ({status}: {message}); check the pool's api_key_env", status=status, endpoint=url
        )
    if 400 <= status < 500:
        if error_type not in _OPENAI_ERROR_TYPES:
            error_type = _OPENAI_TYPE_FOR_STATUS.get(status, "invalid_request_error")
        if code is None and status == 400 and param in _CONTEXT_PARAMS:
            code = CONTEXT_LENGTH_EXCEEDED
        raise BackendRejected(message, status=status, error_type=error_type, code=code, param=param, endpoint=url)
    if status == 503:  # vLLM's own queue is full: busy, not broken
        hint = _retry_after(response.headers.get("retry-after"))
        raise BackendBusy(f"the backend is busy (503: {message})", retry_after=1.0 if hint is None else hint, endpoint=url)

    if status >= 500:
        raise BackendUnavailable(f"the backend failed with {status}: {message}", endpoint=url)
    raise BadBackendReply(f"the backend answered {status}, not a completion", endpoint=url)


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header in delta-seconds form (an HTTP date, or nonsense: None)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds <= 3600 and math.isfinite(seconds) else None


def _error_fields(raw: bytes, status: int, redactor: Redactor) -> tuple[str, str | None, str | None, str | None]:
    """Message, type, code and param of an OpenAI- or vLLM-shaped error body, each cleared of the
    pool's key before it is cut to size (a cut must not leave half a key)."""
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        text = redactor.text(raw.decode("utf-8", "replace").strip())
        return (text[:500] or f"HTTP {status}"), None, None, None
    error = payload.get("error", payload) if isinstance(payload, dict) else {}
    if isinstance(error, str):
        return redactor.text(error)[:500], None, None, None
    if not isinstance(error, dict):
        return f"HTTP {status}", None, None, None
    code = error.get("code")
    param = error.get("param")
    return (
        redactor.text(str(error.get("message") or f"HTTP {status}"))[:2000],
        redactor.text(str(error["type"]))[:200] if error.get("type") else None,
        redactor.text(str(code))[:200] if code is not None and not isinstance(code, int) else None,
        redactor.text(str(param))[:200] if param is not None else None,
    )


def refused(error: BaseException) -> bool:
    """Whether a connect error comes from a refused connection (ECONNREFUSED), anywhere in its
    causes: httpcore wraps the OS's error in its own, and anyio's attempts in a group."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ConnectionRefusedError):
            return True
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        pending.extend(cause for cause in (current.__cause__, current.__context__) if cause is not None)
    return False


def describe(error: httpx.HTTPError) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
