"""The HTTP server's connections: each one's requests in sequence, their count, their idle deadlines, and the drain."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import trio

from tailguard.router.sockets import accept_forever

from .answers import TOO_MANY, error_bytes
from .client_socket import ClientSocket, ClientStream, TlsClientSocket, close_with, tls_handshake
from .exchange import ServerExchange
from .reader import ParsedRequest, Refusal, RequestReader
from .settings import App, HttpSettings, Scope, ServerStatistics, ServerTls

log = logging.getLogger("tailguard.http_server")

# Reads and writes that complete at once do not pass through Trio's scheduler;
# a connection yields to the others at least once per this many requests.
_REQUESTS_PER_YIELD = 32
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_METHODS = {m: m.decode() for m in (b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH")}
_INF = float("inf")


class IdleTimers:
    """Idle connections and their deadlines; one task closes those past theirs.

    A cancel scope per wait between requests cost more than the rest of the
    wait; here a wait is an entry in a dict. Each dict holds deadlines of one
    timeout (now + a constant), so its insertion order is its deadline order
    and the earliest is its first entry. Closing the socket ends the wait
    (``receive_some`` returns end of file), as a client's close would.
    """

    __slots__ = ("fresh", "kept", "_wake_at", "_sleep")

    def __init__(self) -> None:
        self.fresh: dict[ServerConnection, float] = {}  # before a connection's first request (header_timeout)
        self.kept: dict[ServerConnection, float] = {}  # between requests (keep_alive_timeout)
        self._wake_at = _INF
        self._sleep: trio.CancelScope | None = None

    def add(self, timers: dict[ServerConnection, float], connection: ServerConnection, deadline: float) -> None:
        timers[connection] = deadline
        if deadline < self._wake_at and self._sleep is not None:  # only when ``timers`` was empty
            self._wake_at = self._sleep.deadline = deadline

    async def run(self) -> None:
        """Close connections idle past their deadline, at their deadline."""
        while True:
            now = trio.current_time()
            earliest = _INF
            for timers in (self.fresh, self.kept):
                while timers:
                    connection, deadline = next(iter(timers.items()))
                    if deadline > now:
                        earliest = min(earliest, deadline)
                        break
                    del timers[connection]
                    connection.close()
            self._wake_at = earliest
            with trio.CancelScope(deadline=earliest) as self._sleep:
                await trio.sleep_forever()

    def close_all(self) -> None:
        for timers in (self.fresh, self.kept):
            for connection in list(timers):
                connection.close()
            timers.clear()


class Connections:
    """Connections, their count, and the drain."""

    def __init__(
        self,
        app: App,
        settings: HttpSettings,
        server_address: tuple[str, int],
        tls: ServerTls | None = None,
        on_refusal: Callable[[int, str], None] | None = None,
    ) -> None:
        self.app = app
        self.on_refusal = on_refusal
        self.settings = settings
        self.server_address = server_address
        self.tls = tls
        self.connections = 0
        self.refused = 0
        self.draining = False
        self.idle = IdleTimers()
        self._no_connections = trio.Event()

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(self.connections, self.refused, self.draining)

    async def accept(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        """Serve each accepted connection in ``nursery``; over ``max_connections``, a 503 and close."""

        def on_accept(sock: socket.socket, peer: Any) -> None:
            if self.connections >= self.settings.max_connections:
                self.refused += 1
                refuse_at_once(sock)
            else:
                self.connections += 1
                nursery.start_soon(self._serve_connection, sock, peer)

        await accept_forever(listener, on_accept, log)

    async def _serve_connection(self, sock: socket.socket, peer: Any) -> None:
        try:
            context = None if self.tls is None else self.tls.context
            if context is None:
                await ServerConnection(self, sock, peer).serve()
            else:  # the header timeout runs from here: it covers the handshake and the first head
                deadline = trio.current_time() + self.settings.header_timeout
                stream = await tls_handshake(sock, context, self.settings, deadline)
                if stream is not None:
                    await ServerConnection(self, sock, peer, stream, deadline).serve()
        except Exception:  # one broken connection must not stop the server
            log.exception("HTTP connection failed")
        finally:
            self.connections -= 1
            if self.connections == 0 and self.draining:
                self._no_connections.set()

    def drain(self) -> None:
        """Accept no more requests: idle connections close now, busy ones after their answer."""
        self.draining = True
        self.idle.close_all()
        if self.connections == 0:
            self._no_connections.set()

    async def wait_closed(self) -> None:
        await self._no_connections.wait()


def refuse_at_once(sock: socket.socket) -> None:
    """Over the connection cap: a 503 if it fits in the socket buffer, and close."""
    try:
        sock.setblocking(False)
        sock.send(TOO_MANY)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        sock.close()


class ServerConnection:
    """One client connection: requests in sequence (keep-alive), one at a time."""

    __slots__ = ("_server", "_settings", "_sock", "_client", "requests", "_exchange", "_scheme", "_first_deadline")

    def __init__(
        self,
        server: Connections,
        sock: socket.socket,
        peer: Any,
        tls: trio.SSLStream[trio.SocketStream] | None = None,
        first_deadline: float = 0.0,
    ) -> None:
        self._server = server
        self._settings = server.settings
        self._sock: ClientStream
        if tls is None:
            self._sock = ClientSocket(sock, server.settings.write_timeout, self._aborted)
            self._scheme = "http"
        else:
            self._sock = TlsClientSocket(tls, server.settings.write_timeout, self._aborted)
            self._scheme = "https"
        self._first_deadline = first_deadline  # TLS's: the first head's deadline, from before the handshake
        self._client = (peer[0], peer[1]) if isinstance(peer, tuple) and len(peer) >= 2 else None
        self.requests = RequestReader(server.settings.max_header_bytes)
        self._exchange: ServerExchange | None = None

    def _aborted(self, stalled: bool) -> None:
        if self._exchange is not None:
            self._exchange.set_gone(stalled=stalled)

    def close(self) -> None:
        """Idle past the deadline, or a drain: the wait for the next request ends at once."""
        self._sock.close()

    async def serve(self) -> None:
        try:
            first = True
            app = self._server.app
            served = 0
            while not self._sock.closed:
                request = await self._next_request(first)
                first = False
                if request is None:
                    return
                served += 1
                if served % _REQUESTS_PER_YIELD == 0:  # a pipelining client must not hold the loop
                    await trio.lowlevel.checkpoint()
                exchange = self._exchange = ServerExchange(self._sock, self._server, self.requests, request)
                await exchange.run(app, self._scope(request))
                self._exchange = None
                if not await exchange.finish():
                    return
        finally:
            self._sock.close()
            self.requests.close()

    async def _next_request(self, first: bool) -> ParsedRequest | None:
        """The next request's head, or None: the client left, idled out, broke the protocol, or we drain."""
        requests = self.requests
        if requests.queue:  # pipelined: read while the one before was answered
            return requests.queue.popleft()
        server = self._server
        settings = self._settings
        sock = self._sock
        head_deadline = 0.0
        if requests.refusal is None and not requests.stopped and not requests.head_started:  # idle
            if server.draining:
                return None
            now = trio.current_time()
            if first:
                head_deadline = self._first_deadline or now + settings.header_timeout
                timers = server.idle.fresh
                server.idle.add(timers, self, head_deadline)
            else:
                timers = server.idle.kept
                server.idle.add(timers, self, now + settings.keep_alive_timeout)
            try:
                data = await sock.receive_some()
            finally:
                timers.pop(self, None)
            if not data:  # the client left, or idled out (the socket is closed)
                return None
            requests.feed(data)
            if requests.queue:  # the usual case: the whole head in one read
                return requests.queue.popleft()
        if not head_deadline:
            head_deadline = trio.current_time() + settings.header_timeout
        while True:
            if requests.queue:
                return requests.queue.popleft()
            if requests.refusal is not None:
                await self._refuse(requests.refusal)
                return None
            if requests.stopped:
                return None
            with trio.move_on_at(head_deadline):
                data = await sock.receive_some()
                if not data:
                    return None
                requests.feed(data)
                continue
            await self._refuse(Refusal(408, f"the request's head did not arrive within {settings.header_timeout:g} s", "request_timeout"))
            return None

    async def _refuse(self, refusal: Refusal) -> None:
        """Answer an error of the server's own and close (the rest of the stream cannot be trusted)."""
        await close_with(self._sock, error_bytes(refusal.status, refusal.message, refusal.code))
        hook = self._server.on_refusal
        if hook is not None:
            try:
                hook(refusal.status, refusal.message)
            except Exception:  # the log's trouble must not become the connection's
                log.exception("recording a refused request failed")

    def _scope(self, request: ParsedRequest) -> Scope:
        raw_path, _, query = request.target.partition(b"?")
        method = request.method
        return {
            "type": "http",
            "asgi": _ASGI,
            "http_version": request.http_version,
            "method": _METHODS.get(method) or method.decode("ascii"),
            "scheme": self._scheme,
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": request.headers,
            "client": self._client,
            "server": self._server.server_address,
        }

