"""Health checks: Envoy's unhealthy/healthy thresholds, and no verdict from the router's own stalls (issue 20, defect 1)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.backend import ConnectorTransport
from tailguard.router.config import Config, EndpointConfig
from tailguard.router.observe import LoopLag
from tailguard.sim.canned import canned_transport
from tests.helpers.router import INTERACTIVE_URL, two_pool_config


class Engine:
    """/health by mode: "ok" answers 200, "fail" answers 503, "refuse" is refused, "reset" fails to connect otherwise, "hang" never answers."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.probes = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.probes += 1
        if self.mode == "refuse":
            raise httpx.ConnectError("connection refused", request=request) from ConnectionRefusedError(111, "Connection refused")
        if self.mode == "reset":
            raise httpx.ConnectError("connection reset", request=request) from ConnectionResetError(104, "Connection reset by peer")
        if self.mode == "fail":
            return httpx.Response(503)
        if self.mode == "hang":
            await trio.sleep_forever()
        return httpx.Response(200)


def config_with(unhealthy: int | None = None, healthy: int | None = None) -> Config:
    config = two_pool_config()
    interactive = config.pools[0]
    if unhealthy is not None:
        interactive = dataclasses.replace(interactive, unhealthy_threshold=unhealthy)
    if healthy is not None:
        interactive = dataclasses.replace(interactive, healthy_threshold=healthy)
    pools = tuple(dataclasses.replace(pool, health_check="http") for pool in (interactive, *config.pools[1:]))
    return dataclasses.replace(config, pools=pools)


def router_over(engine: Engine, config: Config) -> Router:
    def transport(_: EndpointConfig) -> ConnectorTransport:
        return canned_transport(engine.handle)

    return Router(config, transport_factory=transport, seed=0)


def state(router: Router) -> str:
    return str(router.health()["pools"]["interactive"]["endpoints"][INTERACTIVE_URL])


async def test_an_endpoint_goes_down_after_unhealthy_threshold_failures_in_a_row_and_up_after_one_pass(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine()
    router = router_over(engine, config_with())  # the defaults: 3 and 1
    assert (router.config.pools[0].unhealthy_threshold, router.config.pools[0].healthy_threshold) == (3, 1)
    await router.check_health()
    assert state(router) == "up"
    engine.mode = "fail"  # an answer that is not 200 (a refusal or a silent timeout would count at once)
    await router.check_health()
    await router.check_health()
    assert state(router) == "up"  # two misses are no verdict
    engine.mode = "ok"
    await router.check_health()  # a pass breaks the run
    engine.mode = "reset"
    for _ in range(2):
        await router.check_health()
    assert state(router) == "up"
    await router.check_health()
    assert state(router) == "down"  # the third in a row
    engine.mode = "ok"
    await router.check_health()
    assert state(router) == "up"
    await router.aclose()


async def test_a_refused_connection_marks_an_endpoint_down_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """Issue 32: nothing listens on the engine's port -- an answer no lost packet or stall fakes -- so one is enough."""
    engine = Engine()
    router = router_over(engine, config_with())  # unhealthy_threshold 3
    await router.check_health()
    engine.mode = "refuse"
    await router.check_health()
    assert state(router) == "down"
    engine.mode = "ok"
    await router.check_health()
    assert state(router) == "up"
    await router.aclose()


async def test_healthy_threshold_needs_that_many_passes_in_a_row(autojump_clock: trio.testing.MockClock) -> None:
    engine = Engine()
    router = router_over(engine, config_with(unhealthy=1, healthy=2))
    await router.check_health()
    assert state(router) == "up"  # an endpoint never seen needs one pass, whatever healthy_threshold says (Envoy's start-up rule)
    engine.mode = "fail"
    await router.check_health()
    assert state(router) == "down"
    engine.mode = "ok"
    await router.check_health()
    assert state(router) == "down"
    engine.mode = "fail"
    await router.check_health()  # resets the run of passes
    engine.mode = "ok"
    await router.check_health()
    assert state(router) == "down"
    await router.check_health()
    assert state(router) == "up"
    await router.aclose()


async def test_a_probe_that_timed_out_while_the_loop_stalled_is_not_counted(autojump_clock: trio.testing.MockClock) -> None:
    """The loop stalls (virtual time jumps with nothing run) across the probe's deadline: no verdict on the engine."""
    engine = Engine()
    router = router_over(engine, config_with(unhealthy=1))
    await router.check_health()
    engine.mode = "hang"
    timeout = router.config.timeouts.health_check_timeout
    async with trio.open_nursery() as nursery:
        await nursery.start(router.loop_lag.run)

        async def stall() -> None:
            await trio.sleep(0.3 * timeout)
            autojump_clock.jump(timeout)  # the whole process stopped, e.g. another thread held the GIL

        nursery.start_soon(stall)
        await router.check_health()
        assert state(router) == "up"
        assert router.loop_lag.statistics().worst >= timeout * 0.9
        # The same hang with the loop on time is a verdict.
        await trio.sleep(30)  # the stall is long past
        await router.check_health()
        assert state(router) == "down"
        nursery.cancel_scope.cancel()
    await router.aclose()


async def test_loop_lag_records_how_late_the_monitor_woke(autojump_clock: trio.testing.MockClock) -> None:
    lag = LoopLag(tick=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(lag.run)
        await trio.sleep(1.0)
        quiet = lag.statistics()
        assert quiet.samples >= 15 and quiet.worst == pytest.approx(0.0, abs=1e-6)
        start = trio.current_time()
        autojump_clock.jump(2.0)  # a 2 s stall, seen before the monitor has run again
        assert lag.stalled_since(start) == pytest.approx(2.0, abs=0.06)
        assert lag.excuses(start, 1.0)
        await trio.sleep(0.2)
        stats = lag.statistics()
        assert stats.worst == pytest.approx(2.0, abs=0.06)
        assert stats.buckets[-1] == (float("inf"), stats.samples)
        assert dict(stats.buckets)[1.0] == stats.samples - 1  # one wake-up over 1 s late
        assert lag.stalled_since(start) == pytest.approx(2.0, abs=0.06)  # remembered after the monitor ran
        await trio.sleep(5.0)
        assert lag.stalled_since(trio.current_time() - 1.0) == 0.0  # a later window saw no stall
        assert not lag.excuses(trio.current_time() - 1.0, 1.0)
        nursery.cancel_scope.cancel()
