"""Repro of finding 3 (with key_burst): idle replicas keep their ``block`` of a key's cap (and of an endpoint's) for ever.

A replica with demand gets nothing however often it syncs, though no request
of the key runs anywhere.
"""

from __future__ import annotations

import trio

from bench.harness.redis import redis_process
from tailguard.router.config import ClusterConfig
from tailguard.router.quotas import AdmissionLedger, Demand
from tailguard.server.redis_ledger import RedisLedger

CAP = 4  # key:trial max_concurrency


def replica(name: str, ledger: RedisLedger, state: dict[str, int]) -> AdmissionLedger:
    config = ClusterConfig(redis_url="", replica_id=name, lease_ttl=2.0, static_share=0.25, block=2)
    # as Upkeep._cluster_demands (router/upkeep.py) builds a key's demand: seats held, no waiting count, no priority
    return AdmissionLedger(config, ledger, lambda: [Demand("key:trial", CAP, state["held"], apply=lambda s: state.__setitem__("grant", s))])


async def main() -> None:
    async with redis_process() as redis:
        async with RedisLedger(redis.url, "repro") as ledger:
            states = {n: {"held": 0, "grant": 0} for n in "abcd"}
            budgets = {n: replica(n, ledger, states[n]) for n in "abcd"}
            for _ in range(20):  # 20 sync rounds; c and d are the ones whose callers come now
                for n in "abcd":
                    await budgets[n].sync_once()
            print({n: s["grant"] for n, s in states.items()}, "ledger:", await ledger.grants("key:trial"))
            print("in flight of key:trial anywhere: 0; c and d answer every request of the key with 429")


if __name__ == "__main__":
    trio.run(main)
