"""A replica's side of AdmissionLedger for one endpoint's cap, without a router; shared by the repro scripts.

The seats it runs and wants are set by hand; what the ledger grants it lands in ``granted``.
"""

from __future__ import annotations

from tailguard.router.config import ClusterConfig
from tailguard.router.quotas import AdmissionLedger, Demand
from tailguard.server.redis_ledger import RedisLedger


class Replica:
    def __init__(self, name: str, ledger: RedisLedger, *, cap: int, lease_ttl: float, static_share: float) -> None:
        self.in_use = self.waiting = self.granted = 0
        config = ClusterConfig(redis_url="", replica_id=name, lease_ttl=lease_ttl, static_share=static_share, block=0)
        self.budget = AdmissionLedger(config, ledger, lambda: [Demand("endpoint:e", cap, self.in_use, self.waiting, apply=self._apply)])

    def _apply(self, seats: int) -> None:
        self.granted = seats
