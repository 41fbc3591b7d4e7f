"""Canned answers on production's wire path: an httpx-style handler behind a connector, no socket.

``canned_transport(handler)`` takes what ``httpx.MockTransport`` takes (a
function of an ``httpx.Request`` returning an ``httpx.Response``, or an
awaitable of one) and hands the router a
:class:`~tailguard.router.backend.lean_transport.ConnectorTransport`: the backend
client's LeanTransport writes its request bytes to a memory stream, the
handler sees them parsed back into an ``httpx.Request``, and its response
comes back as HTTP/1.1 bytes (Content-Length, or chunked for a body of
unknown length) that production's parser reads. A handler's exception
propagates out of the write, as MockTransport's out of the request. Needs
no nursery: the handler runs in the writer's task, its body is read as the
client reads.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable

import httptools
import httpx
import trio

from tailguard.router.backend import BackendStream, Connector, ConnectorTransport

from .app import SimApp
from .transport import SimTransport

Handler = Callable[[httpx.Request], "httpx.Response | Awaitable[httpx.Response]"]
_NO_BODY = frozenset({204, 304})


class _Request:
    """httptools' callbacks: one request's parts, collected until it is complete."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


class _CannedStream:
    """The client's end of a connection to ``handler``: a write is parsed, a read returns the answer."""

    def __init__(self, handler: Handler, scheme: str) -> None:
        self._handler = handler
        self._scheme = scheme
        self._new_request()
        self._out = bytearray()
        self._response: httpx.AsyncByteStream | None = None  # a chunked body still to read, and its iterator
        self._body: AsyncIterator[bytes] | None = None
        self._closed = False

    def _new_request(self) -> None:
        self._request = _Request()
        self._parser = httptools.HttpRequestParser(self._request)

    async def send_all(self, data: bytes) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the stream is closed")
        await trio.lowlevel.checkpoint()
        self._parser.feed_data(data)
        if self._request.complete:
            request, method = self._request, self._parser.get_method().decode()
            self._new_request()
            await self._answer(request, method)

    async def _answer(self, parsed: _Request, method: str) -> None:
        host = next((value for name, value in parsed.headers if name.lower() == b"host"), b"engine").decode()
        request = httpx.Request(method, f"{self._scheme}://{host}{parsed.url.decode()}", headers=parsed.headers, content=bytes(parsed.body))
        answer = self._handler(request)
        response = await answer if inspect.isawaitable(answer) else answer
        assert isinstance(response, httpx.Response)
        headers = [(name, value) for name, value in response.headers.raw if name.lower() != b"transfer-encoding"]
        chunked = "content-length" not in response.headers and response.status_code not in _NO_BODY and method != "HEAD"
        if chunked:
            headers.append((b"Transfer-Encoding", b"chunked"))
        head = [f"HTTP/1.1 {response.status_code} {response.reason_phrase}\r\n".encode()]
        head += [name + b": " + value + b"\r\n" for name, value in headers]
        self._out += b"".join(head) + b"\r\n"
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream), "a canned body streams asynchronously"
        if chunked:
            self._response, self._body = stream, aiter(stream)
        else:
            async for chunk in stream:
                self._out += chunk
            await stream.aclose()

    async def receive_some(self, max_bytes: int) -> bytes:
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise trio.ClosedResourceError("the stream is closed")
        while not self._out and self._body is not None:
            try:
                chunk = await anext(self._body)
            except StopAsyncIteration:
                await self._end_body()
                self._out += b"0\r\n\r\n"
            else:
                if chunk:
                    self._out += f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        data, self._out = bytes(self._out[:max_bytes]), self._out[max_bytes:]
        return data  # b"" with nothing left: the server closed nothing, but has nothing more

    async def pause(self, seconds: float) -> None:
        await trio.sleep(seconds)

    async def _end_body(self) -> None:
        """Close the body being read (read to its end, or abandoned: a client hanging up)."""
        response, self._response, self._body = self._response, None, None
        if response is not None:
            await response.aclose()

    async def aclose(self) -> None:
        self._closed = True
        await self._end_body()
        await trio.lowlevel.checkpoint()


def canned_connector(handler: Handler, *, scheme: str = "http") -> Connector:
    """Each connect is a fresh connection to ``handler`` (kept alive for as many requests as the client sends)."""

    async def connect() -> BackendStream:
        await trio.lowlevel.checkpoint()
        return _CannedStream(handler, scheme)

    return connect


def canned_transport(handler: Handler, *, scheme: str = "http") -> ConnectorTransport:
    """What ``httpx.MockTransport(handler)`` was for a router or backend client, on production's LeanTransport."""
    return ConnectorTransport(canned_connector(handler, scheme=scheme))


def sim_canned_transport(app: SimApp) -> ConnectorTransport:
    """A simulated engine's API behind :func:`canned_transport`: no nursery to serve it in (``memory_connector`` needs one)."""
    return canned_transport(SimTransport(app).handle_async_request)
