"""The harness's HTTP/1.1 client (httptools underneath): framing, keep-alive, markers and pieces, errors, on a real socket."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio

from bench.harness.client import KeepAliveClient, LoadCounters, ProtocolError, read_stream
from bench.harness.open_loop import TokenClient

REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"
TOKEN = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'


async def serve(nursery: trio.Nursery, replies: Sequence[Sequence[bytes]], connections: list[int]) -> int:
    """A server that answers the n-th request with ``replies[n]``, each part sent on its own; its port."""
    queue = iter(replies)

    async def handler(stream: trio.SocketStream) -> None:
        connections.append(1)
        buffer = b""
        while data := await stream.receive_some(65536):
            buffer += data
            while b"\r\n\r\n" in buffer:
                _, buffer = buffer.split(b"\r\n\r\n", 1)
                for part in next(queue):
                    await stream.send_all(part)
                    await trio.sleep(0.01)

    listeners = await nursery.start(trio.serve_tcp, handler, 0)
    port: int = listeners[0].socket.getsockname()[1]
    return port


def chunked(*pieces: bytes) -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", *(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces), b"0\r\n\r\n"]


async def test_a_keep_alive_client_reuses_its_connection_until_the_server_says_close() -> None:
    connections: list[int] = []
    ok = [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"]
    closing = [b"HTTP/1.1 503 Busy\r\nconnection: close\r\ncontent-length: 2\r\n\r\nno"]
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, [ok, ok, closing, ok], connections)
        client = KeepAliveClient(port)
        replies = [await client.exchange(REQUEST) for _ in range(4)]
        await client.aclose()
        nursery.cancel_scope.cancel()
    assert [(r.status, r.body_bytes, r.keep_alive) for r in replies] == [(200, 5, True), (200, 5, True), (503, 2, False), (200, 5, True)]
    assert len(connections) == 2


async def test_a_chunked_stream_notes_its_marker_its_done_and_each_whole_piece() -> None:
    connections: list[int] = []
    # The second token is split across two writes: the piece is whole only with both.
    parts = chunked(b"data: role\n\n", TOKEN, TOKEN, b"data: [DONE]\n\n")
    parts[3:4] = [parts[3][:10], parts[3][10:]]
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, [parts], connections)
        client = TokenClient(port)
        reply = await client.exchange(REQUEST, marker=b'"delta":{"content":')
        await client.aclose()
        nursery.cancel_scope.cancel()
    assert reply.status == 200 and reply.done_seen and reply.marker_at is not None
    assert reply.body_bytes == len(b"data: role\n\n") + 2 * len(TOKEN) + len(b"data: [DONE]\n\n")
    assert len(client.token_times) == 2 and client.token_times[0] < client.token_times[1]
    assert client.last_piece == b"data: [DONE]\n\n"


@pytest.mark.parametrize("reply", [[b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort"], [b"NOT HTTP AT ALL\r\n\r\n"]])
async def test_a_response_cut_short_or_unparsable_is_a_protocol_error_and_the_connection_is_dropped(reply: list[bytes]) -> None:
    connections: list[int] = []

    async def cut(stream: trio.SocketStream) -> None:
        connections.append(1)
        await stream.receive_some(65536)
        for part in reply:
            await stream.send_all(part)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, cut, 0)
        client = KeepAliveClient(listeners[0].socket.getsockname()[1])
        for _ in range(2):
            with pytest.raises(ProtocolError):
                await client.exchange(REQUEST)
        nursery.cancel_scope.cancel()
    assert len(connections) == 2  # the failed connection was not reused


async def test_read_stream_counts_events_until_done_and_refuses_a_non_200() -> None:
    connections: list[int] = []
    refused = [b"HTTP/1.1 429 Too Many\r\ncontent-length: 2\r\n\r\n{}"]
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, [chunked(TOKEN, TOKEN + TOKEN, b"data: [DONE]\n\n"), refused], connections)
        counters = LoadCounters()
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(REQUEST)
            assert await read_stream(stream, counters)
            await stream.send_all(REQUEST)
            assert not await read_stream(stream, LoadCounters())
        nursery.cancel_scope.cancel()
    assert counters.events == 4
