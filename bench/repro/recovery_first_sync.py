"""Repro of finding 1: the first sync after Redis returns is not held to the static share.

The recovery limit starts one sync late.
"""

from __future__ import annotations

import trio

from bench.harness.redis import redis_process
from bench.repro.replica import Replica
from tailguard.server.redis_ledger import RedisLedger

CAP, TTL = 8, 0.5


async def main() -> None:
    async with redis_process() as redis, RedisLedger(redis.url, "repro", timeout=0.2) as ledger:
        replicas = [Replica(n, ledger, cap=CAP, lease_ttl=TTL, static_share=0.25) for n in "abcd"]
        for r in replicas:
            await r.budget.sync_once()
        await redis.kill()
        for r in replicas:
            await r.budget.sync_once()
        await trio.sleep(TTL + 0.05)
        for r in replicas:
            await r.budget.sync_once()
            r.in_use, r.waiting = r.granted, 5  # each serves its static share, with a queue
        print("fallback, settled:", {r.budget.replica: r.granted for r in replicas}, "modes", {r.budget.mode for r in replicas})
        await redis.start()
        a = replicas[0]
        await a.budget.sync_once()  # a reconnects first; b, c, d still on their static shares
        print(
            f"a's first sync after Redis returns: granted {a.granted} (static share {int(CAP * 0.25)}); "
            f"a + the others' static shares = {a.granted + 3 * int(CAP * 0.25)} > cap {CAP}"
        )
        await a.budget.sync_once()
        print(f"a's second sync: granted {a.granted} (the recovery limit applies from here)")


if __name__ == "__main__":
    trio.run(main)
