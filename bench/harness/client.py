"""Lean HTTP/1.1 clients the load generators share: a keep-alive client, a pool of them, an SSE stream counter.

Parsing is hand-written and minimal (status line, Content-Length, chunked
framing, ``Connection: close``) so a client costs tens of microseconds a
response and the client's own CPU stays small beside the router's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

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


class KeepAliveClient:
    """One connection to one port, opened lazily, reopened after a failure.

    Requests go one at a time (no pipelining). Parsing is hand-written and
    minimal (status line, Content-Length, chunked framing, Connection: close)
    so the client costs a few tens of microseconds a response.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self._stream: trio.SocketStream | None = None
        self._buffer = b""

    async def exchange(self, request: bytes, marker: bytes | None = None) -> Reply:
        """Send ``request`` (complete bytes), read the whole response.

        Raises OSError, trio.BrokenResourceError or ProtocolError on failure,
        after closing the connection (the next call opens a new one).
        """
        try:
            if self._stream is None:
                self._stream = await trio.open_tcp_stream(HOST, self.port)
                self._buffer = b""
            await self._stream.send_all(request)
            reply = await self._read_reply(marker)
        except BaseException:
            await self.aclose()
            raise
        if not reply.keep_alive:
            await self.aclose()
        return reply

    async def aclose(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await trio.aclose_forcefully(stream)

    async def _fill(self) -> None:
        assert self._stream is not None
        data = await self._stream.receive_some(_READ_SIZE)
        if not data:
            raise ProtocolError("the server closed the connection mid-response")
        self._buffer += data

    async def _read_reply(self, marker: bytes | None) -> Reply:
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            await self._fill()
        head, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise ProtocolError(f"bad status line {lines[0][:80]!r}") from None
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        keep_alive = headers.get(b"connection") != b"close"
        scan = Scan(marker)
        if headers.get(b"transfer-encoding") == b"chunked":
            await self._read_chunked(scan)
        elif b"content-length" in headers:
            await self._read_exactly(int(headers[b"content-length"]), scan)
        else:
            raise ProtocolError("a response without Content-Length or chunked framing")
        return Reply(status, scan.size, scan.marker_at, scan.done_seen, keep_alive)

    async def _read_exactly(self, size: int, scan: Scan | None) -> None:
        while len(self._buffer) < size:
            await self._fill()
        if scan is not None:
            scan.feed(self._buffer[:size])
        self._buffer = self._buffer[size:]

    async def _read_chunked(self, scan: Scan) -> None:
        while True:
            while (end := self._buffer.find(b"\r\n")) < 0:
                await self._fill()
            try:
                size = int(self._buffer[:end].split(b";", 1)[0], 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {self._buffer[:end][:40]!r}") from None
            self._buffer = self._buffer[end + 2 :]
            if size == 0:
                while not self._buffer.startswith(b"\r\n") and (trailers := self._buffer.find(b"\r\n\r\n")) < 0:
                    await self._fill()
                cut = 2 if self._buffer.startswith(b"\r\n") else trailers + 4
                self._buffer = self._buffer[cut:]
                return
            await self._read_exactly(size, scan)
            await self._read_exactly(2, None)  # the chunk's CRLF


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


_TAIL = len(DONE) - 1  # bytes kept between reads so no marker is split unseen


async def read_stream(stream: trio.SocketStream, counters: LoadCounters) -> bool:
    """Count SSE events until [DONE]; False if the response is not a 200 or ends early."""
    tail = b""
    first = True
    while True:
        data = await stream.receive_some(_READ_SIZE)
        if not data:
            return False
        if first:
            if not data.startswith(b"HTTP/1.1 200"):
                return False
            first = False
        window = tail + data
        # Markers wholly inside the tail were counted on the previous read.
        counters.events += window.count(EVENT) - tail.count(EVENT)
        if DONE in window:
            return True
        tail = window[-_TAIL:]


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
