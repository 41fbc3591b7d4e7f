"""One request and its answer on the HTTP server: the ASGI ``receive`` and ``send`` of one call, and the response's framing."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from .answers import error_bytes, status_line
from .client_socket import ClientStream, close_with, linger
from .reader import ParsedRequest, Refusal, RequestReader
from .settings import App, HttpSettings, Message, Scope

log = logging.getLogger("tailguard.http_server")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


class ExchangeHost(Protocol):
    """What an exchange reads of its server: the guards, and whether it drains."""

    @property
    def settings(self) -> HttpSettings: ...

    @property
    def draining(self) -> bool: ...


class ServerExchange:
    """One request and its answer: the ASGI ``receive`` and ``send`` of one call."""

    __slots__ = (
        "_sock", "_server", "_requests", "_request", "_body_deadline", "_delivered", "_continue_due", "_pipelined",
        "started", "complete", "gone", "stalled", "_gone_event", "_body_timed_out", "_bad_body",
        "_status", "_headers", "_head_sent", "_chunked", "_bodiless", "_close_after", "_length_left",
    )

    def __init__(self, sock: ClientStream, server: ExchangeHost, requests: RequestReader, request: ParsedRequest) -> None:
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
        self._bad_body: Refusal | None = None
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
                    await close_with(sock, error_bytes(408, f"the request's body did not arrive within {timeout:g} s", "request_timeout"))
                elif self._bad_body is not None:
                    await close_with(sock, error_bytes(self._bad_body.status, self._bad_body.message, self._bad_body.code))
            sock.close()
            return False
        if not self.complete:
            if not self.started:
                await close_with(sock, error_bytes(500, "tailguard failed unexpectedly (no answer)", "internal_error"))
            sock.close()
            return False
        if not self._request.complete:  # a body the app did not read (413, 404, ...), not all here
            await linger(sock)
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
        lines = [status_line(status)]
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

