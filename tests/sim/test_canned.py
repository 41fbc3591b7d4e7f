"""Canned answers on the wire path: requests parsed back, answers framed, connections kept alive."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tailguard.router.backend import BackendClient, LeanTransport
from tailguard.router.errors import BackendUnavailable
from tailguard.sim.canned import canned_transport

COMPLETION = b'{"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}'


class Events(httpx.AsyncByteStream):
    """A body of unknown length (sent chunked); records whether it was closed."""

    def __init__(self, events: list[bytes]) -> None:
        self.events = events
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield event

    async def aclose(self) -> None:
        self.closed = True


async def test_the_handler_sees_the_request_the_client_sent_and_one_connection_serves_both() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"content-type": "application/json"}, content=COMPLETION)

    backend = BackendClient("http://gpu-0:8000", max_concurrency=2, connect_timeout=1.0, transport=canned_transport(handler))
    for _ in range(2):
        response = await backend.open("/v1/completions", {"prompt": "x"}, {"x-request-id": "r1"}, stream=False)
        assert await response.read() == COMPLETION
        await response.aclose()
    assert [(r.method, str(r.url), r.headers["x-request-id"], r.content) for r in seen] == [
        ("POST", "http://gpu-0:8000/v1/completions", "r1", b'{"prompt": "x"}')
    ] * 2
    assert isinstance(backend.transport, LeanTransport) and backend.transport.opened == 1  # kept alive
    await backend.aclose()


async def test_a_body_of_unknown_length_arrives_chunked_and_is_closed_at_its_end() -> None:
    body = Events([COMPLETION[:10], COMPLETION[10:]])

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=body)

    backend = BackendClient("http://gpu-0:8000", max_concurrency=1, connect_timeout=1.0, transport=canned_transport(handler))
    response = await backend.open("/v1/completions", {"prompt": "x"}, {}, stream=False)
    assert await response.read() == COMPLETION
    await response.aclose()
    assert body.closed
    await backend.aclose()


async def test_a_handlers_error_comes_out_of_the_request() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    backend = BackendClient("http://gpu-0:8000", max_concurrency=1, connect_timeout=1.0, transport=canned_transport(refuse))
    with pytest.raises(BackendUnavailable, match="could not be reached") as caught:
        await backend.open("/v1/completions", {"prompt": "x"}, {}, stream=False)
    assert caught.value.detail is not None and "refused" in caught.value.detail  # for the logs; the caller's message names no address
    await backend.aclose()
