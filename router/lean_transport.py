"""An httpx transport to one backend: HTTP/1.1 keep-alive connections, h11 on Trio streams.

Why not httpx's own: httpcore's connection pool scans every pooled
connection on each request and each release (``is_idle``, ``has_expired``),
so its cost grows with the connections open -- and a router keeps one per
seat. Profiled against the simulated engine: 16% of the backend client's CPU
was that scan. Here a request takes the most recently used idle connection
from a list and puts it back when its response ends: O(1) whatever the
number of connections.

It keeps httpx's seam (``handle_async_request``): the router's backend
client, and every test transport, speak the same interface. Failures are
raised as httpx's exceptions, which ``router.backend`` maps at its boundary.
A request on a kept-alive connection that the server has meanwhile closed
(no byte of the response read) is sent once more on a new connection, as
httpcore does; nothing else is retried here.
"""

from __future__ import annotations

import collections
import ssl
from collections.abc import AsyncIterator

import h11
import httpx
import trio

_READ_SIZE = 64 * 1024
_MAX_HEAD_BYTES = 64 * 1024
# A connection idle this long is closed rather than reused (httpx's default):
# the pool shrinks back after a burst, and a server's own idle timeout
# (uvicorn's is 5 s) rarely beats us to it.
KEEPALIVE_EXPIRY = 5.0


class _Connection:
    """One connection: a Trio stream and its h11 state."""

    __slots__ = ("stream", "h11")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD_BYTES)

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        """The next h11 event, reading as needed; EOF mid-message is h11's RemoteProtocolError."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            self.h11.receive_data(bytes(await self.stream.receive_some(_READ_SIZE)))

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
    ) -> None:
        parsed = httpx.URL(url)
        self._host = parsed.host
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._tls = ssl_context if parsed.scheme == "https" else None
        self._connect_timeout = connect_timeout
        self._max_idle = max_idle
        self._keepalive_expiry = keepalive_expiry
        self._idle: collections.deque[tuple[_Connection, float]] = collections.deque()  # oldest first
        self._closed = False
        self.opened = 0  # connections opened in all (tests and metrics read it)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        await self.expire()
        connection = self._idle.pop()[0] if self._idle else None
        if connection is not None:
            try:
                head = await self._exchange(connection, request)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                await connection.aclose()  # closed by the server while idle: one fresh try
                connection = None
            except BaseException:
                await connection.aclose()
                raise
        if connection is None:
            connection = await self._connect()
            try:
                head = await self._exchange(connection, request)
            except BaseException:
                await connection.aclose()
                raise
        headers = [(name, value) for name, value in head.headers]
        return httpx.Response(
            head.status_code,
            headers=headers,
            stream=_Body(self, connection),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
        )

    async def _connect(self) -> _Connection:
        try:
            with trio.fail_after(self._connect_timeout):
                stream: trio.abc.Stream = await trio.open_tcp_stream(self._host, self._port)
                if self._tls is not None:
                    tls = trio.SSLStream(stream, self._tls, server_hostname=self._host, https_compatible=True)
                    await tls.do_handshake()
                    stream = tls
        except trio.TooSlowError:
            raise httpx.ConnectTimeout(f"no connection to {self._host}:{self._port} within {self._connect_timeout:g} s") from None
        except (OSError, trio.BrokenResourceError) as error:
            raise httpx.ConnectError(f"{self._host}:{self._port}: {error}") from None
        self.opened += 1
        return _Connection(stream)

    async def _exchange(self, connection: _Connection, request: httpx.Request) -> h11.Response:
        """Send the whole request in one write; read up to the response head."""
        try:
            await connection.stream.send_all(_encode(connection.h11, request))
            while True:
                event = await connection.next_event()
                if isinstance(event, h11.Response):
                    return event
                if isinstance(event, h11.InformationalResponse):
                    continue
                raise httpx.RemoteProtocolError(f"unexpected {type(event).__name__} before a response head")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise httpx.WriteError(f"{self._host}:{self._port}: {error}") from None
        except h11.RemoteProtocolError as error:
            raise httpx.RemoteProtocolError(f"{self._host}:{self._port}: {error}") from None

    def release(self, connection: _Connection) -> bool:
        """Keep a connection whose exchange ended cleanly; False if it must be closed."""
        if self._closed or len(self._idle) >= self._max_idle:
            return False
        if connection.h11.our_state is not h11.DONE or connection.h11.their_state is not h11.DONE:
            return False
        connection.h11.start_next_cycle()
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


class _Body(httpx.AsyncByteStream):
    """A response body read from its connection; closing it returns or closes the connection."""

    def __init__(self, transport: LeanTransport, connection: _Connection) -> None:
        self._transport = transport
        self._connection: _Connection | None = connection

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            return
        try:
            while True:
                event = await connection.next_event()
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return
                else:
                    raise httpx.RemoteProtocolError(f"unexpected {type(event).__name__} in a response body")
        except h11.RemoteProtocolError as error:
            raise httpx.RemoteProtocolError(f"the backend broke the response body: {error}") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise httpx.ReadError(f"the backend broke the response body: {error}") from None

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not self._transport.release(connection):
            await connection.aclose()


def _encode(connection: h11.Connection, request: httpx.Request) -> bytes:
    """The request as bytes, head and body in one buffer for one write."""
    parts = [connection.send(h11.Request(method=request.method, target=request.url.raw_path, headers=request.headers.raw))]
    if request.content:
        parts.append(connection.send(h11.Data(data=request.content)))
    parts.append(connection.send(h11.EndOfMessage()))
    return b"".join(part for part in parts if part)
