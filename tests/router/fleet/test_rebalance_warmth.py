"""Rebalancing moves the engine whose prefix cache is coldest for the pool it leaves."""

from __future__ import annotations

import dataclasses

import trio
import trio.testing

from tailguard.router.admission import prefix_key_of
from tailguard.router.fleet import rendezvous_weight
from tests.helpers.router import chat, router_over_engines, run_to_end, with_digest
from tests.router.fleet.test_rebalance import CAP, interactive_load, movable_config

BATCH_URLS = ("http://batch-0:8000", "http://batch-1:8000")
LONG = "A contract of many clauses, each of which the reviewer must read. " * 40  # over interactive's 500 tokens: batch


def warm_prompt(home: str) -> str:
    """A long prompt whose prefix key's home among the batch endpoints is ``home``."""
    for i in range(100):
        text = f"tenant {i}: " + LONG
        key = prefix_key_of(chat(text))
        assert key is not None
        if max(BATCH_URLS, key=lambda url: (rendezvous_weight(key, url), url)) == home:  # rendezvous_order's first
            return text
    raise AssertionError("no prompt homed there")


async def test_the_engine_moved_out_is_the_one_whose_cache_is_coldest(autojump_clock: trio.testing.MockClock) -> None:
    """Both batch engines movable and idle: by URL and load alone batch-0 would go; its cache is the warm one."""
    base = movable_config()
    interactive, batch = base.pools
    both = tuple(dataclasses.replace(e, movable=True) for e in batch.endpoints)
    config = with_digest(base, "both-movable", pools=(interactive, dataclasses.replace(batch, endpoints=both)))
    warm, cold = BATCH_URLS
    text = warm_prompt(warm)
    async with router_over_engines(config) as fleet, trio.open_nursery() as nursery:
        await nursery.start(fleet.router.run)
        await trio.sleep(1.5)  # a look or two: the warmth window has begun
        for i in range(6):  # one tenant's document, asked about again and again: cached on its home
            _, routing = await run_to_end(fleet.router, chat(text + f" Question {i}?", max_tokens=4, request_id=f"b{i}"))
            assert routing.endpoint == warm
        assert fleet.router.endpoint(warm).home_placements == 6 and fleet.router.endpoint(cold).home_placements == 0
        await interactive_load(fleet.router, 30.0, 3 * CAP, [])
        stats = fleet.router.statistics()
        assert stats.moves == {("batch", "interactive"): 1}
        assert {e.url: e.pool for e in stats.endpoints}[cold] == "interactive"  # the cold one went
        assert {e.url: e.pool for e in stats.endpoints}[warm] == "batch"  # the warm one stayed with its tenant
        nursery.cancel_scope.cancel()
