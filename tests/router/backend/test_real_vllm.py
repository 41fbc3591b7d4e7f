"""In front of a real vLLM (issue 19): backend credentials, clean upstream requests, vLLM's own overload, keep-alive.

Each behaviour is checked against the simulator taught the vLLM behaviour in
question (``--api-key``, the queue-full 503, uvicorn's 5 s keep-alive) or a
small backend written for the test, through the router's public seams.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import given, strategies as st

from tailguard.router import Router
from tailguard.router.admission import RouterRequest
from tailguard.router.backend import BackendClient, BackendProbe, ConnectorTransport, EventFilter
from tailguard.router.config import BackendAccess, Config, ConfigError, EndpointConfig, parse_config
from tailguard.router.errors import BackendAuthFailed, QueueTimeout
from tailguard.router.fleet import Endpoint, ModelLenError, ask_model_lens
from tailguard.router.observe import RequestRecord
from tailguard.server.errors_map import http_error
from tailguard.server.metrics import Metrics
from tailguard.sim import PROFILES, Engine, SimApp, SimTransport
from tailguard.sim.canned import canned_transport, sim_canned_transport
from tailguard.sim.http import serve as serve_sim
from tests.helpers.engines import MODEL
from tests.helpers.router import chat

A, B = "http://gpu-a:8000", "http://gpu-b:8000"
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def config_text(urls: tuple[str, ...] = (A,), *, pool_extra: str = "", top: str = "") -> str:
    """One pool over ``urls`` (4 seats each) and one class; ``pool_extra`` goes into the pool's table, ``top`` before it."""
    endpoints = ", ".join(f'{{ url = "{url}", max_concurrency = 4 }}' for url in urls)
    return f"""{top}
[pools.main]
max_concurrency = {4 * len(urls)}
max_queue = 16
max_model_len = 32768
models = ["{MODEL}"]
endpoints = [{endpoints}]
{pool_extra}

[classes.all]
pool = "main"
queue_timeout = 2.0
"""


def config(urls: tuple[str, ...] = (A,), *, pool_extra: str = "", environ: Mapping[str, str] | None = None) -> Config:
    return parse_config(config_text(urls, pool_extra=pool_extra), environ=environ or {})


@asynccontextmanager
async def router_over(handlers: Mapping[str, Handler | SimApp], cfg: Config, *, found_well: bool = True) -> AsyncIterator[Router]:
    """A Router whose endpoints answer through ``handlers`` (an httpx handler, or a simulated engine's API), probed once:
    ``found_well``, that first probe gets 200 everywhere (the handlers fail later if at all); else the handlers answer it."""

    probing = found_well  # endpoints start unknown: a probe must pass first

    def transport_for(endpoint: EndpointConfig) -> ConnectorTransport:
        handler = handlers[endpoint.url]
        answer = sim_canned_transport(handler) if isinstance(handler, SimApp) else canned_transport(handler)

        async def handle(request: httpx.Request) -> httpx.Response:
            if probing:
                return httpx.Response(200, json={"object": "list", "data": []})
            return await answer.handle_async_request(request)

        return canned_transport(handle)

    router = Router(cfg, transport_factory=transport_for, seed=0)
    await router.check_health()  # endpoints take requests once a probe has passed
    probing = False
    try:
        yield router
    finally:
        await router.aclose()


@asynccontextmanager
async def engines(*api_keys: str | None) -> AsyncIterator[list[SimApp]]:
    """Simulated engines (instant profile), each started with its ``--api-key`` (None: none)."""
    async with trio.open_nursery() as nursery:
        apps = []
        for key in api_keys:
            engine = Engine(PROFILES["instant"])
            await nursery.start(engine.run)
            apps.append(SimApp(engine, model=MODEL, api_key=key))
        yield apps
        nursery.cancel_scope.cancel()


async def complete(router: Router, request: RouterRequest, record: RequestRecord | None = None) -> bytes:
    with trio.fail_after(30):
        async with router.open(request, record=record) as completion:
            if request.stream:
                return b"".join([chunk async for chunk in completion.chunks()])
            return await completion.read()


def endpoint(router: Router, url: str) -> Endpoint:
    [found] = [e for e in router.endpoints if e.url == url]
    return found


# -- 1. backend credentials -------------------------------------------------------


async def test_the_pools_key_reaches_every_v1_route_and_the_callers_never_does(autojump_clock: trio.testing.MockClock) -> None:
    cfg = config(pool_extra='api_key_env = "VLLM_KEY"', environ={"VLLM_KEY": "sk-engine\n"})
    assert cfg.pools[0].access.api_key == "sk-engine" and "sk-engine" not in repr(cfg)
    async with engines("sk-engine") as [app], router_over({A: app}, cfg) as router:
        body = json.loads(await complete(router, chat(max_tokens=4)))
        assert body["choices"][0]["finish_reason"]
        probe = BackendProbe(A, connect_timeout=1, transport=sim_canned_transport(app), access=cfg.pools[0].endpoints[0].access)
        assert await probe.max_model_len() > 0 and await probe.completes(MODEL) == 200  # the model probe, the completion probe
        await probe.aclose()
        await router.check_health()
        assert router.health()["status"] == "ready" and endpoint(router, A).credentials_checked


async def test_an_endpoint_entry_overrides_its_pools_key() -> None:
    environ = {"POOL_KEY": "sk-pool", "GPU_KEY": "sk-gpu"}
    cfg = config((A, B), pool_extra='api_key_env = "POOL_KEY"', environ=environ)
    assert {e.access.api_key for e in cfg.pools[0].endpoints} == {"sk-pool"}
    text = f"""
[pools.main]
max_concurrency = 8
max_queue = 0
max_model_len = 32768
models = ["{MODEL}"]
api_key_env = "POOL_KEY"
endpoints = [{{ url = "{A}", max_concurrency = 4 }}, {{ url = "{B}", max_concurrency = 4, api_key_env = "GPU_KEY" }}]
[classes.all]
pool = "main"
queue_timeout = 1.0
"""
    a, b = parse_config(text, environ=environ).pools[0].endpoints
    assert (a.access.api_key, b.access.api_key) == ("sk-pool", "sk-gpu")
    rotated = parse_config(text, environ={**environ, "GPU_KEY": "sk-new"})
    assert rotated.digest != parse_config(text, environ=environ).digest  # a rotated key is a change a reload applies


def test_a_key_variable_that_is_not_set_is_named_and_refuses_the_file() -> None:
    with pytest.raises(ConfigError) as refused:
        config(pool_extra='api_key_env = "VLLM_API_KEY"', environ={})
    [problem] = refused.value.problems
    assert problem.startswith("pools.main.api_key_env:") and "VLLM_API_KEY is not set" in problem


async def test_a_refused_key_is_502_upstream_auth_the_endpoint_down_with_its_reason_and_one_error_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(pool_extra='api_key_env = "VLLM_KEY"', environ={"VLLM_KEY": "sk-stale"})
    async with engines("sk-engine") as [app], router_over({A: app}, cfg) as router:
        with caplog.at_level(logging.ERROR, logger="tailguard.router"):
            with pytest.raises(BackendAuthFailed) as failed:
                await complete(router, chat(max_tokens=4))
        error = http_error(failed.value)
        assert error.status == 502 and error.body["error"]["code"] == "upstream_auth"  # type: ignore[index]
        assert "invalid_api_key" not in json.dumps(error.body)  # not the caller's key to fix
        health = router.health()
        assert health["status"] == "unavailable" and health["pools"]["main"]["endpoints"][A] == "down"
        assert "VLLM_KEY" in health["pools"]["main"]["reasons"][A]
        await router.check_health()  # /health is open under --api-key: the check asks a /v1 route too
        assert router.health()["pools"]["main"]["endpoints"][A] == "down"
        with pytest.raises(BackendAuthFailed, match="upstream_auth: the engine answered 401") as again:  # the next caller too (D2)
            await complete(router, chat(max_tokens=4))
        assert http_error(again.value).status == 502 and not http_error(again.value).retryable
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and A in r.getMessage()]
        assert len(errors) == 1 and endpoint(router, A).failures_in_a_row == 0  # once, and no outlier count


async def test_a_missing_key_is_found_by_the_health_check_before_any_request(autojump_clock: trio.testing.MockClock) -> None:
    async with engines("sk-engine", None) as [guarded, open_one], router_over({A: guarded, B: open_one}, config((A, B)), found_well=False) as router:
        assert router.health()["status"] == "ready"
        await router.check_health()
        health = router.health()["pools"]["main"]
        assert health["endpoints"] == {A: "down", B: "up"} and "api_key_env" in health["reasons"][A]
        for i in range(8):  # every request goes to the engine that takes it
            await complete(router, chat(max_tokens=2, request_id=f"r{i}"))
        assert guarded.engine.statistics().finished_total == 0 and open_one.engine.statistics().finished_total == 8


async def test_a_refused_key_moves_the_request_to_a_sibling_that_takes_it(autojump_clock: trio.testing.MockClock) -> None:
    cfg = config((A, B), pool_extra='api_key_env = "VLLM_KEY"', environ={"VLLM_KEY": "sk-engine"})
    async with engines("sk-engine", "sk-other") as [good, other], router_over({A: good, B: other}, cfg) as router:
        for i in range(20):  # until one lands on B first: its 401 moves it to A, the caller sees nothing
            # Prompts unlike each other: prefix affinity sends one prompt to one engine every time.
            assert json.loads(await complete(router, chat(f"question {i}", max_tokens=2, request_id=f"r{i}")))["choices"]
            if endpoint(router, B).auth_failure is not None:
                break
        assert endpoint(router, B).auth_failure is not None and endpoint(router, A).auth_failure is None
        assert router.statistics().retries == {"main": 1}



# -- 2. clean upstream requests ---------------------------------------------------


class Recorder:
    """A backend that records what it was sent, then answers as a simulated engine."""

    def __init__(self, app: SimApp) -> None:
        self.app = app
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        if request.url.path.endswith("completions"):
            self.seen.append((dict(request.headers), json.loads(body)))
        return await SimTransport(self.app).handle_async_request(httpx.Request(request.method, request.url, headers=request.headers, content=body))


@pytest.mark.parametrize("vllm_priority", [False, True])
async def test_a_callers_priority_and_request_id_never_reach_vllm(vllm_priority: bool, autojump_clock: trio.testing.MockClock) -> None:
    cfg = config(pool_extra=f"vllm_priority = {str(vllm_priority).lower()}")
    async with engines(None) as [app]:
        recorder = Recorder(app)
        async with router_over({A: recorder}, cfg) as router:
            await complete(router, chat(max_tokens=2, params={"priority": -1000, "request_id": "mine", "temperature": 0.5}))
    [(_, body)] = recorder.seen
    assert "request_id" not in body and body["temperature"] == 0.5  # the rest passes untouched
    assert body.get("priority") == (0 if vllm_priority else None)  # the class's, or none


async def test_two_callers_with_one_id_reach_vllm_under_two_and_keep_theirs(autojump_clock: trio.testing.MockClock) -> None:
    async with engines(None) as [app]:
        recorder = Recorder(app)
        async with router_over({A: recorder}, config()) as router:
            records = [RequestRecord("job-7", "http", trio.current_time()) for _ in range(2)]
            async with trio.open_nursery() as nursery:
                for record in records:
                    nursery.start_soon(complete, router, chat(max_tokens=8, request_id="job-7"), record)
    upstream = [headers["x-request-id"] for headers, _ in recorder.seen]
    assert len(set(upstream)) == 2 and "job-7" not in upstream
    assert [headers["x-tailguard-request-id"] for headers, _ in recorder.seen] == ["job-7", "job-7"]
    assert sorted(r.upstream_id or "" for r in records) == sorted(upstream) and {r.request_id for r in records} == {"job-7"}


async def test_a_retry_goes_under_a_fresh_id(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[str] = []

    async def refuses(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["x-request-id"])
        raise httpx.ConnectError("refused")

    async with engines(None) as [app]:
        recorder = Recorder(app)
        async with router_over({A: refuses, B: recorder}, config((A, B))) as router:
            record = RequestRecord("r", "http", trio.current_time())
            for i in range(4):  # prompts unlike each other: prefix affinity sends one prompt to one engine every time
                await complete(router, chat(f"question {i}", max_tokens=2, request_id=f"r{i}"), record)
    retried = [headers["x-request-id"] for headers, _ in recorder.seen]
    assert seen and not set(seen) & set(retried) and record.upstream_id == retried[-1]


async def test_every_stream_asks_for_usage_and_the_caller_gets_it_only_when_asked(autojump_clock: trio.testing.MockClock) -> None:
    async with engines(None) as [app]:
        recorder = Recorder(app)
        async with router_over({A: recorder}, config()) as router:
            quiet = RequestRecord("a", "http", trio.current_time())
            plain = await complete(router, chat(max_tokens=6, stream=True, request_id="a"), quiet)
            asked = await complete(
                router, chat(max_tokens=6, stream=True, request_id="b", params={"stream_options": {"include_usage": True}})
            )
    assert [body["stream_options"] for _, body in recorder.seen] == [{"include_usage": True}] * 2
    assert b'"usage"' not in plain and plain.rstrip().endswith(b"data: [DONE]") and plain.count(b"data:") >= 7
    assert quiet.completion_tokens == 6 and quiet.input_tokens  # counted from the usage event the caller never saw
    assert b'"choices":[],"usage"' in asked.replace(b" ", b"")


def merged_stream(tokens: int, per_event: int) -> bytes:
    """An SSE stream the way vLLM sends one under load: several tokens in one event, then usage, then [DONE]."""
    events: list[dict[str, object]] = []
    for start in range(0, tokens, per_event):
        text = "x" * min(per_event, tokens - start)
        finish = "length" if start + per_event >= tokens else None
        events.append({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})
    events.append({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": tokens, "total_tokens": 11 + tokens}})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


async def test_token_counts_stay_exact_when_vllm_merges_tokens_into_one_event(autojump_clock: trio.testing.MockClock) -> None:
    async def merging(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=merged_stream(12, 4))

    async with router_over({A: merging}, config()) as router:
        record = RequestRecord("m", "http", trio.current_time())
        relayed = await complete(router, chat(max_tokens=12, stream=True, request_id="m"), record)
    assert record.completion_tokens == 12 and record.input_tokens == 11  # 3 content events, 12 tokens
    assert b'"usage"' not in relayed and relayed.endswith(b"data: [DONE]\n\n")


@given(cuts=st.lists(st.integers(min_value=1, max_value=len(merged_stream(5, 2)) - 1), unique=True, max_size=8))
def test_the_usage_event_is_dropped_wherever_the_reads_split_the_stream(cuts: list[int]) -> None:
    stream = merged_stream(5, 2)
    pieces = [stream[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(stream)])]
    usage = EventFilter(drop_usage=True)
    relayed = b"".join(usage.feed(piece) for piece in pieces) + usage.flush()
    usage_event = stream[stream.index(b'data: {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage"') :]
    assert relayed == stream.replace(usage_event[: usage_event.index(b"\n\n") + 2], b"")


# -- 3. vLLM's own overload -------------------------------------------------------


def busy(retry_after: str = "7") -> Handler:
    async def answer(request: httpx.Request) -> httpx.Response:
        error = {"error": {"message": "The server is busy", "type": "ServiceUnavailableError", "param": None, "code": 503}}
        return httpx.Response(503, headers={"retry-after": retry_after}, json=error)

    return answer


async def test_a_busy_engine_sends_its_requests_to_a_free_sibling_and_is_no_outlier(autojump_clock: trio.testing.MockClock) -> None:
    async with engines(None) as [app], router_over({A: busy(), B: app}, config((A, B))) as router:
        for i in range(20):  # the measurement: 5 of these 20 failed as 502 (unlike prompts: affinity spreads them)
            assert json.loads(await complete(router, chat(f"question {i}", max_tokens=2, request_id=f"r{i}")))["choices"]
        full = endpoint(router, A)
        assert full.failures_in_a_row == 0 and not full.ejected and full.busy_answers >= 1
        [stats] = [e for e in router.statistics().endpoints if e.url == A]
        assert stats.busy_answers == full.busy_answers and not stats.key_refused
        page = Metrics(router).render().decode()
        assert f'tailguard_endpoint_busy_total{{endpoint="{A}",pool="main"}} {float(full.busy_answers)}' in page
        assert full.seats == 0  # held at what it ran (nothing else) until its Retry-After is over
        autojump_clock.jump(7.5)
        await trio.testing.wait_all_tasks_blocked()
        assert full.seats == 4  # the spell's timer gave the seats back


async def test_busy_everywhere_waits_in_tailguards_queue_until_its_deadline(autojump_clock: trio.testing.MockClock) -> None:
    """Every engine's own queue full: the request waits in tailguard's queue (its class may), not refused at once;
    at its queue deadline it is 503 queue_timeout, as any request that found no seat in time."""
    started = trio.current_time()
    async with router_over({A: busy("7"), B: busy("3")}, config((A, B))) as router:
        with pytest.raises(QueueTimeout) as refused:
            await complete(router, chat(max_tokens=2))
        waited = trio.current_time() - started
        assert {e.url: e.busy_answers for e in router.endpoints} == {A: 1, B: 1}  # each asked once: their spells outlast the wait
    assert waited == pytest.approx(router.config.classes[0].queue_timeout)
    error = http_error(refused.value)
    assert error.status == 503 and error.body["error"]["code"] == "queue_timeout"  # type: ignore[index]
    assert error.retry_after is not None


async def test_a_request_moved_off_a_busy_engine_whose_next_engine_fails_waits_for_the_busy_one(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM's queue full on one engine, the sibling it moved to failing (an answered 500): the request goes back to
    tailguard's queue until the busy engine has room, as a busy refusal alone does, not 502 for every endpoint
    tried (the busy one did no work and said nothing of its health)."""
    calls = 0

    async def busy_every_other(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls % 2:
            return await busy("1")(request)
        body = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}
        return httpx.Response(200, json=body)

    failed = 0

    async def failing(request: httpx.Request) -> httpx.Response:
        nonlocal failed
        failed += 1
        return httpx.Response(500, json={"error": {"message": "engine error", "type": "InternalServerError", "code": 500}})

    async with router_over({A: busy_every_other, B: failing}, config((A, B))) as router:
        for i in range(6):
            answer = json.loads(await complete(router, chat(f"question {i}", max_tokens=2, request_id=f"r{i}")))
            assert answer["choices"][0]["message"]["content"] == "hi"
            autojump_clock.jump(2.0)  # the next one finds the busy spell over
        assert calls >= 6  # the busy refusals were met (odd calls), and each request was served there after one
        assert failed <= 12  # the failing engine is not asked again and again while the busy one's spell lasts (7 here)


async def test_a_busy_spell_holds_back_the_queue_until_it_ends(autojump_clock: trio.testing.MockClock) -> None:
    """With no sibling, requests wait in tailguard's queue (in priority order) while vLLM's is full, not in vLLM's:
    the one vLLM refused too, seated again when the engine's Retry-After ran out."""
    answers = 0

    async def busy_once(request: httpx.Request) -> httpx.Response:
        nonlocal answers
        answers += 1
        return await (busy("1") if answers == 1 else ok)(request)

    async def ok(request: httpx.Request) -> httpx.Response:
        body = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}
        return httpx.Response(200, json=body)

    async with router_over({A: busy_once}, config()) as router:
        started = trio.current_time()
        await complete(router, chat(max_tokens=2, request_id="first"))
        assert trio.current_time() - started == pytest.approx(1.0)  # back in line until the engine's Retry-After ran out
        assert answers == 2 and router.statistics().pools[0].queue.waiting == 0
        started = trio.current_time()
        await complete(router, chat(max_tokens=2, request_id="second"))
        assert trio.current_time() - started == pytest.approx(0.0)


# -- 4. keep-alive at vLLM's edge -------------------------------------------------


@pytest.mark.parametrize("spacing", [4.9, 4.95, 5.0, 5.05, 5.1])
async def test_no_request_is_written_into_a_connection_uvicorn_is_closing(spacing: float, autojump_clock: trio.testing.MockClock) -> None:
    """The simulator closes idle connections at 5 s, as vLLM's uvicorn does; tailguard stops reusing them at 4 s."""
    async with trio.open_nursery() as nursery:
        engine = Engine(PROFILES["instant"])
        await nursery.start(engine.run)
        port = await nursery.start(serve_sim, SimApp(engine, model=MODEL).handle, "127.0.0.1", 0)
        client = BackendClient(f"http://127.0.0.1:{port}", max_concurrency=4, connect_timeout=2, access=BackendAccess())
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(4):
            response = await client.open("/v1/chat/completions", body, {}, stream=False)
            assert json.loads(await response.read())["choices"]
            await response.aclose()
            await trio.sleep(spacing)
        transport = client.transport
        assert transport.opened == 4 and transport.resent == 0  # type: ignore[attr-defined]
        await client.aclose()
        nursery.cancel_scope.cancel()


def test_the_default_keep_alive_is_below_vllms() -> None:
    cfg = config()
    assert cfg.timeouts.backend_keep_alive_timeout == 4.0
    with pytest.raises(ConfigError, match="timeouts.backend_keep_alive_timeout"):
        parse_config(config_text(top="[timeouts]\nbackend_keep_alive_timeout = -1\n"))


# -- 9. queue_ms is the wait for a seat, not the event loop's delay ------------------


async def test_queue_ms_is_the_wait_for_a_seat_not_the_loops_delay(autojump_clock: trio.testing.MockClock) -> None:
    async with engines(None) as [app], router_over({A: app}, config()) as router:
        pool = router.pool("main")
        lease_holders: list[trio.Event] = []

        async def hold(i: int, done: trio.Event) -> None:
            with trio.fail_after(60):
                async with router.open(chat(max_tokens=2, request_id=f"h{i}")) as completion:
                    await completion.read()
                    await done.wait()
            if i == 0:  # its seat just went to the waiter; before the waiter runs, the loop stalls 3 s (a busy host)
                autojump_clock.jump(3.0)

        async with trio.open_nursery() as nursery:
            for i in range(4):  # every seat taken
                lease_holders.append(trio.Event())
                nursery.start_soon(hold, i, lease_holders[-1])
            await trio.testing.wait_all_tasks_blocked()
            assert pool.in_flight == 4
            record = RequestRecord("w", "http", trio.current_time())
            nursery.start_soon(complete, router, chat(max_tokens=2, request_id="w"), record)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.5)  # it waits half a second for a seat
            lease_holders[0].set()
            await trio.testing.wait_all_tasks_blocked()
            for event in lease_holders[1:]:
                event.set()
    assert record.waited_seconds == pytest.approx(0.5, abs=0.05)


async def test_a_pool_without_max_model_len_asks_an_engine_behind_its_api_key() -> None:
    """Before the key, GET /v1/models got 401 and the pool refused to start."""
    async with trio.open_nursery() as nursery:
        engine = Engine(PROFILES["instant"].replace(max_model_len=16384))
        await nursery.start(engine.run)
        port = await nursery.start(serve_sim, SimApp(engine, model=MODEL, api_key="sk-engine").handle, "127.0.0.1", 0)
        text = config_text((f"http://127.0.0.1:{port}",), pool_extra='api_key_env = "VLLM_KEY"').replace("max_model_len = 32768\n", "")
        asked = await ask_model_lens(parse_config(text, environ={"VLLM_KEY": "sk-engine"}))
        assert asked.config.pools[0].max_model_len == 16384
        with pytest.raises(ModelLenError, match="refused tailguard's key"):
            await ask_model_lens(parse_config(text, environ={"VLLM_KEY": "sk-wrong"}))
        nursery.cancel_scope.cancel()


async def test_a_reload_with_the_rotated_key_brings_the_endpoint_back(autojump_clock: trio.testing.MockClock) -> None:
    old = config(pool_extra='api_key_env = "VLLM_KEY"', environ={"VLLM_KEY": "sk-old"})
    new = config(pool_extra='api_key_env = "VLLM_KEY"', environ={"VLLM_KEY": "sk-new"})
    assert new.digest != old.digest  # the same text: a reload sees the rotation all the same
    async with engines("sk-new") as [app], router_over({A: app}, old, found_well=False) as router:
        await router.check_health()
        assert router.health()["pools"]["main"]["endpoints"][A] == "down"
        router.apply(new)
        assert router.health()["pools"]["main"]["endpoints"][A] == "up"  # a new key deserves a try at once
        assert json.loads(await complete(router, chat(max_tokens=2)))["choices"]
        await router.check_health()
        assert endpoint(router, A).credentials_checked
