"""Which API keys' resources go into the next ledger sync: those that changed or are wanted, never every key ever seen.

Pools and endpoints are few and go into every sync. An API key's seats and
budgets (``key:NAME``, ``tokens:NAME``, ``requests:NAME``) are as many as the
keys that ever sent a request; sending each of them ten times a second
made every sync grow with keys long gone quiet (issue 32: 5,000 idle keys,
a second per sync on two cores, the ledger declared away). So a key's
resources (a :class:`Sparse`: its budgets, or its seats) are sent only

- when something about them changed here (a request came, was admitted,
  ended or settled: the key *stirs* itself), or when their demand changes
  by itself (``due``: a budget's oldest admission leaves its window, idle
  seats go back);
- while it waits here, waits elsewhere, or is being given back to another
  replica (the last answer said so: ``keep``);
- when the ledger *pokes* it: a request of the key waits on another replica
  and this one holds a grant of it;
- all at once when the ledger must hear everything again (the first sync,
  the first after an outage, an emptied Redis).

Between those, the ledger keeps the key's grant as last recorded: a grant
is valid while its replica's lease lives, and the lease is renewed by every
sync, sparse or not. A key whose windows are empty and that holds no grant
beyond its use sends one last want of nothing (its grant and reserve go
back; the ledger deletes its entries) and then costs nothing until its next
request stirs it again.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from itertools import count
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .ledger_terms import Demand

__all__ = ["DUE_PER_SYNC", "Roster", "Sparse"]

DUE_PER_SYNC = 256  # keys a sync carries because their demand changed by itself (a window emptied), at most


class Sparse(Protocol):
    """One API key's resources of the ledger, sent only when they changed or are wanted."""

    def demands(self) -> list[Demand]:
        """The key's resources as this replica uses them now."""
        ...

    def due(self) -> float:
        """When (``trio.current_time()``) its demand changes by itself, unasked; ``math.inf``: never."""
        ...


class Roster:
    """The keys with resources in the ledger, and those the next sync must carry."""

    def __init__(self) -> None:
        self._stirred: dict[Sparse, None] = {}  # to send at the next sync (insertion order: who stirred first)
        self._held: dict[Sparse, tuple[str, ...]] = {}  # keys with entries in the ledger -> their resources
        self._by_resource: dict[str, Sparse] = {}
        self._timers: list[tuple[float, int, Sparse]] = []  # (due, tie-break, key); lazily deleted
        self._due: dict[Sparse, float] = {}
        self._order = count()

    def stir(self, key: Sparse) -> None:
        """Something about ``key`` changed here: the next sync carries it."""
        self._stirred[key] = None

    def poked(self, resources: Iterable[str]) -> bool:
        """The ledger asks for these resources (a request waits for them elsewhere); True when one is held here."""
        found = False
        for resource in resources:
            key = self._by_resource.get(resource)
            if key is not None:
                self._stirred[key] = None
                found = True
        return found

    def take(self, now: float, *, everything: bool = False) -> list[Sparse]:
        """The keys the sync begun now carries: those stirred or due, or (``everything``) every key held too.

        At most ``DUE_PER_SYNC`` of those only due: thousands of keys sent
        once at the same time go quiet at the same time, and a window that
        empties a sync or two late costs nothing but that.
        """
        timers = self._timers
        due = 0
        while timers and timers[0][0] <= now and due < DUE_PER_SYNC:
            when, _, key = heapq.heappop(timers)
            if self._due.get(key) == when:
                del self._due[key]
                self._stirred[key] = None
                due += 1
        if everything:
            for key in self._held:
                self._stirred[key] = None
        batch = list(self._stirred)
        self._stirred.clear()
        return batch

    def sent(self, key: Sparse, resources: tuple[str, ...], *, again: bool, gone: bool) -> None:
        """The ledger answered for ``key``: ``again`` -- carry it next time too; ``gone`` -- it holds nothing there now."""
        if gone:
            self._forget(key)
            return
        self._held[key] = resources
        for resource in resources:
            self._by_resource[resource] = key
        if again:
            self._stirred[key] = None
        when = key.due()
        if math.isfinite(when) and self._due.get(key) != when:
            self._due[key] = when
            heapq.heappush(self._timers, (when, next(self._order), key))

    def unsent(self, keys: Iterable[Sparse]) -> None:
        """A sync that carried ``keys`` failed: they count as held (a fallback share applies) and go with the next full sync."""
        for key in keys:
            if key not in self._held:
                resources = tuple(demand.resource for demand in key.demands())
                self._held[key] = resources
                for resource in resources:
                    self._by_resource[resource] = key

    def knows(self, key: Sparse) -> bool:
        """``key`` has entries in the ledger, or goes (or may go) with a sync still: its object must stay the key's one."""
        return key in self._held or key in self._stirred or key in self._due

    def held(self) -> list[Sparse]:
        """Every key with resources in the ledger (or that failed to reach it)."""
        return list(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def _forget(self, key: Sparse) -> None:
        for resource in self._held.pop(key, ()):
            if self._by_resource.get(resource) is key:
                del self._by_resource[resource]
        self._due.pop(key, None)
