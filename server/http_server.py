"""tailguard's own HTTP/1.1 server on Trio: h11 parses, an ASGI app answers.

Why not hypercorn: its per-request cost was a quarter of the router's CPU,
and its Trio writes are shielded from cancellation, so a client that never
reads its stream held its request (and pool seat) past every deadline and
every drain (issue 11). Here:

- every write is bounded by the request's own cancellation and by
  ``write_timeout``; a write that cannot complete closes the connection (a
  half-written response cannot be resumed), which also tells the app
  ``http.disconnect``;
- the head is sent with the first body bytes: one ``send`` for a complete
  answer, one per ASGI body message for a stream, and a send that fits in the
  socket buffer costs no trip through Trio's scheduler;
- once a request's body is read, the app's wait for ``http.disconnect``
  reads the socket: end of file is ``http.disconnect`` at once (the request
  is cancelled, the socket closed); between requests the connection reads
  too, so a client's close is seen at once (no CLOSE-WAIT);
- the head, the body and the idle time between requests have deadlines; the
  number of connections has a cap; a request with both Transfer-Encoding and
  Content-Length is refused (h11 takes it, RFC 9112 says reject), as h11
  refuses conflicting Content-Lengths and unknown transfer codings;
- a drain stops accepting, closes idle connections, lets requests in flight
  finish up to a grace period, then cancels them.

Errors the server answers itself (400, 408, 431, 500, 503) have OpenAI's
error shape and close the connection.
"""

from __future__ import annotations

import errno
import http
import logging
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import h11
import trio

from router.config_types import ServerConfig

from .errors_map import HttpError

log = logging.getLogger("tailguard.http_server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_READ_SIZE = 64 * 1024
_LINGER_SECONDS = 1.0  # after an answer to a request whose body was not read
_LINGER_BYTES = 1 << 20
_ACCEPT_RETRY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.ECONNABORTED}
_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}


_CONFIGURED = ServerConfig()  # the defaults, from their one place


@dataclass(frozen=True)
class HttpSettings:
    """The server's guards (``[server]`` in config.toml); seconds and bytes."""

    max_header_bytes: int = _CONFIGURED.max_header_bytes
    header_timeout: float = _CONFIGURED.header_timeout
    body_timeout: float = _CONFIGURED.body_timeout
    keep_alive_timeout: float = _CONFIGURED.keep_alive_timeout
    write_timeout: float = _CONFIGURED.write_timeout
    max_connections: int = _CONFIGURED.max_connections
    grace_timeout: float = 5.0  # requests in flight at shutdown get this long, then are cancelled
    backlog: int = 1024

    @classmethod
    def from_config(cls, server: ServerConfig, *, grace_timeout: float) -> HttpSettings:
        return cls(
            max_header_bytes=server.max_header_bytes,
            header_timeout=server.header_timeout,
            body_timeout=server.body_timeout,
            keep_alive_timeout=server.keep_alive_timeout,
            write_timeout=server.write_timeout,
            max_connections=server.max_connections,
            grace_timeout=grace_timeout,
        )


@dataclass(frozen=True)
class ServerStatistics:
    """What the server holds now (tests and metrics read it)."""

    connections: int
    refused_connections: int
    draining: bool


def _error_bytes(status: int, message: str, code: str | None) -> bytes:
    """A complete answer that closes the connection, in OpenAI's error shape."""
    error_type = "overloaded" if status == 503 else "internal_error" if status == 500 else "invalid_request_error"
    error = HttpError(status, {"error": {"message": message, "type": error_type, "param": None, "code": code}}, None)
    body = error.encoded()
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    conn.next_event()
    headers = [*error.headers(), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    return conn.send(h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b""))) + body


_TOO_MANY = _error_bytes(503, "too many open connections; retry shortly", "too_many_connections")


class _Socket:
    """A non-blocking socket driven by Trio's readiness waits.

    Unlike ``trio.SocketStream`` a send that completes at once does not
    checkpoint; a send that must wait is bounded by ``write_timeout`` and, when
    it does not complete, closes the socket (``on_abort`` is told).
    """

    __slots__ = ("_sock", "closed", "_write_timeout", "_on_abort")

    def __init__(self, sock: socket.socket, write_timeout: float, on_abort: Callable[[], None]) -> None:
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass  # not TCP (a test's socketpair)
        self._sock = sock
        self._write_timeout = write_timeout
        self._on_abort = on_abort
        self.closed = False

    async def receive_some(self) -> bytes:
        """Bytes from the peer; ``b""`` when it closed or reset the connection."""
        while not self.closed:
            try:
                return self._sock.recv(_READ_SIZE)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self._sock)
                except trio.ClosedResourceError:  # closed by another task of this connection
                    return b""
            except OSError:
                return b""
        return b""

    async def send_all(self, data: bytes) -> None:
        """Write everything, or close the socket; never raises but Cancelled."""
        if self.closed:
            return
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.abort()
            return
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        done = False
        try:
            with trio.move_on_after(self._write_timeout):
                while view:
                    await trio.lowlevel.wait_writable(self._sock)
                    try:
                        view = view[self._sock.send(view) :]
                    except BlockingIOError:
                        pass
                done = True
        except (OSError, trio.ClosedResourceError):
            pass
        finally:
            if not done:  # timed out, cancelled, or the peer is gone: the stream is cut
                self.abort()

    def shutdown_write(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def abort(self) -> None:
        if not self.closed:
            self.close()
            self._on_abort()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()


class _Server:
    """Connections, their count, and the drain."""

    def __init__(self, app: App, settings: HttpSettings, server_address: tuple[str, int]) -> None:
        self.app = app
        self.settings = settings
        self.server_address = server_address
        self.connections = 0
        self.refused = 0
        self.draining = False
        self.idle_scopes: set[trio.CancelScope] = set()
        self._no_connections = trio.Event()

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(self.connections, self.refused, self.draining)

    async def accept(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        while True:
            try:
                sock, peer = listener.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(listener)
                continue
            except OSError as error:
                if error.errno not in _ACCEPT_RETRY_ERRNOS:
                    raise
                log.warning("accept failed (%s); retrying", error)
                await trio.sleep(0.01)
                continue
            if self.connections >= self.settings.max_connections:
                self.refused += 1
                _refuse_at_once(sock)
            else:
                self.connections += 1
                nursery.start_soon(self._serve_connection, sock, peer)
            await trio.lowlevel.checkpoint()

    async def _serve_connection(self, sock: socket.socket, peer: Any) -> None:
        try:
            await _Connection(self, sock, peer).serve()
        except Exception:  # one broken connection must not stop the server
            log.exception("HTTP connection failed")
        finally:
            self.connections -= 1
            if self.connections == 0 and self.draining:
                self._no_connections.set()

    def drain(self) -> None:
        """Accept no more requests: idle connections close now, busy ones after their answer."""
        self.draining = True
        for scope in self.idle_scopes:
            scope.cancel()
        if self.connections == 0:
            self._no_connections.set()

    async def wait_closed(self) -> None:
        await self._no_connections.wait()


def _refuse_at_once(sock: socket.socket) -> None:
    """Over the connection cap: a 503 if it fits in the socket buffer, and close."""
    try:
        sock.setblocking(False)
        sock.send(_TOO_MANY)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        sock.close()


class _Connection:
    """One client connection: requests in sequence (keep-alive), one at a time."""

    def __init__(self, server: _Server, sock: socket.socket, peer: Any) -> None:
        self._server = server
        self._settings = server.settings
        self._sock = _Socket(sock, server.settings.write_timeout, self._aborted)
        self._client = (peer[0], peer[1]) if isinstance(peer, tuple) and len(peer) >= 2 else None
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=server.settings.max_header_bytes)
        self._exchange: _Exchange | None = None

    def _aborted(self) -> None:
        if self._exchange is not None:
            self._exchange.gone.set()

    async def serve(self) -> None:
        try:
            first = True
            while not self._sock.closed:
                request = await self._next_request(first)
                first = False
                if request is None:
                    return
                exchange = _Exchange(self._h11, self._sock, self._server, request)
                self._exchange = exchange
                await exchange.run(self._server.app, self._scope(request))
                self._exchange = None
                if not await exchange.finish():
                    return
                self._h11.start_next_cycle()
        finally:
            self._sock.close()

    async def _next_request(self, first: bool) -> h11.Request | None:
        """The next request's head, or None: the client left, idled out, broke the protocol, or we drain."""
        settings = self._settings
        now = trio.current_time()
        head_deadline = now + settings.header_timeout
        buffered = len(self._h11.trailing_data[0])
        if not buffered:  # nothing of the next request yet: idle
            if self._server.draining:
                return None
            idle_deadline = head_deadline if first else now + settings.keep_alive_timeout
            with trio.CancelScope(deadline=idle_deadline) as idle:
                self._server.idle_scopes.add(idle)
                try:
                    data = await self._sock.receive_some()
                finally:
                    self._server.idle_scopes.discard(idle)
            if idle.cancelled_caught or not data:
                return None
            self._h11.receive_data(data)
            buffered = len(data)
            if not first:
                head_deadline = trio.current_time() + settings.header_timeout
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as error:
                await self._refuse(error.error_status_hint, f"malformed HTTP request: {error}", "bad_request")
                return None
            if isinstance(event, h11.Request):
                # h11 bounds only an incomplete head; a whole one read at once is measured here.
                if buffered > settings.max_header_bytes and buffered - len(self._h11.trailing_data[0]) > settings.max_header_bytes:
                    await self._refuse(431, f"the request's head is over {settings.max_header_bytes} bytes", "bad_request")
                    return None
                return await self._checked(event)
            if event is not h11.NEED_DATA:
                return None  # the connection closed
            with trio.move_on_at(head_deadline):
                data = await self._sock.receive_some()
                if not data:
                    return None
                self._h11.receive_data(data)
                buffered += len(data)
                continue
            await self._refuse(408, f"the request's head did not arrive within {settings.header_timeout:g} s", "request_timeout")
            return None

    async def _checked(self, request: h11.Request) -> h11.Request | None:
        """Refuse what h11 lets through but RFC 9112 forbids: a body framed twice."""
        has_te = has_cl = False
        for name, _ in request.headers:
            if name == b"transfer-encoding":
                has_te = True
            elif name == b"content-length":
                has_cl = True
        if has_te and has_cl:
            await self._refuse(400, "a request may not have both Transfer-Encoding and Content-Length", "bad_request")
            return None
        return request

    async def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer an error of the server's own and close (the rest of the stream cannot be trusted)."""
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self._sock.send_all(_error_bytes(status, message, code))
            await _linger(self._sock)
        self._sock.close()

    def _scope(self, request: h11.Request) -> Scope:
        target = request.target
        raw_path, _, query = target.partition(b"?")
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": self._client,
            "server": self._server.server_address,
        }


async def _linger(sock: _Socket) -> None:
    """Read (and drop) what the client still sends after our last answer, briefly.

    Closing with unread bytes in the socket makes the kernel send a reset,
    which can destroy the answer before the client reads it.
    """
    sock.shutdown_write()
    received = 0
    with trio.move_on_after(_LINGER_SECONDS):
        while received < _LINGER_BYTES:
            data = await sock.receive_some()
            if not data:
                return
            received += len(data)


class _Exchange:
    """One request and its answer: the ASGI ``receive`` and ``send`` of one call."""

    __slots__ = (
        "_h11", "_sock", "_server", "_settings", "_request", "_body_deadline", "_body_done",
        "_head", "_chunked", "_status", "_headers", "started", "complete", "gone", "_body_timed_out", "_bad_body",
        "_body_delivered",
    )

    def __init__(self, conn: h11.Connection, sock: _Socket, server: _Server, request: h11.Request) -> None:
        self._h11 = conn
        self._sock = sock
        self._server = server
        self._settings = server.settings
        self._request = request
        self._body_deadline = trio.current_time() + server.settings.body_timeout
        self._body_done = False
        self._body_delivered = False
        self._head: bytes | None = None
        self._chunked = False
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self.started = False
        self.complete = False
        self.gone = trio.Event()
        self._body_timed_out = False
        self._bad_body: h11.RemoteProtocolError | None = None

    async def run(self, app: App, scope: Scope) -> None:
        self._body_done = self._bodiless()
        try:
            await app(scope, self.receive, self.send)
        except Exception:
            log.exception("%s %s failed in the app", scope["method"], scope["path"])

    async def finish(self) -> bool:
        """After the app returned: answer what it left unanswered; True to keep the connection."""
        sock = self._sock
        if sock.closed or self.gone.is_set():
            if self._body_timed_out and not self.started and not sock.closed:
                timeout = self._settings.body_timeout
                await self._close_with(_error_bytes(408, f"the request's body did not arrive within {timeout:g} s", "request_timeout"))
            sock.close()
            return False
        if self._bad_body is not None and not self.started:
            await self._close_with(_error_bytes(self._bad_body.error_status_hint, f"malformed HTTP request: {self._bad_body}", "bad_request"))
            return False
        if not self.complete:
            if not self.started:
                await self._close_with(_error_bytes(500, "tailguard failed unexpectedly (no answer)", "internal_error"))
            sock.close()
            return False
        conn = self._h11
        if conn.their_state is not h11.DONE:  # a body the app did not read (413, 404, ...)
            await _linger(sock)
            sock.close()
            return False
        if conn.our_state is not h11.DONE:  # MUST_CLOSE: HTTP/1.0, connection: close, a drain
            sock.close()
            return False
        return True

    async def _close_with(self, data: bytes) -> None:
        await self._sock.send_all(data)
        await _linger(self._sock)
        self._sock.close()

    # -- receive ------------------------------------------------------------

    def _bodiless(self) -> bool:
        """Whether the request has no body; if so h11 is moved past its end."""
        for name, value in self._request.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                return False
        return isinstance(self._h11.next_event(), h11.EndOfMessage)

    async def receive(self) -> Message:
        if self._body_done and not self._body_delivered:
            self._body_delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if self._body_delivered or self.gone.is_set():
            await self._watch()
            return {"type": "http.disconnect"}
        conn = self._h11
        chunks: list[bytes] = []
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as error:  # a broken chunked body
                self._bad_body = error
                self.gone.set()
                return {"type": "http.disconnect"}
            if isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
                continue
            if isinstance(event, h11.EndOfMessage):
                self._body_done = self._body_delivered = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            if chunks:
                return {"type": "http.request", "body": b"".join(chunks), "more_body": True}
            if event is not h11.NEED_DATA:  # closed mid-body
                self.gone.set()
                return {"type": "http.disconnect"}
            if conn.client_is_waiting_for_100_continue and not self.started:
                await self._sock.send_all(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
            with trio.move_on_at(self._body_deadline):
                data = await self._sock.receive_some()
                if data:
                    conn.receive_data(data)
                    continue
                self.gone.set()
                return {"type": "http.disconnect"}
            self._body_timed_out = True
            self.gone.set()
            return {"type": "http.disconnect"}

    async def _watch(self) -> None:
        """After the body, until the client leaves: the app's wait for ``http.disconnect``.

        Reads the socket in the app's own task (no task of ours per request):
        end of file means the client left, and the socket is closed at once; a
        pipelined request waits in h11. Returns when the client is gone.
        """
        conn = self._h11
        while not (self.gone.is_set() or self._sock.closed):
            data = await self._sock.receive_some()
            if not data:
                self.gone.set()
                if not self.complete:
                    self._sock.close()
                return
            conn.receive_data(data)
            if len(conn.trailing_data[0]) > self._settings.max_header_bytes:
                break  # a client pipelining that much waits for us; stop reading
        await self.gone.wait()

    # -- send ---------------------------------------------------------------

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            await self._send_body(message.get("body", b""), message.get("more_body", False))
        elif kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self._status = message["status"]
            self._headers = list(message.get("headers", ()))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def _make_head(self, body: bytes, more: bool) -> bytes:
        headers = self._headers
        if not more and not any(name.lower() == b"content-length" for name, _ in headers):
            headers.append((b"content-length", str(len(body)).encode()))
        if self._server.draining:  # this answer is the connection's last
            headers.append((b"connection", b"close"))
        head = self._h11.send(h11.Response(status_code=self._status, headers=headers, reason=_REASONS.get(self._status, b"")))
        self._chunked = b"transfer-encoding: chunked" in head.lower()
        return head

    async def _send_body(self, body: bytes, more: bool) -> None:
        if not self.started or self.complete:
            raise RuntimeError("http.response.body before the start or after the end")
        if self._sock.closed or self.gone.is_set():
            self.complete = not more
            return
        conn = self._h11
        head = self._head
        out = self._make_head(body, more) if head is None else b""
        self._head = b""
        if self._request.method == b"HEAD":
            body = b""
        if not more:
            self.complete = True
            if body:
                out += conn.send(h11.Data(data=body))
            out += conn.send(h11.EndOfMessage())
        elif body:
            # Frame chunks ourselves: h11's Data event costs more than the chunk.
            out += b"%x\r\n%s\r\n" % (len(body), body) if self._chunked else conn.send(h11.Data(data=body))
        if out:
            await self._sock.send_all(out)


async def serve(
    app: App,
    host: str,
    port: int,
    *,
    settings: HttpSettings,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on host:port until ``shutdown_trigger`` returns, then drain.

    Reports the bound addresses (``["http://host:port"]``), as hypercorn's
    ``serve`` does. On shutdown: stop accepting, close idle connections, give
    requests in flight ``settings.grace_timeout`` s, then cancel them.
    """
    listener = _listen(host, port, settings.backlog)
    bound = listener.getsockname()
    server = _Server(app, settings, (bound[0], bound[1]))
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    try:
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as acceptor:
                acceptor.start_soon(server.accept, listener, connections)
                task_status.started([f"http://{shown}:{bound[1]}"])
                await shutdown_trigger()
                acceptor.cancel_scope.cancel()
            trio.lowlevel.notify_closing(listener)
            listener.close()
            server.drain()
            with trio.move_on_after(settings.grace_timeout):
                await server.wait_closed()
            if server.connections:
                log.warning("HTTP drain: %d connections still open after %g s; closing them", server.connections, settings.grace_timeout)
            connections.cancel_scope.cancel()
    finally:
        if listener.fileno() != -1:
            trio.lowlevel.notify_closing(listener)
            listener.close()


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
