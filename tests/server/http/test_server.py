"""tailguard's own HTTP/1.1 server (server.http_server) over real sockets.

Small ASGI apps stand in for the API where the server's own behaviour is
under test; the last tests run the whole process (router, HttpApi) against a
backend that streams without end, to a client that never reads.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
import trio.lowlevel

from tailguard.router.config import Config, ConfigError, ServerConfig, TimeoutsConfig, parse_config, render_config
from tailguard.server.app import Running, serve as serve_tailguard
from tailguard.server.http.server import HttpSettings, Message, Receive, Scope, Send, serve
from tailguard.sim import SimResponse
from tailguard.sim.app import SSE_HEADERS
from tests.helpers.engines import MODEL
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import engines_on_sockets, eventually, tailguard

SMALL_BUFFER = 4096
SHIPPED = Path(__file__).resolve().parents[3] / "config.toml"


@dataclass
class Recorder:
    """An ASGI app: echoes the body it read; ``/stream`` streams until the client leaves."""

    calls: int = 0
    messages: list[Message] = field(default_factory=list)
    disconnected: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)
    chunk: bytes = b"x" * 65536

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        try:
            if scope["path"] == "/stream":
                await self._stream(receive, send)
                return
            body = b""
            while True:
                message = await receive()
                self.messages.append(message)
                if message["type"] == "http.disconnect":
                    self.disconnected.set()
                    return
                body += message["body"]
                if not message["more_body"]:
                    break
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"echo:" + body})
        finally:
            self.finished.set()

    async def _stream(self, receive: Receive, send: Send) -> None:
        assert (await receive())["more_body"] is False

        async def watch() -> None:
            if (await receive())["type"] == "http.disconnect":
                self.disconnected.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            for _ in range(100_000):  # bounded: 6 GB at most, far more than any socket buffer
                if self.disconnected.is_set():
                    break
                await send({"type": "http.response.body", "body": self.chunk, "more_body": True})
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def server(app: Any, **settings: Any) -> AsyncIterator[tuple[int, trio.Event]]:
    """The server on a free port; yields (port, shutdown)."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: serve(
                app, "127.0.0.1", 0, settings=HttpSettings(**settings), shutdown_trigger=shutdown.wait, task_status=task_status
            )
        )
        yield int(binds[0].rsplit(":", 1)[1]), shutdown
        shutdown.set()


async def connect(port: int, *, receive_buffer: int | None = None) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect(("127.0.0.1", port))
    return sock


async def read_response(sock: trio.socket.SocketType, client: h11.Connection | None = None) -> tuple[int, dict[str, str], bytes]:
    """One response, parsed by h11's client side."""
    client = client or h11.Connection(h11.CLIENT)
    if client.our_state is h11.IDLE:  # h11 must know a request went out
        client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
    status, headers, body = 0, {}, b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await sock.recv(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return status, headers, body


async def closed_by_server(sock: trio.socket.SocketType) -> bool:
    """True when the server closed (end of file or reset), reading and dropping what is left."""
    while True:
        try:
            data = await sock.recv(65536)
        except ConnectionResetError:
            return True
        if not data:
            return True


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    return b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n" % len(body) + b"".join(extra) + b"\r\n" + body


# -- keep-alive and bodies ------------------------------------------------------------


async def test_keep_alive_serves_content_length_and_chunked_bodies_in_sequence() -> None:
    app = Recorder()
    async with server(app) as (port, _):
        with await connect(port) as sock:
            await sock.send(post("/echo", b"hello"))
            assert await read_response(sock) == (200, {"content-type": "text/plain", "content-length": "10"}, b"echo:hello")
            chunked = b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n"
            await sock.send(chunked)
            await trio.sleep(0.05)  # the first piece arrives alone: a message with more_body
            await sock.send(b"4\r\ndefg\r\n0\r\n\r\n")
            status, _, body = await read_response(sock)
            assert (status, body) == (200, b"echo:abcdefg")
    assert app.calls == 2
    second = app.messages[1:]
    assert [m["more_body"] for m in second] == [True] * (len(second) - 1) + [False]
    assert b"".join(m["body"] for m in second) == b"abcdefg" and len(second) >= 2


async def test_expect_100_continue_is_answered_when_the_app_reads() -> None:
    async with server(Recorder()) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n")
            with trio.fail_after(2):
                assert (await sock.recv(65536)).startswith(b"HTTP/1.1 100 ")
            await sock.send(b"ok")
            assert (await read_response(sock))[2] == b"echo:ok"


async def test_an_answer_before_the_whole_body_says_it_closes_the_connection() -> None:
    """A 413 sent while the body is still coming is the connection's last answer:
    its head must say ``connection: close``, or a client's pool reuses the socket
    the server is about to close and its next request fails on a dead connection."""

    async def refuse_unread(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"too large"})

    async with server(refuse_unread) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n" + b"x" * 1000)
            status, headers, body = await read_response(sock)
            assert (status, body) == (413, b"too large")
            assert headers["connection"] == "close"
            assert await closed_by_server(sock)


# -- request smuggling ----------------------------------------------------------------

SMUGGLED = b"GET /second HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n0\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\ncontent-length: 5\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 0, 5\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501),
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", 501),
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n", 400),
    ],
)
async def test_ambiguous_framing_is_refused_and_closed(head: bytes, status: int) -> None:
    """RFC 9112: a body framed two ways is refused and the connection closed,
    so nothing after it is read as a second request."""
    app = Recorder()
    async with server(app) as (port, _):
        with await connect(port) as sock:
            await sock.send(head + SMUGGLED)
            got, headers, body = await read_response(sock)
            assert got == status and headers["connection"] == "close"
            assert json.loads(body)["error"]["type"] == "invalid_request_error"
            assert await closed_by_server(sock)
    assert app.calls == 0


async def test_a_head_over_the_size_limit_gets_431() -> None:
    app = Recorder()
    async with server(app, max_header_bytes=4096) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192 + b"\r\n\r\n")
            assert (await read_response(sock))[0] == 431
            assert await closed_by_server(sock)
    assert app.calls == 0


# -- timeouts and the connection cap (virtual time) -----------------------------------


async def test_a_slow_head_gets_408_and_is_closed(autojump_clock: trio.testing.MockClock) -> None:
    async with server(Recorder(), header_timeout=10.0) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"POST /echo HTTP/1.1\r\nhost: x\r\n")
            start = trio.current_time()
            status, _, body = await read_response(sock)
            assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
            assert 10.0 <= trio.current_time() - start < 11.0
            assert await closed_by_server(sock)


async def test_a_body_that_never_comes_gets_408_and_is_closed(autojump_clock: trio.testing.MockClock) -> None:
    """Headers sent, then a few bytes of the body, then nothing: the slow-loris the old server kept forever."""
    app = Recorder()
    async with server(app, body_timeout=30.0) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nabc")
            start = trio.current_time()
            status, _, _ = await read_response(sock)
            assert status == 408 and 30.0 <= trio.current_time() - start < 31.0
            assert await closed_by_server(sock)
    assert app.disconnected.is_set()  # the app heard the request end


async def test_an_idle_keep_alive_connection_is_closed(autojump_clock: trio.testing.MockClock) -> None:
    async with server(Recorder(), keep_alive_timeout=75.0) as (port, _):
        with await connect(port) as sock:
            await sock.send(post("/echo", b""))
            assert (await read_response(sock))[0] == 200
            start = trio.current_time()
            assert await closed_by_server(sock)
            assert 75.0 <= trio.current_time() - start < 76.0


async def test_a_connection_over_the_cap_gets_503_and_is_closed() -> None:
    async with server(Recorder(), max_connections=2) as (port, _):
        with await connect(port) as one, await connect(port) as two:
            for sock in (one, two):
                await sock.send(post("/echo", b"a"))
                assert (await read_response(sock))[0] == 200
            with await connect(port) as three:
                status, headers, body = await read_response(three)
                assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
                assert await closed_by_server(three)
        # both closed: seats come back
        with trio.fail_after(2):
            while True:
                with await connect(port) as four:
                    await four.send(post("/echo", b"b"))
                    if (await read_response(four))[0] == 200:
                        break
                await trio.sleep(0.01)


# -- the client leaving ---------------------------------------------------------------


async def test_a_client_that_hangs_up_mid_stream_is_noticed_at_once() -> None:
    app = Recorder()
    async with server(app) as (port, _):
        sock = await connect(port)
        await sock.send(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await sock.recv(65536)).startswith(b"HTTP/1.1 200 ")
        sock.close()
        with trio.fail_after(2):
            await app.finished.wait()
        assert app.disconnected.is_set()


async def test_a_closed_keep_alive_connection_is_released_at_once() -> None:
    """The client shuts its side after a complete answer: the server closes too, at once
    (not after the 75 s idle timeout: no CLOSE-WAIT)."""
    async with server(Recorder(), keep_alive_timeout=75.0) as (port, _):
        with await connect(port) as sock:
            await sock.send(post("/echo", b"x"))
            assert (await read_response(sock))[0] == 200
            sock.shutdown(socket.SHUT_WR)
            with trio.fail_after(2):
                assert await sock.recv(65536) == b""


# -- writes to a client that never reads ----------------------------------------------


async def test_a_write_that_cannot_complete_closes_the_connection(autojump_clock: trio.testing.MockClock) -> None:
    app = Recorder()
    async with server(app, write_timeout=30.0) as (port, _):
        with await connect(port, receive_buffer=SMALL_BUFFER) as sock:
            await sock.send(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
            start = trio.current_time()
            with trio.fail_after(60):
                await app.finished.wait()
            assert 30.0 <= trio.current_time() - start < 31.0
            assert app.disconnected.is_set()  # the app was told, as for a client that left
            assert await closed_by_server(sock)


async def test_a_cancelled_write_closes_the_connection(autojump_clock: trio.testing.MockClock) -> None:
    """The app's own deadline cancels a blocked write; the half-sent stream is cut, not resumed."""
    ended: list[float] = []
    done = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        with trio.move_on_after(5.0):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(100_000):
                await send({"type": "http.response.body", "body": b"y" * 65536, "more_body": True})
        ended.append(trio.current_time())
        await send({"type": "http.response.body", "body": b"data: error\n\n"})  # a no-op on a cut stream
        done.set()

    async with server(app, write_timeout=1000.0) as (port, _):
        with await connect(port, receive_buffer=SMALL_BUFFER) as sock:
            start = trio.current_time()
            await sock.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(60):
                await done.wait()
            assert 5.0 <= ended[0] - start < 6.0
            assert await closed_by_server(sock)


async def test_shutdown_drains_then_cuts_a_client_that_never_reads(autojump_clock: trio.testing.MockClock) -> None:
    """Idle connections close at once, a request in flight finishes, a stuck writer is cut at the grace period."""
    app = Recorder()
    slow_done = trio.Event()

    async def both(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/slow":
            await trio.sleep(2.0)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"done"})
            slow_done.set()
            return
        await app(scope, receive, send)

    start = 0.0
    async with server(both, write_timeout=1000.0, grace_timeout=5.0) as (port, shutdown):
        idle = await connect(port)
        await idle.send(post("/echo", b""))
        assert (await read_response(idle))[0] == 200
        stuck = await connect(port, receive_buffer=SMALL_BUFFER)
        await stuck.send(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        slow = await connect(port)
        await slow.send(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await trio.sleep(0.5)
        start = trio.current_time()
        shutdown.set()
        with trio.fail_after(1):
            assert await closed_by_server(idle)
        status, headers, body = await read_response(slow)
        assert (status, body, headers.get("connection")) == (200, b"done", "close")
        with pytest.raises(OSError):
            await connect(port)
    assert 5.0 <= trio.current_time() - start < 6.0  # serve returned at the grace period
    assert app.finished.is_set()
    assert await closed_by_server(stuck)
    for sock in (idle, stuck, slow):
        sock.close()


# -- the whole process: a caller that never reads its stream --------------------------


def _endless_events() -> SimResponse:
    event = b"data: " + json.dumps(
        {"id": "c", "object": "chat.completion.chunk", "model": MODEL, "choices": [{"index": 0, "delta": {"content": "z" * 8192}, "finish_reason": None}]}
    ).encode() + b"\n\n"

    class Events:
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for _ in range(20_000):  # bounded: ~160 MB, far beyond any socket buffer
                yield event
                await trio.lowlevel.checkpoint()

        async def aclose(self) -> None:
            return None

    return SimResponse(200, list(SSE_HEADERS), stream=Events())


async def _endless_backend(method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
    if path.endswith("completions"):
        return _endless_events()
    return SimResponse(200, [("content-type", "application/json")], b"{}")


STREAM = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": true}'


def _config(urls: list[str], *, deadline: float) -> Config:
    timeouts = TimeoutsConfig(end_to_end_timeout=deadline, drain_timeout=1.0)
    config = two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]], timeouts=timeouts, interactive_timeout=0.5, batch_timeout=1.0)
    return dataclasses.replace(config, server=ServerConfig(write_timeout=1000.0))


async def test_a_caller_that_never_reads_loses_its_seat_at_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    """Issue 11, defect 1: the seat comes back at the end-to-end deadline whatever the caller does."""
    async with engines_on_sockets([_endless_backend, _endless_backend]) as backends, tailguard(_config(backends.urls, deadline=1.5)) as running:
        port = int(running.http_url.rsplit(":", 1)[1])
        with await connect(port, receive_buffer=SMALL_BUFFER) as sock:
            await sock.send(post("/v1/chat/completions", STREAM, b"content-type: application/json\r\n"))
            await eventually(lambda: running.router.statistics().open_requests == 1)
            start = trio.current_time()
            await eventually(lambda: running.router.statistics().open_requests == 0, timeout=3.0)
            assert trio.current_time() - start == pytest.approx(1.5, abs=0.05)  # at the deadline (on virtual time)
            assert await closed_by_server(sock)


async def test_a_caller_that_never_reads_is_logged_as_tailguards_timeout_at_the_deadline(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 32: the deadline cancelled a write to a caller that did not read, the cut connection looked
    like the caller leaving, and the request was logged 499 client_cancelled: it is tailguard's e2e timeout."""
    async with engines_on_sockets([_endless_backend, _endless_backend]) as backends, tailguard(_config(backends.urls, deadline=1.5)) as running:
        port = int(running.http_url.rsplit(":", 1)[1])
        with caplog.at_level(logging.INFO, logger="tailguard.access"), await connect(port, receive_buffer=SMALL_BUFFER) as sock:
            await sock.send(post("/v1/chat/completions", STREAM, b"content-type: application/json\r\n"))
            await eventually(lambda: running.router.statistics().open_requests == 1)
            await eventually(lambda: running.router.statistics().open_requests == 0, timeout=3.0)
            await eventually(lambda: any(r.name == "tailguard.access" for r in caplog.records))
    [line] = [r for r in caplog.records if r.name == "tailguard.access"]
    fields = line.fields  # type: ignore[attr-defined]
    assert (fields["outcome"], fields["reason"]) == ("timeout", "e2e_timeout"), fields


async def test_a_caller_cut_for_not_reading_is_logged_as_stalled_not_as_one_who_left(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    """Issue 20: a caller tailguard cut (a write that could not complete in server.write_timeout) was logged 499 client_cancelled."""
    async with engines_on_sockets([_endless_backend, _endless_backend]) as backends:
        config = _config(backends.urls, deadline=30.0)
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, write_timeout=0.5))
        async with tailguard(config) as running:
            port = int(running.http_url.rsplit(":", 1)[1])
            with caplog.at_level(logging.INFO, logger="tailguard.access"), await connect(port, receive_buffer=SMALL_BUFFER) as sock:
                await sock.send(post("/v1/chat/completions", STREAM, b"content-type: application/json\r\n"))
                await eventually(lambda: running.router.statistics().open_requests == 1)
                start = trio.current_time()
                await eventually(lambda: running.router.statistics().open_requests == 0, timeout=10.0)
                assert trio.current_time() - start == pytest.approx(0.5, abs=0.05)  # at the write timeout, not its 30 s deadline
    [line] = [r for r in caplog.records if r.name == "tailguard.access"]
    fields = line.fields  # type: ignore[attr-defined]
    assert (fields["outcome"], fields["reason"], fields["status"]) == ("timeout", "caller_stalled", 408), fields


async def test_a_drain_ends_on_time_with_a_caller_that_never_reads(autojump_clock: trio.testing.MockClock) -> None:
    """Issue 11, defect 1: SIGTERM's drain ends on time (drain timeout, then the HTTP grace period)."""
    async with engines_on_sockets([_endless_backend, _endless_backend]) as backends:
        sock = None
        try:
            with trio.fail_after(15):
                async with trio.open_nursery() as nursery:
                    running: Running = await nursery.start(
                        lambda task_status: serve_tailguard(_config(backends.urls, deadline=60.0), None, http_port=0, task_status=task_status)
                    )
                    port = int(running.http_url.rsplit(":", 1)[1])
                    sock = await connect(port, receive_buffer=SMALL_BUFFER)
                    await sock.send(post("/v1/chat/completions", STREAM, b"content-type: application/json\r\n"))
                    await eventually(lambda: running.router.statistics().open_requests == 1)
                    await trio.testing.wait_all_tasks_blocked()  # the stream is stuck on the full socket
                    start = trio.current_time()
                    running.drain.set()
            assert trio.current_time() - start == pytest.approx(1.0 + 5.0, abs=0.05)  # drain timeout + the HTTP grace period
        finally:
            if sock is not None:
                sock.close()


# -- configuration --------------------------------------------------------------------


def test_the_server_keys_are_read_checked_and_shown() -> None:
    text = SHIPPED.read_text(encoding="utf-8")
    config = parse_config(text.replace("write_timeout = 30.0", "write_timeout = 7.5"))
    assert config.server.write_timeout == 7.5
    settings = HttpSettings.from_config(config.server, grace_timeout=1.0)
    assert (settings.write_timeout, settings.max_connections, settings.grace_timeout) == (7.5, 10_000, 1.0)
    assert "write_timeout" in render_config(config)
    with pytest.raises(ConfigError) as refused:
        parse_config(text.replace('http_server = "lean"', 'http_server = "nginx"').replace("max_connections = 10000", "max_connections = 0"))
    assert "server.http_server" in str(refused.value) and "server.max_connections" in str(refused.value)


def test_the_shipped_config_names_the_parser_the_lean_server_uses() -> None:
    """Before: config.toml said the lean server was "h11 on Trio"; it is llhttp via httptools (issue 20, defect 6)."""
    import tailguard.server.http.reader as lean

    lines = (Path(__file__).resolve().parents[3] / "config.toml").read_text().splitlines()
    at = lines.index('http_server = "lean"')
    above = list(itertools.takewhile(lambda line: line.startswith("#"), reversed(lines[:at])))
    comment = " ".join(line.lstrip("# ") for line in reversed(above))
    assert "import httptools" in Path(lean.__file__).read_text()
    assert "llhttp" in comment and "httptools" in comment and "h11 on Trio" not in comment, comment
