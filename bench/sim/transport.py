"""An httpx transport that puts a simulated engine in-process: no sockets.

``httpx.AsyncClient(transport=SimTransport(app))`` talks to the same
``SimApp`` the socket server runs, so the router and the benchmarks can run
an hour of traffic under ``trio.testing.MockClock``. Closing a streamed
response aborts the sequence, exactly like a socket client hanging up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from .app import SimApp, TokenStream


class _StreamBody(httpx.AsyncByteStream):
    def __init__(self, stream: TokenStream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


class SimTransport(httpx.AsyncBaseTransport):
    """Routes every request of a client to one engine's API."""

    def __init__(self, app: SimApp) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers = {name.lower(): value for name, value in request.headers.items()}
        response = await self.app.handle(request.method, request.url.path, headers, body)
        if response.stream is None:
            return httpx.Response(response.status, headers=response.headers, content=response.body)
        return httpx.Response(response.status, headers=response.headers, stream=_StreamBody(response.stream))
