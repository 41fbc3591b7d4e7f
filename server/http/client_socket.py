"""The HTTP server's side of a client connection: a plain or TLS stream that never raises but Cancelled.

A write that cannot complete within ``write_timeout`` (the client stopped
reading) or that fails closes the connection and tells the connection
(``on_abort``); a read returns ``b""`` when the client is gone. The plain
stream is :class:`~tailguard.router.sockets.ReadinessStream`, the one
readiness-driven socket of the code base; only TLS listeners pay for
``trio.SSLStream``.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Callable

import trio

from tailguard.router.sockets import READ_SIZE, ReadinessStream

from .answers import NOT_TLS
from .settings import HttpSettings

log = logging.getLogger("tailguard.http_server")

_LINGER_SECONDS = 1.0  # after an answer to a request whose body was not read
_LINGER_BYTES = 1 << 20
_TLS_HANDSHAKE = 0x16  # the first byte of a TLS record that opens a handshake


def _ignore(stalled: bool = False) -> None:
    pass


class _CutOnce:
    """What both client streams share: the connection is cut once, and told once (``on_abort``)."""

    __slots__ = ("closed", "_write_timeout", "_on_abort")

    def __init__(self, write_timeout: float, on_abort: Callable[[bool], None]) -> None:
        self._write_timeout = write_timeout
        self._on_abort = on_abort
        self.closed = False

    def abort(self, *, stalled: bool = False) -> None:
        if not self.closed:
            on_abort = self._on_abort
            self.close()
            on_abort(stalled)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._on_abort = _ignore  # it refers back to the connection: no cycle left for the GC
            self._close_now()

    def _close_now(self) -> None:
        raise NotImplementedError


class ClientSocket(_CutOnce):
    """A plain client connection: reads and writes that complete at once do not checkpoint.

    A send that must wait is bounded by ``write_timeout`` and, when it does
    not complete, closes the socket (``on_abort`` is told).
    """

    __slots__ = ("_stream",)

    def __init__(self, sock: socket.socket, write_timeout: float, on_abort: Callable[[bool], None]) -> None:
        super().__init__(write_timeout, on_abort)
        self._stream = ReadinessStream(sock)

    async def receive_some(self) -> bytes:
        """Bytes from the peer; ``b""`` when it closed or reset the connection."""
        try:
            return await self._stream.receive_some()
        except (trio.BrokenResourceError, trio.ClosedResourceError):  # closed by another task of this connection, or reset
            return b""

    async def send_all(self, data: bytes) -> None:
        """Write everything, or close the socket; never raises but Cancelled."""
        if self.closed:
            return
        stream = self._stream
        try:
            rest = stream.send_now(data)
        except trio.BrokenResourceError:
            self.abort()
            return
        if rest is None:
            return
        done = stalled = False
        try:
            with trio.move_on_after(self._write_timeout) as waited:
                await stream.send_rest(rest)
                done = True
            stalled = waited.cancelled_caught  # the peer stopped reading: tailguard cuts it
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if not done:  # timed out, cancelled, or the peer is gone: the stream is cut
                self.abort(stalled=stalled)

    def shutdown_write(self) -> None:
        self._stream.shutdown_write()

    def _close_now(self) -> None:
        self._stream.close()


class TlsClientSocket(_CutOnce):
    """A TLS connection (``trio.SSLStream`` over the accepted socket) behind ``ClientSocket``'s interface.

    Only TLS listeners pay for it; the plain path keeps its raw socket. As
    there, reads return ``b""`` when the peer is gone, a write that cannot
    complete within ``write_timeout`` closes the connection (``on_abort`` is
    told), and ``close`` is synchronous: it closes the socket under the
    stream, which wakes a task waiting on it.
    """

    __slots__ = ("_stream", "_raw")

    def __init__(self, stream: trio.SSLStream[trio.SocketStream], write_timeout: float, on_abort: Callable[[bool], None]) -> None:
        super().__init__(write_timeout, on_abort)
        self._stream = stream
        self._raw = stream.transport_stream.socket

    async def receive_some(self) -> bytes:
        """Bytes from the peer; ``b""`` when it closed, reset or broke the TLS stream."""
        if self.closed:
            return b""
        try:
            data = await self._stream.receive_some(READ_SIZE)
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

    def _close_now(self) -> None:
        self._raw.close()  # Trio's socket: tells a task waiting on it first


async def tls_handshake(
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
                await close_with(ClientSocket(sock, settings.write_timeout, _ignore), NOT_TLS)
                return None
            tls = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), context, server_side=True, https_compatible=True)
            await tls.do_handshake()
            stream = tls
        if stream is None and first:
            log.info("TLS handshake with %s: not done within server.header_timeout (%g s)", peer(sock), settings.header_timeout)
    except trio.BrokenResourceError as error:
        cause = error.__cause__
        log.info("TLS handshake with %s failed: %s", peer(sock), getattr(cause, "reason", None) or cause or error)
    finally:
        if stream is None and sock.fileno() != -1:
            trio.lowlevel.notify_closing(sock)
            sock.close()
    return stream


def peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "a client"
    return f"{host}:{port}"



ClientStream = ClientSocket | TlsClientSocket


async def linger(sock: ClientStream) -> None:
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


async def close_with(sock: ClientStream, data: bytes) -> None:
    await sock.send_all(data)
    await linger(sock)
    sock.close()

