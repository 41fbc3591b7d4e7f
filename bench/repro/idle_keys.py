"""What one ledger sync costs with N budgeted keys that each sent one request and went quiet (issue 32, item 3).

``python -m bench.repro.idle_keys [--keys 5000] [--syncs 30]``: one replica
(AdmissionLedger + BudgetGrants, as the router builds them) on a fresh
redis-server on 127.0.0.1; each of ``--keys`` keys with a token and a
request budget sends one request (reserved, then settled), then nothing.
Measured twice, ``--syncs`` syncs each: a second after the last request
(the keys' windows still hold it) and once the windows have emptied (the
trio clock jumped 61 s; Redis keeps its own). Printed per sync: the
resources sent, wall milliseconds of ``sync_once`` (the replica's Python
work and the round trip), Redis's own microseconds for the script
(``INFO commandstats``), and the keys left in Redis.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import coredis
import trio
import trio.testing

from bench.harness.redis import redis_process
from tailguard.router.config import ClusterConfig
from tailguard.router.quotas import NO_TERMS, AdmissionLedger, BudgetGrants, Budgets, LedgerStore, Synced, SyncTerms, Want
from tailguard.server.redis_ledger import RedisLedger


class Counting:
    """The ledger, with the number of resources each sync sent."""

    def __init__(self, ledger: LedgerStore) -> None:
        self.ledger = ledger
        self.sent: list[int] = []

    async def sync(
        self, replica: str, lease_ttl: float, wants: Sequence[Want], incarnation: str = "", *, terms: SyncTerms = NO_TERMS
    ) -> Synced:
        self.sent.append(len(wants))
        return await self.ledger.sync(replica, lease_ttl, wants, incarnation, terms=terms)


async def script_usec(client: Any) -> tuple[int, int]:
    """(calls, microseconds) of EVALSHA so far, as Redis counts them."""
    stats = await client.info("commandstats")
    entry = stats.get("cmdstat_evalsha", {})
    return int(entry.get("calls", 0)), int(entry.get("usec", 0))


async def phase(name: str, shared: AdmissionLedger, store: Counting, client: Any, syncs: int) -> None:
    store.sent.clear()
    for _ in range(200):  # what changed since the last phase reaches the ledger first (a few hundred keys a sync)
        await shared.sync_once()
        if store.sent[-1] == 0:
            break
    settling = store.sent[:-1]
    print(f"{name}: {len(settling)} syncs carried the change first ({sum(settling)} resources in all)")
    store.sent.clear()
    calls0, usec0 = await script_usec(client)
    wall: list[float] = []
    cpu0 = time.process_time()
    for _ in range(syncs):
        started = time.perf_counter()
        await shared.sync_once()
        wall.append((time.perf_counter() - started) * 1000)
    cpu = (time.process_time() - cpu0) * 1000 / syncs
    calls, usec = await script_usec(client)
    redis_us = (usec - usec0) / max(1, calls - calls0)
    keys = await client.dbsize()
    print(
        f"{name}: {statistics.mean(store.sent):.0f} resources per sync; {statistics.mean(wall):.2f} ms per sync "
        f"(median {statistics.median(wall):.2f}, max {max(wall):.2f}); replica CPU {cpu:.2f} ms per sync; "
        f"Redis {redis_us:.0f} us per script; {keys} keys in Redis; mode {shared.mode}"
    )


async def main(keys: int, syncs: int, clock: trio.testing.MockClock) -> None:
    async with redis_process() as redis:
        client: Any = coredis.Redis.from_url(redis.url, decode_responses=True)
        async with RedisLedger(redis.url, "idle", timeout=5.0) as ledger, client:
            store = Counting(ledger)
            config = ClusterConfig(redis_url="", replica_id="r0", lease_ttl=5.0)
            shared = AdmissionLedger(config, store, list)
            windows = Budgets()
            shares = BudgetGrants(shared, windows)
            await shared.sync_once()

            async def one(i: int) -> None:
                key = shares.of(f"key-{i}", 20_000, 600)
                grant = await key.reserve(100, priority=0, deadline=trio.current_time() + 30.0)
                grant.settle(60, served=True)
                done.append(i)

            for first in range(0, keys, 500):  # a batch of keys asks at once; syncs grant them
                done: list[int] = []
                batch = min(500, keys - first)
                async with trio.open_nursery() as nursery:
                    for i in range(first, first + batch):
                        nursery.start_soon(one, i)
                    await trio.testing.wait_all_tasks_blocked()
                    while len(done) < batch:
                        await shared.sync_once()
                        await trio.testing.wait_all_tasks_blocked()
            print(f"{keys} keys sent one request each")
            await phase("quiet (a second after)", shared, store, client, syncs)
            clock.jump(61.0)
            await phase("idle (windows empty)", shared, store, client, syncs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=5000)
    parser.add_argument("--syncs", type=int, default=30)
    args = parser.parse_args()
    mock = trio.testing.MockClock(rate=1.0)
    trio.run(main, args.keys, args.syncs, mock, clock=mock)
