"""A lean HTTP/1.1 server on Trio for the simulator (h11 parses, we write).

Why not an ASGI server: a relayed SSE event costs ~100 µs of CPU through an ASGI
stack, and the simulator must stream thousands of events a second beside the
router on two cores. Here one engine step costs one ``send`` per connection,
whatever the number of tokens in it, and a send that fits in the socket
buffer costs no trip through Trio's scheduler (``ReadinessStream.send_all``,
``router/sockets.py``); a
profile showed those trips were a third of the simulator's CPU.

While a response is being produced, a watcher reads the socket: end of file
means the client went away, and the response's cancel scope is cancelled, so
the engine aborts the sequence within a step (as vLLM does).

Between requests a kept-alive connection waits ``keep_alive_timeout`` seconds
(5 by default: uvicorn's ``timeout_keep_alive``, which vLLM sets from
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) for the next request's first byte, then the
server closes it, as uvicorn does; a client that reuses a pooled connection
just after that meets a closed socket.

Connections come from a listening socket (``serve``) or from anything else
that reads and writes like one (``serve_connection``: the in-process
simulator's memory streams, ``bench/sim/memory.py``).

A handler (or a body stream) that raises ``DropConnection`` closes the socket
at once, without a response or in the middle of one. A ``Gate`` (the fault
switch) may close the listening socket and every connection, and open the
same port again later: a killed and revived engine.
"""

from __future__ import annotations

import http
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import h11
import trio

from tailguard.router.sockets import ReadinessStream, accept_forever, listen

from .app import ApiError, DropConnection, SimResponse

log = logging.getLogger("bench.sim.http")

Handler = Callable[[str, str, Mapping[str, str], bytes], Awaitable[SimResponse]]

MAX_BODY_BYTES = 16 * 1024 * 1024
KEEP_ALIVE_TIMEOUT = 5.0  # uvicorn's timeout_keep_alive default, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE
_BACKLOG = 4096


class Gate(Protocol):
    """Whether the server listens now, and a way to wait for that to change."""

    @property
    def listening(self) -> bool: ...

    async def wait_changed(self) -> None: ...


class Connection(Protocol):
    """What the server reads and writes a connection through: ``ReadinessStream``'s calls."""

    async def receive_or_eof(self) -> bytes: ...

    async def send_all(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class _EngineConnection:
    """One client connection: requests in sequence (keep-alive), one at a time."""

    def __init__(self, sock: Connection, handler: Handler, keep_alive_timeout: float) -> None:
        self._sock = sock
        self._handler = handler
        self._keep_alive_timeout = keep_alive_timeout
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
                if not await self._wait_for_next_request():
                    return
        except* (trio.BrokenResourceError, h11.ProtocolError):
            pass  # the client went away or broke the protocol mid-response
        except* DropConnection:
            pass  # on purpose: the socket closes with no (or half a) response
        finally:
            self._sock.close()

    async def _wait_for_next_request(self) -> bool:
        """Wait (at most ``keep_alive_timeout``) for the next request's first bytes; False: idle too long, close.

        As uvicorn's keep-alive timer, it runs only while no byte of the next
        request is here; once one arrives the request is read without it.
        """
        buffered, closed = self._h11.trailing_data
        if buffered or closed:
            return True  # pipelined (kept by the disconnect watcher), or the peer already closed
        with trio.move_on_after(self._keep_alive_timeout):
            self._h11.receive_data(await self._sock.receive_or_eof())
            return True
        return False

    async def _next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        while True:
            event = self._h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self._h11.receive_data(await self._sock.receive_or_eof())

    async def _next_request(self) -> tuple[str, str, dict[str, str], bytes] | None:
        try:
            event = await self._next_event()
            if not isinstance(event, h11.Request):
                return None  # closed, or paused after an unread body
            method = event.method.decode("ascii")
            path = event.target.decode("latin-1").split("?", 1)[0]
            headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in event.headers}
            too_big = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
            if int(headers.get("content-length", "0") or 0) > MAX_BODY_BYTES:
                await self._send_simple(SimResponse.error(too_big))
                return None
            chunks: list[bytes] = []
            size = 0
            while True:
                event = await self._next_event()
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > MAX_BODY_BYTES:
                        await self._send_simple(SimResponse.error(too_big))
                        return None
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return method, path, headers, b"".join(chunks)
                else:
                    return None
        except h11.RemoteProtocolError as error:
            if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await self._send_simple(SimResponse.error(ApiError(400, f"malformed HTTP request: {error}")))
            return None

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
        data = await self._sock.receive_or_eof()
        if not data:
            self._client_gone = True
            scope.cancel()
            return
        # A pipelined request: keep it for the next cycle and stop watching.
        self._h11.receive_data(data)

    async def _send_simple(self, response: SimResponse) -> None:
        headers = [*response.headers, ("content-length", str(len(response.body)))]
        data = self._h11.send(h11.Response(status_code=response.status, headers=headers, reason=_reason(response.status)))
        if response.body:
            data += self._h11.send(h11.Data(data=response.body))
        data += self._h11.send(h11.EndOfMessage())
        await self._sock.send_all(data)

    async def _send_stream(self, response: SimResponse) -> None:
        assert response.stream is not None
        head = self._h11.send(h11.Response(status_code=response.status, headers=response.headers, reason=_reason(response.status)))
        await self._sock.send_all(head)
        send_all = self._sock.send_all
        if b"transfer-encoding: chunked" in head.lower():
            # Frame chunks ourselves: h11's Data event costs more than the event.
            async for chunk in response.stream:
                await send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        else:  # an HTTP/1.0 client: h11 delimits the body by closing
            async for chunk in response.stream:
                await send_all(self._h11.send(h11.Data(data=chunk)))
        await send_all(self._h11.send(h11.EndOfMessage()))


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


async def serve(
    handler: Handler,
    host: str,
    port: int,
    *,
    gate: Gate | None = None,
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on host:port until cancelled; reports the bound port.

    With a ``gate``, the port is closed (and every connection dropped) while
    ``gate.listening`` is false, and bound again when it turns true. A
    connection idle ``keep_alive_timeout`` seconds between requests is closed.
    """
    if keep_alive_timeout < 0:
        raise ValueError(f"keep_alive_timeout must not be negative, got {keep_alive_timeout}")
    listener = listen(host, port, _BACKLOG)
    bound = listener.getsockname()[1]
    task_status.started(bound)
    while True:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_accept, listener, handler, nursery, keep_alive_timeout)
                if gate is not None:
                    nursery.start_soon(_close_when_shut, gate, nursery.cancel_scope)
        finally:
            trio.lowlevel.notify_closing(listener)
            listener.close()
        assert gate is not None  # only a gate ends the accept loop without an error
        while not gate.listening:
            await gate.wait_changed()
        listener = listen(host, bound, _BACKLOG)


async def _close_when_shut(gate: Gate, scope: trio.CancelScope) -> None:
    while gate.listening:
        await gate.wait_changed()
    scope.cancel()  # the accept loop and every connection: their sockets close


async def serve_connection(connection: Connection, handler: Handler, keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT) -> None:
    """Serve one client connection until either end closes it (it is closed then)."""
    try:
        await _EngineConnection(connection, handler, keep_alive_timeout).serve()
    except Exception:  # one broken connection must not stop the server
        log.exception("connection failed")


async def _accept(listener: socket.socket, handler: Handler, nursery: trio.Nursery, keep_alive_timeout: float) -> None:
    def on_accept(sock: socket.socket, _: object) -> None:
        nursery.start_soon(serve_connection, ReadinessStream(sock), handler, keep_alive_timeout)

    await accept_forever(listener, on_accept, log)
