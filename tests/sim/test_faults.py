"""The simulator's fault modes, each checked on a real socket with httpx.

Negative checks ("never answers") wait a fraction of a second of real time:
a hung engine gives nothing else to wait for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from tailguard.sim import PROFILES, AdminApp, DropConnection, Engine, Fault, FaultError, FaultInjector, FaultSwitch, SimApp, SimTransport
from tailguard.sim.__main__ import build_parser
from tailguard.sim.http import serve
from tests.helpers.engines import MODEL

QUICK = PROFILES["latency"].replace(base_ms=1.0, per_seq_ms=0.01, max_model_len=4096, kv_cache_tokens=100_000)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
NO_ANSWER_S = 0.3  # how long a hung engine is watched not answering


@dataclass
class Faulty:
    client: httpx.AsyncClient
    admin: httpx.AsyncClient
    switch: FaultSwitch
    engine: Engine
    port: int


@asynccontextmanager
async def faulty_engine(fault: Fault | None = None) -> AsyncIterator[Faulty]:
    """One engine behind the fault injector on a free port, and an admin port that reaches it."""
    engine = Engine(QUICK)
    switch = FaultSwitch(fault)
    handler = FaultInjector(SimApp(engine, model=MODEL), switch).handle
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        port = await nursery.start(partial(serve, handler, "127.0.0.1", 0, gate=switch))
        admin_port = await nursery.start(serve, AdminApp({port: switch}).handle, "127.0.0.1", 0)
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}", timeout=5) as admin,
        ):
            yield Faulty(client, admin, switch, engine, port)
        nursery.cancel_scope.cancel()


async def set_fault(f: Faulty, **fault: object) -> None:
    reply = await f.client.post("/_sim/faults", json=fault)
    assert reply.status_code == 200, reply.text


def events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


async def no_answer(request: object) -> bool:
    """Whether ``request`` (an awaitable) is still unanswered after NO_ANSWER_S."""
    with trio.move_on_after(NO_ANSWER_S) as scope:
        await request  # type: ignore[misc]
    return scope.cancelled_caught


async def running_goes_to_zero(engine: Engine) -> None:
    with trio.fail_after(2):
        while engine.statistics().running or engine.statistics().waiting:
            await trio.sleep(0.01)


async def test_admin_route_shows_sets_and_refuses() -> None:
    async with faulty_engine() as f:
        assert (await f.client.get("/_sim/faults")).json() == {"mode": "none"}
        set_reply = await f.client.post("/_sim/faults", json={"mode": "error_rate", "p": 0.25})
        assert set_reply.json() == {"mode": "error_rate", "p": 0.25}
        assert (await f.client.get("/_sim/faults")).json() == {"mode": "error_rate", "p": 0.25}
        assert (await f.admin.get("/_sim/faults")).json() == {str(f.port): {"mode": "error_rate", "p": 0.25}}
        for body, key in (({"mode": "melt"}, "mode"), ({"mode": "huge", "p": 0.5}, "p"), ({"mode": "huge", "size": "big"}, "size"), ({"zap": 1}, "zap")):
            refused = await f.client.post("/_sim/faults", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["message"].startswith(f"{key}:")
        assert (await f.client.post("/_sim/faults", content=b"[1]")).status_code == 400
        assert (await f.admin.post("/_sim/faults/1", json={})).status_code == 404
        assert f.switch.fault == Fault("error_rate", p=0.25)  # refusals changed nothing
        await set_fault(f, mode="none")
        reply = await f.client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8


def test_fault_parse_forms() -> None:
    assert Fault.parse("none") == Fault()
    assert Fault.parse("revive") == Fault()
    assert Fault.parse("error_rate:p=0.3") == Fault("error_rate", p=0.3)
    assert Fault.parse("huge:size=1000,status=200") == Fault("huge", size=1000, status=200)
    assert Fault.parse("truncated:events=1,abrupt=true") == Fault("truncated", events=1, abrupt=True)
    assert Fault.parse("redirect:location=http://127.0.0.1:9/x") == Fault("redirect", location="http://127.0.0.1:9/x")
    assert Fault.parse('{"mode": "hang"}') == Fault("hang")
    for bad in ("melt", "error_rate:p=2", "huge:status=404", "hang:p=0.1", "error_rate:p"):
        with pytest.raises(FaultError):
            Fault.parse(bad)
    assert build_parser().parse_args(["--fault", "kill", "--admin-port", "0"]).fault == "kill"


async def test_kill_drops_connections_and_revive_listens_on_the_same_port() -> None:
    async with faulty_engine() as f:
        stream_cut = trio.Event()

        async def long_stream() -> None:
            with pytest.raises(httpx.RemoteProtocolError):
                async with f.client.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 3000, "stream": True}) as reply:
                    async for _ in reply.aiter_bytes():
                        if f.switch.fault.mode == "none":
                            await f.admin.post(f"/_sim/faults/{f.port}", json={"mode": "kill"})
            stream_cut.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream)
            with trio.fail_after(5):
                await stream_cut.wait()
        await running_goes_to_zero(f.engine)  # the dropped stream freed its seat
        with pytest.raises(httpx.ConnectError):
            await f.client.get("/health")
        assert (await f.admin.get(f"/_sim/faults/{f.port}")).json() == {"mode": "kill"}
        await f.admin.post(f"/_sim/faults/{f.port}", json={"mode": "revive"})
        assert (await f.client.get("/health")).status_code == 200
        assert (await f.client.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_hang_reads_the_request_and_never_answers() -> None:
    async with faulty_engine(Fault("hang")) as f:
        assert await no_answer(f.client.post("/v1/chat/completions", json=CHAT))
        assert await no_answer(f.client.get("/health"))
        assert (await f.client.get("/_sim/faults")).json() == {"mode": "hang"}  # the admin route still answers
        assert f.engine.statistics().running == 0  # nothing reached the engine


async def test_half_dead_is_healthy_but_completions_hang() -> None:
    async with faulty_engine(Fault("half_dead")) as f:
        assert (await f.client.get("/health")).status_code == 200
        assert (await f.client.get("/v1/models")).status_code == 200
        assert await no_answer(f.client.post("/v1/chat/completions", json=CHAT))
        assert await no_answer(f.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))


async def test_error_rate_answers_a_share_with_vllms_500() -> None:
    async with faulty_engine(Fault("error_rate", p=1.0)) as f:
        reply = await f.client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 500
        assert reply.json()["error"]["type"] == "InternalServerError" and reply.json()["error"]["code"] == 500
        assert (await f.client.get("/health")).status_code == 200  # only completions fail
        await set_fault(f, mode="error_rate", p=0.5)
        statuses = [(await f.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})).status_code for _ in range(30)]
        assert set(statuses) == {200, 500} and 5 <= statuses.count(500) <= 25


async def test_garbage_is_200_without_json_or_sse() -> None:
    async with faulty_engine(Fault("garbage")) as f:
        plain = await f.client.post("/v1/chat/completions", json=CHAT)
        assert plain.status_code == 200 and plain.headers["content-type"] == "application/json"
        with pytest.raises(ValueError):  # not JSON, not even UTF-8
            plain.json()
        streamed = await f.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200 and streamed.headers["content-type"] == "text/event-stream"
        assert streamed.content and events(streamed.text) == []


async def test_truncated_streams_and_bodies() -> None:
    async with faulty_engine(Fault("truncated", events=2)) as f:
        stream = {**CHAT, "max_tokens": 50, "stream": True}
        clean = await f.client.post("/v1/chat/completions", json=stream)  # the chunked body ends, early
        assert clean.status_code == 200 and len(events(clean.text)) == 2 and "[DONE]" not in clean.text
        with pytest.raises(httpx.RemoteProtocolError):
            await f.client.post("/v1/chat/completions", json=CHAT)  # Content-Length promised more
        await set_fault(f, mode="truncated", events=2, abrupt=True)
        with pytest.raises(httpx.RemoteProtocolError):
            await f.client.post("/v1/chat/completions", json=stream)
        await running_goes_to_zero(f.engine)  # every cut sequence was aborted


async def test_huge_bodies_are_whole_and_written_in_pieces() -> None:
    size = 3_000_000
    async with faulty_engine(Fault("huge", size=size)) as f:
        error = await f.client.post("/v1/chat/completions", json=CHAT)
        assert error.status_code == 500 and len(error.content) == size == int(error.headers["content-length"])
        assert error.json()["error"]["code"] == 500
        await set_fault(f, mode="huge", size=size, status=200)
        plain = await f.client.post("/v1/chat/completions", json=CHAT)
        assert plain.status_code == 200 and len(plain.content) == size
        assert plain.json()["choices"][0]["finish_reason"] == "length"
        streamed = await f.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert len(streamed.content) == size and events(streamed.text)[-1] == "[DONE]"
    # In memory at any time: one piece of 64 KiB, not the body.
    pieces = [len(p) async for p in _huge_stream(size)]
    assert sum(pieces) == size and max(pieces) <= 64 * 1024


async def _huge_stream(size: int) -> AsyncIterator[bytes]:
    handler = FaultInjector(SimApp(Engine(QUICK), model=MODEL), FaultSwitch(Fault("huge", size=size))).handle
    response = await handler("POST", "/v1/chat/completions", {}, json.dumps(CHAT).encode())
    assert response.stream is not None and response.body == b""
    async for piece in response.stream:
        yield piece


async def test_gzip_garbage_fails_to_decode() -> None:
    async with faulty_engine(Fault("gzip_garbage")) as f:
        with pytest.raises(httpx.DecodingError):
            await f.client.post("/v1/chat/completions", json=CHAT)
        async with f.client.stream("POST", "/v1/chat/completions", json=CHAT) as reply:
            assert reply.status_code == 200 and reply.headers["content-encoding"] == "gzip"
            raw = b"".join([chunk async for chunk in reply.aiter_raw()])
        assert raw.startswith(b"\x1f\x8b")


async def test_redirect_is_a_302_with_location() -> None:
    async with faulty_engine(Fault("redirect", location="http://127.0.0.1:9/v1/elsewhere")) as f:
        reply = await f.client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 302 and reply.headers["location"] == "http://127.0.0.1:9/v1/elsewhere"
        assert reply.content == b""


async def test_echo_auth_quotes_the_authorization_it_was_sent_in_an_error_body() -> None:
    async with faulty_engine(Fault("echo_auth", status=401)) as f:
        reply = await f.client.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-backend-123"})
        assert reply.status_code == 401 and "Bearer sk-backend-123" in reply.json()["error"]["message"]
        for status in (400, 500):
            await set_fault(f, mode="echo_auth", status=status)
            reply = await f.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stream": True}, headers={"authorization": "k"})
            assert reply.status_code == status and reply.json()["error"]["code"] == status and "Authorization: k" in reply.text
        assert (await f.client.get("/health")).status_code == 200  # only completions answer so
    assert Fault.parse("echo_auth:status=400") == Fault("echo_auth", status=400)
    for bad in ("echo_auth:status=200", "huge:status=401"):
        with pytest.raises(FaultError, match="status"):
            Fault.parse(bad)


SURROGATE_BODIES = (
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "ab\\ud866cd"}], "max_tokens": 4}'),
    ("/v1/completions", b'{"prompt": "\\udfff", "max_tokens": 4}'),
)


async def test_tokenizer_panic_drops_the_connection_on_a_lone_surrogate() -> None:
    async with faulty_engine(Fault("tokenizer_panic")) as f:
        for path, body in SURROGATE_BODIES:
            with pytest.raises(httpx.RemoteProtocolError):
                await f.client.post(path, content=body, headers={"content-type": "application/json"})
        # Text the tokenizer takes (a valid surrogate pair is one character) is served; the engine serves on.
        paired = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 4}'
        assert (await f.client.post("/v1/chat/completions", content=paired, headers={"content-type": "application/json"})).status_code == 200
        assert f.engine.statistics().finished_total == 1
        await set_fault(f, mode="tokenizer_panic", trigger="any")  # now every completion panics
        with pytest.raises(httpx.RemoteProtocolError):
            await f.client.post("/v1/chat/completions", content=paired)
        assert (await f.client.get("/health")).status_code == 200  # only completions are tokenized
        await set_fault(f, mode="none")  # healthy again: the same text is vLLM's 400, not a drop
        for path, body in SURROGATE_BODIES:
            assert (await f.client.post(path, content=body, headers={"content-type": "application/json"})).status_code == 400
    with pytest.raises(FaultError, match="trigger"):
        Fault.parse("tokenizer_panic:trigger=sometimes")
    assert Fault.parse("tokenizer_panic").to_json() == {"mode": "tokenizer_panic", "trigger": "surrogate"}


async def test_in_process_transport_maps_a_drop_to_httpx_errors() -> None:
    switch = FaultSwitch(Fault("truncated", events=1))
    engine = Engine(QUICK)
    handler = FaultInjector(SimApp(engine, model=MODEL), switch).handle
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with httpx.AsyncClient(transport=SimTransport(handler), base_url="http://sim") as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post("/v1/chat/completions", json=CHAT)
            switch.set(Fault("kill"))
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get("/health")
        nursery.cancel_scope.cancel()
    panicking = FaultInjector(SimApp(Engine(QUICK), model=MODEL), FaultSwitch(Fault("tokenizer_panic")))
    with pytest.raises(DropConnection):
        await panicking.handle("POST", "/v1/completions", {}, b'{"prompt": "\\ud866"}')


def test_cli_starts_in_a_fault_mode_and_the_admin_port_revives() -> None:
    command = [sys.executable, "-m", "tailguard.sim", "--port", "0", "--fault", "kill", "--admin-port", "0", "--base-ms", "1"]
    root = Path(__file__).resolve().parents[2]
    with subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            engine_line, admin_line = process.stdout.readline(), process.stdout.readline()
            assert "fault={'mode': 'kill'}" in engine_line
            engine_url = engine_line.split()[1].removesuffix("/v1")
            admin_url = admin_line.split()[1]
            port = engine_url.rsplit(":", 1)[1]
            with pytest.raises(httpx.ConnectError):
                httpx.get(engine_url + "/health")
            assert httpx.get(admin_url).json() == {port: {"mode": "kill"}}
            assert httpx.post(f"{admin_url}/{port}", json={"mode": "none"}).json() == {"mode": "none"}
            assert httpx.get(engine_url + "/health").status_code == 200
        finally:
            process.terminate()
