"""Sockets on Trio's readiness waits: one stream, one listener, one accept loop (no wire format).

The HTTP server (``server/http/``), the backend transport
(``router/backend/lean_transport.py``) and the simulated engine (``bench/sim/http.py``)
all read and write through :class:`ReadinessStream`, and the two servers
listen and accept through :func:`listen` and :func:`accept_forever`.

Why not ``trio.SocketStream``: a relayed stream gets one event per engine
step, so the socket is almost always empty when the next read starts. A
SocketStream read tries ``recv`` first and nearly always gets EAGAIN (a
system call and an exception for nothing) before it waits; its send yields
to the scheduler once more even when the bytes went at once. Here a read
that came back short waits for readiness first, and a send that completes
at once returns at once (no checkpoint). Errors are Trio's, as a
SocketStream raises them.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable
from typing import Any, NoReturn

import trio

READ_SIZE = 64 * 1024
_ACCEPT_RETRY_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.ECONNABORTED))


class ReadinessStream:
    """A connected, non-blocking TCP socket, read and written on Trio's readiness waits.

    ``receive_some`` and ``send_all`` raise ``trio.BrokenResourceError`` when
    the connection broke and ``trio.ClosedResourceError`` once it was closed
    (also to a task waiting on it when another task closes it). ``close`` is
    synchronous, so a timer or a drain can end a wait without a task of its own.
    """

    __slots__ = ("sock", "closed", "_drained", "_expected")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass  # not TCP (a test's socketpair)
        self.sock = sock
        self.closed = False
        # After a read that came back short the socket is almost surely empty:
        # the next read waits for readiness first instead of a recv that fails
        # with EAGAIN. A fresh connection counts as read: nothing is there yet.
        self._drained = True
        self._expected = False  # the caller paused on purpose: the next read tries the socket at once

    async def receive_some(self, max_bytes: int = READ_SIZE) -> bytes:
        """Bytes from the peer; ``b""`` at its end of file."""
        if self.closed:
            raise trio.ClosedResourceError("the connection was closed")
        sock = self.sock
        if self._expected:  # the caller just slept: it yielded already, and bytes are most likely here
            self._expected = False
        elif self._drained:
            await trio.lowlevel.wait_readable(sock)
        else:  # the last read filled its buffer (a big body): more may be there, but let the others run first
            await trio.lowlevel.checkpoint()
        while True:
            try:
                data = sock.recv(max_bytes)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError as error:
                raise trio.BrokenResourceError(f"the connection broke: {error}") from error
            self._drained = len(data) < max_bytes
            return data

    async def receive_or_eof(self, max_bytes: int = READ_SIZE) -> bytes:
        """Bytes from the peer; ``b""`` when it closed, reset or broke the connection, or it was closed here."""
        try:
            return await self.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def pause(self, seconds: float) -> None:
        """Sleep while bytes pile up; the next read then tries the socket before it waits for readiness."""
        await trio.sleep(seconds)
        self._expected = True

    def send_now(self, data: bytes) -> memoryview | None:
        """Send what the socket takes without waiting; the rest, or None when all of it went."""
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as error:
            raise trio.BrokenResourceError(f"the connection broke: {error}") from error
        return None if sent == len(data) else memoryview(data)[sent:]

    async def send_rest(self, view: memoryview) -> None:
        """Send ``view`` (what ``send_now`` left), waiting for room as often as needed."""
        sock = self.sock
        while view:
            await trio.lowlevel.wait_writable(sock)
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:
                pass
            except OSError as error:
                raise trio.BrokenResourceError(f"the connection broke: {error}") from error

    async def send_all(self, data: bytes) -> None:
        """Write everything; a write that completes at once does not checkpoint."""
        if self.closed:
            raise trio.ClosedResourceError("the connection was closed")
        rest = self.send_now(data)
        if rest is not None:
            await self.send_rest(rest)

    def shutdown_write(self) -> None:
        """End of file for the peer; reading goes on."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        """Close now; a task waiting on the socket gets ``ClosedResourceError``."""
        if not self.closed:
            self.closed = True
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()


def listen(host: str, port: int, backlog: int, *, reuse_port: bool = False) -> socket.socket:
    """A non-blocking listening socket on host:port (0: a free port); OSError when it cannot be bound.

    ``reuse_port``: several worker processes listen on the same port and the
    kernel spreads new connections over them (SO_REUSEPORT).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def accept_forever(listener: socket.socket, on_accept: Callable[[socket.socket, Any], None], log: logging.Logger) -> NoReturn:
    """Hand each accepted connection (socket, peer address) to ``on_accept``, until cancelled.

    Running out of file descriptors or memory, or a connection aborted before
    it was accepted, is logged and retried after 10 ms (the server keeps
    serving the connections it has); any other error is raised.
    """
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
        on_accept(sock, peer)
        await trio.lowlevel.checkpoint()
