"""tailguard's HTTP/1.1 server: what llhttp parses and what the server frames, over real sockets.

The server parses with llhttp (httptools) in its strict mode and writes
responses itself; these tests pin the framing both ways: pipelining,
HTTP/1.0, HEAD, Host, versions, trailers, size limits, upgrades, and the
refusals llhttp makes for the server (a test per lenient flag it must not
have).
"""

from __future__ import annotations

import json

import h11
import pytest
import trio

from tailguard.server.http.server import Receive, Scope, Send
from tests.server.http.test_server import Recorder, closed_by_server, connect, post, read_response, server

SMUGGLED = b"GET /second HTTP/1.1\r\nhost: x\r\n\r\n"


async def read_all(sock: trio.socket.SocketType) -> bytes:
    """Everything the server sends until it closes."""
    data = b""
    with trio.fail_after(5):
        while chunk := await sock.recv(65536):
            data += chunk
    return data


async def streamer(scope: Scope, receive: Receive, send: Send) -> None:
    """Three body messages of unknown total length (or a declared one on /declared)."""
    await receive()
    headers = [(b"content-length", b"9")] if scope["path"] == "/declared" else []
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for part in (b"abc", b"def", b"ghi"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


# -- refusals: llhttp strict, and the server's own checks ------------------------------


@pytest.mark.parametrize(
    ("head", "status"),
    [
        # llhttp refuses a repeated Content-Length even when both agree (RFC 9112 allows
        # merging them; refusing is the safer reading in front of other parsers).
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\nhello", 400),
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked, gzip\r\n\r\n0\r\n\r\n", 501),
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\nabc", 501),
        (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: identity\r\ncontent-length: 3\r\n\r\nabc", 501),
        (b"GET /echo HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /echo HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", 400),
        (b"GET /echo HTTP/2.0\r\nhost: x\r\n\r\n", 505),
        # llhttp's lenient flags, each off: a bare LF, obs-fold, a CR alone, a bad header
        # byte, an unknown method (chunked framing: the next test).
        (b"GET /echo HTTP/1.1\nhost: x\n\n", 400),
        (b"GET /echo HTTP/1.1\r\nhost: x\r\nx-a: b\r\n c\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nhost: x\r\nx-a: b\rx-c: d\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nhost: x\r\nx-a: b\x01c\r\n\r\n", 400),
        (b"BREW /echo HTTP/1.1\r\nhost: x\r\n\r\n", 400),
    ],
)
async def test_what_llhttp_or_the_server_refuses_is_answered_and_closed(head: bytes, status: int) -> None:
    app = Recorder()
    async with server(app) as (port, _):
        with await connect(port) as sock:
            await sock.send(head + SMUGGLED)
            got, headers, body = await read_response(sock)
            assert (got, headers["connection"]) == (status, "close")
            assert json.loads(body)["error"]["type"] == "invalid_request_error"
            assert await closed_by_server(sock)
    assert app.calls == 0


@pytest.mark.parametrize(
    "chunks",
    [b"3 \r\nabc\r\n0\r\n\r\n", b"3\r\nabcX0\r\n\r\n", b"3\nabc\n0\n\n", b"zz\r\n"],
    ids=["space after the size", "no CRLF after a chunk", "bare LF", "not a size"],
)
async def test_a_broken_chunked_body_is_answered_400_and_closed(chunks: bytes) -> None:
    """The app, reading the body, hears the request end; the client gets a 400."""
    app = Recorder()
    async with server(app) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + SMUGGLED)
            got, headers, body = await read_response(sock)
            assert (got, headers["connection"]) == (400, "close") and "malformed" in json.loads(body)["error"]["message"]
            assert await closed_by_server(sock)
    assert app.calls == 1 and app.disconnected.is_set()


async def test_http_1_0_without_host_is_served_and_closed() -> None:
    async with server(Recorder()) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"POST /echo HTTP/1.0\r\ncontent-length: 2\r\n\r\nhi" + SMUGGLED)
            answer = await read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: close" in head and b"content-length: 7" in head
    assert body == b"echo:hi"  # and nothing for the bytes after it


async def test_a_stream_to_http_1_0_ends_with_the_connection() -> None:
    async with server(streamer) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"GET / HTTP/1.0\r\n\r\n")
            head, _, body = (await read_all(sock)).partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head and b"connection: close" in head and body == b"abcdefghi"


async def test_a_stream_to_http_1_1_is_chunked_and_the_connection_kept() -> None:
    async with server(streamer) as (port, _):
        with await connect(port) as sock:
            for path in (b"/", b"/declared"):
                await sock.send(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
                status, headers, body = await read_response(sock)
                assert (status, body, headers.get("connection")) == (200, b"abcdefghi", None)
                assert headers.get("transfer-encoding") == (None if path == b"/declared" else "chunked")
        # the chunked framing, byte for byte
        with await connect(port) as sock:
            await sock.send(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            head, _, body = (await read_all(sock)).partition(b"\r\n\r\n")
    assert b"connection: close" in head and body == b"3\r\nabc\r\n3\r\ndef\r\n3\r\nghi\r\n0\r\n\r\n"


async def test_head_gets_the_headers_of_get_and_no_body() -> None:
    async with server(Recorder()) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"HEAD /echo HTTP/1.1\r\nhost: x\r\n\r\n" + post("/echo", b"after"))
            client = h11.Connection(h11.CLIENT)
            client.send(h11.Request(method="HEAD", target="/", headers=[("host", "x")]))
            client.send(h11.EndOfMessage())
            status, headers, body = await read_response(sock, client)
            assert (status, headers["content-length"], body) == (200, "5", b"")
            client.start_next_cycle()
            assert (await read_response(sock, client))[2] == b"echo:after"  # the body's absence kept the framing


# -- pipelining ------------------------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order(autojump_clock: trio.testing.MockClock) -> None:
    order: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/slow":
            await trio.sleep(1.0)  # the later requests are read meanwhile; their answers wait
        order.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["path"].encode() + b":" + body})

    chunked = b"POST /chunked HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\nbc\r\n0\r\nx-trailer: t\r\n\r\n"
    async with server(app) as (port, _):
        with await connect(port) as sock:
            await sock.send(post("/slow", b"a") + chunked + b"GET /last HTTP/1.1\r\nhost: x\r\n\r\n")
            client = h11.Connection(h11.CLIENT)
            answers = []
            for _ in range(3):
                answers.append((await read_response(sock, client))[2])
                client.start_next_cycle()
    assert answers == [b"/slow:a", b"/chunked:bc", b"/last:"]
    assert order == ["/slow", "/chunked", "/last"]


async def test_requests_after_a_close_are_not_served() -> None:
    app = Recorder()
    async with server(app) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" + SMUGGLED)
            head, _, body = (await read_all(sock)).partition(b"\r\n\r\n")
    assert b"connection: close" in head and body == b"echo:" and app.calls == 1


async def test_an_upgrade_is_answered_and_the_connection_closed() -> None:
    app = Recorder()
    async with server(app) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n" + SMUGGLED)
            head, _, body = (await read_all(sock)).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" in head and body == b"echo:" and app.calls == 1


async def test_a_small_body_the_app_did_not_read_keeps_the_connection() -> None:
    """The body arrived whole, so the framing is intact: no need to close."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})

    async with server(app) as (port, _):
        with await connect(port) as sock:
            for _ in range(2):
                await sock.send(post("/nothing", b"unread"))
                assert await read_response(sock) == (404, {"content-length": "2"}, b"no")


# -- limits ------------------------------------------------------------------------------


async def test_an_incomplete_head_over_the_limit_gets_431() -> None:
    app = Recorder()
    async with server(app, max_header_bytes=4096) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 3000)
            await sock.send(b"a" * 3000)  # still no end of the head
            assert (await read_response(sock))[0] == 431
            assert await closed_by_server(sock)
    assert app.calls == 0


async def test_trailers_over_the_limit_get_431() -> None:
    app = Recorder()
    async with server(app, max_header_bytes=4096) as (port, _):
        with await connect(port) as sock:
            # more than one read (64 KiB) over the limit: an incomplete trailer is held to the limit plus one read
            await sock.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nx-t: " + b"t" * 80_000)
            assert (await read_response(sock))[0] == 431
            assert await closed_by_server(sock)
    assert app.disconnected.is_set()  # the app read "abc", then heard the request end


# -- responses the app gets wrong --------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [[(b"x-a", b"b\r\nx-injected: yes")], [(b"x-a", b"b\nc")], [(b"x-a", b"b\x00")], [(b"content-length", b"10")]],
)
async def test_a_response_the_server_cannot_frame_is_not_sent(headers: list[tuple[bytes, bytes]]) -> None:
    """A header with CR, LF or NUL, or a body shorter than its declared length: nothing goes out, the connection closes."""
    failed = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            await send({"type": "http.response.body", "body": b"short"})
        except RuntimeError:
            failed.set()
            raise

    async with server(app) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert await read_all(sock) == b""
    assert failed.is_set()


async def test_header_values_lose_the_whitespace_around_them() -> None:
    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["headers"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async with server(app) as (port, _):
        with await connect(port) as sock:
            await sock.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Request-Id: \t abc \t\r\n\r\n")
            assert await read_response(sock) == (204, {}, b"")  # and no content-length on a 204
    assert seen == [[(b"host", b"x"), (b"x-request-id", b"abc")]]


# -- idle connections (virtual time) -----------------------------------------------------


async def test_a_silent_connection_is_closed_at_the_head_timeout_even_beside_a_kept_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The idle timers' task sleeps until the kept connection's 75 s; a new, silent
    connection (10 s) must wake it earlier."""
    async with server(Recorder(), header_timeout=10.0, keep_alive_timeout=75.0) as (port, _):
        with await connect(port) as kept:
            await kept.send(post("/echo", b""))
            assert (await read_response(kept))[0] == 200
            await trio.sleep(1.0)
            start = trio.current_time()
            with await connect(port) as silent, trio.fail_after(20):
                assert await closed_by_server(silent)
                assert 10.0 <= trio.current_time() - start < 11.0
            assert await closed_by_server(kept)
            assert 75.0 <= trio.current_time() - start + 1.0 < 76.0
