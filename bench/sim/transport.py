"""An httpx transport that puts a simulated engine in-process: no sockets.

``httpx.AsyncClient(transport=SimTransport(app))`` talks to the same
``SimApp`` the socket server runs, so the router and the benchmarks can run
an hour of traffic under ``trio.testing.MockClock``. Closing a streamed
response aborts the sequence, exactly like a socket client hanging up; a
dropped connection (``DropConnection``) is httpx's ``RemoteProtocolError``, as
over a socket.

It calls the engine's API directly, with no HTTP in between: a closed
response aborts the sequence before ``aclose`` returns. A router that should
run production's transport over an in-process engine is given a
``ConnectorTransport`` over ``memory.memory_connector`` instead (the
simulator's HTTP server on memory streams).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from .app import BodyStream, DropConnection, SimApp
from .http import Handler


class _StreamBody(httpx.AsyncByteStream):
    def __init__(self, stream: BodyStream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream:
                yield chunk
        except DropConnection:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body") from None

    async def aclose(self) -> None:
        await self._stream.aclose()


class SimTransport(httpx.AsyncBaseTransport):
    """Routes every request of a client to one engine's API."""

    def __init__(self, app: SimApp | Handler) -> None:
        self.app = app
        self._handle: Handler = app.handle if isinstance(app, SimApp) else app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers = {name.lower(): value for name, value in request.headers.items()}
        try:
            response = await self._handle(request.method, request.url.path, headers, body)
        except DropConnection:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request) from None
        if response.stream is None:
            return httpx.Response(response.status, headers=response.headers, content=response.body)
        return httpx.Response(response.status, headers=response.headers, stream=_StreamBody(response.stream))
