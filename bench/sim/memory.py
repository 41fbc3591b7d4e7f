"""An in-process connector to a simulated engine: its HTTP server on memory streams, no socket.

``LeanTransport(url, connect=memory_connector(app.handle, nursery))`` (or a
:class:`~tailguard.router.backend.lean_transport.ConnectorTransport` over it, handed
to the router) writes production's request bytes and parses the response
with production's parser, while the engine's end is the same server code that
serves real sockets (``bench/sim/http.py``). Memory streams take no time, so
it runs under ``trio.testing.MockClock`` (real sockets do not).
"""

from __future__ import annotations

import trio
import trio.testing

from tailguard.router.backend import BackendStream, Connector, SleepingStream
from tailguard.router.sockets import READ_SIZE

from .http import KEEP_ALIVE_TIMEOUT, Handler, serve_connection


class _ServerEnd:
    """The engine's end, read and written as the server reads a socket (``ReadinessStream``'s calls)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: trio.StapledStream[trio.testing.MemorySendStream, trio.testing.MemoryReceiveStream]) -> None:
        self._stream = stream

    async def receive_or_eof(self) -> bytes:
        """Bytes from the client; ``b""`` when it closed its end, or this end was closed."""
        try:
            return bytes(await self._stream.receive_some(READ_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def send_all(self, data: bytes) -> None:
        await self._stream.send_all(data)

    def close(self) -> None:
        """Close both directions now: the client reads its end of file, its next write breaks."""
        self._stream.send_stream.close()
        self._stream.receive_stream.close()


def memory_connector(handler: Handler, nursery: trio.Nursery, *, keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT) -> Connector:
    """Each connect makes a memory stream pair and serves its far end in ``nursery`` (which must outlive the connections)."""

    async def connect() -> BackendStream:
        client, server = trio.testing.memory_stream_pair()
        nursery.start_soon(serve_connection, _ServerEnd(server), handler, keep_alive_timeout)
        await trio.lowlevel.checkpoint()
        return SleepingStream(client)

    return connect
