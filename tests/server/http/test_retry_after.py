"""A fresh pool's refusals carry spread Retry-After hints on the wire (router/queueing/retry_hint.py).

Before a pool has measured a drain rate its hint is the floor; sent as it is,
every client of the first burst came back in the same instant. Read here as
a client reads them: ``retry-after`` and ``retry-after-ms`` on real sockets.
"""

from __future__ import annotations

import dataclasses

import httpx
import trio

from tailguard.router.config import Config, TimeoutsConfig
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, engines_on_sockets, tailguard

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
FLOOR = 1.0  # [timeouts] retry_after, the hint's floor
REFUSALS = 12  # of each kind


def no_seats(urls: list[str]) -> Config:
    """Pools that never seat anyone: interactive has no queue (429 queue_full), batch a short deadline (503 queue_timeout)."""
    config = two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]], timeouts=TimeoutsConfig(retry_after=FLOOR))
    interactive, batch = config.pools
    pools = (dataclasses.replace(interactive, max_concurrency=0, max_queue=0), dataclasses.replace(batch, max_concurrency=0))
    classes = tuple(dataclasses.replace(klass, queue_timeout=0.05) for klass in config.classes)
    return dataclasses.replace(config, pools=pools, classes=classes)


async def test_a_fresh_pools_first_refusals_carry_spread_hints() -> None:
    answers: list[httpx.Response] = []
    async with engines_on_sockets([QUICK, QUICK]) as backends, tailguard(no_seats(backends.urls)) as running:
        async with httpx.AsyncClient(base_url=running.http_url, timeout=10) as client:

            async def ask(max_tokens: int) -> None:
                body = {"messages": MESSAGES, "max_tokens": max_tokens}
                answers.append(await client.post("/v1/chat/completions", json=body))

            async with trio.open_nursery() as nursery:
                for _ in range(REFUSALS):
                    nursery.start_soon(ask, 8)  # interactive
                    nursery.start_soon(ask, 200)  # batch: over interactive's 128 output tokens
    assert sorted(answer.status_code for answer in answers) == [429] * REFUSALS + [503] * REFUSALS
    for status in (429, 503):
        refused = [answer for answer in answers if answer.status_code == status]
        millis = [int(answer.headers["retry-after-ms"]) for answer in refused]
        # Never sooner than the floor, at most half of it again; and not one instant for the whole burst.
        assert all(FLOOR * 1000 <= ms <= FLOOR * 1500 for ms in millis), millis
        assert len(set(millis)) > REFUSALS // 2, millis
        # Retry-After is the same hint in whole seconds, rounded up.
        assert all(int(answer.headers["retry-after"]) == -(-int(answer.headers["retry-after-ms"]) // 1000) for answer in refused)
