"""The shared admission ledger on a real redis-server: grants, leases, priority, fallback and recovery."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from router.cluster import NO_WAITER, ClusterConfig, Demand, SharedBudget
from server.redis_ledger import RedisLedger

from .redis_helpers import RedisServer, redis_server

CAP = 10
TTL = 0.4  # real seconds: Redis expires leases on its own clock


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


class Replica:
    """One replica's view of one capped resource, and its budget."""

    def __init__(self, name: str, ledger: RedisLedger, *, static_share: float = 0.5) -> None:
        self.in_use = 0
        self.waiting = 0
        self.best_waiting = NO_WAITER
        self.granted = 0
        config = ClusterConfig(redis_url="", replica_id=name, lease_ttl=TTL, static_share=static_share, block=0)
        self.budget = SharedBudget(config, ledger, self.demands)

    def demands(self) -> list[Demand]:
        return [Demand("pool:x", CAP, self.in_use, self.waiting, self.best_waiting, self._apply)]

    def _apply(self, seats: int) -> None:
        self.granted = seats

    async def need(self, in_use: int, waiting: int = 0, best_waiting: int = NO_WAITER) -> int:
        self.in_use, self.waiting, self.best_waiting = in_use, waiting, best_waiting
        await self.budget.sync_once()
        return self.granted


async def test_grants_never_add_up_past_the_cap_and_come_back_when_released(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "t1") as ledger:
        a, b = Replica("a", ledger), Replica("b", ledger)
        assert await a.need(0, waiting=7) == 7
        assert await b.need(0, waiting=7) == 3  # only what a does not hold
        assert await ledger.grants("pool:x") == {"a": 7, "b": 3}
        assert await a.need(2) == 2  # a's demand fell: it gives seats back
        assert await b.need(3, waiting=5) == 8
        assert sum((await ledger.grants("pool:x")).values()) <= CAP


async def test_a_dead_replicas_seats_return_within_the_lease(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "t2") as ledger:
        dead, alive = Replica("dead", ledger), Replica("alive", ledger)
        assert await dead.need(8) == 8  # then it stops syncing, as after kill -9
        assert await alive.need(0, waiting=8) == 2
        started = trio.current_time()
        with trio.fail_after(5 * TTL):
            while await alive.need(0, waiting=8) < 8:
                await trio.sleep(TTL / 10)
        assert trio.current_time() - started <= 2 * TTL  # within the lease TTL (and one sync)
        assert await ledger.grants("pool:x") == {"alive": 8}  # the dead one's entry is gone


async def test_a_more_urgent_request_waiting_elsewhere_gets_the_next_free_seat(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "t3") as ledger:
        a, b = Replica("a", ledger), Replica("b", ledger)
        assert await a.need(5) == 5 and await b.need(5) == 5  # the cap is full
        assert await b.need(5, waiting=1, best_waiting=1) == 5  # a long request waits on b
        assert await a.need(5, waiting=1, best_waiting=0) == 5  # a short one waits on a
        # One of b's requests ends: b keeps only the seats it uses, though its own long one waits.
        assert await b.need(4, waiting=1, best_waiting=1) == 4
        assert await a.need(5, waiting=1, best_waiting=0) == 6  # the seat goes to a's short request
        assert await b.need(4, waiting=1, best_waiting=1) == 4
        assert sum((await ledger.grants("pool:x")).values()) == CAP


async def test_redis_down_falls_back_to_static_shares_and_recovers_without_double_counting(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "t4") as ledger:
        a, b = Replica("a", ledger, static_share=0.5), Replica("b", ledger, static_share=0.5)
        assert await a.need(2) == 2 and await b.need(0, waiting=8) == 8
        redis.stop()
        # At once: no more than the grant the ledger counted, nor the static share (5).
        assert await a.need(2, waiting=6) == 2 and await b.need(8) == 5
        assert a.budget.mode == b.budget.mode == "fallback"
        await trio.sleep(TTL)
        # After the lease: every replica has noticed; each has its static share.
        assert await a.need(2, waiting=6) == 5 and await b.need(8) == 5
        redis.start()  # an empty Redis: the ledger is rebuilt from what the replicas claim
        with trio.fail_after(10):
            while a.budget.mode != "ledger":
                await a.need(5, waiting=3)
                await trio.sleep(0.05)
        # While the others may still be on their static shares: at most ours.
        assert await a.need(5, waiting=3) == 5
        assert await b.need(8) == 5  # b is back too; its 8 in use wait for the others to go
        grants = await ledger.grants("pool:x")
        assert grants == {"a": 5, "b": 5} and sum(grants.values()) <= CAP
        for _ in range(10):  # the recovery window passes; both keep syncing, as they do
            await trio.sleep(TTL / 4)
            await a.need(5)
            await b.need(8)
        assert await b.need(8) == 5  # a holds 5: nothing is counted twice
        assert await a.need(2) == 2 and await b.need(8) == 8
        assert sum((await ledger.grants("pool:x")).values()) == CAP
