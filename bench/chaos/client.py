"""The chaos benchmark's HTTP side: a small h11 client and the verdict on each answer.

Every request ends in one ``Answer``: its outcome as a short label
(``200``, ``503 no_backend``, ``200+error upstream_error``, ``dropped``, ...),
whether the caller got exactly one terminal answer, and whether it was a
success. A terminal answer is a complete HTTP response that says what
happened: a completion (JSON with ``choices``), an error (any non-200
status), or a stream that ends with exactly one of ``data: [DONE]`` and a
``data: {"error": ...}`` event, as its last event. Not terminal: a dropped or
cut connection, no answer within the client's bound, a 200 whose body is not
a completion, a stream that ends with neither marker (or with both). A client
that hangs up on purpose (the cancel storm) expects no answer: ``client left``
is not counted against the router.

The client speaks HTTP/1.1 through h11 (a maintained parser, and the one the
simulator uses) over Trio sockets, keeps connections alive for a short while,
and can send raw bytes for probes h11 would refuse to write.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import h11
import trio

HOST = "127.0.0.1"
BODY_CAP = 64 * 1024 * 1024  # bytes of a body kept for the verdict (the rest is counted)
_READ_SIZE = 64 * 1024
_MAX_IDLE_S = 1.0  # a kept-alive connection older than this is not reused (the server may close it)
_MAX_IDLE = 256


JSON_CONTENT = (("content-type", "application/json"),)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send; ``raw`` replaces the bytes h11 would write (header probes)."""

    path: str
    body: bytes
    stream: bool = False
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = JSON_CONTENT
    raw: bytes | None = None


@dataclass
class Reply:
    """What came back, as far as it came: ``failure`` says how it ended early."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    size: int = 0
    failure: str | None = None  # connect failed | dropped | cut mid-body | no answer | client left


@dataclass
class Answer:
    """One request's fate, as the benchmark counts it."""

    group: str  # normal | attack | cancel
    sent_at: float  # perf_counter
    elapsed: float
    outcome: str
    terminal: bool
    ok: bool
    size: int = 0
    detail: str = ""  # for an answer that is not terminal: what the request was


class _Conn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = time.perf_counter()
        self.used = False


class HttpPool:
    """Keep-alive connections to one port, reused while fresh; fresh ones on demand."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._idle: list[_Conn] = []
        self.stale_retries = 0  # reused connections that closed before any answer: retried once on a new one

    async def request(self, spec: RequestSpec, timeout: float, *, keep: bool = True) -> Reply:
        """Send ``spec`` and read the whole answer within ``timeout`` s.

        Cancelling the caller (a client that leaves) closes the connection.
        """
        with trio.move_on_after(timeout):
            conn = self._take() if keep and spec.raw is None else None
            reused = conn is not None
            while True:
                if conn is None:
                    try:
                        conn = _Conn(await trio.open_tcp_stream(HOST, self.port))
                    except OSError:
                        return Reply(failure="connect failed")
                reply = await self._exchange(conn, spec, keep)
                if reused and reply.failure == "dropped" and reply.status is None:
                    self.stale_retries += 1  # the server closed an idle connection as we reused it
                    reused, conn = False, None
                    continue
                return reply
        return Reply(failure="no answer")

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await trio.aclose_forcefully(conn.stream)

    def _take(self) -> _Conn | None:
        now = time.perf_counter()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < _MAX_IDLE_S:
                return conn
            conn.stream.socket.close()
        return None

    async def _exchange(self, conn: _Conn, spec: RequestSpec, keep: bool) -> Reply:
        reply = Reply()
        done = False
        try:
            await _send(conn, spec, self.port)
            done = await _receive(conn, reply)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            reply.failure = "dropped" if reply.status is None else "cut mid-body"
        finally:
            reusable = done and keep and conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE
            if reusable and len(self._idle) < _MAX_IDLE:
                conn.h11.start_next_cycle()
                conn.idle_since = time.perf_counter()
                self._idle.append(conn)
            else:
                conn.stream.socket.close()
        return reply


async def _send(conn: _Conn, spec: RequestSpec, port: int) -> None:
    headers = [("host", f"{HOST}:{port}"), *spec.headers, ("content-length", str(len(spec.body)))]
    data = conn.h11.send(h11.Request(method=spec.method, target=spec.path, headers=headers))
    data += conn.h11.send(h11.Data(data=spec.body)) if spec.body else b""
    data += conn.h11.send(h11.EndOfMessage())
    # h11's state now expects the answer; a probe writes its own bytes instead.
    await conn.stream.send_all(spec.raw if spec.raw is not None else data)


async def _receive(conn: _Conn, reply: Reply) -> bool:
    """Read one response into ``reply``; True once it ended properly."""
    pieces: list[bytes] = []
    kept = 0
    while True:
        event = conn.h11.next_event()
        if event is h11.NEED_DATA:
            conn.h11.receive_data(await conn.stream.receive_some(_READ_SIZE))
        elif isinstance(event, h11.Response):
            reply.status = event.status_code
            reply.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        elif isinstance(event, h11.Data):
            reply.size += len(event.data)
            if kept < BODY_CAP:
                pieces.append(bytes(event.data))
                kept += len(event.data)
        elif isinstance(event, h11.EndOfMessage):
            reply.body = b"".join(pieces)
            return True
        elif isinstance(event, h11.ConnectionClosed):
            reply.body = b"".join(pieces)
            reply.failure = "dropped" if reply.status is None else "cut mid-body"
            return False
        # InformationalResponse: wait for the real one


def probe_bytes(port: int, path: str, body: bytes, header_name: str, header_value: bytes) -> bytes:
    """A POST written by hand, with one header value h11 would refuse to send."""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {HOST}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{header_name}: "
    ).encode()
    return head + header_value + b"\r\n\r\n" + body


# -- the verdict ------------------------------------------------------------------------


def judge(reply: Reply, stream: bool) -> tuple[str, bool, bool]:
    """(outcome label, exactly one terminal answer, success) of one HTTP reply."""
    if reply.failure == "client left":
        return "client left", True, False  # by design: nobody is there to answer
    if reply.failure is not None:
        return reply.failure, False, False
    status = reply.status
    if status != 200:
        return f"{status} {_error_code(reply.body)}", True, False
    if reply.size > len(reply.body):
        return f"200 body over {BODY_CAP >> 20} MiB", True, True
    if stream:
        return _judge_stream(reply)
    try:
        completion = json.loads(reply.body)
    except ValueError:
        return "200 not JSON", False, False
    if isinstance(completion, dict) and isinstance(completion.get("choices"), list):
        return "200", True, True
    return "200 not a completion", False, False


def _judge_stream(reply: Reply) -> tuple[str, bool, bool]:
    if not reply.headers.get("content-type", "").startswith("text/event-stream"):
        return "200 stream not SSE", False, False
    events = sse_data(reply.body)
    ends = [i for i, data in enumerate(events) if data == b"[DONE]" or data.startswith(b'{"error"')]
    if not ends:
        return "200 stream without [DONE] or error", False, False
    if len(ends) > 1 or ends[0] != len(events) - 1:
        return "200 stream with more than one end", False, False
    last = events[-1]
    if last == b"[DONE]":
        return "200", True, True
    return f"200+error {_error_code(last)}", True, False


def sse_data(body: bytes) -> list[bytes]:
    """The ``data`` of each complete event of an SSE body."""
    events = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            events.append(b"\n".join(lines))
    return events


def _error_code(body: bytes) -> str:
    """An OpenAI-shaped error's code (or type); otherwise what the body is."""
    if not body:
        return "(empty body)"
    try:
        error = json.loads(body[:65536] if len(body) > 65536 else body)["error"]
        return str(error.get("code") or error.get("type") or "(error without code)")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "(not an OpenAI error)"


async def send(pool: HttpPool, spec: RequestSpec, group: str, timeout: float, into: list[Answer], *, keep: bool = True) -> Reply:
    """One request, judged and appended to ``into``; what came back, for an attack that reads it."""
    start = time.perf_counter()
    reply = await pool.request(spec, timeout, keep=keep)
    outcome, terminal, ok = judge(reply, spec.stream)
    detail = "" if terminal else f"{spec.path} stream={spec.stream} status={reply.status} body={reply.body[-200:]!r}"
    into.append(Answer(group, start, time.perf_counter() - start, outcome, terminal, ok, reply.size, detail))
    return reply


def tally(answers: Iterable[Answer]) -> dict[str, int]:
    """Outcome label -> count, most frequent first."""
    return dict(Counter(a.outcome for a in answers).most_common())


def recovery_s(normal: Sequence[Answer], fault_end: float) -> float | None:
    """From the fault's end to the first success after the last failure (sent after the end).

    0 when nothing sent after the end failed; None when the last one failed.
    """
    after = sorted((a for a in normal if a.sent_at >= fault_end), key=lambda a: a.sent_at)
    failed = [i for i, a in enumerate(after) if not a.ok]
    if not failed:
        return 0.0
    rest = after[failed[-1] + 1 :]
    return rest[0].sent_at - fault_end if rest else None
