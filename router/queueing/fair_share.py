"""Fair shares of a queue's seats between tenants: start-time fair queuing over tokens.

First come, first served across callers lets one tenant's burst push every
other tenant's requests to the back of the line. Within one priority the
queue orders waiters instead by a *start tag* (Goyal et al., "Start-time
Fair Queuing", SIGCOMM '96), counted in tokens as the virtual token counter
of Sheng et al. ("Fairness in Serving Large Language Models", OSDI '24)
does, because a request is no unit of GPU work:

- each tenant has a finish tag ``F``, the tokens it has been served or is
  waiting for, over its ``weight``; the clock ``V`` is the largest start
  tag granted;
- a request starts at ``S = max(V, F)`` and moves ``F`` on by what it may
  cost, its prompt and its max_tokens, over the weight; when it ends, the
  max_tokens it did not generate are handed back (:meth:`FairClock.settle`).
  Reserved at arrival, a tenant's running requests count against it while
  they run, so a tenant holding most seats waits behind one holding few,
  as budgets reserve (router/quotas/budgets.py). One that gets no seat (refused, timed out,
  gone) hands its charge back (:meth:`FairClock.withdraw`), so clients that
  give up do not leave their tenant in debt for work never done; a new
  request still starts no earlier than its tenant's newest waiter (the
  queue passes that as ``after``), so one tenant's own requests keep their
  arrival order;
- ``max(V, F)``: a tenant idle for a while starts at the clock, not with
  credit banked while it was away, so the scheme is work-conserving and an
  idle tenant's share goes to whoever waits, without a later burst of its
  own starving anyone.

A single tenant, or callers without a share, get the arrival order they had.

Replicas (``[cluster]``) each order their own queue; every second they
trade what each tenant was served (router/queueing/fair_share_sync.py), and each adds what
the others served a tenant to that tenant's finish tag here
(:meth:`FairClock.absorb`), so a tenant served heavily on one replica waits
its turn on the others too, at most a second's service behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["NO_SHARE", "FairClock", "FairStatistics", "Share"]


@dataclass(frozen=True)
class Share:
    """Who a request is for and what it may cost: its tenant, the tenant's weight, its prompt and max_tokens."""

    tenant: str
    weight: float = 1.0
    tokens: int = 0


NO_SHARE = Share("")


@dataclass(frozen=True)
class FairStatistics:
    """A queue's fair clock: where it stands, and how many tenants it keeps a finish tag or a served total of."""

    virtual: float
    tagged: int
    served: int


class FairClock:
    """The tags of one queue: a finish tag per tenant that has one above the clock, and the clock."""

    __slots__ = ("_finish", "_forget_at", "changed", "served", "virtual")

    def __init__(self) -> None:
        self.virtual = 0.0  # V: the largest start tag granted a seat
        self._finish: dict[str, float] = {}
        # Each tenant's tokens served here, over its weight, since this process began (what replicas trade).
        self.served: dict[str, float] = {}
        self.changed: set[str] = set()  # tenants whose ``served`` moved since the last trade (router/queueing/fair_share_sync.py)
        self._forget_at = 64  # prune tenants at or below the clock once this many are kept

    def start(self, share: Share, after: float = 0.0) -> float:
        """The start tag of a request for ``share`` arriving now, no earlier than ``after``; what it may cost is charged."""
        tag = max(self.virtual, self._finish.get(share.tenant, 0.0), after)
        self._finish[share.tenant] = tag + share.tokens / share.weight
        if len(self._finish) >= self._forget_at:
            self._forget()
        return tag

    def granted(self, tag: float, share: Share) -> None:
        """A request with this start tag got its seat: the clock moves to it, and its tenant was served its charge."""
        if tag > self.virtual:
            self.virtual = tag
        if share.tenant:
            self.served[share.tenant] = self.served.get(share.tenant, 0.0) + share.tokens / share.weight
            self.changed.add(share.tenant)

    def withdraw(self, share: Share) -> None:
        """A request that got no seat (refused, timed out, displaced, gone) hands back its charge."""
        if share.tenant in self._finish:
            self._finish[share.tenant] -= share.tokens / share.weight

    def settle(self, share: Share, generated: int, reserved: int) -> None:
        """A seated request ended having generated ``generated`` of the ``reserved`` max_tokens it was charged for."""
        if not share.tenant:  # no share (first come, first served): nothing to count
            return
        delta = (generated - reserved) / share.weight
        self.served[share.tenant] = self.served.get(share.tenant, 0.0) + delta
        self.changed.add(share.tenant)
        if share.tenant in self._finish:
            self._finish[share.tenant] += delta

    def absorb(self, tenant: str, served_elsewhere: float) -> None:
        """Another replica served ``tenant`` this much (over its weight) since the last trade: it starts later here too."""
        if served_elsewhere > 0:
            self._finish[tenant] = max(self.virtual, self._finish.get(tenant, 0.0)) + served_elsewhere

    def finish(self, tenant: str) -> float:
        """The tenant's finish tag, or the clock when it has none above it (for tests and metrics)."""
        return max(self.virtual, self._finish.get(tenant, 0.0))

    def forget(self, keep: Callable[[str], bool], *, idle: bool) -> None:
        """Drop what orders nothing any more: the tags and served totals of tenants ``keep`` refuses
        (keys a reload removed), and, when the queue is ``idle`` (no waiter and no seat held), every tag.

        Idle, a busy period is over: as start-time fair queuing does at the
        end of one, the clock moves to the largest finish tag, so every
        tenant starts the next level with the others (what they were charged
        was served, and nothing runs that a settle could still hand back).
        """
        if idle and self._finish:
            self.virtual = max(self.virtual, *self._finish.values())
            self._finish = {}
            self._forget_at = 64
        elif self._finish:
            self._finish = {tenant: tag for tenant, tag in self._finish.items() if tag > self.virtual and keep(tenant)}
            self._forget_at = max(64, 2 * len(self._finish))
        for tenant in [tenant for tenant in self.served if not keep(tenant)]:
            del self.served[tenant]

    def statistics(self) -> FairStatistics:
        return FairStatistics(self.virtual, len(self._finish), len(self.served))

    def _forget(self) -> None:
        """Drop tenants at or below the clock (they start there anyway), keeping the table as small as who is ahead of it."""
        self._finish = {tenant: tag for tenant, tag in self._finish.items() if tag > self.virtual}
        self._forget_at = max(64, 2 * len(self._finish))
