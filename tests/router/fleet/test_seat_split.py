"""Rebalancing by seats, in virtual time: a share of an engine serves the busy pool, the engine never runs past its cap."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import pytest
import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.config import Config, ConfigError, LendConfig, RebalanceConfig, parse_config, render_config
from tailguard.router.fleet import Endpoint
from tailguard.server.metrics import Metrics
from tests.helpers.config_text import BASE
from tests.helpers.router import BATCH_URL, INTERACTIVE_URL, chat, router_over_engines, run_to_end, two_pool_config, with_digest
from tests.router.fleet.test_rebalance import interactive_load

CAP = 8
SPARE_URL = "http://batch-1:8000"


def split_config(
    *, seat_step: float = 0.25, cooldown: float = 60.0, batch_urls: tuple[str, ...] = (BATCH_URL,), movable: Iterable[str] = (BATCH_URL,)
) -> Config:
    """Interactive: one engine of 8 seats. Batch: ``batch_urls``, 8 seats each; ``movable`` may move, by ``seat_step``."""
    base = two_pool_config(interactive_cap=CAP, batch_cap=CAP, batch_urls=batch_urls, interactive_timeout=60.0, batch_timeout=120.0)
    interactive, batch = base.pools
    moving = set(movable)
    batch = dataclasses.replace(batch, endpoints=tuple(dataclasses.replace(e, movable=e.url in moving) for e in batch.endpoints))
    rebalance = RebalanceConfig(interval=1.0, hold_time=5.0, threshold=0.3, cooldown=cooldown, seat_step=seat_step)
    return with_digest(base, f"split-{seat_step}", pools=(interactive, batch), rebalance=rebalance)


def caps(router: Router) -> dict[tuple[str, str], int]:
    """(pool, URL) -> the cap of that pool's endpoint for the URL now."""
    return {(e.pool, e.url): e.max_concurrency for e in router.statistics().endpoints}


def engine_members(router: Router, url: str) -> list[Endpoint]:
    """The endpoints that hold seats of the engine at ``url``: its own and its shares (dropped ones still draining too)."""
    engine = router.endpoint(url)
    return [engine] if engine.split is None else engine.split.members


async def batch_load(router: Router, seconds: float, concurrency: int, max_tokens: int = 300) -> None:
    """``concurrency`` callers sending batch jobs (max_tokens over interactive's 128) back to back for ``seconds``."""
    end = trio.current_time() + seconds

    async def caller(i: int) -> None:
        n = 0
        while trio.current_time() < end:
            await run_to_end(router, chat(f"job {i}-{n}", max_tokens=max_tokens, request_id=f"b{i}-{n}"))
            n += 1

    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(caller, i)


async def wait_for_moves(router: Router, moves: dict[tuple[str, str], int], within: float) -> None:
    with trio.fail_after(within):
        while router.statistics().moves != moves:
            await trio.sleep(0.25)


async def test_a_sustained_imbalance_moves_a_share_of_the_engine_after_hold_time(autojump_clock: trio.testing.MockClock) -> None:
    """2 engines, 1:1: a whole move would empty the batch pool; 2 of its 8 seats move instead."""
    async with router_over_engines(split_config()) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        served: list[str] = []
        started = trio.current_time()
        nursery.start_soon(interactive_load, fleet.router, 30.0, 3 * CAP, served)
        await wait_for_moves(fleet.router, {("batch", "interactive"): 1}, within=15.0)
        assert trio.current_time() - started >= 5.0  # not before hold_time
        await trio.sleep(31.0)  # the load ends; the cooldown holds a second move off
        stats = fleet.router.statistics()
        assert stats.moves == {("batch", "interactive"): 1} and stats.moving == {}
        assert caps(fleet.router) == {("interactive", INTERACTIVE_URL): CAP, ("batch", BATCH_URL): CAP - 2, ("interactive", BATCH_URL): 2}
        assert stats.pool("interactive").max_concurrency == CAP + 2 and stats.pool("batch").max_concurrency == CAP - 2
        assert BATCH_URL in served  # the share served interactive requests; the access log's endpoint is the engine's URL
        for url, engine in fleet.engines.items():
            assert engine.statistics().max_running_seen <= CAP, url
        page = Metrics(fleet.router).render().decode()
        assert f'tailguard_endpoint_max_concurrency{{endpoint="{BATCH_URL}",pool="interactive"}} 2.0' in page
        assert f'tailguard_endpoint_max_concurrency{{endpoint="{BATCH_URL}",pool="batch"}} {CAP - 2:.1f}' in page
        assert f'tailguard_pool_max_concurrency{{pool="interactive"}} {CAP + 2:.1f}' in page
        assert 'tailguard_endpoint_moves_total{from="batch",to="interactive"} 1.0' in page
        own, share = engine_members(fleet.router, BATCH_URL)
        assert share.usable and share.engine is own
        own.healthy = False  # down by the engine's health check: its share is down with it, not probed apart
        assert not share.usable and fleet.router.pool("interactive").healthy
        own.healthy, own.ejected_until = True, trio.current_time() + 10.0  # and out while the engine is ejected
        assert not share.usable
        nursery.cancel_scope.cancel()


async def test_the_engine_never_runs_past_its_cap_while_a_share_drains_in(autojump_clock: trio.testing.MockClock) -> None:
    """The batch engine full of long jobs: the share's seats come only as they end."""
    async with router_over_engines(split_config()) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        for i in range(CAP):  # every batch seat, jobs of different lengths
            nursery.start_soon(run_to_end, fleet.router, chat(f"job {i}", max_tokens=1500 + 300 * i, request_id=f"b{i}"))
        await trio.testing.wait_all_tasks_blocked()
        engine = fleet.engine(BATCH_URL)
        assert engine.statistics().running == CAP
        nursery.start_soon(interactive_load, fleet.router, 60.0, 3 * CAP, [])
        share_used_at: list[int] = []  # the engine's own endpoint's in flight when the share first held a seat
        with trio.fail_after(90):
            while not share_used_at:
                members = engine_members(fleet.router, BATCH_URL)
                assert sum(m.in_flight for m in members) <= CAP and engine.statistics().running <= CAP
                if len(members) > 1 and members[1].in_flight:
                    share_used_at.append(members[0].in_flight)
                await trio.sleep(0.01)
        assert fleet.router.statistics().moves == {("batch", "interactive"): 1}
        assert share_used_at[0] <= CAP - 2  # the batch jobs had fallen within the lowered cap first
        with trio.fail_after(60):
            while engine_members(fleet.router, BATCH_URL)[0].in_flight:  # the long jobs finish where they run
                assert engine.statistics().running <= CAP
                await trio.sleep(0.01)
        assert engine.statistics().max_running_seen <= CAP
        nursery.cancel_scope.cancel()


async def test_a_move_back_shrinks_the_share_and_a_share_at_zero_seats_goes_away(autojump_clock: trio.testing.MockClock) -> None:
    router_config = split_config(cooldown=10.0)
    async with router_over_engines(router_config) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        await interactive_load(fleet.router, 20.0, 3 * CAP, [])  # two moves, ~10 s apart: the same engine's share grows
        await trio.sleep(10.0)
        assert fleet.router.statistics().moves == {("batch", "interactive"): 2}
        assert caps(fleet.router)[("interactive", BATCH_URL)] == 4 and caps(fleet.router)[("batch", BATCH_URL)] == 4
        nursery.start_soon(batch_load, fleet.router, 60.0, 3 * CAP)
        await wait_for_moves(fleet.router, {("batch", "interactive"): 2, ("interactive", "batch"): 1}, within=30.0)
        assert caps(fleet.router) == {("interactive", INTERACTIVE_URL): CAP, ("batch", BATCH_URL): 6, ("interactive", BATCH_URL): 2}
        await wait_for_moves(fleet.router, {("batch", "interactive"): 2, ("interactive", "batch"): 2}, within=30.0)
        assert caps(fleet.router) == {("interactive", INTERACTIVE_URL): CAP, ("batch", BATCH_URL): CAP}  # the share is gone
        assert fleet.router.statistics().pool("batch").max_concurrency == CAP
        await trio.sleep(1.0)
        assert fleet.router.endpoint(BATCH_URL).split is None  # its last requests ended: the engine is whole again
        assert fleet.engine(BATCH_URL).statistics().max_running_seen <= CAP
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("seat_step", "moves"), [(1.0, {}), (0.25, {("batch", "interactive"): 2})], ids=["whole-flaps", "seats"])
async def test_seats_move_where_a_whole_engine_would_flap(
    seat_step: float, moves: dict[tuple[str, str], int], autojump_clock: trio.testing.MockClock
) -> None:
    """Interactive asks 12 seats of 8, batch 10 of 16: a whole engine would turn it round (16 : 8), 2 seats at a time settle at 12 : 12."""
    config = split_config(seat_step=seat_step, cooldown=15.0, batch_urls=(BATCH_URL, SPARE_URL), movable=(SPARE_URL,))
    async with router_over_engines(config) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        nursery.start_soon(batch_load, fleet.router, 60.0, 10)
        await interactive_load(fleet.router, 60.0, 12, [])
        stats = fleet.router.statistics()
        assert stats.moves == moves  # never back again
        if moves:
            assert stats.pool("interactive").max_concurrency == 12 and stats.pool("batch").max_concurrency == 12
            assert caps(fleet.router)[("interactive", SPARE_URL)] == 4
        for url, engine in fleet.engines.items():
            assert engine.statistics().max_running_seen <= CAP, url
        nursery.cancel_scope.cancel()


async def test_a_reload_puts_the_files_assignment_back_while_the_share_drains(autojump_clock: trio.testing.MockClock) -> None:
    config = split_config()
    async with router_over_engines(config) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        nursery.start_soon(interactive_load, fleet.router, 20.0, 3 * CAP, [])
        await wait_for_moves(fleet.router, {("batch", "interactive"): 1}, within=15.0)
        with trio.fail_after(10):
            while not engine_members(fleet.router, BATCH_URL)[1].in_flight:
                await trio.sleep(0.1)
        fleet.router.apply(with_digest(config, "reloaded"))
        assert caps(fleet.router) == {("interactive", INTERACTIVE_URL): CAP, ("batch", BATCH_URL): CAP}
        stats = fleet.router.statistics()
        assert stats.pool("interactive").max_concurrency == CAP and stats.pool("batch").max_concurrency == CAP
        nursery.start_soon(batch_load, fleet.router, 10.0, 2 * CAP)  # the engine's own pool wants its seats back at once
        with trio.fail_after(20):
            while fleet.router.endpoint(BATCH_URL).split is not None:  # the share's requests finish, never past the cap
                assert sum(m.in_flight for m in engine_members(fleet.router, BATCH_URL)) <= CAP
                await trio.sleep(0.01)
        await trio.sleep(30.0)
        assert caps(fleet.router) == {("interactive", INTERACTIVE_URL): CAP, ("batch", BATCH_URL): CAP}
        assert fleet.engine(BATCH_URL).statistics().max_running_seen <= CAP
        nursery.cancel_scope.cancel()


def test_seat_step_is_read_checked_and_shown() -> None:
    movable = BASE.replace('max_concurrency = 128 },\n]', 'max_concurrency = 128, movable = true },\n]')
    config = parse_config(movable + "\n[rebalance]\nseat_step = 0.25\n")
    assert config.rebalance.seat_step == 0.25 and config.rebalance.step_seats(128) == 32
    assert RebalanceConfig(seat_step=0.1).step_seats(30) == 3 and RebalanceConfig(seat_step=0.01).step_seats(8) == 1
    assert parse_config(movable).rebalance.seat_step == 1.0
    assert "0.25 of an engine's seats a move" in render_config(config)
    assert "whole engines" in render_config(parse_config(movable))
    for bad in ("0", "1.5", '"half"'):
        with pytest.raises(ConfigError, match="rebalance.seat_step"):
            parse_config(movable + f"\n[rebalance]\nseat_step = {bad}\n")
    with pytest.raises(ConfigError, match=r"rebalance.seat_step: must be 1 under \[cluster\]"):
        parse_config(movable + '\n[rebalance]\nseat_step = 0.5\n\n[cluster]\nredis_url = "redis://127.0.0.1:6379"\n')
    parse_config(movable + '\n[cluster]\nredis_url = "redis://127.0.0.1:6379"\n')  # whole engines are fine there


async def test_a_step_that_would_leave_the_engine_no_seat_moves_it_whole_and_its_share_merges(autojump_clock: trio.testing.MockClock) -> None:
    """Half an engine a move: the second takes what is left, as a whole-engine move, and the engine joins as one endpoint."""
    config = split_config(seat_step=0.5, cooldown=10.0, batch_urls=(BATCH_URL, SPARE_URL), movable=(SPARE_URL,))
    async with router_over_engines(config) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        nursery.start_soon(interactive_load, fleet.router, 40.0, 4 * CAP, [])
        await wait_for_moves(fleet.router, {("batch", "interactive"): 1}, within=15.0)
        assert caps(fleet.router)[("interactive", SPARE_URL)] == 4 and caps(fleet.router)[("batch", SPARE_URL)] == 4
        await wait_for_moves(fleet.router, {("batch", "interactive"): 2}, within=30.0)
        assert caps(fleet.router) == {("interactive", INTERACTIVE_URL): CAP, ("interactive", SPARE_URL): CAP, ("batch", BATCH_URL): CAP}
        stats = fleet.router.statistics()
        assert stats.pool("interactive").max_concurrency == 2 * CAP and stats.pool("batch").max_concurrency == CAP
        await trio.sleep(40.0)
        assert fleet.router.endpoint(SPARE_URL).split is None  # the merged share's requests ended
        assert fleet.engine(SPARE_URL).statistics().max_running_seen <= CAP
        nursery.cancel_scope.cancel()


async def test_a_pool_that_lends_to_the_busy_one_moves_no_seat_share(autojump_clock: trio.testing.MockClock) -> None:
    """Lending already gives the busy pool the spare seats, bounded by what a borrowed request may stall: no share."""
    config = split_config()
    interactive, batch = config.pools
    lending = with_digest(config, "split-lending", pools=(interactive, dataclasses.replace(batch, lend=LendConfig(to=("interactive",)))))
    async with router_over_engines(lending) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        served: list[str] = []
        nursery.start_soon(interactive_load, fleet.router, 30.0, 3 * CAP, served)
        await trio.sleep(31.0)  # past hold_time many times over, the imbalance all along
        stats = fleet.router.statistics()
        assert stats.moves == {} and stats.pool("batch").max_concurrency == CAP  # one batch engine: no whole move either
        assert BATCH_URL in served  # the interactive requests borrowed its seats instead
        nursery.cancel_scope.cancel()
