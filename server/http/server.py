"""tailguard's own HTTP/1.1 server on Trio: llhttp parses, an ASGI app answers.

Why a server of its own: the ASGI server used before cost a quarter of the
router's CPU a request, and its Trio writes were shielded from cancellation, so a client that never
reads its stream held its request (and pool seat) past every deadline and
every drain (issue 11). Why llhttp (httptools) and not h11: h11 is pure
Python, and was most of this server's own CPU in a profile at saturation
(``python -m bench router-overhead`` under py-spy). Here:

- requests are parsed by llhttp (C) through ``httptools.HttpRequestParser``;
  the server never parses HTTP itself, it only writes responses: status
  line, headers and, when the body is known, the body in one buffer and one
  ``send``; a stream's chunks are framed as they go;
- every write is bounded by the request's own cancellation and by
  ``write_timeout``; a write that cannot complete closes the connection (a
  half-written response cannot be resumed), which also tells the app
  ``http.disconnect``;
- once a request's body is read, the app's wait for ``http.disconnect``
  reads the socket: end of file is ``http.disconnect`` at once (the request
  is cancelled, the socket closed); between requests the connection reads
  too, so a client's close is seen at once (no CLOSE-WAIT);
- pipelined requests are parsed as they arrive, queued in order and
  answered in order, one at a time; while a request is answered at most
  ``max_header_bytes`` more are read;
- the head, the body and the idle time between requests have deadlines (an
  idle wait is an entry in a dict that one task reaps, not a cancel scope
  per request); the number of connections has a cap;
- a connection yields to the others at least every 32 requests: reads and
  writes that complete at once do not pass through Trio's scheduler;
- a drain stops accepting, closes idle connections, lets requests in flight
  finish up to a grace period, then cancels them.

RFC 9112 checks, and who does them. llhttp, strict (httptools 0.9 sets a
lenient flag only through ``set_dangerous_leniencies``, which this module
never calls; tests/test_http_server_parser.py pins each refusal): the
request line and version syntax, header name tokens and value characters
(no control bytes but tab, no obs-fold), bare LF, Content-Length syntax and
overflow, a duplicate Content-Length (even an identical one), Content-Length
together with Transfer-Encoding, chunked not the last coding, the chunked
framing itself, and data after a request that closes the connection. This
module: Transfer-Encoding other than exactly ``chunked`` (501, as a server
that does not implement a coding must), Host missing or repeated in
HTTP/1.1 (400), versions other than 1.0 and 1.1 (505), the head's size (431),
and the framing of responses (Content-Length or chunked; HEAD, 204 and 304
without a body; ``connection: close`` for HTTP/1.0, a client's close or a
drain; a response header with CR, LF or NUL, or a body that does not match
its declared length, is never sent). Upgrades (and CONNECT) are not served: such a request is answered
and the connection closed.

Errors the server answers itself (400, 408, 431, 500, 501, 503, 505) have
OpenAI's error shape and close the connection.
"""

from __future__ import annotations

import errno
import http
import logging
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import httptools
import trio

from tailguard.router.config_types import ServerConfig

from ..errors_map import HttpError

log = logging.getLogger("tailguard.http_server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_READ_SIZE = 64 * 1024
_LINGER_SECONDS = 1.0  # after an answer to a request whose body was not read
_LINGER_BYTES = 1 << 20
_CHUNK_LINE_BYTES = 64  # framing allowed per chunk of a chunked body (size line, extensions)
# Reads and writes that complete at once do not pass through Trio's scheduler;
# a connection yields to the others at least once per this many requests.
_REQUESTS_PER_YIELD = 32
_ACCEPT_RETRY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.ECONNABORTED}
_STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in http.HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_METHODS = {m: m.decode() for m in (b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH")}
_VERSIONS = frozenset(("1.1", "1.0"))
_INF = float("inf")


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
    reuse_port: bool = False  # several worker processes accept on the same port (SO_REUSEPORT)

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


class ServerTls:
    """The context a TLS listener hands each new connection; ``context`` is replaced on reload.

    A connection keeps the context it was accepted with; None serves plain
    TCP (the listener was started with TLS and a reload turned it off).
    """

    __slots__ = ("context",)

    def __init__(self, context: ssl.SSLContext | None) -> None:
        self.context = context


def _status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status


def _error_bytes(status: int, message: str, code: str | None) -> bytes:
    """A complete answer that closes the connection, in OpenAI's error shape."""
    error_type = "overloaded" if status == 503 else "internal_error" if status == 500 else "invalid_request_error"
    error = HttpError(status, {"error": {"message": message, "type": error_type, "param": None, "code": code}}, None)
    body = error.encoded()
    headers = [*error.headers(), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    return _status_line(status) + b"".join(b"%s: %s\r\n" % header for header in headers) + b"\r\n" + body


_TOO_MANY = _error_bytes(503, "too many open connections; retry shortly", "too_many_connections")
_NOT_TLS = _error_bytes(400, "this port speaks TLS: use https://", "tls_required")
_TLS_HANDSHAKE = 0x16  # the first byte of a TLS record that opens a handshake


# -- reading requests: llhttp's callbacks -----------------------------------------------


@dataclass(frozen=True)
class _Refusal:
    """A request the server will not serve: the answer, then close."""

    status: int
    message: str
    code: str = "bad_request"


class _Refused(Exception):
    """Raised from a parser callback: llhttp stops, ``_Requests.feed`` records the refusal."""


class _Request:
    """One request's head, and its body as it arrives (llhttp fills it in)."""

    __slots__ = ("method", "target", "http_version", "headers", "keep_alive", "expect_continue", "body", "complete")

    def __init__(self, method: bytes, target: bytes, http_version: str, headers: list[tuple[bytes, bytes]], keep_alive: bool, expect_continue: bool) -> None:
        self.method = method
        self.target = target
        self.http_version = http_version
        self.headers = headers
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body: list[bytes] = []  # arrived, not yet handed to the app
        self.complete = False  # the whole body arrived


class _Requests:
    """The requests arriving on one connection, parsed by llhttp: a sans-I/O reader.

    ``feed`` hands bytes to llhttp, whose callbacks (the ``on_*`` methods)
    queue each request once its head is complete and add body bytes to it;
    a request that cannot be served becomes ``refusal``, after the requests
    before it, and nothing after it is parsed.

    The head's size: llhttp has no limit of its own. A head that arrived
    whole is measured from its parts when the bytes read for it could exceed
    the limit; a head still incomplete after a read is refused once the
    bytes read since the last request ended exceed the limit (bytes of the
    read in which that request ended are not counted, so an incomplete head
    is held to the limit plus one read at most). Chunked framing and trailers
    are bounded the same way.
    """

    __slots__ = (
        "_parser", "_limit", "queue", "refusal", "stopped", "_url", "_headers", "_hosts", "_expect", "_parsing", "_last",
        "_fed", "_feed_start", "_head_low", "_head_high", "_body_mark", "_body_seen", "_chunks",
    )

    def __init__(self, max_header_bytes: int) -> None:
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._limit = max_header_bytes
        self.queue: deque[_Request] = deque()
        self.refusal: _Refusal | None = None
        self.stopped = False  # after an upgrade request: what follows is not ours to parse
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._hosts = 0
        self._expect = False
        self._parsing: _Request | None = None  # head complete, body not yet
        self._last: _Request | None = None
        self._fed = 0  # bytes fed to llhttp, all told
        self._feed_start = 0  # _fed before the current feed
        self._head_low = 0  # _fed before the feed in which the last request ended
        self._head_high = 0  # _fed after it
        self._body_mark = 0  # _fed after the feed in which the body being parsed began
        self._body_seen = 0  # body bytes since then
        self._chunks = 0

    def close(self) -> None:
        """Drop the parser (it holds this object's methods: a cycle otherwise left to the GC)."""
        self._parser = None

    @property
    def head_started(self) -> bool:
        """Whether some of the next request's head is buffered (after the queued ones)."""
        return self._fed > self._head_high or bool(self._url) or self._parsing is not None

    def feed(self, data: bytes) -> None:
        parser = self._parser
        if self.refusal is not None or self.stopped or parser is None:
            return  # llhttp stopped at the error; nothing after it is served
        self._feed_start = self._fed
        self._fed += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrades are not served: that request is answered and the connection closed.
            if self._last is not None:
                self._last.keep_alive = False
            self.stopped = True
            return
        except httptools.HttpParserError as error:  # a _Refused from a callback comes as one too
            if self.refusal is None:
                self.refusal = _parser_refusal(error)
            return
        parsing = self._parsing
        if parsing is None:
            if self._fed - self._head_high > self._limit:
                self.refusal = _Refusal(431, f"the request's head is over {self._limit} bytes")
        elif self._fed - self._body_mark - self._body_seen > self._limit + _CHUNK_LINE_BYTES * self._chunks:
            self.refusal = _Refusal(431, f"the request's chunked framing and trailers are over {self._limit} bytes")

    def _refuse(self, refusal: _Refusal) -> None:
        if self.refusal is None:
            self.refusal = refusal
        raise _Refused

    # llhttp's callbacks, in the order it calls them

    def on_url(self, url: bytes) -> None:
        self._url += url  # in pieces when the target arrives in pieces

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._parsing is not None:
            return  # a trailer of a chunked body: not passed on (bounded in ``feed``)
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp strips the whitespace before a value, not after
        self._headers.append((name, value))
        if name == b"host":
            self._hosts += 1
        elif name == b"transfer-encoding":
            if value.strip().lower() != b"chunked" or any(n == b"transfer-encoding" for n, _ in self._headers[:-1]):
                self._refuse(_Refusal(501, f"unsupported transfer-encoding: {value.decode('latin-1')!r} (only chunked)"))
        elif name == b"expect":
            self._expect = value.strip().lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        version = parser.get_http_version()
        headers = self._headers
        if self._fed - self._head_low > self._limit:  # the bytes read could hold a head over the limit: measure it
            size = len(self._url) + sum(len(name) + len(value) + 4 for name, value in headers) + 24
            if size > self._limit:
                self._refuse(_Refusal(431, f"the request's head is over {self._limit} bytes"))
        if version not in _VERSIONS:
            self._refuse(_Refusal(505, f"HTTP/{version} is not supported (HTTP/1.1 and HTTP/1.0 are)"))
        if self._hosts != 1 and version == "1.1":
            self._refuse(_Refusal(400, "an HTTP/1.1 request needs one Host header" + (" (it has several)" if self._hosts else "")))
        modern = version == "1.1"
        request = _Request(
            parser.get_method(), self._url, version, headers, modern and parser.should_keep_alive(), modern and self._expect
        )
        self._url = b""
        self._headers = []
        self._hosts = 0
        self._expect = False
        self._parsing = self._last = request
        self._body_mark = self._fed
        self._body_seen = self._chunks = 0
        self.queue.append(request)

    def on_body(self, body: bytes) -> None:
        request = self._parsing
        assert request is not None
        request.body.append(body)
        self._body_seen += len(body)

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_message_complete(self) -> None:
        request = self._parsing
        assert request is not None
        request.complete = True
        self._parsing = None
        self._head_low = self._feed_start
        self._head_high = self._fed


def _parser_refusal(error: httptools.HttpParserError) -> _Refusal:
    """llhttp's error as an answer: 501 for a transfer coding it refused, 400 otherwise."""
    reason = str(error)
    if "`Transfer-Encoding`" in reason:  # llhttp's reasons for a coding list that does not end in one chunked
        return _Refusal(501, f"unsupported transfer-encoding ({reason}); only chunked")
    return _Refusal(400, f"malformed HTTP request: {reason}")


def _ignore(stalled: bool = False) -> None:
    pass


# -- the socket ---------------------------------------------------------------------------


class _Socket:
    """A non-blocking socket driven by Trio's readiness waits.

    Unlike ``trio.SocketStream`` a send that completes at once does not
    checkpoint; a send that must wait is bounded by ``write_timeout`` and, when
    it does not complete, closes the socket (``on_abort`` is told).
    """

    __slots__ = ("_sock", "closed", "_write_timeout", "_on_abort", "_drained")

    def __init__(self, sock: socket.socket, write_timeout: float, on_abort: Callable[[bool], None]) -> None:
        sock.setblocking(False)
        # After a read that came back short the socket is almost surely empty:
        # the next read waits for readiness first instead of a recv that fails
        # with EAGAIN (a system call and an exception each request). A fresh
        # connection counts as read: its first bytes may not be here yet.
        self._drained = True
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
        wait = self._drained
        if not wait:  # the last read filled its buffer (a big body): more may be there, but let the others run first
            await trio.lowlevel.checkpoint()
        while not self.closed:
            if wait:
                try:
                    await trio.lowlevel.wait_readable(self._sock)
                except trio.ClosedResourceError:  # closed by another task of this connection
                    return b""
            try:
                data = self._sock.recv(_READ_SIZE)
            except BlockingIOError:
                wait = True
                continue
            except OSError:
                return b""
            self._drained = len(data) < _READ_SIZE
            return data
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
        done = stalled = False
        try:
            with trio.move_on_after(self._write_timeout) as waited:
                while view:
                    await trio.lowlevel.wait_writable(self._sock)
                    try:
                        view = view[self._sock.send(view) :]
                    except BlockingIOError:
                        pass
                done = True
            stalled = waited.cancelled_caught  # the peer stopped reading: tailguard cuts it
        except (OSError, trio.ClosedResourceError):
            pass
        finally:
            if not done:  # timed out, cancelled, or the peer is gone: the stream is cut
                self.abort(stalled=stalled)

    def shutdown_write(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def abort(self, *, stalled: bool = False) -> None:
        if not self.closed:
            on_abort = self._on_abort
            self.close()
            on_abort(stalled)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._on_abort = _ignore  # it refers back to the connection: no cycle left for the GC
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()


class _TlsSocket:
    """A TLS connection (``trio.SSLStream`` over the accepted socket) behind ``_Socket``'s interface.

    Only TLS listeners pay for it; the plain path keeps its raw socket. As
    there, reads return ``b""`` when the peer is gone, a write that cannot
    complete within ``write_timeout`` closes the connection (``on_abort`` is
    told), and ``close`` is synchronous: it closes the socket under the
    stream, which wakes a task waiting on it.
    """

    __slots__ = ("_stream", "_raw", "closed", "_write_timeout", "_on_abort")

    def __init__(self, stream: trio.SSLStream[trio.SocketStream], write_timeout: float, on_abort: Callable[[bool], None]) -> None:
        self._stream = stream
        self._raw = stream.transport_stream.socket
        self._write_timeout = write_timeout
        self._on_abort = on_abort
        self.closed = False

    async def receive_some(self) -> bytes:
        """Bytes from the peer; ``b""`` when it closed, reset or broke the TLS stream."""
        if self.closed:
            return b""
        try:
            data = await self._stream.receive_some(_READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""
        return data if isinstance(data, bytes) else bytes(data)

    async def send_all(self, data: bytes) -> None:
        """Write everything, or close the connection; never raises but Cancelled."""
        if self.closed:
            return
        done = stalled = False
        try:
            with trio.move_on_after(self._write_timeout) as waited:
                await self._stream.send_all(data)
                done = True
            stalled = waited.cancelled_caught  # the peer stopped reading: tailguard cuts it
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if not done:
                self.abort(stalled=stalled)

    def shutdown_write(self) -> None:
        """End of file for the peer (without TLS's close_notify: HTTP's framing says where answers end)."""
        try:
            self._raw.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def abort(self, *, stalled: bool = False) -> None:
        if not self.closed:
            on_abort = self._on_abort
            self.close()
            on_abort(stalled)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._on_abort = _ignore
            self._raw.close()  # Trio's socket: tells a task waiting on it first


async def _tls_handshake(
    sock: socket.socket, context: ssl.SSLContext, settings: HttpSettings, deadline: float
) -> trio.SSLStream[trio.SocketStream] | None:
    """TLS's handshake on an accepted socket, by ``deadline``; None, the socket closed, if it fails.

    A client that speaks plain HTTP to the port gets a 400 saying so (its
    first byte cannot open a TLS handshake); one that fails the handshake
    (no certificate where one is required, an unknown CA, too slow) is
    closed, logged, and never reaches the request path.
    """
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    stream = None
    first = b""
    try:
        with trio.move_on_at(deadline):
            await trio.lowlevel.wait_readable(sock)
            try:
                first = sock.recv(1, socket.MSG_PEEK)
            except OSError:
                return None  # reset before a byte: nothing to say
            if not first:
                return None  # connected and left (a load balancer's TCP probe)
            if first[0] != _TLS_HANDSHAKE:
                await _close_with(_Socket(sock, settings.write_timeout, _ignore), _NOT_TLS)
                return None
            tls = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), context, server_side=True, https_compatible=True)
            await tls.do_handshake()
            stream = tls
        if stream is None and first:
            log.info("TLS handshake with %s: not done within server.header_timeout (%g s)", _peer(sock), settings.header_timeout)
    except trio.BrokenResourceError as error:
        cause = error.__cause__
        log.info("TLS handshake with %s failed: %s", _peer(sock), getattr(cause, "reason", None) or cause or error)
    finally:
        if stream is None and sock.fileno() != -1:
            trio.lowlevel.notify_closing(sock)
            sock.close()
    return stream


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "a client"
    return f"{host}:{port}"


# -- the server and its connections ----------------------------------------------------------


class _IdleTimers:
    """Idle connections and their deadlines; one task closes those past theirs.

    A cancel scope per wait between requests cost more than the rest of the
    wait; here a wait is an entry in a dict. Each dict holds deadlines of one
    timeout (now + a constant), so its insertion order is its deadline order
    and the earliest is its first entry. Closing the socket ends the wait
    (``receive_some`` returns end of file), as a client's close would.
    """

    __slots__ = ("fresh", "kept", "_wake_at", "_sleep")

    def __init__(self) -> None:
        self.fresh: dict[_Connection, float] = {}  # before a connection's first request (header_timeout)
        self.kept: dict[_Connection, float] = {}  # between requests (keep_alive_timeout)
        self._wake_at = _INF
        self._sleep: trio.CancelScope | None = None

    def add(self, timers: dict[_Connection, float], connection: _Connection, deadline: float) -> None:
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


class _Server:
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
        self.idle = _IdleTimers()
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
            context = None if self.tls is None else self.tls.context
            if context is None:
                await _Connection(self, sock, peer).serve()
            else:  # the header timeout runs from here: it covers the handshake and the first head
                deadline = trio.current_time() + self.settings.header_timeout
                stream = await _tls_handshake(sock, context, self.settings, deadline)
                if stream is not None:
                    await _Connection(self, sock, peer, stream, deadline).serve()
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

    __slots__ = ("_server", "_settings", "_sock", "_client", "requests", "_exchange", "_scheme", "_first_deadline")

    def __init__(
        self,
        server: _Server,
        sock: socket.socket,
        peer: Any,
        tls: trio.SSLStream[trio.SocketStream] | None = None,
        first_deadline: float = 0.0,
    ) -> None:
        self._server = server
        self._settings = server.settings
        self._sock: _Socket | _TlsSocket
        if tls is None:
            self._sock = _Socket(sock, server.settings.write_timeout, self._aborted)
            self._scheme = "http"
        else:
            self._sock = _TlsSocket(tls, server.settings.write_timeout, self._aborted)
            self._scheme = "https"
        self._first_deadline = first_deadline  # TLS's: the first head's deadline, from before the handshake
        self._client = (peer[0], peer[1]) if isinstance(peer, tuple) and len(peer) >= 2 else None
        self.requests = _Requests(server.settings.max_header_bytes)
        self._exchange: _Exchange | None = None

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
                exchange = self._exchange = _Exchange(self._sock, self._server, self.requests, request)
                await exchange.run(app, self._scope(request))
                self._exchange = None
                if not await exchange.finish():
                    return
        finally:
            self._sock.close()
            self.requests.close()

    async def _next_request(self, first: bool) -> _Request | None:
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
            await self._refuse(_Refusal(408, f"the request's head did not arrive within {settings.header_timeout:g} s", "request_timeout"))
            return None

    async def _refuse(self, refusal: _Refusal) -> None:
        """Answer an error of the server's own and close (the rest of the stream cannot be trusted)."""
        await _close_with(self._sock, _error_bytes(refusal.status, refusal.message, refusal.code))
        hook = self._server.on_refusal
        if hook is not None:
            try:
                hook(refusal.status, refusal.message)
            except Exception:  # the log's trouble must not become the connection's
                log.exception("recording a refused request failed")

    def _scope(self, request: _Request) -> Scope:
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


async def _linger(sock: _Socket | _TlsSocket) -> None:
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


async def _close_with(sock: _Socket | _TlsSocket, data: bytes) -> None:
    await sock.send_all(data)
    await _linger(sock)
    sock.close()


class _Exchange:
    """One request and its answer: the ASGI ``receive`` and ``send`` of one call."""

    __slots__ = (
        "_sock", "_server", "_requests", "_request", "_body_deadline", "_delivered", "_continue_due", "_pipelined",
        "started", "complete", "gone", "stalled", "_gone_event", "_body_timed_out", "_bad_body",
        "_status", "_headers", "_head_sent", "_chunked", "_bodiless", "_close_after", "_length_left",
    )

    def __init__(self, sock: _Socket | _TlsSocket, server: _Server, requests: _Requests, request: _Request) -> None:
        self._sock = sock
        self._server = server
        self._requests = requests
        self._request = request
        self._body_deadline = 0.0  # set when the body is first waited for
        self._delivered = False  # the whole body went to the app
        self._continue_due = request.expect_continue
        self._pipelined = 0  # bytes read after the body, for the requests after this one
        self.started = False
        self.complete = False
        self.gone = False  # the client left, or the connection was cut
        self.stalled = False  # cut because a write to it could not complete (it stopped reading)
        self._gone_event: trio.Event | None = None
        self._body_timed_out = False
        self._bad_body: _Refusal | None = None
        self._status = 0
        self._headers: Any = ()
        self._head_sent = False
        self._chunked = False
        self._bodiless = False
        self._close_after = False
        self._length_left = -1  # a length the app declared, not yet sent; -1: none

    def set_gone(self, *, stalled: bool = False) -> None:
        if not self.gone:
            self.stalled = stalled
        self.gone = True
        if self._gone_event is not None:
            self._gone_event.set()

    async def run(self, app: App, scope: Scope) -> None:
        try:
            await app(scope, self.receive, self.send)
        except Exception:
            log.exception("%s %s failed in the app", scope["method"], scope["path"])

    async def finish(self) -> bool:
        """After the app returned: answer what it left unanswered; True to keep the connection."""
        sock = self._sock
        if sock.closed or self.gone:
            if not (self.started or sock.closed):  # the body timed out or broke: say so
                if self._body_timed_out:
                    timeout = self._server.settings.body_timeout
                    await _close_with(sock, _error_bytes(408, f"the request's body did not arrive within {timeout:g} s", "request_timeout"))
                elif self._bad_body is not None:
                    await _close_with(sock, _error_bytes(self._bad_body.status, self._bad_body.message, self._bad_body.code))
            sock.close()
            return False
        if not self.complete:
            if not self.started:
                await _close_with(sock, _error_bytes(500, "tailguard failed unexpectedly (no answer)", "internal_error"))
            sock.close()
            return False
        if not self._request.complete:  # a body the app did not read (413, 404, ...), not all here
            await _linger(sock)
            sock.close()
            return False
        if self._close_after:  # HTTP/1.0, connection: close, a drain, an upgrade
            sock.close()
            return False
        return True

    # -- receive ------------------------------------------------------------

    async def receive(self) -> Message:
        request = self._request
        if self._delivered or self.gone:
            await self._watch()
            # tailguard's own key beside ASGI's: its app logs a caller cut for not reading apart from one who left
            return {"type": "http.disconnect", "tailguard.stalled": True} if self.stalled else {"type": "http.disconnect"}
        body = request.body
        while True:
            if body or request.complete:
                data = b"".join(body)
                body.clear()
                self._continue_due = False
                if request.complete:
                    self._delivered = True
                    return {"type": "http.request", "body": data, "more_body": False}
                return {"type": "http.request", "body": data, "more_body": True}
            refusal = self._requests.refusal
            if refusal is not None:  # a broken chunked body
                self._bad_body = refusal
                self.set_gone()
                return {"type": "http.disconnect"}
            if self._continue_due:
                self._continue_due = False
                if not self.started:
                    await self._sock.send_all(_CONTINUE)
            if not self._body_deadline:
                self._body_deadline = trio.current_time() + self._server.settings.body_timeout
            with trio.move_on_at(self._body_deadline):
                data = await self._sock.receive_some()
                if data:
                    self._requests.feed(data)
                    continue
                self.set_gone()
                return {"type": "http.disconnect"}
            self._body_timed_out = True
            self.set_gone()
            return {"type": "http.disconnect"}

    async def _watch(self) -> None:
        """After the body, until the client leaves: the app's wait for ``http.disconnect``.

        Reads the socket in the app's own task (no task of ours per request):
        end of file means the client left, and the socket is closed at once; a
        pipelined request is parsed and queued. Returns when the client is gone.
        """
        sock = self._sock
        limit = self._server.settings.max_header_bytes
        while not (self.gone or sock.closed) and self._pipelined <= limit:
            data = await sock.receive_some()
            if not data:
                self.set_gone()
                if not self.complete:
                    sock.close()
                return
            self._pipelined += len(data)
            self._requests.feed(data)
        if not self.gone:  # a client pipelining that much waits for us; stop reading
            if self._gone_event is None:
                self._gone_event = trio.Event()
            await self._gone_event.wait()

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
            self._headers = message.get("headers", ())
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    async def _send_body(self, body: bytes, more: bool) -> None:
        if not self.started or self.complete:
            raise RuntimeError("http.response.body before the start or after the end")
        if not more:
            self.complete = True
        if self._sock.closed or self.gone:
            return
        if not self._head_sent:
            out = self._head(body, more)
        elif self._bodiless:
            return
        elif self._chunked:
            if more:
                if not body:
                    return
                out = b"%x\r\n%s\r\n" % (len(body), body)
            else:
                out = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else _LAST_CHUNK
        else:
            out = self._counted(body, more)
            if not out:
                return
        await self._sock.send_all(out)

    def _counted(self, body: bytes, more: bool) -> bytes:
        """A body under a declared length: no more than it, and all of it by the end."""
        if self._length_left >= 0:
            self._length_left -= len(body)
            if self._length_left < 0 or (not more and self._length_left):
                self._close_after = True  # the framing is broken: this answer is the connection's last
                raise RuntimeError("the body does not match the declared content-length")
        return body

    def _head(self, body: bytes, more: bool) -> bytes:
        """The status line and headers, framed, with the first body bytes: what goes in the first send."""
        self._head_sent = True
        status = self._status
        request = self._request
        # An answer that starts before the body is all here (a 413, a 404, ...)
        # is the connection's last: say so, or a client reuses a socket we close.
        close = not request.keep_alive or self._server.draining or not request.complete
        lines = [_status_line(status)]
        length = None
        for name, value in self._headers:  # names are lower-case (ASGI)
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                continue  # the server frames the body
            elif name == b"connection":
                if close:
                    continue  # ours says close
                if b"close" in value.lower():
                    close = True
            lines.append(b"%s: %s\r\n" % (name, value))
        if status < 200 or status in (204, 304):
            self._bodiless = True
            body = b""
        elif length is not None:
            self._length_left = int(length)
        elif not more:
            lines.append(b"content-length: %d\r\n" % len(body))
        elif request.http_version == "1.1":
            lines.append(_CHUNKED)
            self._chunked = True
        else:
            close = True  # HTTP/1.0 and a body of unknown length: it ends where the connection does
        if close:
            lines.append(_CLOSE)
            self._close_after = True
        lines.append(b"\r\n")
        head = b"".join(lines)
        if head.count(b"\n") != len(lines) or head.count(b"\r") != len(lines) or b"\0" in head:
            self._close_after = True
            raise RuntimeError("a response header holds CR, LF or NUL")
        if request.method == b"HEAD":
            self._bodiless = True  # the headers a GET would get, no body
            return head
        if self._bodiless:
            return head
        if self._chunked:
            if not body:
                return head if more else head + _LAST_CHUNK
            if more:
                return b"%s%x\r\n%s\r\n" % (head, len(body), body)
            return b"%s%x\r\n%s\r\n0\r\n\r\n" % (head, len(body), body)
        return head + self._counted(body, more)


async def serve(
    app: App,
    host: str,
    port: int,
    *,
    settings: HttpSettings,
    shutdown_trigger: Callable[[], Awaitable[object]],
    tls: ServerTls | None = None,
    on_refusal: Callable[[int, str], None] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on host:port until ``shutdown_trigger`` returns, then drain.

    ``on_refusal(status, message)`` hears of each request the server answers
    itself, before the app (malformed, a head too large or too slow), so the
    app's access log has a line for it too.

    Reports the bound addresses (``["http://host:port"]``, ``https://`` with
    ``tls``), so tests can start it on port 0. With ``tls`` each connection is
    served over TLS with the context ``tls`` holds when it is accepted. On
    shutdown: stop accepting, close idle connections, give requests in
    flight ``settings.grace_timeout`` s, then cancel them.
    """
    listener = _listen(host, port, settings.backlog, reuse_port=settings.reuse_port)
    bound = listener.getsockname()
    server = _Server(app, settings, (bound[0], bound[1]), tls, on_refusal)
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    scheme = "https" if tls is not None and tls.context is not None else "http"
    try:
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as acceptor:
                acceptor.start_soon(server.accept, listener, connections)
                acceptor.start_soon(server.idle.run)
                task_status.started([f"{scheme}://{shown}:{bound[1]}"])
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


def _listen(host: str, port: int, backlog: int, *, reuse_port: bool = False) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # the kernel spreads new connections over every worker's listener
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
