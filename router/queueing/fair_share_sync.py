"""Fair shares across replicas: each trades, every second, what it served each tenant of each pool.

Each replica orders its own queue (router/queueing/fair_share.py). With ``[cluster]``
a tenant whose requests a load balancer sends mostly to one replica would
otherwise be fresh on every other. So every ``INTERVAL`` each replica
publishes its per-pool, per-tenant served tokens (over the weights, since
it started) to the ledger and reads the others'; what the others served a
tenant since the last trade is added to that tenant's finish tag here
(``FairClock.absorb``). Off the request path: one round trip a second, not
one a request, carrying only the tenants served since the last trade either
way (a tenant idle for a while costs the trade nothing). How far apart replicas drift: a tenant's service on the
others is seen here at most one interval (plus a round trip) late, so a
burst on one replica can take at most a second's worth of seats on another
before it counts there. A replica that dies leaves its totals behind; they
stop growing, so they add nothing more. A failed trade changes nothing:
each replica's own shares stand, and the next trade catches up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import trio

from .fair_share import FairClock

log = logging.getLogger("tailguard.fair_sync")

INTERVAL = 1.0  # seconds between trades

Served = dict[str, dict[str, float]]  # pool -> tenant -> tokens served (over the weight), cumulative


@runtime_checkable
class ServiceStore(Protocol):
    """Where replicas trade what they served (Redis: ``server.redis_ledger.RedisLedger.trade_service``)."""

    async def trade_service(self, replica: str, served: Mapping[str, Mapping[str, float]]) -> Served:
        """Record this replica's totals (those given: the others it recorded before stand); return, per pool
        and tenant, the sum of every other replica's -- for the tenants that changed since this replica's
        last trade of the pool, or all of them at its first."""
        ...


class FairTrade:
    """What the other replicas had served each tenant at the last trade, and the trades themselves."""

    def __init__(self, replica: str, store: ServiceStore, clocks: Callable[[], Mapping[str, FairClock]]) -> None:
        self._replica = replica
        self._store = store
        self._clocks = clocks  # pool name -> its queue's fair clock, as the fleet has them now
        self._seen: Served = {}
        self.trades = 0
        self.failures = 0

    async def trade_once(self) -> None:
        """One round trip: publish this replica's totals, add to each tenant here what the others served it since."""
        clocks = dict(self._clocks())
        # Only the tenants served since the last trade: the ledger keeps each replica's totals, so a
        # trade costs what changed, not every tenant ever served here.
        mine = {pool: {tenant: clock.served[tenant] for tenant in clock.changed} for pool, clock in clocks.items()}
        for pool_clock in clocks.values():
            pool_clock.changed = set()
        try:
            with trio.fail_after(INTERVAL):
                theirs = await self._store.trade_service(self._replica, mine)
        except Exception as error:  # the ledger away or slow: each replica's own shares stand
            for pool, pool_clock in clocks.items():
                pool_clock.changed |= mine[pool].keys()  # sent again at the next trade
            self.failures += 1
            if self.failures == 1 or self.failures % 60 == 0:
                log.warning("cluster: fair shares not traded (%s: %s); each replica keeps its own", type(error).__name__, error)
            return
        self.trades += 1
        for pool, tenants in theirs.items():
            clock = clocks.get(pool)
            first = pool not in self._seen  # the first trade of a pool only sets where counting starts
            seen = self._seen.setdefault(pool, {})
            for tenant, total in tenants.items():
                before = seen.get(tenant, 0.0)
                seen[tenant] = total
                if clock is not None and not first:
                    clock.absorb(tenant, total - before)
        for pool in mine:  # traded, even with nothing served anywhere yet: counting starts now
            self._seen.setdefault(pool, {})

    @property
    def tenants_seen(self) -> int:
        """Tenants of the other replicas' totals kept here, over every pool."""
        return sum(len(seen) for seen in self._seen.values())

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the others' totals of tenants ``keep`` refuses (keys a reload removed): they order nothing here any more."""
        for pool, seen in self._seen.items():
            self._seen[pool] = {tenant: total for tenant, total in seen.items() if keep(tenant)}

    async def run(self) -> None:
        """Trade forever, every ``INTERVAL`` seconds."""
        while True:
            await self.trade_once()
            await trio.sleep(INTERVAL)
