"""tailguard's own HTTP/1.1 server on Trio: llhttp parses, an ASGI app answers.

Why a server of its own: the ASGI server used before cost a quarter of the
router's CPU a request, and its Trio writes were shielded from
cancellation, so a client that never reads its stream held its request (and
pool seat) past every deadline and every drain (issue 11). Why llhttp (httptools) and not h11: h11 is pure
Python, and was most of this server's own CPU in a profile at saturation
(``python -m bench router_overhead`` under py-spy). Here:

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
never calls; tests/server/http/test_server_parser.py pins each refusal): the
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

The parts: ``reader.py`` (the requests, parsed by llhttp: sans-I/O),
``client_socket.py`` (the client's stream, plain or TLS), ``exchange.py``
(one request and its answer), ``connection.py`` (a connection's requests in
sequence, their count and idle deadlines, the drain), ``settings.py`` and
``answers.py``; this module serves them on a port.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from tailguard.router.sockets import listen

from .connection import Connections
from .settings import (
    App as App,
    HttpSettings as HttpSettings,
    Message as Message,
    Receive as Receive,
    Scope as Scope,
    Send as Send,
    ServerStatistics as ServerStatistics,
    ServerTls as ServerTls,
)

log = logging.getLogger("tailguard.http_server")


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
    listener = listen(host, port, settings.backlog, reuse_port=settings.reuse_port)
    bound = listener.getsockname()
    server = Connections(app, settings, (bound[0], bound[1]), tls, on_refusal)
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
