"""The backend client's transport seam: what it posts through, and what a router's transport must be.

``router.backend.client.BackendClient`` sends every completion request through
:class:`BackendTransport`'s ``post`` and reads every response body as a
:class:`BackendBody`. That is :class:`~router.lean_transport.LeanTransport`
(bytes on a kept-alive connection, no ``httpx.Request``), over TCP or over a
``ConnectorTransport``'s connector: an in-process engine, or a test's canned
answers (``tailguard.sim.canned``), so tests post as production does. Only a
benchmark that measures the layer above the wire (``bench sse_check``) hands
the client an :class:`HttpxTransport` explicitly, as its ``backend_transport``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Protocol

import httpx
import trio


class BackendBody(Protocol):
    """A response body as the backend client reads it: raw bytes, and a pause that lets them pile up."""

    def __aiter__(self) -> AsyncGenerator[bytes, None]: ...

    async def pause(self, seconds: float) -> None: ...

    async def aclose(self) -> None: ...


class BackendTransport(Protocol):
    """Where the backend client posts; the response's ``stream`` is a :class:`BackendBody`."""

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> httpx.Response: ...

    async def expire(self) -> None: ...

    async def aclose(self) -> None: ...


class _PausableBody(httpx.AsyncByteStream):
    """Another transport's body, with the pause the lean one has (a sleep: nothing to tell a socket)."""

    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self._inner = inner
        self._closed = False

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        async for chunk in self._inner:
            yield chunk
        await self.aclose()  # whole: closed at once, as httpx's ``aiter_raw`` closes a response it read to the end

    async def pause(self, seconds: float) -> None:
        await trio.sleep(seconds)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._inner.aclose()


class HttpxTransport:
    """Any ``httpx.AsyncBaseTransport`` behind ``post``: the request is built as an ``httpx.Request``."""

    def __init__(self, transport: httpx.AsyncBaseTransport, base_url: str, *, connect_timeout: float) -> None:
        self.transport = transport
        self._base = base_url.rstrip("/")
        self._urls: dict[str, httpx.URL] = {}
        # Read by httpx's own transports (a test's); the lean one times its connects itself.
        self._extensions = {"timeout": {"connect": connect_timeout, "pool": connect_timeout, "read": None, "write": None}}

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> httpx.Response:
        url = self._urls.get(path)
        if url is None:  # parsed once per path: a few paths, every request
            url = self._urls[path] = httpx.URL(self._base + path)
        request = httpx.Request("POST", url, content=body, headers=headers, extensions=self._extensions)
        response = await self.transport.handle_async_request(request)
        response.request = request
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream), "an async transport's response streams asynchronously"
        response.stream = _PausableBody(stream)
        return response

    async def expire(self) -> None:
        """Nothing to expire: the transport underneath keeps its own connections, if any."""

    async def aclose(self) -> None:
        await self.transport.aclose()
