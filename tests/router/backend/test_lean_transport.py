"""The lean backend transport over real sockets and over a connector: keep-alive, stale connections, failures."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
import trio.testing

from tailguard.router.backend import KEEPALIVE_EXPIRY, BackendClient, LeanTransport, ResponseBody
from tailguard.sim import Engine, SimApp
from tailguard.sim.http import KEEP_ALIVE_TIMEOUT
from tailguard.sim.memory import memory_connector
from tests.helpers.engines import MODEL
from tests.helpers.sockets import QUICK, Backends

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def post(transport: LeanTransport, url: str, *, stream: bool = False) -> tuple[int, bytes]:
    request = httpx.Request("POST", url + "/v1/chat/completions", json={**BODY, "stream": stream})
    response = await transport.handle_async_request(request)
    try:
        return response.status_code, b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()


async def test_sequential_and_concurrent_calls_reuse_their_connections(one_engine: Backends) -> None:
    url = one_engine.urls[0]
    transport = LeanTransport(url, connect_timeout=2, max_idle=8)
    for _ in range(20):
        status, body = await post(transport, url)
        assert status == 200 and b'"finish_reason"' in body
    assert transport.opened == 1  # one keep-alive connection served them all
    results: list[int] = []

    async def one(stream: bool) -> None:
        status, body = await post(transport, url, stream=stream)
        assert body.rstrip().endswith(b"data: [DONE]") if stream else body.startswith(b"{")
        results.append(status)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(one, bool(i % 2))
    assert results == [200] * 8 and transport.opened <= 8
    await transport.aclose()


async def test_a_connection_the_server_closed_while_idle_is_replaced_once() -> None:
    answered = 0

    async def one_answer_per_connection(stream: trio.SocketStream) -> None:
        nonlocal answered
        await stream.receive_some(65536)
        answered += 1
        body = b'{"ok": true}'
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await stream.aclose()  # no "connection: close": the client believes it may reuse it

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, one_answer_per_connection, 0, host="127.0.0.1"))
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        transport = LeanTransport(url, connect_timeout=2, max_idle=4)
        for _ in range(3):
            assert await post(transport, url) == (200, b'{"ok": true}')
            await trio.sleep(0.01)  # let the server's close arrive
        assert answered == 3 and transport.opened == 3
        await transport.aclose()
        nursery.cancel_scope.cancel()


async def test_refused_and_broken_connections_are_httpx_errors() -> None:
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nobody listens there
    transport = LeanTransport(f"http://127.0.0.1:{port}", connect_timeout=2, max_idle=1)
    with pytest.raises(httpx.ConnectError):
        await post(transport, f"http://127.0.0.1:{port}")

    async def cut_mid_body(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"partial")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, cut_mid_body, 0, host="127.0.0.1"))
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        broken = LeanTransport(url, connect_timeout=2, max_idle=1)
        with pytest.raises(httpx.RemoteProtocolError):
            await post(broken, url)
        await broken.aclose()
        nursery.cancel_scope.cancel()


async def test_connections_idle_past_the_expiry_are_closed_not_reused(one_engine: Backends) -> None:
    url = one_engine.urls[0]
    transport = LeanTransport(url, connect_timeout=2, max_idle=8, keepalive_expiry=0.05)
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(post, transport, url)
    assert transport.idle == transport.opened >= 2  # a burst left several connections idle
    opened = transport.opened
    await trio.sleep(0.1)  # twice the expiry, in real time: the sockets are real
    assert (await post(transport, url))[0] == 200
    assert transport.opened == opened + 1 and transport.idle == 1  # the idle ones were closed; a fresh one served
    await transport.aclose()


async def _serve_raw(answer: bytes, nursery: trio.Nursery) -> tuple[str, list[int]]:
    """A server answering every request on a connection with ``answer`` (closing after it if it says so)."""
    connections: list[int] = []

    async def handle(stream: trio.SocketStream) -> None:
        connections.append(1)
        while await stream.receive_some(65536):
            await stream.send_all(answer)
            if b"connection: close" in answer or b"content-length" not in answer.lower() and b"chunked" not in answer:
                await stream.aclose()
                return

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", connections


@pytest.mark.parametrize(
    ("answer", "body", "reused"),
    [
        # chunked, kept alive
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", b"abcde", True),
        # an informational response first, then the real one
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", b"ok", True),
        # the server says it will close: never reused
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok", b"ok", False),
        # neither length nor chunks: the body ends with the connection
        (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end", b"until the end", False),
        # bytes after the response: the connection is not trusted again
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", b"ok", False),
    ],
)
async def test_response_framing_and_when_a_connection_is_reused(answer: bytes, body: bytes, reused: bool) -> None:
    async with trio.open_nursery() as nursery:
        url, connections = await _serve_raw(answer, nursery)
        transport = LeanTransport(url, connect_timeout=2, max_idle=4)
        assert await post(transport, url) == (200, body)
        assert transport.idle == (1 if reused else 0)
        assert await post(transport, url) == (200, body)
        assert len(connections) == (1 if reused else 2)
        await transport.aclose()
        nursery.cancel_scope.cancel()


async def test_a_malformed_response_is_a_protocol_error_and_a_header_that_splits_the_head_is_never_sent() -> None:
    async with trio.open_nursery() as nursery:
        url, _ = await _serve_raw(b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n", nursery)
        transport = LeanTransport(url, connect_timeout=2, max_idle=4)
        with pytest.raises(httpx.RemoteProtocolError):
            await post(transport, url)
        request = httpx.Request("POST", url + "/v1/completions", content=b"{}", headers={"x-request-id": "a\r\nx-evil: 1"})
        with pytest.raises(httpx.LocalProtocolError):
            await transport.handle_async_request(request)
        assert transport.idle == 0
        await transport.aclose()
        nursery.cancel_scope.cancel()


async def _serve(handle: Callable[[trio.SocketStream], Awaitable[None]], nursery: trio.Nursery) -> str:
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def _read_request(stream: trio.SocketStream) -> bytes:
    """One request with a content-length body, whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")))
    while len(body) < length:
        body += await stream.receive_some(65536)
    return body


async def test_bodies_bigger_than_a_read_and_bodies_that_trickle_arrive_whole_both_ways() -> None:
    big = bytes(range(256)) * 1200  # 300 KB: several full reads, and a send the socket cannot take at once
    pieces = [b"data: %d\n\n" % i for i in range(6)]

    async def handle(stream: trio.SocketStream) -> None:
        body = await _read_request(stream)  # the big request body, sent whole
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await _read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in pieces:  # an engine's steps: each read finds one event, then waits for the next
            await trio.sleep(0.01)
            await stream.send_all(b"%x\r\n%s\r\n" % (len(piece), piece))
        await stream.send_all(b"0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        url = await _serve(handle, nursery)
        transport = LeanTransport(url, connect_timeout=2, max_idle=4)
        with trio.fail_after(5):  # a request body sent in part would leave both sides waiting
            response = await transport.handle_async_request(httpx.Request("POST", url + "/v1/completions", content=big))
            assert b"".join([chunk async for chunk in response.aiter_raw()]) == big
        await response.aclose()
        response = await transport.handle_async_request(httpx.Request("POST", url + "/v1/completions", content=b"{}"))
        chunks = [chunk async for chunk in response.aiter_raw()]
        await response.aclose()
        assert b"".join(chunks) == b"".join(pieces) and len(chunks) >= 2  # relayed as they came, not at the end
        assert transport.opened == 1 and transport.idle == 1  # one connection served both
        await transport.aclose()
        nursery.cancel_scope.cancel()


async def test_a_call_cancelled_while_it_waits_closes_its_connection() -> None:
    saw_close = trio.Event()

    async def never_answers(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        if await stream.receive_some(65536) == b"":  # the client hung up: the engine would abort the generation
            saw_close.set()

    async with trio.open_nursery() as nursery:
        url = await _serve(never_answers, nursery)
        transport = LeanTransport(url, connect_timeout=2, max_idle=4)
        with trio.move_on_after(0.2) as waited:
            await post(transport, url)
        assert waited.cancelled_caught
        with trio.fail_after(2):
            await saw_close.wait()
        assert transport.idle == 0  # never kept for another request
        await transport.aclose()
        nursery.cancel_scope.cancel()


def _sse_answer(events: int) -> bytes:
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'] * events)
    last = b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n%s%x\r\n%s\r\n0\r\n\r\n" % (chunks, len(last), last)


async def test_the_backend_client_gives_a_connection_back_when_its_body_ends_and_drops_one_it_abandons() -> None:
    completion = b'{"choices": [{"index": 0, "message": {"content": "ok"}, "finish_reason": "stop"}]}'
    answers = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(completion), completion),
        _sse_answer(3),
    ]
    hung_up = trio.Event()

    async def handle(stream: trio.SocketStream) -> None:
        for answer in answers:
            await _read_request(stream)
            await stream.send_all(answer)
        await _read_request(stream)
        await stream.send_all(_sse_answer(0)[: -len(b"0\r\n\r\n") - 60])  # a stream that stops halfway
        if await stream.receive_some(65536) == b"":
            hung_up.set()

    async with trio.open_nursery() as nursery:
        url = await _serve(handle, nursery)
        transport = LeanTransport(url, connect_timeout=2, max_idle=4)
        client = BackendClient(url, max_concurrency=4, connect_timeout=2, backend_transport=transport)
        with trio.fail_after(5):
            response = await client.open("/v1/chat/completions", BODY, {}, stream=False)
            assert await response.read() == completion
            assert transport.idle == 1  # back in the pool before the caller closed the response
            await response.aclose()
            response = await client.open("/v1/chat/completions", {**BODY, "stream": True}, {}, stream=True)
            await response.start()
            relayed = b"".join([chunk async for chunk in response.chunks()])
            assert relayed.count(b"data:") == 5 and transport.idle == 1
            await response.aclose()
            response = await client.open("/v1/chat/completions", {**BODY, "stream": True}, {}, stream=True)
            await response.start()
            await response.aclose()  # the caller left mid-stream: the connection cannot be trusted again
            await hung_up.wait()
        assert transport.idle == 0 and transport.opened == 1 and client.in_flight == 0
        await transport.aclose()
        nursery.cancel_scope.cancel()


async def test_a_closed_connection_raises_trios_closed_error_not_a_value_error() -> None:
    async def hold(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        url = await _serve(hold, nursery)
        transport = LeanTransport(url, connect_timeout=2, max_idle=4)
        connection = await transport._connect()
        await connection.stream.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await connection.stream.receive_some(1024)
        with pytest.raises(trio.ClosedResourceError):
            await connection.stream.send_all(b"x")
        nursery.cancel_scope.cancel()


async def test_post_writes_the_bytes_an_httpx_request_would_and_refuses_a_header_that_splits_the_head() -> None:
    heads: list[bytes] = []

    async def handle(stream: trio.SocketStream) -> None:
        for _ in range(2):
            data = b""
            while b"\r\n\r\n" not in data or not data.endswith(b"{}"):
                data += await stream.receive_some(65536)
            heads.append(data)
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")

    async with trio.open_nursery() as nursery:
        url = await _serve(handle, nursery) + "/base/"  # an endpoint's URL may have a path, with or without its slash
        transport = LeanTransport(url, connect_timeout=2, max_idle=4)
        headers = {"content-type": "application/json", "x-request-id": "r-1"}
        sends: tuple[Callable[[], Awaitable[httpx.Response]], ...] = (
            lambda: transport.post("/v1/chat/completions", b"{}", headers),
            lambda: transport.handle_async_request(httpx.Request("POST", url.rstrip("/") + "/v1/chat/completions", content=b"{}", headers=headers)),
        )
        for send in sends:
            response = await send()
            assert response.status_code == 200 and await response.aread() == b"{}"
            await response.aclose()
        assert heads[0].lower() == heads[1].lower() and heads[0].startswith(b"POST /base/v1/chat/completions HTTP/1.1\r\n")
        assert transport.opened == 1
        for bad in ({"x-request-id": "a\r\nx-evil: 1"}, {"x-request-id": "caf\u00e9"}):
            with pytest.raises((httpx.LocalProtocolError, UnicodeEncodeError)):
                await transport.post("/v1/completions", b"{}", bad)
        assert len(heads) == 2  # nothing more was sent
        await transport.aclose()
        nursery.cancel_scope.cancel()


async def test_a_connect_timeout_noticed_in_a_stall_of_the_loop_is_tried_once_more(monkeypatch: pytest.MonkeyPatch, one_engine: Backends) -> None:
    """Issue 20, defect 1: a connect that 'timed out' while tailguard's own loop was stalled is not the engine's fault.

    The first attempt's deadline passes while the loop is blocked (a stall
    of 0.5 s past it); the transport tries once more, and the engine,
    healthy all along, answers.
    """
    url = one_engine.urls[0]
    transport = LeanTransport(url, connect_timeout=0.2, max_idle=8)
    real = LeanTransport._connect_once
    attempts: list[str] = []

    async def stalled_first(self: LeanTransport, deadline: float) -> object:
        if not attempts:
            attempts.append("stalled")
            time.sleep(deadline - trio.current_time() + 0.5)  # the whole loop stops, past the deadline
            raise trio.TooSlowError
        attempts.append("connected")
        return await real(self, deadline)

    monkeypatch.setattr(LeanTransport, "_connect_once", stalled_first)
    status, _ = await post(transport, url)
    assert status == 200 and attempts == ["stalled", "connected"]
    await transport.aclose()


async def test_a_connect_timeout_in_a_loop_on_time_is_the_engines_and_not_tried_again(monkeypatch: pytest.MonkeyPatch, one_engine: Backends) -> None:
    url = one_engine.urls[0]
    transport = LeanTransport(url, connect_timeout=0.2, max_idle=8)
    attempts: list[float] = []

    async def never_connects(self: LeanTransport, deadline: float) -> object:
        attempts.append(deadline)
        await trio.sleep_until(deadline)  # the loop runs on time: the engine did not answer
        raise trio.TooSlowError

    monkeypatch.setattr(LeanTransport, "_connect_once", never_connects)
    with pytest.raises(httpx.ConnectTimeout):
        await post(transport, url)
    assert len(attempts) == 1
    await transport.aclose()


@asynccontextmanager
async def in_memory_engine(*, keepalive_expiry: float = KEEPALIVE_EXPIRY) -> AsyncIterator[LeanTransport]:
    """A LeanTransport whose connections are memory streams to an in-process engine's own HTTP server."""
    engine = Engine(QUICK)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        connect = memory_connector(SimApp(engine, model=MODEL).handle, nursery)
        transport = LeanTransport("http://sim", connect_timeout=2, max_idle=4, connect=connect, keepalive_expiry=keepalive_expiry)
        try:
            yield transport
        finally:
            await transport.aclose()
            nursery.cancel_scope.cancel()


async def test_a_connector_carries_the_same_bytes_with_no_socket(autojump_clock: trio.testing.MockClock) -> None:
    async with in_memory_engine() as transport:
        for stream in (False, True, False):
            response = await transport.post("/v1/chat/completions", json.dumps({**BODY, "stream": stream}).encode(), {"content-type": "application/json"})
            body = b"".join([chunk async for chunk in response.aiter_raw()])
            await response.aclose()
            assert response.status_code == 200
            assert body.rstrip().endswith(b"data: [DONE]") if stream else b'"finish_reason"' in body
        assert transport.opened == 1  # kept alive across plain and streamed answers


async def test_a_memory_connection_the_engine_closed_while_idle_is_replaced_once(autojump_clock: trio.testing.MockClock) -> None:
    async with in_memory_engine(keepalive_expiry=60) as transport:
        assert (await post(transport, "http://sim"))[0] == 200
        await trio.sleep(KEEP_ALIVE_TIMEOUT + 1)  # the engine's keep-alive timer closes it, ours does not yet
        assert (await post(transport, "http://sim"))[0] == 200
        assert (transport.opened, transport.resent) == (2, 1)


async def test_a_paused_body_sleeps_on_a_memory_stream(autojump_clock: trio.testing.MockClock) -> None:
    async with in_memory_engine() as transport:
        response = await transport.post("/v1/chat/completions", json.dumps({**BODY, "stream": True}).encode(), {"content-type": "application/json"})
        assert isinstance(response.stream, ResponseBody)
        started = trio.current_time()
        await response.stream.pause(0.25)
        assert trio.current_time() - started == pytest.approx(0.25)
        assert b"".join([chunk async for chunk in response.stream]).rstrip().endswith(b"data: [DONE]")
