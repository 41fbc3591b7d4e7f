"""Repro of finding 2: after the ledger fails, once lease_ttl has passed every replica moves to its static share.

It does so whatever the others still have running: seats in use above a
static share are counted twice.
"""

from __future__ import annotations

import trio

from bench.harness.redis import redis_process
from bench.repro.replica import Replica
from tailguard.server.redis_ledger import RedisLedger

CAP, TTL = 4, 0.5


async def main() -> None:
    async with redis_process() as redis, RedisLedger(redis.url, "repro", timeout=0.2) as ledger:
        a, b = (Replica(n, ledger, cap=CAP, lease_ttl=TTL, static_share=0.5) for n in "ab")
        a.waiting = 3
        await a.budget.sync_once()
        a.in_use, a.waiting = 3, 0  # a runs 3 long requests
        b.waiting = 1
        await b.budget.sync_once()
        b.in_use, b.waiting = 1, 0  # b runs 1
        print(f"ledger mode: a granted {a.granted} (in use {a.in_use}), b granted {b.granted} (in use {b.in_use}); cap {CAP}")
        await redis.kill()
        b.in_use = 0  # b's request ends; a's long ones go on
        for r in (a, b):
            await r.budget.sync_once()
        print(f"at once:     a may use {a.granted}, b may use {b.granted}")
        await trio.sleep(TTL + 0.05)
        for r in (a, b):
            await r.budget.sync_once()
        print(
            f"after TTL:   a may use {a.granted} (still runs {a.in_use}), b may use {b.granted} -> "
            f"in use at most {a.in_use + b.granted} > cap {CAP}"
            if a.in_use + b.granted > CAP
            else "no overlap"
        )


if __name__ == "__main__":
    trio.run(main)
