"""Issue 32, item 6: an engine takes nothing until a probe passes, a silent one is down at once, a half-dead one is found by the default probe.

In virtual time over simulated engines; a black hole is a transport that
takes a request and never answers (a port that accepts and says nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import httpx
import trio
import trio.testing

from tailguard.router import Router, errors
from tailguard.router.admission import RouterRequest
from tailguard.router.config import Config, PlacementConfig, TimeoutsConfig
from tailguard.sim.canned import canned_transport
from tests.helpers.router import BATCH_URL, INTERACTIVE_URL, chat, router_over_engines, run_to_end, two_pool_config

SECOND = "http://interactive-1:8000"
Wrap = Callable[[str, httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]


def config(*urls: str, least_loaded: bool = False, interval: float | None = None) -> Config:
    base = two_pool_config(interactive_urls=urls or (INTERACTIVE_URL, SECOND), timeouts=TimeoutsConfig(
        health_check_interval=interval if interval is not None else TimeoutsConfig.health_check_interval
    ))
    if not least_loaded:
        return base
    interactive = dataclasses.replace(base.pool("interactive"), placement=PlacementConfig(mode="least_loaded"))
    return dataclasses.replace(base, pools=(interactive, base.pool("batch")))


def sick(url: str, *, health: bool = False, calls: list[str] | None = None) -> Wrap:
    """``url`` takes every request and never answers (``health``: but answers GET /health, as a half-dead engine does)."""

    def wrap(this: str, inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        if this != url:
            return inner

        async def handle(request: httpx.Request) -> httpx.Response:
            if health and request.url.path == "/health":
                return await inner.handle_async_request(request)
            if calls is not None and request.method == "POST" and b'"ping"' not in request.content:
                calls.append(this)
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        return canned_transport(handle)

    return wrap


async def timed(router: Router, request: RouterRequest, took: list[float]) -> None:
    """Run ``request`` to its end; how long it took goes into ``took``."""
    start = trio.current_time()
    await run_to_end(router, request)
    took.append(trio.current_time() - start)


def state(router: Router, url: str) -> str:
    return str(router.health()["pools"]["interactive"]["endpoints"][url])


async def test_an_engine_is_unknown_until_its_first_probe_and_a_request_waits_for_that_probe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with router_over_engines(config(INTERACTIVE_URL), probe=False) as fleet:
        router = fleet.router
        assert state(router, INTERACTIVE_URL) == "unknown" and router.health()["status"] == "unavailable"
        served: list[float] = []

        async def ask() -> None:
            _, routing = await run_to_end(router, chat(request_id="early"))
            served.append(routing.queue_seconds)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.sleep(0.5)
            assert served == []  # waiting for the verdict, not refused
            await router.check_health()
        assert served == [0.5] and state(router, INTERACTIVE_URL) == "up" and router.health()["status"] == "ready"


async def test_a_request_waiting_for_a_first_probe_that_fails_is_refused_at_the_verdict(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(config(INTERACTIVE_URL), wrap=sick(INTERACTIVE_URL), probe=False) as fleet:
        router = fleet.router
        async with trio.open_nursery() as nursery:
            nursery.start_soon(router.check_health)
            start = trio.current_time()
            try:
                await run_to_end(router, chat())
            except errors.NoBackend:
                pass
            else:
                raise AssertionError("served by a black hole")
            assert trio.current_time() - start == router.config.timeouts.health_check_timeout  # the verdict, not queue_timeout (3 s)
        assert state(router, INTERACTIVE_URL) == "down"


async def test_a_black_holed_engine_takes_no_stream_before_its_first_probe(autojump_clock: trio.testing.MockClock) -> None:
    """The chaos run: endpoints started up, so 7 of 20 streams went to a black hole and waited out their deadline."""
    calls: list[str] = []
    async with router_over_engines(config(least_loaded=True), wrap=sick(SECOND, calls=calls), probe=False) as fleet:
        router = fleet.router
        took: list[float] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(router.run)
            async with trio.open_nursery() as streams:
                for i in range(20):
                    streams.start_soon(timed, router, chat(f"question {i}", stream=True, request_id=f"s{i}"), took)
            await trio.sleep(router.config.timeouts.health_check_timeout)
            assert state(router, SECOND) == "down"  # its first probe timed out, the engine silent
            nursery.cancel_scope.cancel()
        assert calls == [] and len(took) == 20 and max(took) < 1.0


async def test_a_probe_that_times_out_marks_a_silent_engine_down_at_once_and_its_waiting_calls_go_elsewhere(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A miss counts at once when the loop was on time and the engine sent nothing; while it streams elsewhere it is a miss."""
    hang_probe = False

    def probe_hangs(url: str, inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        if url != SECOND:
            return inner

        async def handle(request: httpx.Request) -> httpx.Response:
            if hang_probe and b'"ping"' in request.content:
                await trio.sleep_forever()
            return await inner.handle_async_request(request)

        return canned_transport(handle)

    async with router_over_engines(config(SECOND), wrap=probe_hangs) as fleet:  # busy: a stream flows while the probe waits
        router = fleet.router
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_to_end, router, chat("tell me a story", max_tokens=128, stream=True))
            await trio.sleep(0.1)
            hang_probe = True
            await router.check_health()
            assert state(router, SECOND) == "up"  # one miss of three: the engine was sending bytes meanwhile
    calls: list[str] = []
    async with router_over_engines(config(least_loaded=True), wrap=sick(SECOND, calls=calls)) as fleet:
        router = fleet.router
        took: list[float] = []
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(timed, router, chat(f"question {i}", stream=True, request_id=f"s{i}"), took)
            await trio.testing.wait_all_tasks_blocked()
            assert calls  # some wait on the silent engine
            await router.check_health()
            assert state(router, SECOND) == "down"  # after one probe, not three
            assert len(took) == 6 - len(calls)  # one silent miss may be a starved API server: its calls wait on
            await router.check_health()  # a second in a row, nothing heard since: they give up
        timeout = router.config.timeouts.health_check_timeout
        assert len(took) == 6 and max(took) < 2 * timeout + 0.5  # tried elsewhere then, not after first_byte_timeout (60 s)
        retries = router.statistics().retries
        assert retries is not None and retries["interactive"] == len(calls)


async def test_one_silent_miss_of_an_engine_running_whole_answers_gives_up_no_call(autojump_clock: trio.testing.MockClock) -> None:
    """The real suite's false alarm: vLLM's API server, starved of CPU while its engine runs whole answers (no
    byte until each ends), missed one probe; its calls were given up and one caller got a 502. One silent miss
    takes the engine out of placement for a turn; its calls are given up only if the next probe is silent too."""
    stalled = False

    def stall_once(url: str, inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            probe = request.url.path == "/health" or b'"ping"' in request.content
            if stalled and probe:
                await trio.sleep(5.0)
            elif request.method == "POST" and not probe:
                await trio.sleep(3.0)  # a long whole answer: no byte until it ends
            return await inner.handle_async_request(request)

        return canned_transport(handle)

    async with router_over_engines(config(SECOND), wrap=stall_once) as fleet:
        router = fleet.router
        took: list[float] = []
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(timed, router, chat(f"summarise {i}", request_id=f"w{i}"), took)
            await trio.sleep(0.05)
            stalled = True
            await router.check_health()
            assert state(router, SECOND) == "down"
            stalled = False
            await router.check_health()
            assert state(router, SECOND) == "up"
            assert took == []  # all three still running: none was given up
        retries = router.statistics().retries
        assert len(took) == 3 and retries is not None and retries["interactive"] == 0


async def test_a_half_dead_engine_costs_no_unary_request_its_deadline_under_the_default_probe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """/health fine, completions hung: unary requests used to wait out their 120 s deadline there (3.2% of them)."""
    calls: list[str] = []
    async with router_over_engines(config(least_loaded=True), wrap=sick(SECOND, health=True, calls=calls)) as fleet:
        router = fleet.router
        assert router.config.pool("interactive").health_check == "auto"  # the default
        took: list[float] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(router.run)
            async with trio.open_nursery() as requests:
                for i in range(60):  # 2 a second for 30 s
                    requests.start_soon(timed, router, chat(f"question {i}", request_id=f"u{i}"), took)
                    await trio.sleep(0.5)
            nursery.cancel_scope.cancel()
        interval = router.config.timeouts.health_check_interval
        timeout = router.config.timeouts.health_check_timeout
        # At worst: sent just after a turn began; the next sees it wait, the one after (a completion) finds the
        # engine silent, and the one after that, silent again, gives its calls up.
        assert len(took) == 60 and max(took) < 3 * interval + timeout
        assert calls and state(router, SECOND) == "down"


async def test_a_reload_probes_a_new_engine_at_once(autojump_clock: trio.testing.MockClock) -> None:
    calls: list[str] = []
    first = config(INTERACTIVE_URL, least_loaded=True, interval=30.0)
    async with router_over_engines(first, extra_urls=[SECOND], wrap=sick(SECOND, calls=calls)) as fleet:
        router = fleet.router
        async with trio.open_nursery() as nursery:
            await nursery.start(router.run)
            await trio.sleep(1.0)
            second = config(INTERACTIVE_URL, SECOND, least_loaded=True, interval=30.0)
            router.apply(dataclasses.replace(second, digest="second"))
            assert state(router, SECOND) == "unknown"
            async with trio.open_nursery() as requests:
                for i in range(6):
                    requests.start_soon(run_to_end, router, chat(f"question {i}", stream=True, request_id=f"s{i}"))
            assert trio.current_time() < 1.0 + 0.5  # none waited on the newcomer (its probe takes 1 s to time out)
            await trio.sleep(router.config.timeouts.health_check_timeout)
            assert state(router, SECOND) == "down"  # its first probe ran at once, not at the next turn (30 s)
            nursery.cancel_scope.cancel()
        assert calls == []
        assert router.endpoint(BATCH_URL).healthy
