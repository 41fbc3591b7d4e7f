"""When a replica may grow its grants again after the ledger was away or lost its memory.

While Redis is away every replica runs on its fallback caps, which the
ledger does not count. When it answers again, a replica that grew at once
could take seats another replica still uses on its fallback cap; so each
claims no more than its own fallback cap until every replica that was
alive before has synced since Redis came back (each then has its grants
recorded, and is held to them). The ledger says who synced when
(``Synced.members``) and when it came back (``Synced.resumed``: the first
sync after nobody synced for half a lease, or after it lost its memory).
A replica that never comes back (killed meanwhile) is waited for no longer
than ``2 x lease_ttl``; that was the only rule before, and why quiet
tenants waited the whole queue deadline for grants after every outage.

A Redis restarted with empty memory (or flushed) answers with a new
*epoch*: every grant this replica holds is gone from it though it still
uses them. The ledger refuses the sync (``Synced.status == "epoch"``)
before granting anything; the replica then sends every resource again,
held to what it may use now, under the same rule as after an outage.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .ledger_terms import Synced

__all__ = ["Recovery"]


class Recovery:
    """The ledger's epoch as last seen, the replicas alive before a fault, and how long grants stay held."""

    def __init__(self, replica: str, lease_ttl: float, sync_interval: float) -> None:
        self._replica = replica
        self._lease_ttl = lease_ttl
        # A replica that began syncing just after this one's last answer is known to none of its answers:
        # after a lost memory (where the ledger cannot say who was alive) grants stay held this long at least,
        # its next sync's worth (each replica syncs every interval, and claims everything again at once).
        self._least = 2 * sync_interval
        self.epoch = ""  # the ledger memory this replica's grants are recorded in ("": none yet)
        self._peers: frozenset[str] = frozenset()  # the other replicas alive at the last answer before a fault
        self._since = -math.inf  # when (trio time) the ledger answered again; -inf: not recovering
        self._waiting_for: frozenset[str] = frozenset()
        self._lost = False  # the ledger lost its memory: it cannot say who was alive before
        self._last_seen = 0.0  # the ledger's clock at this replica's last answer before a fault

    def recovering(self, now: float) -> bool:
        """Grants stay at the fallback caps: some replica alive before may still run on its own."""
        return now - self._since < 2 * self._lease_ttl

    def left(self, now: float) -> float:
        """Seconds until grants may grow whoever has not come back (0 when not recovering)."""
        return max(0.0, self._since + 2 * self._lease_ttl - now) if self.recovering(now) else 0.0

    def began(self, now: float, *, lost: bool = False) -> None:
        """The ledger answers again (after an outage, or, ``lost``, with a new memory): hold grants until the others are back."""
        self._since = now
        self._waiting_for = self._peers
        self._lost = lost

    def answered(self, synced: Synced, now: float) -> bool:
        """A sync answered in this epoch; True when this answer ends the recovery (grow now: sync again at once)."""
        self.epoch = synced.epoch or self.epoch
        members = synced.members
        if self.recovering(now):
            # Alive before: known here, or (when the ledger paused while this replica was away, and kept its
            # memory) synced within a lease before that pause.
            paused = synced.paused if synced.resumed > self._last_seen else 0.0
            before = {name for name, last in members.items() if paused and last >= paused - self._lease_ttl}
            self._waiting_for = (self._waiting_for | before) - {self._replica}
            back = {name for name, last in members.items() if last >= synced.resumed}
            if self._waiting_for - back or (self._lost and now - self._since < self._least):
                return False
            self._since = -math.inf
            return True
        self._last_seen = synced.now
        alive_after = synced.now - self._lease_ttl
        self._peers = frozenset(name for name, last in members.items() if name != self._replica and last >= alive_after)
        return False

    def waiting_for(self) -> frozenset[str]:
        """The replicas alive before the fault that have not synced since (for the log and tests)."""
        return self._waiting_for
