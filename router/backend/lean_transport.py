"""An httpx transport to one backend: HTTP/1.1 keep-alive connections, llhttp (httptools) on Trio streams.

Why not httpx's own: httpcore's connection pool scans every pooled
connection on each request and each release (``is_idle``, ``has_expired``),
so its cost grows with the connections open -- and a router keeps one per
seat. Profiled against the simulated engine: 16% of the backend client's CPU
was that scan. Here a request takes the most recently used idle connection
from a list and puts it back when its response ends: O(1) whatever the
number of connections.

It keeps httpx's seam (``handle_async_request``): the router's backend
client, and every test transport, speak the same interface. Failures are
raised as httpx's exceptions, which ``router.backend.client`` maps at its boundary.
A request on a kept-alive connection that the server has meanwhile closed
(no byte of the response read) is sent once more on a new connection, as
httpcore does; nothing else is retried here.

Connections are opened over TCP (and TLS) unless a ``connect`` is given: a
:data:`Connector` returns any connected :class:`BackendStream`, so tests and
the in-process simulator (``bench/sim/memory.py``) run these same bytes and
this same parsing with no socket.
"""

from __future__ import annotations

import collections
import logging
import re
import socket
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from typing import Protocol

import httptools
import httpx
import trio

from ..observe import noticed_late
from ..sockets import READ_SIZE, ReadinessStream

log = logging.getLogger("tailguard.transport")

_MAX_HEAD_BYTES = 64 * 1024
# A connection idle this long is closed rather than reused (httpx's default):
# the pool shrinks back after a burst, and a server's own idle timeout
# (uvicorn's is 5 s) rarely beats us to it.
KEEPALIVE_EXPIRY = 5.0
_CONNECT_TIMEOUT = 5.0  # httpx's, for a request that names none
_UNSAFE = re.compile(rb"[\r\n\0]")


class BackendStream(Protocol):
    """What a connection reads and writes: a plain socket's, TLS's, or a test's in memory.

    ``pause`` waits while the body piles up: a socket is told that its next
    read will find bytes (``ReadinessStream.pause``), any other stream just sleeps.
    """

    async def receive_some(self, max_bytes: int) -> bytes | bytearray: ...

    async def send_all(self, data: bytes) -> None: ...

    async def pause(self, seconds: float) -> None: ...

    async def aclose(self) -> None: ...


Connector = Callable[[], Awaitable[BackendStream]]


class SleepingStream:
    """A Trio stream with the pause of one that has nothing to be told, a sleep: TLS's (which cannot be subclassed), a memory stream."""

    __slots__ = ("receive_some", "send_all", "aclose")

    def __init__(self, stream: trio.abc.Stream) -> None:
        # Bound once: a read costs what it costs on the stream itself.
        self.receive_some = stream.receive_some
        self.send_all = stream.send_all
        self.aclose = stream.aclose

    async def pause(self, seconds: float) -> None:
        await trio.sleep(seconds)


class _BackendConnection:
    """One connection: a Trio stream and llhttp's parser of the responses on it.

    llhttp calls the ``on_*`` methods from ``feed_data``; they only record
    what it found. One response at a time is in flight on a connection.
    """

    __slots__ = (
        "stream", "_parser", "status", "reason", "headers", "head_bytes", "head_done", "keep_alive", "body", "done", "spoiled", "eof"
    )

    def __init__(self, stream: BackendStream) -> None:
        self.stream = stream
        self._parser = httptools.HttpResponseParser(self)
        self.spoiled = False  # bytes after a response, or a broken one: never reuse
        self.eof = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.head_done = False
        self.keep_alive = False
        self.body: list[bytes] = []
        self.done = False

    # llhttp's callbacks
    def on_message_begin(self) -> None:
        if self.done or self.head_done:
            self.spoiled = True  # a second response to one request

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value)
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()  # llhttp resets it once the message ends
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200 and self.status != 101:
            self._reset()  # an informational response: the real one follows
            return
        self.done = True

    async def receive(self) -> None:
        """Read what the server sent and parse it; EOF sets ``eof``."""
        data = await self.stream.receive_some(READ_SIZE)
        if not data:
            self.eof = True
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self.spoiled = True
            raise httpx.RemoteProtocolError(f"malformed response: {error}") from None
        if not self.head_done and self.head_bytes > _MAX_HEAD_BYTES:
            raise httpx.RemoteProtocolError(f"a response head over {_MAX_HEAD_BYTES} bytes")

    async def read_head(self) -> None:
        """Read up to a final (non-1xx) response head."""
        while not self.head_done or 100 <= self.status < 200 and self.status != 101:
            if self.eof:
                raise httpx.RemoteProtocolError("the server closed the connection without a response")
            await self.receive()

    def close_delimited(self) -> bool:
        """Whether the body ends where the connection does (neither length nor chunks given)."""
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def reusable(self) -> bool:
        return self.done and self.keep_alive and not self.spoiled and not self.eof

    def next_cycle(self) -> None:
        self._reset()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class LeanTransport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 to one ``host:port`` (``https`` with ``ssl_context``)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        max_idle: int,
        ssl_context: ssl.SSLContext | None = None,
        keepalive_expiry: float = KEEPALIVE_EXPIRY,
        connect: Connector | None = None,
    ) -> None:
        parsed = httpx.URL(url)
        self._base = url.rstrip("/")
        self._heads: dict[str, bytes] = {}  # path -> request line and Host, built once per path
        self._host = parsed.host
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._tls = ssl_context if parsed.scheme == "https" else None
        self._connect_timeout = connect_timeout
        self._max_idle = max_idle
        self._keepalive_expiry = keepalive_expiry
        self._open: Connector = connect or self._open_tcp
        self._idle: collections.deque[tuple[_BackendConnection, float]] = collections.deque()  # oldest first
        self._closed = False
        self.opened = 0  # connections opened in all (tests and metrics read it)
        self.resent = 0  # requests sent again because a kept-alive connection was closed under them

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._send(_encode(request))

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> httpx.Response:
        """POST ``body`` to this transport's URL + ``path``, written as bytes with no httpx.Request.

        The router's hot path: an httpx.Request (its Headers, URL and content
        handling) was ~5% of a short request's router CPU. The bytes are what
        httpx would send: the request line, Host, ``headers`` (ASCII, as httpx
        requires; none may hold CR, LF or NUL; never Host or Content-Length,
        which are this method's), Content-Length, the body.
        """
        head = self._heads.get(path)
        if head is None:
            url = httpx.URL(self._base + path)
            head = self._heads[path] = b"POST " + url.raw_path + b" HTTP/1.1\r\nHost: " + url.netloc + b"\r\n"
        parts = [head]
        _add_headers(parts, [(name.encode("ascii"), value.encode("ascii")) for name, value in headers.items()])
        parts += (b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        return await self._send(b"".join(parts))

    async def _send(self, data: bytes) -> httpx.Response:
        """Send an encoded request on a kept-alive connection (once more on a new one if it was closed) or a new one."""
        if self._closed:
            raise RuntimeError("the transport is closed")
        await self.expire()
        connection = self._idle.pop()[0] if self._idle else None
        if connection is not None:
            try:
                await self._exchange(connection, data)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                await connection.aclose()  # closed by the server while idle: one fresh try
                connection = None
                self.resent += 1
            except BaseException:
                await connection.aclose()
                raise
        if connection is None:
            connection = await self._connect()
            try:
                await self._exchange(connection, data)
            except BaseException:
                await connection.aclose()
                raise
        return httpx.Response(
            connection.status,
            headers=connection.headers,
            stream=ResponseBody(self, connection),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": connection.reason},
        )

    async def _connect(self) -> _BackendConnection:
        """A new connection; a connect timeout noticed in a stall of this loop is tried once more.

        The stall may have hidden the engine's answer: the timeout would be
        tailguard's, and outlier detection would count it against the engine.
        """
        for attempt in range(2):
            deadline = trio.current_time() + self._connect_timeout
            try:
                return await self._connect_once(deadline)
            except trio.TooSlowError:
                if attempt == 0 and noticed_late(deadline):
                    log.info("connecting to %s:%s timed out in a stall of tailguard's loop: trying once more", self._host, self._port)
                    continue
                raise httpx.ConnectTimeout(f"no connection to {self._host}:{self._port} within {self._connect_timeout:g} s") from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connect_once(self, deadline: float) -> _BackendConnection:
        try:
            with trio.fail_at(deadline):
                stream = await self._open()
        except (OSError, trio.BrokenResourceError) as error:
            raise httpx.ConnectError(f"{self._host}:{self._port}: {error}") from None
        self.opened += 1
        return _BackendConnection(stream)

    async def _open_tcp(self) -> BackendStream:
        """The default connector: TCP to ``host:port``, TLS over it for ``https``."""
        opened = await trio.open_tcp_stream(self._host, self._port)
        if self._tls is None:  # the socket, without SocketStream (its options, TCP_NODELAY among them, stay set)
            return ReadinessStream(socket.socket(fileno=opened.socket.detach()))
        tls = trio.SSLStream(opened, self._tls, server_hostname=self._host, https_compatible=True)
        try:
            await tls.do_handshake()
        except BaseException:  # refused, timed out or cancelled: the socket must not wait for the GC
            opened.socket.close()
            raise
        return SleepingStream(tls)

    async def _exchange(self, connection: _BackendConnection, data: bytes) -> None:
        """Send the whole request in one write; read up to the response head."""
        try:
            await connection.stream.send_all(data)
            await connection.read_head()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise httpx.WriteError(f"{self._host}:{self._port}: {error}") from None
        except httpx.RemoteProtocolError as error:
            raise httpx.RemoteProtocolError(f"{self._host}:{self._port}: {error}") from None

    def release(self, connection: _BackendConnection) -> bool:
        """Keep a connection whose exchange ended cleanly; False if it must be closed."""
        if self._closed or len(self._idle) >= self._max_idle or not connection.reusable():
            return False
        connection.next_cycle()
        self._idle.append((connection, trio.current_time()))
        return True

    async def expire(self) -> None:
        """Close the connections idle for longer than the keep-alive expiry (the oldest are first)."""
        horizon = trio.current_time() - self._keepalive_expiry
        while self._idle and self._idle[0][1] < horizon:
            await self._idle.popleft()[0].aclose()

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, collections.deque()
        for connection, _ in idle:
            await connection.aclose()


class ConnectorTransport(httpx.AsyncBaseTransport):
    """An engine reached through ``connect`` instead of TCP: what a test or the in-process simulator hands the router.

    The backend client builds its own LeanTransport over ``connect`` (the
    pool size and keep-alive expiry production's has: ``router.backend.client``), so
    completions take the production path. The health probe's httpx client
    sends here; closing this closes the connections it opened for that, and
    a later request opens new ones (the probe is rebuilt on a reload).
    """

    def __init__(self, connect: Connector, *, max_idle: int = 2) -> None:
        self.connect = connect
        self._max_idle = max_idle
        self._lean: LeanTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        lean = self._lean
        if lean is None:
            timeout = request.extensions.get("timeout", {}).get("connect") or _CONNECT_TIMEOUT
            base = str(request.url.copy_with(raw_path=b"/"))
            lean = self._lean = LeanTransport(base, connect_timeout=timeout, max_idle=self._max_idle, connect=self.connect)
        return await lean.handle_async_request(request)

    async def aclose(self) -> None:
        lean, self._lean = self._lean, None
        if lean is not None:
            await lean.aclose()


class ResponseBody(httpx.AsyncByteStream):
    """A response body read from its connection; closing it returns or closes the connection.

    The backend client iterates it directly rather than through httpx's
    ``aiter_raw``: one layer of async generator less for every relayed chunk.
    """

    def __init__(self, transport: LeanTransport, connection: _BackendConnection) -> None:
        self._transport = transport
        self._connection: _BackendConnection | None = connection

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        connection = self._connection
        if connection is None:
            return
        try:
            while True:
                if connection.body:
                    data = connection.body[0] if len(connection.body) == 1 else b"".join(connection.body)
                    connection.body.clear()
                    yield data
                if connection.done:
                    break
                if connection.eof:
                    if connection.close_delimited():
                        connection.done = True
                        break
                    raise httpx.RemoteProtocolError("the backend closed the connection mid-body")
                await connection.receive()
        except httpx.RemoteProtocolError as error:
            connection.spoiled = True
            raise httpx.RemoteProtocolError(f"the backend broke the response body: {error}") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            connection.spoiled = True
            raise httpx.ReadError(f"the backend broke the response body: {error}") from None
        # The body is whole: the connection goes back to the pool now, not when
        # the caller gets round to closing the response (after its own writes).
        await self.aclose()

    async def pause(self, seconds: float) -> None:
        """Let the body pile up for ``seconds``; the next read then takes it at once (no wait for readiness)."""
        connection = self._connection
        if connection is None:
            await trio.sleep(seconds)
        else:
            await connection.stream.pause(seconds)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not self._transport.release(connection):
            await connection.aclose()


def _encode(request: httpx.Request) -> bytes:
    """The request as bytes, head and body in one buffer for one write.

    httpx has set Host and Content-Length; a header that could split the
    head (CR, LF or NUL in it) is refused, never sent.
    """
    head = [request.method.encode(), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    _add_headers(head, request.headers.raw)
    head.append(b"\r\n")
    if request.content:
        head.append(request.content)
    return b"".join(head)


def _add_headers(parts: list[bytes], headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Append ``name: value`` lines, refusing a header that could split the head (CR, LF or NUL in it)."""
    for name, value in headers:
        if _UNSAFE.search(name) or _UNSAFE.search(value):
            raise httpx.LocalProtocolError(f"a header with a control character: {name!r}")
        parts += (name, b": ", value, b"\r\n")
