"""A lean HTTP/1.1 server on Trio sockets for the simulator (h11 parses, we write).

Why not hypercorn: a relayed SSE event costs ~100 µs of CPU through an ASGI
stack, and the simulator must stream thousands of events a second beside the
router on two cores. Here one engine step costs one ``send_all`` per
connection, whatever the number of tokens in it.

While a response is being produced, a watcher reads the socket: end of file
means the client went away, and the response's cancel scope is cancelled, so
the engine aborts the sequence within a step (as vLLM does).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import h11
import trio

from .app import ApiError, SimResponse

log = logging.getLogger("bench.sim.http")

Handler = Callable[[str, str, Mapping[str, str], bytes], Awaitable[SimResponse]]

MAX_BODY_BYTES = 16 * 1024 * 1024
_READ_SIZE = 64 * 1024


class _Connection:
    """One client connection: requests in sequence (keep-alive), one at a time."""

    def __init__(self, stream: trio.SocketStream, handler: Handler) -> None:
        self._stream = stream
        self._handler = handler
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        self._client_gone = False

    async def serve(self) -> None:
        try:
            while True:
                request = await self._next_request()
                if request is None:
                    return
                await self._respond(*request)
                if self._client_gone or self._h11.our_state is not h11.DONE:
                    return
                if self._h11.their_state is not h11.DONE:
                    return  # the client sent a body we did not read to the end
                self._h11.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            await trio.aclose_forcefully(self._stream)

    async def _next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        while True:
            event = self._h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self._stream.receive_some(_READ_SIZE)
            self._h11.receive_data(data)

    async def _next_request(self) -> tuple[str, str, dict[str, str], bytes] | None:
        try:
            event = await self._next_event()
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None
            if not isinstance(event, h11.Request):
                return None
            method = event.method.decode("ascii")
            path = event.target.decode("latin-1").split("?", 1)[0]
            headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in event.headers}
            declared = int(headers.get("content-length", "0") or 0)
            if declared > MAX_BODY_BYTES:
                await self._send_simple(SimResponse.error(ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")))
                return None
            chunks: list[bytes] = []
            size = 0
            while True:
                event = await self._next_event()
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > MAX_BODY_BYTES:
                        await self._send_simple(SimResponse.error(ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")))
                        return None
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return None
        except h11.RemoteProtocolError as error:
            if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await self._send_simple(SimResponse.error(ApiError(400, f"malformed HTTP request: {error}")))
            return None
        return method, path, headers, b"".join(chunks)

    async def _respond(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_for_disconnect, nursery.cancel_scope)
            response = await self._handler(method, path, headers, body)
            if response.stream is None:
                await self._send_simple(response)
            else:
                try:
                    await self._send_stream(response)
                finally:
                    await response.stream.aclose()
            nursery.cancel_scope.cancel()

    async def _watch_for_disconnect(self, scope: trio.CancelScope) -> None:
        """Cancel the response when the client closes its end of the socket."""
        data = await self._stream.receive_some(_READ_SIZE)
        if not data:
            self._client_gone = True
            scope.cancel()
            return
        # A pipelined request: keep it for the next cycle and stop watching.
        self._h11.receive_data(data)

    async def _send_simple(self, response: SimResponse) -> None:
        headers = [*response.headers, ("content-length", str(len(response.body)))]
        data = self._h11.send(h11.Response(status_code=response.status, headers=headers))
        if response.body:
            data += self._h11.send(h11.Data(data=response.body))
        data += self._h11.send(h11.EndOfMessage())
        await self._stream.send_all(data)

    async def _send_stream(self, response: SimResponse) -> None:
        assert response.stream is not None
        send = self._h11.send
        await self._stream.send_all(send(h11.Response(status_code=response.status, headers=response.headers)))
        async for chunk in response.stream:
            await self._stream.send_all(send(h11.Data(data=chunk)))
        await self._stream.send_all(send(h11.EndOfMessage()))


async def serve(
    handler: Handler,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on host:port until cancelled; reports the bound port."""
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=4096)
    bound = listeners[0].socket.getsockname()[1]

    async def on_connection(stream: trio.SocketStream) -> None:
        await _Connection(stream, handler).serve()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, on_connection, listeners)
        task_status.started(bound)
