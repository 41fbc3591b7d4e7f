"""A replica's side of SharedBudget for one endpoint's cap, without a router; shared by the repro scripts.

The seats it runs and wants are set by hand; what the ledger grants it lands in ``granted``.
"""

from __future__ import annotations

from tailguard.router.cluster import Demand, SharedBudget
from tailguard.router.config_types import ClusterConfig
from tailguard.server.redis_ledger import RedisLedger


class Replica:
    def __init__(self, name: str, ledger: RedisLedger, *, cap: int, lease_ttl: float, static_share: float) -> None:
        self.in_use = self.waiting = self.granted = 0
        config = ClusterConfig(redis_url="", replica_id=name, lease_ttl=lease_ttl, static_share=static_share, block=0)
        self.budget = SharedBudget(config, ledger, lambda: [Demand("endpoint:e", cap, self.in_use, self.waiting, apply=self._apply)])

    def _apply(self, seats: int) -> None:
        self.granted = seats
