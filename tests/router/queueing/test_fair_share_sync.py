"""Fair shares traded across replicas (router/queueing/fair_share_sync.py), through a store in memory and through a real Redis."""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence

import pytest
import trio

from tailguard.router.config import ClusterConfig
from tailguard.router.dispatch import Router
from tailguard.router.queueing import FairClock, FairTrade, Served, ServiceStore, Share
from tailguard.router.quotas import NO_TERMS, Caller, Synced, SyncTerms, Want
from tailguard.server.redis_ledger import RedisLedger
from tests.helpers.redis_server import RedisServer
from tests.helpers.router import chat, two_pool_config
from tests.router.quotas.test_ledger import shared_engines


class MemoryStore:
    """The ledger's totals in a dict: replica -> pool -> tenant -> served."""

    def __init__(self) -> None:
        self.totals: dict[str, Served] = {}
        self.away = False

    async def trade_service(self, replica: str, served: Mapping[str, Mapping[str, float]]) -> Served:
        if self.away:
            raise ConnectionError("the ledger is away")
        mine = self.totals.setdefault(replica, {})
        for pool, tenants in served.items():
            mine.setdefault(pool, {}).update(tenants)
        theirs: Served = {pool: {} for pool in served}
        for other, pools in self.totals.items():
            for pool, tenants in pools.items():
                if other != replica and pool in served:
                    for tenant, total in tenants.items():
                        theirs.setdefault(pool, {})[tenant] = theirs.get(pool, {}).get(tenant, 0.0) + total
        return theirs


def serve(clock: FairClock, share: Share, times: int) -> None:
    """``times`` requests of ``share`` seated and ended here, each generating all it reserved."""
    for _ in range(times):
        clock.granted(clock.start(share), share)


async def test_a_tenant_served_on_one_replica_waits_its_turn_on_the_other() -> None:
    store = MemoryStore()
    assert isinstance(store, ServiceStore)
    a_clock, b_clock = FairClock(), FairClock()
    a = FairTrade("a", store, lambda: {"interactive": a_clock})
    b = FairTrade("b", store, lambda: {"interactive": b_clock})
    heavy, light = Share("heavy", tokens=100), Share("light", tokens=100)
    serve(a_clock, heavy, 1)
    await a.trade_once()
    await b.trade_once()  # b's first sight of a's totals: where its counting starts, nothing absorbed
    assert b_clock.finish("heavy") == 0.0
    serve(a_clock, heavy, 5)  # heavy's burst lands on replica a
    await a.trade_once()
    await b.trade_once()
    assert b_clock.finish("heavy") == 500.0  # on b, heavy starts behind what a served it since
    assert b_clock.start(light) < b_clock.start(heavy)
    store.away = True
    await b.trade_once()  # a failed trade changes nothing
    assert (b.failures, b.trades) == (1, 2)


async def test_weights_are_traded_as_served_over_the_weight() -> None:
    store = MemoryStore()
    a_clock, b_clock = FairClock(), FairClock()
    a, b = FairTrade("a", store, lambda: {"p": a_clock}), FairTrade("b", store, lambda: {"p": b_clock})
    await a.trade_once()
    await b.trade_once()
    serve(a_clock, Share("big", weight=4.0, tokens=400), 2)
    await a.trade_once()
    await b.trade_once()
    assert b_clock.finish("big") == 200.0


async def test_redis_keeps_each_replicas_totals_and_returns_the_others(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "fair") as ledger:
        assert await ledger.trade_service("a", {"interactive": {"heavy": 500.0, "light": 20.0}}) == {"interactive": {}}
        theirs = await ledger.trade_service("b", {"interactive": {"light": 5.0}, "batch": {}})
        assert theirs == {"interactive": {"heavy": 500.0, "light": 20.0}, "batch": {}}
        await ledger.trade_service("c", {"interactive": {"heavy": 1.5}})
        assert (await ledger.trade_service("a", {"interactive": {"heavy": 600.0}}))["interactive"] == {"light": 5.0, "heavy": 1.5}


async def test_two_replicas_trade_through_redis(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "fair2") as ledger:
        a_clock, b_clock = FairClock(), FairClock()
        a, b = FairTrade("a", ledger, lambda: {"interactive": a_clock}), FairTrade("b", ledger, lambda: {"interactive": b_clock})
        serve(a_clock, Share("heavy", tokens=10), 1)
        for trade in (a, b):
            await trade.trade_once()
        serve(a_clock, Share("heavy", tokens=10), 3)
        for trade in (a, b):
            await trade.trade_once()
        assert b_clock.finish("heavy") == pytest.approx(30.0)
        with trio.move_on_after(0.01):  # run() trades at once, then waits: cancelled in its wait
            await b.run()
        assert b.trades == 3


async def test_two_routers_trade_what_they_served_each_caller(redis: RedisServer) -> None:
    """A caller served on replica a starts behind on replica b within about a second: the routers trade by themselves."""
    base = two_pool_config(interactive_cap=8)
    engines, transports = shared_engines()
    routers = [
        Router(
            dataclasses.replace(base, cluster=ClusterConfig(redis.url, namespace="fair3", replica_id=name, lease_ttl=1.0, sync_interval=0.05)),
            transport_factory=lambda endpoint: transports[endpoint.url],
            seed=0,
        )
        for name in ("a", "b")
    ]
    heavy = Caller("heavy", frozenset(), None)
    async with RedisLedger(redis.url, "fair3") as ledger, trio.open_nursery() as nursery:
        watched = Watched(ledger)
        for engine in engines.values():
            await nursery.start(engine.run)
        for router in routers:
            await nursery.start(functools.partial(router.run, ledger=watched))
        with trio.fail_after(5):
            for name in ("a", "b"):
                await watched.traded[name].wait()  # both have traded once: counting starts
        for i in range(3):
            async with routers[0].open(chat(f"q{i}", max_tokens=8, request_id=f"h{i}"), caller=heavy) as completion:
                await completion.read()
        clock = routers[1].pool("interactive").queue.fair
        with trio.fail_after(5):
            while clock.finish("heavy") == clock.finish("nobody"):
                await trio.sleep(0.1)
        assert clock.finish("heavy") > clock.finish("nobody")  # b never served heavy, and still puts it behind
        nursery.cancel_scope.cancel()


class Counted:
    """A store, with how many tenants each trade sent and got back."""

    def __init__(self, store: ServiceStore) -> None:
        self.store = store
        self.sent: list[int] = []
        self.got: list[int] = []

    async def trade_service(self, replica: str, served: Mapping[str, Mapping[str, float]]) -> Served:
        self.sent.append(sum(len(tenants) for tenants in served.values()))
        theirs = await self.store.trade_service(replica, served)
        self.got.append(sum(len(tenants) for tenants in theirs.values()))
        return theirs


class Watched(Counted):
    """A router's ledger: its syncs pass through, and ``traded[replica]`` is set at that replica's first trade."""

    def __init__(self, ledger: RedisLedger) -> None:
        super().__init__(ledger)
        self.ledger = ledger
        self.traded: defaultdict[str, trio.Event] = defaultdict(trio.Event)

    async def sync(
        self, replica: str, lease_ttl: float, wants: Sequence[Want], incarnation: str = "", *, terms: SyncTerms = NO_TERMS
    ) -> Synced:
        return await self.ledger.sync(replica, lease_ttl, wants, incarnation, terms=terms)

    async def trade_service(self, replica: str, served: Mapping[str, Mapping[str, float]]) -> Served:
        theirs = await super().trade_service(replica, served)
        self.traded[replica].set()
        return theirs


async def test_a_trade_carries_the_tenants_served_since_the_last_not_every_tenant_ever_served(redis: RedisServer) -> None:
    """Issue 32, item 3: 2,000 tenants served once each on a went quiet; each trade still carried all of them, both ways."""
    async with RedisLedger(redis.url, "fair4") as ledger:
        a_store, b_store = Counted(ledger), Counted(ledger)
        a_clock, b_clock = FairClock(), FairClock()
        a, b = FairTrade("a", a_store, lambda: {"p": a_clock}), FairTrade("b", b_store, lambda: {"p": b_clock})
        await b.trade_once()  # b counts from here
        for i in range(2_000):
            serve(a_clock, Share(f"tenant-{i}", tokens=10), 1)
        await a.trade_once()
        await b.trade_once()
        assert (a_store.sent[-1], b_store.got[-1]) == (2_000, 2_000)  # each once: served on a, absorbed on b
        assert b_clock.finish("tenant-5") == pytest.approx(10.0)
        for trade in (a, b, a, b):
            await trade.trade_once()
        assert a_store.sent[-2:] == [0, 0] and b_store.got[-2:] == [0, 0]  # quiet: nothing goes either way
        serve(a_clock, Share("tenant-7", tokens=10), 2)
        await a.trade_once()
        await b.trade_once()
        assert (a_store.sent[-1], b_store.got[-1]) == (1, 1)
        assert b_clock.finish("tenant-7") == pytest.approx(30.0)


async def test_what_the_others_served_a_removed_key_is_forgotten() -> None:
    """Issue 32, item 4: the others' totals were kept for every tenant ever traded, keys a reload removed included."""
    store = MemoryStore()
    a_clock, b_clock = FairClock(), FairClock()
    a, b = FairTrade("a", store, lambda: {"p": a_clock}), FairTrade("b", store, lambda: {"p": b_clock})
    for tenant in ("kept", "removed"):
        serve(a_clock, Share(tenant, tokens=10), 1)
    await a.trade_once()
    await b.trade_once()
    assert b.tenants_seen == 2
    b.forget(lambda tenant: tenant == "kept")
    assert b.tenants_seen == 1
    serve(a_clock, Share("kept", tokens=10), 1)  # trading goes on for the kept one
    await a.trade_once()
    await b.trade_once()
    assert b_clock.finish("kept") == 10.0
