"""What a replica and the admission ledger's store say to each other, and what a replica knows of its waiters.

The store (Redis in production, ``server/redis_ledger.py``) takes a ``Want``
per resource and answers a ``Synced``; ``Demand`` is a resource as the router
sees it between syncs, ``Yielding`` who waits for it on another replica. Apart
from :mod:`ledger` (the replica's side, which keeps its grants in step) so that
both sides, and the budgets that ride on the same syncs, read one vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

NO_WAITER = 1 << 30  # the "best priority waiting" of a resource nobody waits for
IDLE_AFTER = 60.0  # seconds: an API key's seats unused this long here go back to the ledger (router/quotas/ledger_roster.py)


@dataclass(frozen=True)
class Want:
    """What this replica asks of one resource at a sync."""

    resource: str
    cap: int  # the cluster-wide cap
    target: int  # seats it wants recorded as its own
    best_waiting: int = NO_WAITER  # the most urgent class priority waiting for it here
    in_use: int = 0  # seats in use here (recorded, so others can tell a full cap from idle blocks)
    # Seats kept even when more urgent work waits elsewhere: as many as this replica may be using
    # when the answer comes back (its grant while the sync is under way); None: ``in_use``.
    keep: int | None = None
    # When the oldest request waiting here at ``best_waiting`` came (wall-clock seconds: replicas compare them).
    since: float = 0.0
    # Seconds: as urgent a request elsewhere comes first only if it came earlier by more (clock skew, news age).
    tolerance: float = 0.0
    # Seconds the grant outlives this replica: what it admitted still counts that long after its lease
    # lapses (a budget over a sliding window: its last minute). 0: a dead replica's grant returns at once.
    hold: float = 0.0
    # When the oldest use still counted here began (wall-clock seconds; 0: none): a window's age, so the
    # others can tell when it will have room again (router/quotas/budget_grants.py).
    used_since: float = 0.0
    # Of the cap no replica holds, the part recorded as this replica's *reserve*, beyond its grant: what
    # it may use too should Redis go away (a budget, so a tenant well under it is not held to its last
    # grant through an outage). None while a request waits for the resource on another replica.
    share: float = 0.0
    # The reserve this replica may use until it hears this sync's answer (the last answer's): the
    # ledger keeps grant and reserve together at least at ``keep`` plus this.
    reserve_keep: int = 0
    # One of an API key's resources, sent only when it changed or is wanted (router/quotas/ledger_roster.py):
    # when a request of this replica waits for it unserved, the ledger pokes the others that hold some.
    sparse: bool = False


@dataclass(frozen=True)
class SyncTerms:
    """How the ledger is to take one sync."""

    epoch: str = ""  # the ledger memory this replica's grants are in ("": none yet); another one refuses the sync
    deadline: float = 0.0  # wall-clock seconds after which Redis must not run it (the replica gave up); 0: none
    probe: bool = False  # record nothing, grant nothing: does the ledger answer? (while this replica is in fallback)


NO_TERMS = SyncTerms()  # a sync with no epoch yet, no deadline


@dataclass(frozen=True)
class Synced:
    """The ledger's answer to a sync."""

    grants: list[int]  # per want, in order
    contended: bool  # a request waits on another replica: sync again soon, seats may be wanted back
    elsewhere: list[int] = field(default_factory=list)  # per want: seats in use on the other live replicas
    # Per want: a more urgent request waits on another replica; the next sync gives back what is not in use.
    yielding: list[bool] = field(default_factory=list)
    # Per want: the most urgent class priority waiting for it on the other live replicas (NO_WAITER: none).
    urgent: list[int] = field(default_factory=list)
    # Per want: when the oldest of those most urgent requests came (wall-clock seconds).
    urgent_since: list[float] = field(default_factory=list)
    # Per want: the oldest ``used_since`` on the other live replicas (wall-clock seconds; 0: none said).
    elsewhere_since: list[float] = field(default_factory=list)
    reserves: list[int] = field(default_factory=list)  # per want: its reserve (``Want.share``) beyond the grant
    # "ok"; "epoch": the ledger is not the memory ``SyncTerms.epoch`` names (Redis restarted empty or was
    # flushed): nothing was recorded or granted; "probe": it answers (``SyncTerms.probe``).
    status: str = "ok"
    epoch: str = ""  # the ledger's memory: made anew by the first sync that finds none
    now: float = 0.0  # the ledger's clock (wall-clock seconds)
    resumed: float = 0.0  # when it last answered after nobody synced for half a lease, or after losing its memory
    paused: float = 0.0  # the last sync before that pause (0: none, a new memory)
    members: dict[str, float] = field(default_factory=dict)  # replica -> when it last synced (wall-clock seconds)
    poked: list[str] = field(default_factory=list)  # sparse resources held here that a request waits for elsewhere


class LedgerStore(Protocol):
    """The shared ledger (Redis in production, ``server.redis_ledger``)."""

    async def sync(
        self, replica: str, lease_ttl: float, wants: Sequence[Want], incarnation: str = "", *, terms: SyncTerms = NO_TERMS
    ) -> Synced:
        """Renew the replica's lease and record its grants; returns them, per want in order.

        ``incarnation`` tells this process from an earlier one under the same
        replica id (a restarted container): what the earlier one holds
        (``Want.hold``) is not taken for the new one's.
        """
        ...


@dataclass(frozen=True)
class Yielding:
    """A request waits for a resource on another replica, as the last sync found: a seat freed here may be its.

    A seat of the resource that frees up here goes to a request here only if
    it comes first: a lower class priority than ``priority``, or the same and
    arrived (this process's ``trio.current_time()``) by ``since`` -- the
    other's arrival, plus a tolerance for clock skew; otherwise the
    router lowers its grant to the seats still in use and calls
    ``give_back(seats)``: the budget records the lower grant and syncs at
    once, so the ledger can grant the seat to the other replica at its next
    sync (a tenth of ``sync_interval`` while a request waits anywhere).
    """

    priority: int
    give_back: Callable[[int], None] = field(repr=False)
    since: float = math.inf  # inf: the same priority here always comes first

    def before(self, priority: int, arrived: float) -> bool:
        """A request here at ``priority`` that arrived at ``arrived`` comes before the one elsewhere."""
        return (priority, arrived) <= (self.priority, self.since)


class Arrivals:
    """The requests waiting here, by (class priority, arrival): who is first, to compare with the other replicas.

    A wait queue orders its own waiters; this says when the first of them
    came, which the ledger compares across replicas (``Want.since``).
    """

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[int, float]] = {}
        self._next = 0

    def add(self, priority: int, arrived: float) -> int:
        """A request starts waiting; returns the token ``discard`` takes when it stops."""
        self._next += 1
        self._waiting[self._next] = (priority, arrived)
        return self._next

    def discard(self, token: int) -> None:
        self._waiting.pop(token, None)

    def first(self) -> tuple[int, float] | None:
        """(priority, arrival) of the most urgent request waiting here, the oldest of its priority; None: nobody."""
        return min(self._waiting.values()) if self._waiting else None


@dataclass
class Demand:
    """One resource as the router sees it now."""

    resource: str
    cap: int
    in_use: int
    waiting: int = 0
    best_waiting: int = NO_WAITER
    apply: Callable[[int], None] = field(default=lambda granted: None, repr=False)  # gives the router the grant
    # Tells the router, after each sync, who waits for it elsewhere (None: nobody, or Redis is away).
    yielding: Callable[[Yielding | None], None] = field(default=lambda way: None, repr=False)
    oldest: float = math.inf  # when the oldest request waiting at ``best_waiting`` came (trio.current_time())
    hold: float = 0.0  # ``Want.hold``: how long what was admitted under the grant still counts after a lease lapses
    block: int | None = None  # spare beyond demand, in the resource's units; None: ``cluster.block``
    used_since: float = math.inf  # ``Want.used_since``, on trio.current_time(); inf: none
    share: float = 0.0  # ``Want.share``
    sparse: bool = False  # ``Want.sparse``: an API key's resource, synced only when it changed or is wanted


@dataclass
class ClusterStatus:
    mode: str  # "ledger", "fallback" or "starting"
    replica: str
    grants: dict[str, int]
    syncs: int
    failures: int
    fallback_since: float | None
