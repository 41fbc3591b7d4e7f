"""The lean backend transport over real sockets: keep-alive, stale connections, failures."""

from __future__ import annotations

import functools

import httpx
import pytest
import trio

from router.lean_transport import LeanTransport

from .http_helpers import QUICK, engines_on_sockets
from .sim_helpers import MODEL

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def post(transport: LeanTransport, url: str, *, stream: bool = False) -> tuple[int, bytes]:
    request = httpx.Request("POST", url + "/v1/chat/completions", json={**BODY, "stream": stream})
    response = await transport.handle_async_request(request)
    try:
        return response.status_code, b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()


async def test_sequential_and_concurrent_calls_reuse_their_connections() -> None:
    async with engines_on_sockets([QUICK]) as backends:
        url = backends.urls[0]
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


async def test_connections_idle_past_the_expiry_are_closed_not_reused() -> None:
    async with engines_on_sockets([QUICK]) as backends:
        url = backends.urls[0]
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
