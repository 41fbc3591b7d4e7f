"""The backend client: error mapping at the httpx boundary, and sharded pools."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
import trio.testing

from router.backend import SHARD_CONNECTIONS, BackendClient, BackendResponse
from router.errors import BackendRejected, BackendUnavailable


def client_for(handler: object, cap: int = 8) -> BackendClient:
    return BackendClient("http://gpu-0:8000", max_concurrency=cap, connect_timeout=1.0, transport=httpx.MockTransport(handler))  # type: ignore[arg-type]


@asynccontextmanager
async def opened(backend: BackendClient, headers: dict[str, str] | None = None) -> AsyncIterator[BackendResponse]:
    """One non-streaming call, read to its end, closed on exit."""
    response = await backend.open("/v1/completions", {"prompt": "x"}, headers or {}, stream=False)
    try:
        await response.start()
        yield response
    finally:
        await response.aclose()


@pytest.mark.parametrize(
    ("status", "body", "error", "needle"),
    [
        (400, b'{"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}', BackendRejected, "bad n"),
        (404, b'{"object": "error", "message": "no such model", "type": "NotFoundError"}', BackendRejected, "no such model"),
        (422, b"plain text complaint", BackendRejected, "plain text complaint"),
        (500, b'{"error": {"message": "CUDA OOM"}}', BackendUnavailable, "CUDA OOM"),
        (503, b"", BackendUnavailable, "503"),
    ],
)
async def test_error_statuses_map_into_the_router_tree(status: int, body: bytes, error: type[Exception], needle: str) -> None:
    backend = client_for(lambda request: httpx.Response(status, content=body))
    with pytest.raises(error, match=needle) as caught:
        async with opened(backend):
            pass
    if isinstance(caught.value, BackendRejected):
        assert caught.value.status == status
    await backend.aclose()


async def test_refused_connection_is_unavailable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    backend = client_for(refuse)
    with pytest.raises(BackendUnavailable, match="could not be reached"):
        async with opened(backend):
            pass
    assert not await backend.health()
    await backend.aclose()


async def test_calls_fill_shards_that_add_up_to_the_cap(autojump_clock: trio.testing.MockClock) -> None:
    release = trio.Event()
    seen: list[str] = []

    async def slow(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["x-request-id"])
        await release.wait()
        return httpx.Response(200, json={"ok": True})

    cap = 2 * SHARD_CONNECTIONS + 5
    backend = client_for(slow, cap=cap)
    assert sorted(s.size for s in backend._shards) == [5, SHARD_CONNECTIONS, SHARD_CONNECTIONS]

    async def call(i: int) -> None:
        async with opened(backend, {"x-request-id": str(i)}) as response:
            await response.read()

    async with trio.open_nursery() as nursery:
        for i in range(cap):
            nursery.start_soon(call, i)
        await trio.testing.wait_all_tasks_blocked()
        # Every shard is filled to its own size: none queues inside httpx.
        assert sorted(s.in_flight for s in backend._shards) == [5, SHARD_CONNECTIONS, SHARD_CONNECTIONS]
        assert len(seen) == cap
        release.set()
    assert all(s.in_flight == 0 for s in backend._shards)
    await backend.aclose()


async def test_backend_cookies_are_never_kept_or_sent() -> None:
    sent_cookies: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent_cookies.append(request.headers.get("cookie"))
        return httpx.Response(200, json={"ok": True}, headers={"set-cookie": "session=caller-a; Path=/"})

    backend = client_for(handler)
    for _ in range(2):
        async with opened(backend) as response:
            await response.read()
    assert sent_cookies == [None, None]  # caller A's cookie never reaches caller B
    await backend.aclose()
