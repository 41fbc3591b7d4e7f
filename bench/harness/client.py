"""Lean HTTP/1.1 clients the load generators share: a keep-alive client, a pool of them, an SSE stream counter.

Responses are parsed by httptools (llhttp, the parser tailguard's own server
uses), fed each read as it arrives: a response costs a few C calls and three
small callbacks, so the client's CPU stays small beside the router's (the
overhead benchmark measures the router's CPU beside vllm-router on 2 cores).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httptools
import trio

HOST = "127.0.0.1"
CALL_TIMEOUT_S = 10.0  # a gRPC call's or an open-loop request's own bound

CHAT_PATH = "/v1/chat/completions"

Source = Callable[[], bytes]  # the next request's bytes: a load loop asks once per request (``bench.harness.unique``)

_READ_SIZE = 64 * 1024


class ProtocolError(Exception):
    """The server closed the connection early or sent something unparsable."""


@dataclass
class Reply:
    """One response, as much of it as a benchmark needs."""

    status: int
    body_bytes: int
    marker_at: float | None  # perf_counter() when the marker (e.g. a token event) first arrived
    done_seen: bool  # the body held "data: [DONE]" (streams)
    keep_alive: bool


class ReplyReader:
    """httptools' callbacks for one response at a time: its body goes to ``scan``, its end is noted.

    A client that wants more of the body (``TokenClient``) hands its
    connection a subclass (``KeepAliveClient.reader``).
    """

    def __init__(self) -> None:
        self.scan = Scan(None)
        self.complete = False
        self.keep_alive = True
        self.parser: httptools.HttpResponseParser | None = None  # the connection's; set by the client

    def start(self, scan: Scan) -> None:
        """Ready for the next response, its body counted by ``scan``."""
        self.scan, self.complete = scan, False

    def on_headers_complete(self) -> None:
        # llhttp knows keep-alive from the head (and forgets it once the message completes).
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.scan.feed(body)

    def on_message_complete(self) -> None:
        self.complete = True


class KeepAliveClient:
    """One connection to one port, opened lazily, reopened after a failure.

    Requests go one at a time (no pipelining); a response's framing
    (Content-Length, chunked, ``Connection: close``) is httptools' to read.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self._stream: trio.SocketStream | None = None
        self._response = self.reader()
        self._parser = self._new_parser()

    async def exchange(self, request: bytes, marker: bytes | None = None) -> Reply:
        """Send ``request`` (complete bytes), read the whole response.

        Raises OSError, trio.BrokenResourceError or ProtocolError on failure,
        after closing the connection (the next call opens a new one).
        """
        self._response.start(Scan(marker))
        try:
            if self._stream is None:
                self._stream = await trio.open_tcp_stream(HOST, self.port)
                self._parser = self._new_parser()
            await self._stream.send_all(request)
            reply = await self._read_reply(self._stream)
        except BaseException:
            await self.aclose()
            raise
        if not reply.keep_alive:
            await self.aclose()
        return reply

    def _new_parser(self) -> httptools.HttpResponseParser:
        """A parser for a new connection (a closed one's may hold a half-read response)."""
        self._response.parser = parser = httptools.HttpResponseParser(self._response)
        return parser

    def reader(self) -> ReplyReader:
        """The callbacks this client's parser calls."""
        return ReplyReader()

    async def aclose(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await trio.aclose_forcefully(stream)

    async def _read_reply(self, stream: trio.SocketStream) -> Reply:
        response = self._response
        while not response.complete:
            data = await stream.receive_some(_READ_SIZE)
            if not data:
                raise ProtocolError("the server closed the connection mid-response")
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserError as error:
                raise ProtocolError(f"unparsable response: {error}") from None
        scan = response.scan
        return Reply(self._parser.get_status_code(), scan.size, scan.marker_at, scan.done_seen, response.keep_alive)


class Scan:
    """Counts body bytes and notes when ``marker`` and ``[DONE]`` first appear.

    A short tail of earlier bytes is kept so a marker split across reads or
    chunks is still found.
    """

    def __init__(self, marker: bytes | None) -> None:
        self.marker = marker
        self.size = 0
        self.marker_at: float | None = None
        self.done_seen = False
        self._tail = b""

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        window = self._tail + data
        if self.marker is not None and self.marker_at is None and self.marker in window:
            self.marker_at = time.perf_counter()
        if not self.done_seen and DONE in window:
            self.done_seen = True
        self._tail = window[-32:]


def http_request(port: int, path: str, payload: object) -> bytes:
    """A keep-alive POST with a JSON body, as bytes (built once, sent many times)."""
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: {HOST}:{port}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


MAX_CONNECTIONS = 2048  # per open-loop pool; beyond it an arrival is dropped (and counted)
STALE_IDLE_S = 4.0  # real s: an idle connection older than this is not reused (servers close idle ones: the simulator and vLLM after 5 s, tailguard after 75 s)


class ConnectionPool:
    """Idle keep-alive connections to one port: take one, or open one (connected on its first exchange).

    A connection idle STALE_IDLE_S or more is never reused: a request written
    to a connection the server has just closed for idleness fails before any
    reply, which would count as a failure of the set-up when it is the
    client's own doing (a pool that grows, shrinks and grows again reaches
    deep into its idle stack).
    """

    def __init__(self, port: int, cap: int = MAX_CONNECTIONS) -> None:
        self.port = port
        self.cap = cap  # what try_take opens at most
        self._idle: list[KeepAliveClient] = []
        self._all: list[KeepAliveClient] = []
        self._idle_since: dict[int, float] = {}

    @property
    def opened(self) -> int:
        return len(self._all)

    def _new(self) -> KeepAliveClient:
        return KeepAliveClient(self.port)

    def take(self) -> KeepAliveClient:
        now = time.perf_counter()
        while self._idle:
            client = self._idle.pop()
            if now - self._idle_since.pop(id(client), now) < STALE_IDLE_S:
                return client
            # stale: left for aclose(), which closes every client the pool made
        client = self._new()
        self._all.append(client)
        return client

    def try_take(self) -> KeepAliveClient | None:
        """An idle connection, or a new one while fewer than ``cap`` are open; None (never waits) beyond: an open loop drops the arrival."""
        return None if not self._idle and len(self._all) >= self.cap else self.take()

    def give_back(self, client: KeepAliveClient) -> None:
        self._idle_since[id(client)] = time.perf_counter()
        self._idle.append(client)

    async def aclose(self) -> None:
        """Close every connection the pool opened (a failed one has closed itself already)."""
        clients, self._all, self._idle = self._all, [], []
        for client in clients:
            await client.aclose()


@dataclass
class LoadCounters:
    """What the clients of one engine have received so far (cumulative)."""

    events: int = 0  # SSE events ("data: " lines), including the finish event and [DONE]
    streams_started: int = 0
    streams_done: int = 0
    errors: int = 0

EVENT = b"data: "
DONE = b"data: [DONE]"
_ERROR_BACKOFF_S = 0.1
_MAX_REQUESTS_PER_CLIENT = 10_000  # a bound on every client loop besides the deadline


class _EventCounter:
    """httptools' callbacks for one stream: its status, SSE events counted into ``counters`` as the body arrives, [DONE] noted."""

    def __init__(self, counters: LoadCounters) -> None:
        self.counters = counters
        self.headers_done = False
        self.done = False
        self.ended = False
        self._tail = b""

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        window = self._tail + body
        # Markers wholly inside the tail were counted with the previous piece.
        self.counters.events += window.count(EVENT) - self._tail.count(EVENT)
        self.done = self.done or DONE in window
        self._tail = window[-(len(DONE) - 1) :]

    def on_message_complete(self) -> None:
        self.ended = True


async def read_stream(stream: trio.SocketStream, counters: LoadCounters) -> bool:
    """Count SSE events until [DONE]; False if the response is not a 200 or ends (or breaks) before it."""
    events = _EventCounter(counters)
    parser = httptools.HttpResponseParser(events)
    while not events.done:
        data = await stream.receive_some(_READ_SIZE)
        if not data:
            return False
        try:
            parser.feed_data(data)
        except httptools.HttpParserError:
            return False
        if events.headers_done and parser.get_status_code() != 200 or events.ended and not events.done:
            return False
    return True


async def sse_client(port: int, request: Source, deadline: float, counters: LoadCounters) -> None:
    """One connection at a time: stream a completion (``request()``'s bytes) to its end, then start the next."""
    with trio.move_on_at(deadline):
        for _ in range(_MAX_REQUESTS_PER_CLIENT):
            ok = False
            try:
                stream = await trio.open_tcp_stream(HOST, port)
                async with stream:
                    await stream.send_all(request())
                    counters.streams_started += 1
                    ok = await read_stream(stream, counters)
            except (OSError, trio.BrokenResourceError):
                ok = False
            if ok:
                counters.streams_done += 1
            else:
                counters.errors += 1
                await trio.sleep(_ERROR_BACKOFF_S)


def engine_counts(page: bytes) -> tuple[int, int]:
    """(vllm:num_requests_running, vllm:num_requests_waiting) from an engine's /metrics page."""
    counts = {b"vllm:num_requests_running": 0, b"vllm:num_requests_waiting": 0}
    for line in page.splitlines():
        for name in counts:
            if line.startswith((name + b"{", name + b" ")):
                counts[name] = int(float(line.rsplit(b" ", 1)[1]))
    return counts[b"vllm:num_requests_running"], counts[b"vllm:num_requests_waiting"]

TOKEN_MARKER = b'"delta":{"content":'  # a token event; the first event (the role) does not match
