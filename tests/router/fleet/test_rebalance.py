"""Automatic rebalancing in virtual time: moves follow demand, drop nothing, never exceed a cap, never flap."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from tailguard.router.config import Config, ConfigError, EndpointConfig, PlacementConfig, RebalanceConfig, parse_config, render_config
from tailguard.server.metrics import Metrics
from tests.helpers.config_text import BASE
from tests.helpers.router import INTERACTIVE_URL, chat, router_over_engines, run_to_end, two_pool_config, with_digest

SPARE_URL = "http://batch-1:8000"  # the batch pool's second, movable endpoint
CAP = 4
REBALANCE = RebalanceConfig(interval=1.0, hold_time=5.0, threshold=0.3, cooldown=60.0)


def movable_config(
    *, movable: bool = True, rebalance: str = "auto", batch_urls: tuple[str, ...] = ("http://batch-0:8000", SPARE_URL), load_factor: float = 1.25
) -> Config:
    """Interactive: one endpoint of 4 seats. Batch: two of 4, the last one movable (affinity's bound ``load_factor``)."""
    base = two_pool_config(interactive_cap=CAP, batch_cap=CAP, batch_urls=batch_urls, interactive_timeout=60.0, batch_timeout=60.0)
    interactive, batch = base.pools
    endpoints = tuple(
        dataclasses.replace(e, movable=movable and e.url == SPARE_URL) for e in batch.endpoints
    )
    placement = PlacementConfig(load_factor=load_factor)
    batch = dataclasses.replace(batch, endpoints=endpoints, rebalance=rebalance, placement=placement)  # type: ignore[arg-type]
    return with_digest(base, "movable", pools=(interactive, batch), rebalance=REBALANCE)


async def interactive_load(router: object, seconds: float, concurrency: int, done: list[str]) -> None:
    """``concurrency`` callers asking short questions back to back for ``seconds`` (virtual)."""
    end = trio.current_time() + seconds

    async def caller(i: int) -> None:
        n = 0
        while trio.current_time() < end:
            _, routing = await run_to_end(router, chat(f"q{i}-{n}", max_tokens=64, request_id=f"i{i}-{n}"))  # type: ignore[arg-type]
            done.append(routing.endpoint)
            n += 1

    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(caller, i)


async def test_a_starved_pool_gets_the_idle_pools_movable_endpoint_and_nothing_is_dropped(autojump_clock: trio.testing.MockClock) -> None:
    config = movable_config()
    async with router_over_engines(config) as fleet, trio.open_nursery() as background:
        await background.start(fleet.router.run)
        served: list[str] = []
        await interactive_load(fleet.router, 30.0, 3 * CAP, served)  # three times its seats, for 30 s
        stats = fleet.router.statistics()
        assert stats.moves == {("batch", "interactive"): 1}  # one move, not back and forth
        assert {e.url: e.pool for e in stats.endpoints}[SPARE_URL] == "interactive"
        assert stats.pool("interactive").max_concurrency == 2 * CAP and stats.pool("batch").max_concurrency == CAP
        assert SPARE_URL in served and INTERACTIVE_URL in served  # it served interactive requests once it joined
        for url, engine in fleet.engines.items():  # the engines' own running counts never passed a cap
            assert engine.statistics().max_running_seen <= CAP, url
        assert stats.open_requests == 0 and stats.in_flight == 0
        by_pool = {entry["pool"]: entry for entry in fleet.router.assignment()}  # what /v1/limits shows
        assert (by_pool["interactive"]["endpoints"], by_pool["interactive"]["max_concurrency"]) == (2, 2 * CAP)
        assert (by_pool["batch"]["endpoints"], by_pool["batch"]["configured_max_concurrency"]) == (1, 2 * CAP)
        page = Metrics(fleet.router).render().decode()
        assert 'tailguard_endpoint_moves_total{from="batch",to="interactive"} 1.0' in page
        assert f'tailguard_endpoint_assignment{{endpoint="{SPARE_URL}",pool="interactive"}} 1.0' in page
        assert f'tailguard_pool_max_concurrency{{pool="interactive"}} {2 * CAP:.1f}' in page
        background.cancel_scope.cancel()


async def test_a_moving_endpoint_finishes_its_old_pools_requests_before_it_joins(autojump_clock: trio.testing.MockClock) -> None:
    config = movable_config(load_factor=1.0)  # the bound at the mean: two jobs, one on each batch endpoint
    async with router_over_engines(config) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        spare = fleet.engine(SPARE_URL)
        long_done: list[str] = []

        async def long_job(i: int) -> None:  # batch work, spread over both batch endpoints
            _, routing = await run_to_end(fleet.router, chat(f"job {i}", max_tokens=1000, request_id=f"b{i}"))
            long_done.append(routing.endpoint)

        for i in range(2):
            nursery.start_soon(long_job, i)
        await trio.testing.wait_all_tasks_blocked()
        assert spare.statistics().running == 1  # one long job runs on the movable endpoint
        served: list[str] = []
        nursery.start_soon(interactive_load, fleet.router, 20.0, 4 * CAP, served)
        with trio.fail_after(60):
            while not fleet.router.statistics().moving:
                await trio.sleep(0.5)
        # Draining: it takes no new batch request, and its long job still runs there.
        assert fleet.router.statistics().moving == {SPARE_URL: ("batch", "interactive")}
        assert spare.statistics().running == 1 and spare.statistics().max_running_seen <= CAP
        with trio.fail_after(120):
            while fleet.router.statistics().moving:
                assert spare.statistics().running <= 1  # nothing of interactive's before the batch job ended
                await trio.sleep(0.1)
        assert SPARE_URL in long_done  # its batch job finished there, not dropped
        assert fleet.router.statistics().moves == {("batch", "interactive"): 1}
        nursery.cancel_scope.cancel()


async def test_a_reload_during_a_move_puts_the_file_back(autojump_clock: trio.testing.MockClock) -> None:
    config = movable_config(load_factor=1.0)  # the bound at the mean: one long job on each batch endpoint
    async with router_over_engines(config) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        nursery.start_soon(run_to_end, fleet.router, chat("job", max_tokens=3000, request_id="b0"))
        nursery.start_soon(run_to_end, fleet.router, chat("job", max_tokens=3000, request_id="b1"))
        await trio.testing.wait_all_tasks_blocked()
        served: list[str] = []
        nursery.start_soon(interactive_load, fleet.router, 15.0, 4 * CAP, served)
        with trio.fail_after(60):
            while not fleet.router.statistics().moving:
                await trio.sleep(0.5)
        fleet.router.apply(with_digest(config, "reloaded"))
        stats = fleet.router.statistics()
        assert stats.moving == {} and {e.url: e.pool for e in stats.endpoints}[SPARE_URL] == "batch"
        assert stats.pool("interactive").max_concurrency == CAP
        await trio.sleep(200)  # the long job ends; the old move must not complete (and the cooldown holds)
        stats = fleet.router.statistics()
        assert stats.moves == {} and {e.url: e.pool for e in stats.endpoints}[SPARE_URL] == "batch"
        assert fleet.engine(SPARE_URL).statistics().max_running_seen <= CAP
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "config",
    [
        movable_config(rebalance="off"),  # the pool opted out
        movable_config(movable=False),  # nothing is movable
        movable_config(batch_urls=(SPARE_URL,)),  # its only endpoint: a pool is never emptied
    ],
    ids=["rebalance-off", "nothing-movable", "only-endpoint"],
)
async def test_no_move_where_the_config_forbids_it(config: Config, autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(config) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        await interactive_load(fleet.router, 20.0, 3 * CAP, [])
        assert fleet.router.statistics().moves == {} and fleet.router.statistics().moving == {}
        nursery.cancel_scope.cancel()


def test_rebalance_settings_and_movable_endpoints_read_from_the_file() -> None:
    text = BASE.replace('{ url = "http://127.0.0.1:8003", max_concurrency = 128 }', '{ url = "http://127.0.0.1:8003", max_concurrency = 128, movable = true }')
    text += '\n[rebalance]\ninterval = 2\nhold_time = 20\nthreshold = 0.5\ncooldown = 30\n'
    config = parse_config(text)
    assert config.rebalance == RebalanceConfig(interval=2.0, hold_time=20.0, threshold=0.5, cooldown=30.0)
    assert [e.movable for e in config.pool("batch").endpoints] == [False, True]
    assert config.pool("batch").endpoints[1] == EndpointConfig("http://127.0.0.1:8003", 128, movable=True)
    with pytest.raises(ConfigError, match="hold_time"):
        parse_config(BASE + "\n[rebalance]\ninterval = 10\nhold_time = 5\n")
    with pytest.raises(ConfigError, match="rebalance"):
        parse_config(BASE.replace("[pools.batch]\n", '[pools.batch]\nrebalance = "sometimes"\n'))


def test_check_config_shows_rebalancing_only_when_something_can_move() -> None:
    assert "rebalance" not in render_config(parse_config(BASE))
    movable = BASE.replace('max_concurrency = 128 },\n]', 'max_concurrency = 128, movable = true },\n]')
    text = render_config(parse_config(movable))
    assert "rebalance" in text and "max_concurrency 128, movable" in text and "hold_time" in text
