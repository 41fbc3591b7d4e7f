"""The backend client: error mapping at the httpx boundary, and sharded pools."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
import trio.testing

from tailguard.router.backend import REFUSED, BackendClient, BackendProbe, BackendResponse, ConnectorTransport, LeanTransport
from tailguard.router.errors import BackendRejected, BackendStreamError, BackendUnavailable, BadBackendReply
from tailguard.sim import PROFILES, Engine, SimApp
from tailguard.sim.canned import canned_transport
from tailguard.sim.memory import memory_connector
from tests.helpers.engines import MODEL

COMPLETION = {"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}


def client_for(handler: object, cap: int = 8) -> BackendClient:
    return BackendClient("http://gpu-0:8000", max_concurrency=cap, connect_timeout=1.0, transport=canned_transport(handler))  # type: ignore[arg-type]


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


@pytest.mark.parametrize(
    ("status", "body", "error_type", "code"),
    [
        (400, b'{"error": {"message": "temperature must be non-negative", "type": "BadRequestError", "param": "temperature", "code": 400}}', "invalid_request_error", None),
        (400, b'{"error": {"message": "1 validation error", "type": "Bad Request", "param": "body.max_tokens", "code": 400}}', "invalid_request_error", None),
        (400, b'{"error": {"message": "maximum context length is 4096", "type": "BadRequestError", "param": "input_tokens", "code": 400}}', "invalid_request_error", "context_length_exceeded"),
        (400, b'{"error": {"message": "too long", "type": "BadRequestError", "param": "input_text", "code": 400}}', "invalid_request_error", "context_length_exceeded"),
        (404, b'{"error": {"message": "no such model", "type": "NotFoundError", "param": "model", "code": 404}}', "invalid_request_error", None),
        (429, b'{"error": {"message": "slow down", "type": "TooManyRequests"}}', "rate_limit_error", None),
        (400, b'{"error": {"message": "bad", "type": "invalid_request_error", "code": "custom_code"}}', "invalid_request_error", "custom_code"),
    ],
)
async def test_an_engines_4xx_reaches_callers_in_openais_types(status: int, body: bytes, error_type: str, code: str | None) -> None:
    """Issue 33, D5: vLLM's own type strings become OpenAI's; its context refusal gets tailguard's code; message and param kept."""
    backend = client_for(lambda request: httpx.Response(status, content=body))
    with pytest.raises(BackendRejected) as caught:
        async with opened(backend):
            pass
    sent = json.loads(body)["error"]
    assert (caught.value.error_type, caught.value.code) == (error_type, code)
    assert caught.value.message == sent["message"] and caught.value.param == sent.get("param")
    await backend.aclose()


async def test_refused_connection_is_unavailable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    backend = client_for(refuse)
    with pytest.raises(BackendUnavailable, match="could not be reached"):
        async with opened(backend):
            pass
    probe = BackendProbe("http://gpu-0:8000", connect_timeout=1.0, transport=canned_transport(refuse))
    assert not await probe.health()
    await backend.aclose()
    await probe.aclose()


async def test_a_probe_tells_a_refused_connection_from_no_answer_over_real_sockets() -> None:
    """Issue 32: a refused connection (nothing listens) marks an endpoint down at once; any other failure is a miss."""
    with trio.socket.socket() as closed:
        await closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: the kernel refuses every connection
        probe = BackendProbe(f"http://127.0.0.1:{port}", connect_timeout=1.0)
        assert await probe.health() == REFUSED and await probe.status("GET", "/health") is None
        await probe.aclose()
    with trio.socket.socket() as deaf:
        await deaf.bind(("127.0.0.1", 0))
        deaf.listen(8)  # accepts (the kernel's backlog) and never answers: a black hole
        probe = BackendProbe(f"http://127.0.0.1:{deaf.getsockname()[1]}", connect_timeout=1.0)
        with trio.move_on_after(0.5) as waited:
            await probe.health()
        assert waited.cancelled_caught
        await probe.aclose()


async def test_calls_up_to_the_cap_run_at_once_and_are_counted(autojump_clock: trio.testing.MockClock) -> None:
    release = trio.Event()
    seen: list[str] = []

    async def slow(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["x-request-id"])
        await release.wait()
        return httpx.Response(200, json=COMPLETION)

    cap = 70
    backend = client_for(slow, cap=cap)

    async def call(i: int) -> None:
        async with opened(backend, {"x-request-id": str(i)}) as response:
            await response.read()

    async with trio.open_nursery() as nursery:
        for i in range(cap):
            nursery.start_soon(call, i)
        await trio.testing.wait_all_tasks_blocked()
        assert len(seen) == cap and backend.in_flight == cap  # none waits inside the client
        release.set()
    assert backend.in_flight == 0
    await backend.aclose()


async def test_backend_cookies_are_never_kept_or_sent() -> None:
    sent_cookies: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent_cookies.append(request.headers.get("cookie"))
        return httpx.Response(200, json=COMPLETION, headers={"set-cookie": "session=caller-a; Path=/"})

    backend = client_for(handler)
    for _ in range(2):
        async with opened(backend) as response:
            await response.read()
    assert sent_cookies == [None, None]  # caller A's cookie never reaches caller B
    await backend.aclose()


# -- replies that are not what was asked for (issue 10, defects 6, 7 and 8) ----------


class Produced:
    """A body written to the wire in chunks, counting how many were asked for."""

    def __init__(self, chunk: bytes, count: int, *, head: bytes = b"") -> None:
        self.chunk, self.count, self.head = chunk, count, head
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.head:
            yield self.head
        for _ in range(self.count):
            self.sent += 1
            yield self.chunk


async def call(handler: object, *, stream: bool = False, max_body_bytes: int = 1 << 20) -> bytes:
    """One call read to its end (the whole SSE for streams)."""
    backend = BackendClient(
        "http://gpu-0:8000", max_concurrency=4, connect_timeout=1.0, transport=canned_transport(handler), max_body_bytes=max_body_bytes  # type: ignore[arg-type]
    )
    try:
        response = await backend.open("/v1/completions", {"prompt": "x"}, {}, stream=stream)
        try:
            await response.start()
            if not stream:
                return await response.read()
            return b"".join([chunk async for chunk in response.chunks()])
        finally:
            await response.aclose()
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("status", "headers", "body", "stream", "needle"),
    [
        (302, {"location": "http://elsewhere/"}, b"", False, "answered 302"),
        (200, {"content-type": "text/html"}, b"<html>", False, "content-type 'text/html'"),
        (200, {"content-type": "application/json"}, b"not json at all", False, "not a JSON object"),
        (200, {"content-type": "application/json"}, b"[1, 2]", False, "not a JSON object"),
        (200, {"content-type": "application/json", "content-encoding": "gzip"}, b"garbage, not gzip", False, "does not decode"),
        (200, {"content-type": "application/json"}, b"{" + b'"a":' * 2000 + b"1", False, "not a JSON object"),
        (200, {"content-type": "application/json"}, b"", True, "content-type 'application/json'"),
        (200, {"content-type": "text/event-stream"}, b'data: {"choices":[{"text":"a","finish_reason":null}]}\n\n', True, "without [DONE]"),
    ],
)
async def test_a_reply_that_is_not_a_completion_is_a_bad_backend_reply(
    status: int, headers: dict[str, str], body: bytes, stream: bool, needle: str
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers=headers, content=Produced(body, 1))

    with pytest.raises(BadBackendReply, match=re.escape(needle)):
        await call(handler, stream=stream)


async def test_a_stream_may_end_with_done_or_a_finish_reason() -> None:
    events = [
        b'data: {"choices":[{"text":"a","finish_reason":null}]}\n\ndata: [DONE]\n\n',
        b'data: {"choices":[{"text":"a","finish_reason":"length"}]}\n\n',
    ]
    for body in events:

        async def handler(request: httpx.Request, body: bytes = body) -> httpx.Response:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=Produced(body, 1))

        assert await call(handler, stream=True) == body


async def test_an_error_event_in_a_stream_is_relayed_then_raised() -> None:
    error = b'data: {"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}}\n\ndata: [DONE]\n\n'
    relayed: list[bytes] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=Produced(error, 1, head=b'data: {"choices":[]}\n\n'))

    backend = client_for(handler)
    response = await backend.open("/v1/completions", {"prompt": "x"}, {}, stream=True)
    await response.start()
    with pytest.raises(BackendStreamError, match="engine dead"):
        async for chunk in response.chunks():
            relayed.append(chunk)
    await response.aclose()
    await backend.aclose()
    assert relayed[-1] == error  # every byte reached the caller before the error was raised


async def test_an_error_body_is_read_only_up_to_its_cap() -> None:
    body = Produced(b"x" * 65536, 300 * 16, head=b'{"error": {"message": "huge"')  # 300 MB if read whole

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, headers={"content-type": "application/json"}, content=body)

    with pytest.raises(BackendUnavailable, match="failed with 500"):
        await call(handler)
    assert body.sent <= 2


async def test_a_completion_body_over_its_cap_is_refused_without_reading_on() -> None:
    body = Produced(b" " * 65536, 300 * 16, head=b'{"choices": []')

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/json"}, content=body)

    with pytest.raises(BadBackendReply, match="over 1048576 bytes"):
        await call(handler, max_body_bytes=1 << 20)
    assert body.sent <= 17


async def test_a_probe_reads_a_huge_answer_only_up_to_its_cap() -> None:
    """A sick engine answering every completion probe with 32 MiB must not cost 32 MiB a probe."""
    bodies: list[Produced] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(Produced(b"x" * 65536, 512))
        return httpx.Response(500, headers={"content-type": "application/json"}, content=bodies[-1])

    probe = BackendProbe("http://gpu-0:8000", connect_timeout=1.0, transport=canned_transport(handler))
    assert await probe.completes("m") == 500 and await probe.health() == 500
    assert [b.sent for b in bodies] == [2, 2]  # 64 KiB each, then the response was closed
    await probe.aclose()


class Split:
    """A body written in the given pieces (how TCP may cut it)."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


async def relayed(*pieces: bytes) -> bytes:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=Split(*pieces))

    return await call(handler, stream=True)


async def test_a_stream_verdict_does_not_depend_on_where_chunks_split() -> None:
    usage = b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n'
    # [DONE] cut in two after the usage event: a complete stream.
    assert await relayed(b'data: {"choices":[{"text":"a","finish_reason":null}]}\n\n', usage + b"data: [DO", b"NE]\n\n")
    # The model writing "[DONE]" in its text, then the stream cut: not complete.
    with pytest.raises(BadBackendReply, match="without"):
        await relayed(b'data: {"choices":[{"text":"[DONE]","finish_reason":null}]}\n\n', b'data: {"choices":[{"text":"b"')
    # An error event cut inside its "error" key is still the backend's error.
    with pytest.raises(BackendStreamError, match="engine died"):
        await relayed(b'data: {"choices":[]}\n\ndata: {"err', b'or": {"message": "engine died", "code": 500}}\n\ndata: [DONE]\n\n')


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"error": {"message": "oops"}}, "holds an error"),
        ({"id": "x", "choices": []}, "no choices"),
        ({"choices": [{"text": "a"}]}, "without a finish reason"),
    ],
)
async def test_a_json_object_that_is_not_a_completion_is_refused(body: dict[str, object], needle: str) -> None:
    with pytest.raises(BadBackendReply, match=needle):
        await call(lambda request: httpx.Response(200, json=body))


async def test_a_connector_transport_gets_the_production_transport_and_the_probe_its_own(autojump_clock: trio.testing.MockClock) -> None:
    engine = Engine(PROFILES["latency"])
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        shared = ConnectorTransport(memory_connector(SimApp(engine, model=MODEL).handle, nursery))
        backend = BackendClient("http://sim", max_concurrency=4, connect_timeout=1.0, transport=shared)
        probe = BackendProbe("http://sim", connect_timeout=1.0, transport=shared)
        assert isinstance(backend.transport, LeanTransport)  # completions take the production path
        async with opened(backend) as response:
            assert b'"choices"' in await response.read()
        assert await probe.health()
        await probe.aclose()  # the probe's connections close, the client's stay
        probe = BackendProbe("http://sim", connect_timeout=1.0, transport=shared)
        assert await probe.health()  # and a probe built again (a reload's) connects anew
        async with opened(backend):
            pass
        assert backend.transport.opened == 1
        await backend.aclose()
        await probe.aclose()
        nursery.cancel_scope.cancel()
