"""A reload that removes a pool, or leaves it no endpoint, moves its waiting requests or fails them at once."""

from __future__ import annotations

import dataclasses

import trio
import trio.testing

from tailguard.router import Router, errors
from tailguard.router.admission import Routing
from tailguard.router.config import Config
from tests.helpers.router import BATCH_URL, INTERACTIVE_URL, chat, router_over_engines, run_to_end, two_pool_config, with_digest

Outcome = tuple[bytes, Routing] | errors.TailguardError  # a request's (body, routing), or its error


async def _queued(router: Router, count: int, outcomes: list[Outcome], nursery: trio.Nursery, max_tokens: int = 100) -> None:
    """``count`` interactive requests started; each one's end (its routing or its error) lands in ``outcomes``."""

    async def one(index: int) -> None:
        try:
            outcomes.append(await run_to_end(router, chat(max_tokens=max_tokens, request_id=f"q{index}", params={"ignore_eos": True})))
        except errors.TailguardError as error:
            outcomes.append(error)

    for index in range(count):
        nursery.start_soon(one, index)
    await trio.testing.wait_all_tasks_blocked()


def interactive_to_batch(config: Config) -> Config:
    """The interactive pool gone; its class served by the batch pool."""
    interactive, batch = config.classes
    return with_digest(config, "no-interactive-pool", pools=(config.pools[1],), classes=(dataclasses.replace(interactive, pool="batch"), batch))


async def test_a_removed_pools_waiters_move_to_where_their_class_goes_now(autojump_clock: trio.testing.MockClock) -> None:
    config = two_pool_config(interactive_cap=2, batch_cap=64, interactive_timeout=30.0)
    async with router_over_engines(config) as fleet:
        router = fleet.router
        outcomes: list[Outcome] = []
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            await _queued(router, 12, outcomes, nursery)
            interactive = router.statistics().pool("interactive")
            assert (interactive.in_flight, interactive.queue.waiting) == (2, 10)
            router.apply(interactive_to_batch(config))
        assert not [o for o in outcomes if isinstance(o, errors.TailguardError)]  # every waiter served
        pools = sorted(o[1].pool for o in outcomes if not isinstance(o, errors.TailguardError))
        assert pools.count("batch") == 10 and pools.count("interactive") == 2  # the two seated finished where they ran
        assert trio.current_time() - started < 10  # served at once by the batch pool's idle seats, far before the 30 s deadline
        assert fleet.engine(BATCH_URL).statistics().finished_total == 10
        assert router.statistics().in_flight == 0


async def test_an_emptied_pools_waiters_fail_at_once(autojump_clock: trio.testing.MockClock) -> None:
    config = two_pool_config(interactive_cap=2, batch_cap=64, interactive_timeout=30.0)
    async with router_over_engines(config) as fleet:
        router = fleet.router
        outcomes: list[Outcome] = []
        async with trio.open_nursery() as nursery:
            await _queued(router, 6, outcomes, nursery)
            emptied = dataclasses.replace(config.pools[0], endpoints=())
            router.apply(with_digest(config, "emptied", pools=(emptied, config.pools[1])))
            await trio.testing.wait_all_tasks_blocked()
            at_once = [o for o in outcomes if isinstance(o, errors.TailguardError)]
            assert len(at_once) == 4 and all(isinstance(o, errors.NoBackend) for o in at_once)
        assert len(outcomes) == 6  # the two running requests finished on their retired endpoint
        assert fleet.engine(INTERACTIVE_URL).statistics().finished_total == 2
        assert router.statistics().in_flight == 0
