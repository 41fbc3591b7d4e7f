"""Live failures and the pool: outlier ejection, one retry elsewhere, first-byte timeouts, probes.

Issue 10, defects 1 and 2: one failed response used to take an endpoint out
until the next health check, so a client could empty a pool on purpose, and a
half-dead engine (``/health`` fine, completions hung) was never taken out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
import trio.testing

from tailguard.router import Router, errors
from tailguard.router.backend import ConnectorTransport
from tailguard.router.config import Config, EndpointConfig, OutlierDetectionConfig, PlacementConfig, TimeoutsConfig
from tailguard.server.metrics import Metrics
from tailguard.sim.canned import canned_transport
from tests.helpers.router import chat, run_to_end, two_pool_config
from tests.helpers.sockets import QUICK, engines_on_sockets

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
GPUS = [f"http://gpu-{i}:8000" for i in range(4)]
COMPLETION = {
    "id": "cmpl-1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}


STREAM = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


async def ok(request: httpx.Request) -> httpx.Response:
    if request.content and json.loads(request.content).get("stream"):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=STREAM)
    return httpx.Response(200, json=COMPLETION)


async def fail(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "CUDA error: an illegal memory access"}})


async def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def hang(request: httpx.Request) -> httpx.Response:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def config_for(
    urls: list[str],
    *,
    consecutive: int = 3,
    percent: float = 50.0,
    first_byte_timeout: float = 60.0,
    health_check: str = "http",
) -> Config:
    """One interactive pool over ``urls`` (cap 4 each), with the given outlier rules, placing by load alone (one
    prompt every time: prefix affinity would send it all to one engine)."""
    base = two_pool_config(interactive_cap=4, interactive_urls=urls, timeouts=TimeoutsConfig(health_check_timeout=1.0))
    interactive = dataclasses.replace(
        base.pool("interactive"),
        first_byte_timeout=first_byte_timeout,
        health_check=health_check,  # type: ignore[arg-type]
        placement=PlacementConfig(mode="least_loaded"),
        outlier_detection=OutlierDetectionConfig(
            consecutive_failures=consecutive, base_ejection_time=5.0, max_ejection_time=60.0, max_ejection_percent=percent
        ),
    )
    return dataclasses.replace(base, pools=(interactive, base.pool("batch")))


@asynccontextmanager
async def router_over(handlers: dict[str, Handler], config: Config) -> AsyncIterator[tuple[Router, dict[str, int]]]:
    """A Router whose endpoints answer with ``handlers`` (per URL) once a first probe found them all well; also counts completion calls per URL."""
    calls = dict.fromkeys(handlers, 0)
    probing = True  # the first probe finds every engine well (they fail later): endpoints start unknown

    def transport_for(endpoint: EndpointConfig) -> ConnectorTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            if probing:
                return await ok(request)
            if request.method == "POST" and endpoint.url in calls:  # not the GET /v1/models that checks the key
                calls[endpoint.url] += 1
            return await handlers.get(endpoint.url, ok)(request)

        return canned_transport(handle)

    router = Router(config, transport_factory=transport_for, seed=0)
    await router.check_health()
    probing = False
    try:
        yield router, calls
    finally:
        await router.aclose()


def endpoint(router: Router, url: str):  # type: ignore[no-untyped-def]
    return next(e for e in router.pool("interactive").endpoints if e.url == url)


async def settle(router: Router, request_id: str, *, stream: bool = False) -> type[Exception] | None:
    """Run one interactive request; the error class it ended with, or None."""
    try:
        await run_to_end(router, chat(request_id=request_id, stream=stream))
    except errors.TailguardError as error:
        return type(error)
    return None


async def test_one_failure_never_ejects_and_a_run_of_them_does_for_growing_times(autojump_clock: trio.testing.MockClock) -> None:
    bad, good = GPUS[:2]
    async with router_over({bad: fail, good: ok}, config_for([bad, good])) as (router, calls):
        sick = endpoint(router, bad)
        for i in range(40):
            await settle(router, f"a{i}")
            if sick.failures_in_a_row == 1:
                # One answered 500 counts, and takes nothing out.
                assert not sick.ejected and router.health()["pools"]["interactive"]["endpoints"][bad] == "up"
            if sick.ejected:
                break
        assert sick.ejected and sick.ejections == 1
        assert sick.ejected_until == pytest.approx(trio.current_time() + 5.0)
        assert router.health()["pools"]["interactive"]["endpoints"][bad] == "ejected"
        page = Metrics(router).render().decode()
        assert f'tailguard_endpoint_ejected{{endpoint="{bad}",pool="interactive"}} 1.0' in page
        assert f'tailguard_endpoint_ejections_total{{endpoint="{bad}",pool="interactive"}} 1.0' in page
        assert 'tailguard_pool_healthy_endpoints{pool="interactive"} 1.0' in page
        before = calls[bad]
        for i in range(10):
            assert await settle(router, f"b{i}") is None  # everything goes to the good one meanwhile
        assert calls[bad] == before
        await trio.sleep(5.1)
        assert not sick.ejected  # the ejection runs out by itself
        for i in range(40):
            await settle(router, f"c{i}")
            if sick.ejected:
                break
        assert sick.ejections == 2
        assert sick.ejected_until == pytest.approx(trio.current_time() + 10.0)  # base x 2: it grows
        assert router.statistics().endpoints[0].ejections + router.statistics().endpoints[1].ejections == 2


async def test_a_success_ends_the_run_of_failures(autojump_clock: trio.testing.MockClock) -> None:
    answers = iter([fail, fail, ok, fail, fail, ok] * 3)

    async def flaky(request: httpx.Request) -> httpx.Response:
        return await next(answers)(request)

    url = GPUS[0]
    async with router_over({url: flaky}, config_for([url, GPUS[1]], consecutive=3)) as (router, _):
        target = endpoint(router, url)
        router.pool("interactive").endpoints.remove(endpoint(router, GPUS[1]))  # all traffic to the flaky one
        for i in range(18):
            await settle(router, f"r{i}")
        assert target.ejections == 0 and target.failures_in_a_row == 0


async def test_the_only_endpoint_of_a_pool_is_never_ejected_by_traffic(autojump_clock: trio.testing.MockClock) -> None:
    url = GPUS[0]
    async with router_over({url: fail}, config_for([url], consecutive=2, percent=50)) as (router, _):
        outcomes = [await settle(router, f"r{i}") for i in range(20)]
        # Every request reached the backend (502), none was refused for want of an endpoint.
        assert outcomes == [errors.BackendUnavailable] * 20
        assert not endpoint(router, url).ejected and router.health()["status"] == "ready"


async def test_at_most_the_configured_share_is_ejected(autojump_clock: trio.testing.MockClock) -> None:
    urls = GPUS[:4]
    async with router_over(dict.fromkeys(urls, fail), config_for(urls, consecutive=2, percent=50)) as (router, _):
        for i in range(60):
            await settle(router, f"r{i}")
        ejected = [e.url for e in router.pool("interactive").endpoints if e.ejected]
        assert len(ejected) == 2  # 50% of 4, however many keep failing
        assert router.statistics().pool("interactive").healthy_endpoints == 2


async def test_a_refused_connection_is_retried_once_on_another_endpoint(autojump_clock: trio.testing.MockClock) -> None:
    dead, alive = GPUS[:2]
    async with router_over({dead: refuse, alive: ok}, config_for([dead, alive], consecutive=50)) as (router, calls):
        for i in range(20):
            assert await settle(router, f"r{i}") is None  # the caller never sees the refusal
        assert calls[dead] > 0 and router.statistics().retries == {"interactive": calls[dead], "batch": 0}
        assert f'tailguard_backend_retries_total{{pool="interactive"}} {calls[dead]:.1f}' in Metrics(router).render().decode()
        stats = router.statistics()
        assert stats.in_flight == 0 and all(e.in_flight == 0 for e in stats.endpoints)


async def test_an_answered_500_that_sent_nothing_is_retried_once_elsewhere(autojump_clock: trio.testing.MockClock) -> None:
    """Issue 20: a 500 before any byte reached the caller is tried once more on another endpoint (was: the caller's 502)."""
    sick, alive = GPUS[:2]
    async with router_over({sick: fail, alive: ok}, config_for([sick, alive], consecutive=50)) as (router, calls):
        outcomes = [await settle(router, f"r{i}") for i in range(20)]
        assert outcomes == [None] * 20 and calls[alive] == 20
        assert router.statistics().retries == {"interactive": calls[sick], "batch": 0} and calls[sick] > 0
    async with router_over({sick: fail, alive: fail}, config_for([sick, alive], consecutive=50)) as (router, calls):
        assert await settle(router, "both") is errors.BackendUnavailable  # tried once more, no further
        assert calls[sick] + calls[alive] == 2


async def test_without_another_free_endpoint_the_refusal_is_the_answer(autojump_clock: trio.testing.MockClock) -> None:
    url = GPUS[0]
    async with router_over({url: refuse}, config_for([url])) as (router, calls):
        with pytest.raises(errors.BackendUnavailable, match="could not be reached"):
            await run_to_end(router, chat())
        assert calls[url] == 1 and router.statistics().retries == {"interactive": 0, "batch": 0}


async def test_a_reset_before_the_response_head_is_retried_over_real_sockets() -> None:
    async def hang_up(stream: trio.SocketStream) -> None:
        request = await stream.receive_some(65536)  # read the request, then close without a word
        if request.startswith(b"GET /health"):  # its health check passes (the pool's is "http")
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, hang_up, 0, host="127.0.0.1"))
        reset_url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        async with engines_on_sockets([QUICK]) as backends:
            router = Router(config_for([reset_url, backends.urls[0]], consecutive=50), seed=1)
            await router.check_health()
            try:
                for i in range(12):
                    assert await settle(router, f"r{i}") is None
                retries = router.statistics().retries
                assert retries is not None and retries["interactive"] >= 1
                assert endpoint(router, reset_url).failures_in_a_row >= 1
            finally:
                await router.aclose()
        nursery.cancel_scope.cancel()


async def test_a_stream_with_no_first_event_in_time_fails_and_is_retried(autojump_clock: trio.testing.MockClock) -> None:
    stuck, alive = GPUS[:2]
    config = config_for([stuck, alive], first_byte_timeout=1.0, consecutive=50)
    async with router_over({stuck: hang, alive: ok}, config) as (router, calls):
        for i in range(10):
            started = trio.current_time()
            assert await settle(router, f"r{i}", stream=True) is None
            assert trio.current_time() - started <= 1.0 + 1e-6  # at most one timeout, never the 120 s deadline
        assert calls[stuck] > 0 and endpoint(router, stuck).failures_in_a_row == calls[stuck]
    async with router_over({stuck: hang}, config_for([stuck], first_byte_timeout=1.0)) as (router, _):
        started = trio.current_time()
        with pytest.raises(errors.BackendTimeout, match="no first byte within 1 s"):
            await run_to_end(router, chat(stream=True))
        assert trio.current_time() - started == pytest.approx(1.0)
        assert router.statistics().in_flight == 0


async def test_a_long_non_streaming_answer_is_not_cut_by_the_first_byte_timeout(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM sends a non-streaming body when generation ends: 70 s of work is no hang."""

    async def slow(request: httpx.Request) -> httpx.Response:
        await trio.sleep(70)
        return await ok(request)

    urls = GPUS[:2]
    async with router_over(dict.fromkeys(urls, slow), config_for(urls, first_byte_timeout=60.0)) as (router, calls):
        assert await settle(router, "long") is None
        assert trio.current_time() == pytest.approx(70.0)
        assert sum(calls.values()) == 1 and router.statistics().retries == {"interactive": 0, "batch": 0}


async def test_a_stream_is_timed_to_its_first_event_not_its_head(autojump_clock: trio.testing.MockClock) -> None:
    async def head_then_nothing(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            await trio.sleep_forever()
            yield b""

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    url = GPUS[0]
    async with router_over({url: head_then_nothing}, config_for([url], first_byte_timeout=2.0)) as (router, _):
        with pytest.raises(errors.BackendTimeout):
            await run_to_end(router, chat(stream=True))
        assert trio.current_time() == pytest.approx(2.0)


@pytest.mark.parametrize("kind", ["http", "completion"])
async def test_a_completion_probe_takes_out_a_half_dead_engine(kind: str, autojump_clock: trio.testing.MockClock) -> None:
    async def half_dead(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return await hang(request)

    url = GPUS[0]
    async with router_over({url: half_dead}, config_for([url], health_check=kind)) as (router, _):
        await router.check_health()
        # The completion probe timed out, with this loop on time and the engine silent: down at once
        # (issue 32; it took the pool's unhealthy_threshold, 3 probes, before). /health never sees it.
        assert endpoint(router, url).healthy is (kind == "http")
        assert trio.current_time() == pytest.approx(1.0 if kind == "completion" else 0.0)


async def test_a_passing_completion_probe_ends_an_ejection(autojump_clock: trio.testing.MockClock) -> None:
    bad, good = GPUS[:2]
    failing = True

    async def recovers(request: httpx.Request) -> httpx.Response:
        probe = json.loads(request.content).get("prompt") == "ping"
        return await (fail if failing and not probe else ok)(request)

    async with router_over({bad: recovers, good: ok}, config_for([bad, good], health_check="completion")) as (router, _):
        sick = endpoint(router, bad)
        for i in range(40):
            await settle(router, f"r{i}")
            if sick.ejected:
                break
        assert sick.ejected
        failing = False
        await router.check_health()
        assert not sick.ejected and sick.healthy


async def test_health_checks_and_scrapes_survive_a_failing_turn(autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    turns = scrapes = 0

    async def broken_then_fine(request: httpx.Request) -> httpx.Response:
        nonlocal turns, scrapes
        if request.url.path == "/health":
            turns += 1
            if turns == 1:
                raise RuntimeError("a bug in a transport")
            return httpx.Response(500)
        if request.url.path == "/metrics":
            scrapes += 1
            if scrapes == 1:
                raise RuntimeError("a bug in a transport")
            return httpx.Response(200, text="vllm:num_requests_running 3\n")
        return await ok(request)

    url = GPUS[0]
    async with router_over({url: broken_then_fine}, config_for([url])) as (router, _):
        async with trio.open_nursery() as nursery:
            await nursery.start(router.run)
            await trio.sleep(router.config.metrics.backend_scrape_interval * 1.5)  # two turns of each loop at least
            nursery.cancel_scope.cancel()
        assert turns >= 2 and not endpoint(router, url).healthy  # the loop went on after the failure
        messages = [r.getMessage() for r in caplog.records]
        assert any("its health probe failed" in m for m in messages)
        assert any("backend load scrape failed" in m for m in messages)
        load = endpoint(router, url).load
        assert scrapes >= 2 and load is not None and load.running == 3


async def test_a_non_streaming_call_that_outlives_the_deadline_counts_against_its_endpoint(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stuck, alive = GPUS[:2]
    async with router_over({stuck: hang, alive: ok}, config_for([stuck, alive], consecutive=2)) as (router, calls):
        sick = endpoint(router, stuck)
        for i in range(20):
            with contextlib.suppress(AssertionError):  # run_to_end: "deadline passed" at the router's 120 s
                await settle(router, f"r{i}")
            if sick.ejected:
                break
        assert sick.ejected and calls[stuck] == 2  # two calls that used up their whole deadline
    async with router_over({stuck: hang}, config_for([stuck])) as (router, calls):
        # A caller that leaves early says nothing about the endpoint.
        with trio.move_on_after(1):
            await run_to_end(router, chat(request_id="impatient"))
        assert calls[stuck] == 1 and endpoint(router, stuck).failures_in_a_row == 0


async def test_an_engine_failing_one_request_in_ten_is_ejected_by_its_ratio_and_costs_callers_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 20: never 5 failures in a row, so the consecutive rule never fired, and failing fast made it
    look the least loaded: 10.2% of requests got 502 beside a healthy engine."""
    sick, alive = GPUS[:2]
    answered = 0

    async def slow_ok(request: httpx.Request) -> httpx.Response:
        await trio.sleep(0.05)
        return await ok(request)

    async def one_in_ten(request: httpx.Request) -> httpx.Response:
        nonlocal answered
        answered += 1
        return await (fail(request) if answered % 10 == 0 else slow_ok(request))

    errors_seen: list[type[Exception]] = []

    async def caller(router: Router, worker: int) -> None:
        for i in range(40):
            error = await settle(router, f"w{worker}-{i}")
            if error is not None:
                errors_seen.append(error)

    config = config_for([sick, alive], consecutive=5)
    async with router_over({sick: one_in_ten, alive: slow_ok}, config) as (router, calls):
        async with trio.open_nursery() as nursery:
            for worker in range(3):  # the healthy engine (4 seats) always has one free for a retry
                nursery.start_soon(caller, router, worker)
        assert errors_seen == []  # each failure was tried once more on the healthy engine
        assert endpoint(router, sick).ejections >= 1  # by the ratio rule: it never failed 5 in a row
        assert calls[sick] < calls[alive]  # and failing fast did not draw the traffic to it


async def test_an_ejection_that_runs_out_lets_one_trial_request_in_and_a_failed_trial_ejects_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 20: readmitted at full traffic, a half-dead engine lost a whole run of requests each time."""
    sick, alive = GPUS[:2]
    healed = False

    async def slow_ok(request: httpx.Request) -> httpx.Response:
        await trio.sleep(0.5)
        return await ok(request)

    async def sick_until_healed(request: httpx.Request) -> httpx.Response:
        return await (slow_ok(request) if healed else fail(request))

    async def burst(router: Router, tag: str) -> None:
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(settle, router, f"{tag}{i}")
            await trio.testing.wait_all_tasks_blocked()
            assert endpoint(router, sick).in_flight <= 1  # on trial: one request at a time

    async with router_over({sick: sick_until_healed, alive: slow_ok}, config_for([sick, alive], consecutive=3)) as (router, calls):
        for i in range(20):
            await settle(router, f"a{i}")
            if endpoint(router, sick).ejected:
                break
        assert endpoint(router, sick).ejections == 1
        autojump_clock.jump(5.0)  # the ejection runs out
        before = calls[sick]
        await burst(router, "b")
        assert calls[sick] == before + 1 and endpoint(router, sick).ejections == 2  # one trial, failed: out again at once
        autojump_clock.jump(10.0)
        healed = True
        await burst(router, "c")
        assert not endpoint(router, sick).half_open and endpoint(router, sick).seats == 4  # a passed trial: the full cap back
