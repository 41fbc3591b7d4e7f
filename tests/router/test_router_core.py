"""The router core over in-process engines, in virtual time."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from tailguard.router import Router, errors
from tailguard.router.admission import RouterRequest
from tailguard.router.config import Config, ConfigError, LimitsConfig, TimeoutsConfig, parse_config
from tailguard.sim import PROFILES
from tailguard.sim.canned import canned_transport
from tests.helpers.router import BATCH_URL, INTERACTIVE_URL, chat, router_over_engines, run_to_end, two_pool_config, with_digest

LONG_TEXT = "The quarterly report covers revenue, costs and outlook in detail. " * 200  # ~3,300 tokens


async def test_short_requests_go_interactive_and_long_go_batch(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        body, routing = await run_to_end(fleet.router, chat(max_tokens=16))
        assert routing.request_class == "interactive" and routing.pool == "interactive"
        assert routing.endpoint == INTERACTIVE_URL
        _, long_routing = await run_to_end(fleet.router, chat(LONG_TEXT, max_tokens=16))
        assert long_routing.pool == "batch"
        # A short prompt asking for many tokens is batch too (origin: max_tokens > 128).
        _, wordy = await run_to_end(fleet.router, chat(max_tokens=200))
        assert wordy.pool == "batch"
        assert fleet.engine(INTERACTIVE_URL).statistics().finished_total == 1
        assert fleet.engine(BATCH_URL).statistics().finished_total == 2
        assert json.loads(body)["usage"]["completion_tokens"] == 16


async def test_caps_clamp_default_and_reject(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        body, routing = await run_to_end(fleet.router, chat(max_tokens=5000))
        assert routing.max_tokens == 1024 and routing.clamped
        assert json.loads(body)["usage"]["completion_tokens"] == 1024
        _, default = await run_to_end(fleet.router, chat(max_tokens=None))
        assert default.max_tokens == 256 and not default.clamped and default.pool == "batch"
        with pytest.raises(errors.PromptTooLong, match="input cap of 8192"):
            await run_to_end(fleet.router, chat("word " * 40_000))
        assert fleet.router.statistics().in_flight == 0
    reject = two_pool_config(limits=LimitsConfig(over_cap="reject"))
    async with router_over_engines(reject) as fleet:
        with pytest.raises(errors.MaxTokensTooLarge, match="output cap of 1024"):
            await run_to_end(fleet.router, chat(max_tokens=1025))
    small_model = two_pool_config(max_model_len=2000)
    async with router_over_engines(small_model) as fleet:
        with pytest.raises(errors.PromptTooLong, match="2000-token context"):
            await run_to_end(fleet.router, chat("word " * 1500, max_tokens=1000))


async def test_pool_cap_holds_under_a_burst(autojump_clock: trio.testing.MockClock) -> None:
    config = two_pool_config(interactive_cap=4, max_queue=100, interactive_timeout=10.0)
    async with router_over_engines(config) as fleet:
        engine = fleet.engine(INTERACTIVE_URL)
        outcomes: list[str] = []

        async def one(i: int) -> None:
            _, routing = await run_to_end(fleet.router, chat(f"question {i}", max_tokens=32))
            outcomes.append(routing.pool)

        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
            stats = fleet.router.statistics().pool("interactive")
            assert stats.in_flight == 4 and stats.queue.waiting == 56
        assert outcomes == ["interactive"] * 60
        assert engine.statistics().max_running_seen == 4  # the engine has 64 seats; the router held it to 4
        assert fleet.router.statistics().in_flight == 0


async def test_queue_deadline_and_full_queue(autojump_clock: trio.testing.MockClock) -> None:
    config = two_pool_config(interactive_cap=1, max_queue=1, interactive_timeout=2.0)
    async with router_over_engines(config) as fleet:
        results: dict[str, object] = {}

        async def hold_the_seat() -> None:
            await run_to_end(fleet.router, chat("first", max_tokens=120))  # ~1 s of decoding

        async def wait_in_queue() -> None:
            start = trio.current_time()
            try:
                await run_to_end(fleet.router, chat("second", max_tokens=16))
            except errors.QueueTimeout as error:
                results["timeout_after"] = trio.current_time() - start
                results["retry_after"] = error.retry_after
            else:
                results["served_after"] = trio.current_time() - start

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold_the_seat)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(wait_in_queue)
            await trio.testing.wait_all_tasks_blocked()
            before = trio.current_time()
            with pytest.raises(errors.QueueFull):
                await run_to_end(fleet.router, chat("third", max_tokens=16))
            assert trio.current_time() == before  # rejected at once
        # The seat frees after ~1 s, before the 2 s deadline: the waiter is served.
        assert "served_after" in results and results["served_after"] < 2.0  # type: ignore[operator]


async def test_queue_timeout_fires_at_the_class_deadline(autojump_clock: trio.testing.MockClock) -> None:
    config = two_pool_config(interactive_cap=1, max_queue=8, interactive_timeout=0.5)
    async with router_over_engines(config) as fleet:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_to_end, fleet.router, chat("hog", max_tokens=128))  # ~1 s
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            with pytest.raises(errors.QueueTimeout) as caught:
                await run_to_end(fleet.router, chat("late", max_tokens=16))
            assert trio.current_time() - start == pytest.approx(0.5)
            assert caught.value.retry_after >= 1
        assert fleet.router.statistics().in_flight == 0
        assert fleet.router.statistics().pool("interactive").queue.waiting == 0


async def test_shared_pool_serves_higher_priority_first(autojump_clock: trio.testing.MockClock) -> None:
    base = two_pool_config(interactive_cap=1, max_queue=100, interactive_timeout=20.0)
    # The origin's design: both classes in one pool, short first.
    classes = tuple(dataclasses.replace(c, pool="batch") for c in base.classes)
    config = with_digest(base, "shared", classes=classes)
    async with router_over_engines(config) as fleet:
        order: list[str] = []

        async def one(text: str, max_tokens: int) -> None:
            _, routing = await run_to_end(fleet.router, chat(text, max_tokens=max_tokens))
            order.append(routing.request_class)

        async with trio.open_nursery() as nursery:
            for i in range(16):  # batch cap is 16: fill it with long ones first
                nursery.start_soon(one, f"long {i}", 500)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(5):
                nursery.start_soon(one, f"long later {i}", 500)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(5):
                nursery.start_soon(one, f"short {i}", 16)
        # Queued shorts overtake the long requests that queued before them.
        after_first_wave = order[16:]
        assert after_first_wave[:5] == ["interactive"] * 5


async def test_cancel_mid_stream_frees_engine_and_slot(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        engine = fleet.engine(INTERACTIVE_URL)
        with trio.CancelScope() as scope:
            async with fleet.router.open(chat(max_tokens=100, stream=True)) as completion:
                async for _ in completion.chunks():
                    if engine.statistics().generation_tokens_total >= 3:
                        scope.cancel()  # the client went away
        assert fleet.router.statistics().in_flight == 0
        await trio.sleep(0.02)  # one engine step
        assert engine.statistics().running == 0 and engine.statistics().aborted_total == 1

        # A burst of cancellations at random points leaks nothing.
        async def cancelled_after(delay: float, i: int) -> None:
            with trio.move_on_after(delay):
                await run_to_end(fleet.router, chat(f"q{i}", max_tokens=100, stream=i % 2 == 0))

        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(cancelled_after, 0.01 * (i % 17), i)
        await trio.sleep(0.05)
        assert fleet.router.statistics().in_flight == 0
        assert fleet.router.statistics().waiting == 0
        assert engine.statistics().running == 0 and engine.statistics().kv_used_tokens == 0


async def test_end_to_end_deadline_aborts_the_generation(autojump_clock: trio.testing.MockClock) -> None:
    config = two_pool_config(timeouts=TimeoutsConfig(end_to_end_timeout=5.0), batch_timeout=2.0)
    async with router_over_engines(config) as fleet:
        engine = fleet.engine(BATCH_URL)
        request = chat(max_tokens=1000)  # ~8 s of decoding alone
        with trio.CancelScope(deadline=fleet.router.deadline_for(request)) as scope:
            async with fleet.router.open(request) as completion:
                await completion.read()
        assert scope.cancelled_caught
        assert fleet.router.statistics().in_flight == 0
        await trio.sleep(0.05)
        assert engine.statistics().aborted_total == 1 and engine.statistics().running == 0
        # A caller's own (gRPC) deadline wins when it is sooner.
        sooner = RouterRequest(kind="completion", request_id="x", prompt="hi", deadline=trio.current_time() + 1.0)
        assert fleet.router.deadline_for(sooner) == pytest.approx(trio.current_time() + 1.0)


async def test_backend_4xx_passes_through(autojump_clock: trio.testing.MockClock) -> None:
    # The router believes the model takes 32k tokens; this engine takes 4k: vLLM's 400 comes back.
    small = {INTERACTIVE_URL: PROFILES["latency"], BATCH_URL: PROFILES["throughput"].replace(max_model_len=4096, kv_cache_tokens=100_000)}
    async with router_over_engines(two_pool_config(), params=small) as fleet:
        with pytest.raises(errors.BackendRejected) as rejected:
            await run_to_end(fleet.router, chat("word " * 4000, max_tokens=1000))
        assert rejected.value.status == 400 and "maximum context length is 4096" in rejected.value.message
        assert fleet.router.statistics().in_flight == 0


async def test_unreachable_endpoint_fails_fast_and_only_its_health_check_takes_it_down(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        endpoint = fleet.router.pool("interactive").endpoints[0]
        real = endpoint.client
        up = False

        async def refuse(request: httpx.Request) -> httpx.Response:
            if up:
                return httpx.Response(200)
            raise httpx.ConnectError("connection refused", request=request)

        from tailguard.router.backend import BackendClient, BackendProbe

        real_probe = endpoint.probe
        endpoint.client = BackendClient(endpoint.url, max_concurrency=8, connect_timeout=1.0, transport=canned_transport(refuse))
        endpoint.probe = BackendProbe(endpoint.url, connect_timeout=1.0, transport=canned_transport(refuse))
        with pytest.raises(errors.BackendUnavailable, match="could not be reached"):
            await run_to_end(fleet.router, chat())
        # One failed request is no verdict: the endpoint stays in until its health check fails.
        assert endpoint.healthy and endpoint.failures_in_a_row == 1
        for _ in range(3):  # the pool's unhealthy_threshold (default 3): three failed probes in a row
            await fleet.router.check_health()
        assert not endpoint.healthy
        with pytest.raises(errors.NoBackend):
            await run_to_end(fleet.router, chat())
        assert fleet.router.health()["status"] == "unavailable"
        up = True
        await fleet.router.check_health()
        assert endpoint.healthy
        await endpoint.client.aclose()
        await endpoint.probe.aclose()
        endpoint.client, endpoint.probe = real, real_probe
        _, routing = await run_to_end(fleet.router, chat())
        assert routing.pool == "interactive"


async def test_reload_moves_an_endpoint_under_live_traffic(autojump_clock: trio.testing.MockClock) -> None:
    spare = "http://batch-1:8000"
    config = two_pool_config(interactive_cap=4, batch_urls=(BATCH_URL, spare))
    async with router_over_engines(config) as fleet:
        failures: list[BaseException] = []
        served_by: dict[str, set[str]] = {"interactive": set(), "batch": set()}

        async def client(i: int) -> None:
            for j in range(20):
                text, max_tokens = (f"short {i} {j}", 16) if i % 2 else (f"long {i} {j}", 300)
                try:
                    _, routing = await run_to_end(fleet.router, chat(text, max_tokens=max_tokens))
                    served_by[routing.pool].add(routing.endpoint)
                except Exception as error:
                    failures.append(error)

        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(client, i)
            await trio.sleep(1.0)
            # Move the spare GPU from batch to interactive, while requests run on it.
            assert fleet.engine(spare).statistics().running > 0
            moved = two_pool_config(interactive_cap=4, interactive_urls=(INTERACTIVE_URL, spare), batch_urls=(BATCH_URL,))
            fleet.router.apply(with_digest(moved, "moved"))
            assert fleet.router.statistics().pool("interactive").max_concurrency == 8
        assert failures == []
        assert spare in served_by["interactive"] and spare in served_by["batch"]
        assert fleet.router.statistics().in_flight == 0


async def test_lowered_cap_admits_nobody_until_in_flight_falls(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config(interactive_cap=4, interactive_timeout=30.0)) as fleet:
        engine = fleet.engine(INTERACTIVE_URL)
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(run_to_end, fleet.router, chat(f"q{i}", max_tokens=64))
            await trio.testing.wait_all_tasks_blocked()
            assert (engine.statistics().running, fleet.router.statistics().waiting) == (4, 4)
            fleet.router.apply(with_digest(two_pool_config(interactive_cap=1, interactive_timeout=30.0), "lowered"))
            samples = 0
            while fleet.router.statistics().waiting or fleet.router.statistics().in_flight:
                await trio.sleep(0.005)
                samples += 1
                if engine.statistics().finished_total < 4:
                    # The four admitted before the reload finish; nobody new starts.
                    assert fleet.router.statistics().waiting == 4
                else:
                    assert engine.statistics().running <= 1
        assert samples > 100 and engine.statistics().finished_total == 8
        assert fleet.router.statistics().pool("interactive").max_concurrency == 1


async def test_an_endpoint_removed_and_restored_keeps_its_in_flight_count(autojump_clock: trio.testing.MockClock) -> None:
    config = two_pool_config(interactive_cap=2, interactive_timeout=30.0)
    async with router_over_engines(config) as fleet:
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(run_to_end, fleet.router, chat(f"long-running {i}", max_tokens=128))
            await trio.testing.wait_all_tasks_blocked()
            emptied = with_digest(two_pool_config(interactive_cap=2, interactive_urls=()), "emptied")
            fleet.router.apply(emptied)
            with pytest.raises(errors.NoBackend):
                await run_to_end(fleet.router, chat("while empty"))
            fleet.router.apply(with_digest(config, "restored"))
            endpoint = fleet.router.pool("interactive").endpoints[0]
            assert endpoint.in_flight == 2  # the same object: its running requests still count
            nursery.start_soon(run_to_end, fleet.router, chat("third", max_tokens=8))
            await trio.testing.wait_all_tasks_blocked()
            assert fleet.router.statistics().pool("interactive").queue.waiting == 1  # the cap holds
        assert fleet.engine(INTERACTIVE_URL).statistics().max_running_seen == 2


# -- failing fast under sustained overload ---------------------------------------------


@dataclasses.dataclass
class Fates:
    """What happened to each request of a run: served (with its queue wait), refused, timed out."""

    served: list[float] = dataclasses.field(default_factory=list)  # queue seconds of each
    refused_at_once: list[float] = dataclasses.field(default_factory=list)  # 503 at arrival: seconds to the answer
    timed_out: list[float] = dataclasses.field(default_factory=list)  # 503 after waiting: seconds waited
    full: int = 0


def fail_fast(config: Config, fraction: float) -> Config:
    pools = tuple(dataclasses.replace(p, fail_fast_fraction=fraction) for p in config.pools)
    return with_digest(config, f"fail-fast-{fraction:g}", pools=pools)


async def offer(router: Router, rate: float, seconds: float, *, seed: int = 7, max_tokens: int = 100) -> Fates:
    """Poisson arrivals of short chats at ``rate`` a second for ``seconds``; every request's fate."""
    rng = random.Random(seed)
    fates = Fates()

    async def one(i: int) -> None:
        arrival = trio.current_time()
        try:
            _, routing = await run_to_end(router, chat(f"question {i}", max_tokens=max_tokens, request_id=f"r{i}"))
        except errors.QueueTimeout as error:
            waited = trio.current_time() - arrival
            (fates.refused_at_once if "expected" in error.message else fates.timed_out).append(waited)
        except errors.QueueFull:
            fates.full += 1
        else:
            fates.served.append(routing.queue_seconds)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        at, i = rng.expovariate(rate), 0
        while at < seconds:
            await trio.sleep_until(start + at)
            nursery.start_soon(one, i)
            at, i = at + rng.expovariate(rate), i + 1
    return fates


# One latency engine behind a cap of 8; 100-token answers hold a seat ~0.9 s: ~9 requests a second.
OVERLOADED = two_pool_config(interactive_cap=8, max_queue=200, interactive_timeout=3.0)


async def test_sustained_overload_is_refused_at_arrival(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(fail_fast(OVERLOADED, 1.0)) as fleet:
        fates = await offer(fleet.router, rate=20.0, seconds=60.0)
        stats = fleet.router.statistics().pool("interactive")
        assert stats.in_flight == 0 and stats.queue.waiting == 0  # nothing leaked
        assert fleet.engine(INTERACTIVE_URL).statistics().running == 0
    assert stats.drain_rate is not None and 8 < stats.drain_rate < 12
    assert fates.full == 0
    assert len(fates.refused_at_once) > 450  # about half of the ~1,200 arrivals
    assert max(fates.refused_at_once) == 0.0  # answered in no (virtual) time
    assert stats.queue.refused_early_total == len(fates.refused_at_once)
    # Refusing only what is expected to time out leaves the boundary cases
    # (expected 2.5-3 s, releases come in bursts): some of those still wait
    # it out, about one for ten refused -- against one for one without (below).
    assert max(fates.served) < 3.0
    assert len(fates.timed_out) <= 0.12 * len(fates.refused_at_once)


async def test_fail_fast_serves_as_many_as_waiting_does(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(fail_fast(OVERLOADED, 0.0)) as fleet:
        waited = await offer(fleet.router, rate=20.0, seconds=60.0)
        assert fleet.router.statistics().pool("interactive").queue.refused_early_total == 0
    async with router_over_engines(fail_fast(OVERLOADED, 1.0)) as fleet:
        fast = await offer(fleet.router, rate=20.0, seconds=60.0)
    # Without it, the overflow waits its 3 s out and then fails; with it, it fails at once.
    assert not waited.refused_at_once and len(waited.timed_out) > 450
    assert min(waited.timed_out) == pytest.approx(3.0)
    assert len(fast.served) >= 0.97 * len(waited.served)
    # A lower fraction keeps the standing queue short (the admitted wait less)
    # and leaves a margin for the estimate: only the cold start's requests,
    # queued before the pool had measured 32 releases, still time out.
    async with router_over_engines(fail_fast(OVERLOADED, 0.5)) as fleet:
        margin = await offer(fleet.router, rate=20.0, seconds=60.0)
    assert len(margin.served) >= 0.97 * len(waited.served)
    assert max(margin.served[100:]) < 0.5 * 3.0 + 0.3  # past the cold start
    assert len(margin.timed_out) <= 15


async def test_normal_load_refuses_nobody(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(fail_fast(OVERLOADED, 1.0)) as fleet:
        fates = await offer(fleet.router, rate=6.5, seconds=60.0)  # ~0.7 of the pool
        stats = fleet.router.statistics().pool("interactive")
    assert not fates.refused_at_once and not fates.timed_out and fates.full == 0
    assert stats.seat_seconds is not None and stats.queue.refused_early_total == 0


async def test_a_cold_pool_refuses_nobody_on_a_guess(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(fail_fast(OVERLOADED, 1.0)) as fleet:
        fates = await offer(fleet.router, rate=2000.0, seconds=0.03)  # ~60 at once, before any release
    # Many could not be seated in time, but with no release measured yet, none was refused on a guess.
    assert not fates.refused_at_once and len(fates.timed_out) > 10
    assert len(fates.served) + len(fates.timed_out) > 50


async def test_the_drain_rate_follows_a_reloaded_cap(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(fail_fast(OVERLOADED, 1.0)) as fleet:
        await offer(fleet.router, rate=20.0, seconds=10.0)
        before = fleet.router.statistics().pool("interactive")
        assert before.drain_rate is not None and before.seat_seconds is not None
        # Seats are free now: the queue gets no estimate, so nobody could be refused.
        assert fleet.router.pool("interactive").queue.expected_wait(0) is None
        halved = two_pool_config(interactive_cap=4, max_queue=200, interactive_timeout=3.0)
        fleet.router.apply(fail_fast(halved, 1.0))
        after = fleet.router.statistics().pool("interactive")
        assert after.drain_rate == pytest.approx(before.drain_rate / 2)
        # Served at the new cap, the pool refuses a share of the same offered load it did not refuse before.
        fates = await offer(fleet.router, rate=6.5, seconds=30.0, seed=8)
        assert fates.refused_at_once and max(fates.served) < 3.0
        assert fleet.router.statistics().pool("interactive").in_flight == 0


def test_fail_fast_fraction_is_a_fraction() -> None:
    text = (Path(__file__).resolve().parents[2] / "config.toml").read_text()
    text = text.replace("fail_fast_fraction = 1.0", "fail_fast_fraction = 1.5")
    with pytest.raises(ConfigError, match=r"pools.interactive.fail_fast_fraction: must be at most 1"):
        parse_config(text)
    assert parse_config(text.replace("1.5", "0")).pool("interactive").fail_fast_fraction == 0.0
    assert parse_config(text.replace("fail_fast_fraction = 1.5\n", "")).pool("interactive").fail_fast_fraction == 1.0
