"""Repro: after the ledger fails, once lease_ttl has passed every replica moves to its static share
whatever the others still have running: seats in use above a static share are counted twice."""
from __future__ import annotations
import sys
import trio
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
from tailguard.router.cluster import Demand, SharedBudget
from tailguard.router.config_types import ClusterConfig
from tailguard.server.redis_ledger import RedisLedger
from tests.redis_helpers import RedisServer

CAP, TTL = 4, 0.5

class Replica:
    def __init__(self, name: str, ledger: RedisLedger) -> None:
        self.in_use = self.waiting = self.granted = 0
        config = ClusterConfig(redis_url="", replica_id=name, lease_ttl=TTL, static_share=0.5, block=0)
        self.budget = SharedBudget(config, ledger, lambda: [Demand("endpoint:e", CAP, self.in_use, self.waiting, apply=self._apply)])
    def _apply(self, seats: int) -> None:
        self.granted = seats

async def main() -> None:
    redis = RedisServer(); redis.start()
    async with RedisLedger(redis.url, "repro", timeout=0.2) as ledger:
        a, b = Replica("a", ledger), Replica("b", ledger)
        a.waiting = 3; await a.budget.sync_once(); a.in_use, a.waiting = 3, 0   # a runs 3 long requests
        b.waiting = 1; await b.budget.sync_once(); b.in_use, b.waiting = 1, 0   # b runs 1
        print(f"ledger mode: a granted {a.granted} (in use {a.in_use}), b granted {b.granted} (in use {b.in_use}); cap {CAP}")
        redis.stop()
        b.in_use = 0                                                          # b's request ends; a's long ones go on
        for r in (a, b): await r.budget.sync_once()
        print(f"at once:     a may use {a.granted}, b may use {b.granted}")
        await trio.sleep(TTL + 0.05)
        for r in (a, b): await r.budget.sync_once()
        print(f"after TTL:   a may use {a.granted} (still runs {a.in_use}), b may use {b.granted} -> "
              f"in use at most {a.in_use + b.granted} > cap {CAP}" if a.in_use + b.granted > CAP else "no overlap")

trio.run(main)
