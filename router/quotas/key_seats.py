"""An API key's seats across the replicas: this replica's grant of the key's cap, and who waits for more."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from ..errors import CallerOverLimit, QueueFull, QueueTimeout
from ..queueing import WaitQueue
from .ledger_terms import IDLE_AFTER, NO_WAITER, Arrivals, Demand, Yielding

if TYPE_CHECKING:
    from .ledger import AdmissionLedger  # which holds the keys' seats


class KeySeats:
    """This replica's seats of one API key's cap, under ``[cluster]``: in use, granted, waited for.

    A request takes a seat of the replica's grant at once, no round trip. When
    the grant is used up it waits in line (class priority, then arrival) for
    a sync to grant another, until its queue deadline; its waiting count and
    priority go into the key's demand, so the ledger is asked for what it
    needs and idle replicas give their spare seats of the key back. It is
    refused (``CallerOverLimit``) at once when the key's cap is full here
    alone; when it is full across the replicas -- as a single process
    refuses at its cap -- as the first sync begun after it came finds it
    (one round trip: the others' seats as of their own last syncs, at most
    ``sync_interval`` old, a tenth of it while any request waits anywhere);
    or when its deadline passes. Waiting longer for fresher news serves a
    few requests a single process would refuse, late: measured, it cost
    more at P99 than it gave (bench/results/cluster/after-findings-3-4.md).
    """

    def __init__(self, budget: AdmissionLedger, name: str, cap: int) -> None:
        self.name = name
        self.resource = f"key:{name}"
        self.cap = cap
        self.in_use = 0
        self.granted = 0
        self._budget = budget
        self._yielding: Yielding | None = None  # a request of the key waits on another replica (the last sync)
        # A waiter's ticket: when it came ("full" counts only from a sync begun after it).
        self._queue: WaitQueue[bool, float] = WaitQueue(self._grant, max_waiting=1 << 30)
        self._arrivals = Arrivals()
        self._last = -math.inf  # when a request of the key last came or ended here (trio time)

    def demands(self) -> list[Demand]:
        """The key's seats as the ledger hears of them; idle ``IDLE_AFTER`` here, none kept spare (its grant goes back)."""
        first = self._arrivals.first()
        priority, oldest = (NO_WAITER, math.inf) if first is None else first
        idle = self._idle() and trio.current_time() >= self._last + IDLE_AFTER
        return [
            Demand(self.resource, self.cap, self.in_use, self._queue.waiting, priority, self._apply, self._yield, oldest,
                   block=0 if idle else None, sparse=True)
        ]

    def due(self) -> float:
        """Idle seats go back ``IDLE_AFTER`` after the key's last request here."""
        return self._last + IDLE_AFTER if self._idle() else math.inf

    def _idle(self) -> bool:
        return self.in_use == 0 and self._queue.waiting == 0

    def forgettable(self) -> bool:
        """Nothing of the key runs or waits here and this replica holds no seat of it."""
        return self._idle() and self.granted == 0

    def _stir(self) -> None:
        self._last = trio.current_time()
        self._budget.stir(self)

    async def take(self, priority: int, deadline: float, retry_after: float) -> None:
        """Take one seat of the key, waiting for the ledger until ``deadline`` if this replica has none free.

        Raises:
          CallerOverLimit: the cap is full (here, or across replicas at a sync
            after this request came), the ledger is unreachable (fallback:
            no sync will grant more), or ``deadline`` passed.
        """
        if self.in_use + self._queue.waiting >= self.cap:
            raise self._over(f"already has {self.in_use + self._queue.waiting} requests in flight here, its cap", retry_after)
        if self.in_use >= min(self.cap, self.granted):
            self._budget.wake()  # ask the ledger now, not at the next tick
        came = trio.current_time()
        token = self._arrivals.add(priority, came)
        self._stir()
        try:
            seated = await self._queue.get(priority, deadline, came, retry_after=retry_after)
        except (QueueTimeout, QueueFull):
            raise self._over("got no seat of its cap from the other replicas before its queue deadline", retry_after) from None
        finally:
            self._arrivals.discard(token)
            self._stir()
        if not seated:
            if self._budget.mode != "ledger":
                raise self._over("has used this replica's share of its cap (the shared ledger is unreachable)", retry_after)
            raise self._over(f"already has {self.cap} requests in flight across the replicas, its cap", retry_after)

    def release(self) -> None:
        """A request of the key ended: its seat goes to the next waiter here, unless one elsewhere comes first.

        Then (``Yielding``: more urgent, or as urgent and older) the grant
        falls to the seats in use and the ledger hears of it at once, so the
        other replica's request gets the seat.
        """
        self.in_use -= 1
        self._stir()
        way = self._yielding
        if way is not None and self.in_use < self.granted:
            first = self._arrivals.first()
            if first is None or not way.before(*first):
                self.granted = self.in_use
                way.give_back(self.in_use)
        self._queue.dispatch()

    def _grant(self, came: float) -> bool | None:
        """True: a seat, taken; False: refused (cap full); None: wait for the next sync."""
        if self.in_use < min(self.cap, self.granted):
            self.in_use += 1
            return True
        budget = self._budget
        if budget.mode != "ledger":
            return False
        if budget.synced_from > came and budget.in_use_elsewhere(self.resource) + self.in_use >= self.cap:
            return False
        return None

    def _apply(self, seats: int) -> None:
        self.granted = seats
        self._queue.dispatch()

    def _yield(self, way: Yielding | None) -> None:
        self._yielding = way

    def _over(self, why: str, retry_after: float) -> CallerOverLimit:
        return CallerOverLimit(f"the caller {self.name!r} {why}; retry after {retry_after:g} s", retry_after=retry_after)
