"""One admission budget shared by every replica: caps stay strict however many run.

Each capped resource (a pool, an endpoint, an API key) has one cap for the
whole cluster. A replica admits requests only within its *grant*: the seats
of that cap the shared ledger has recorded as its own. The ledger (a store:
``server.redis_ledger`` on Redis) keeps, per resource, every replica's grant,
and a replica's grants count only while its lease lives (it renews it on
every sync); a replica that dies (kill -9) stops renewing, and its seats
return to the others within ``lease_ttl``.

Round trips stay off the request path: admission is local, against the
grant. A background sync (every ``sync_interval`` s, and at once when a
request finds its grant used up) asks the ledger for what the replica needs:
the seats in use, the requests waiting, and a small ``block`` of spare seats
so a burst does not wait for a round trip. A grant grows only once the ledger
has recorded it, and shrinks locally before the ledger hears of it, so the
sum of what replicas may use never exceeds a cap. While a request waits here
for seats the last sync did not grant, the replica syncs ten times as often.

An API key's cap (``KeySeats``): a request whose key has no seat left in
this replica's grant waits, in class priority order and until its queue
deadline, for a sync to grant one -- its waiting count and priority are in
the key's demand -- rather than being refused while the cap has room on
other replicas. It is refused (429) when the key's cap is full across the
replicas: the ledger records the seats each replica uses, not only its grant.

Priority across replicas: with a sync each replica publishes the best
(lowest) class priority waiting for each pool, each of its endpoints and
each API key, and hears the best waiting on the others (``Yielding``).
While another live replica has a more urgent request waiting, the ledger
lets a replica keep only the seats it uses, and a seat that frees up on it
goes to a request of its own only if that one is as urgent as the one
elsewhere; otherwise the replica lowers its grant at once and syncs, and
the short request on replica A gets the seat before the long ones queued
on replica B. While any request waits on another replica, every replica
syncs ten times as often, so the seat changes hands within a few
milliseconds, and the yielding ends at the first sync after the request
elsewhere is served. Between equally urgent waiters the oldest goes
first, across replicas too: each demand carries when its oldest most urgent
waiter came (wall clock, so replicas can compare), and a replica whose
oldest waiter came later than one elsewhere (by more than half a
``sync_interval``, for clock skew and the age of the news) yields to it as
to a more urgent one. An idle replica
waits for nothing, so any waiter elsewhere is more urgent: it gives back
the spare ``block`` seats it holds of that resource, and a replica with a
long queue may grow past its block up to what the others use.

Pools and endpoints go into every sync; an API key's seats and budgets
only while they change or are wanted (router/quotas/ledger_roster.py), so a sync
costs what is in use, not every key ever seen.

Redis unreachable or slow (a sync fails or takes over half the TTL): the
replica falls back at once to ``min(grant, static share)`` of each cap (a
budget: its grant and its reserve, ``Want.share``), and once every request
admitted before the outage has ended (the end-to-end deadline, at least the
lease) to its static share: ``static_share`` of the cap, the shares of all
replicas adding up to at most 1, so the caps hold in total. It is
*degraded*, not down; its syncs only ask whether the ledger answers, and the
first that does is followed at once by one carrying everything. Then it
claims no more than its fallback cap until every replica alive before has
synced since (at most ``2 x lease_ttl``: router/quotas/ledger_recovery.py), and only
then grows as usual: no seat is counted twice. A ledger that lost its memory
(a new epoch) refuses the sync; the replica claims again all it uses, under
the same rule. A replica cut off from Redis while the others still reach it
is the case this cannot make strict: after the TTL the others take back its
grant while it still serves its static share (documented in docs/replicas.md).
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import trio

from ..config import ClusterConfig
from ..errors import CallerOverLimit, QueueFull, QueueTimeout
from ..queueing import WaitQueue
from .ledger_recovery import Recovery
from .ledger_roster import Roster, Sparse

log = logging.getLogger("tailguard.cluster")

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


class AdmissionLedger:
    """This replica's grants, kept in step with the ledger by ``run``."""

    def __init__(
        self, config: ClusterConfig, store: LedgerStore, demands: Callable[[], list[Demand]], *, settle_after: float = 0.0
    ) -> None:
        self.config = config
        # In fallback, the static share is safe only once every request admitted under a larger grant,
        # here or on another replica, has ended: the end-to-end deadline (and at least the lease).
        self._settle_after = max(config.lease_ttl, settle_after)
        self.replica = config.replica()
        self.incarnation = secrets.token_hex(4)  # this process, should a restarted one take the same replica id
        self._store = store
        self._demands = demands  # pools and endpoints: every sync carries them
        self._roster = Roster()  # API keys' seats and budgets: only those that changed or are wanted
        self._recovery = Recovery(self.replica, config.lease_ttl, config.sync_interval)
        self._full = True  # the next sync carries every key's resources (the first; after an outage or a lost memory)
        self._grants: dict[str, int] = {}
        self._reserves: dict[str, int] = {}  # per resource: its reserve beyond the grant, at the last answer (Want.share)
        self._bases: dict[str, int] = {}  # in fallback, per resource: grant and reserve when the ledger went away
        self._settles: set[float] = set()  # in fallback: the times away at which some resource's static share applies
        self._away = 0.0  # in fallback: how long the ledger had been away at the last failed sync
        self.mode = "starting"
        self._fallback_since: float | None = None
        self._forgot = False  # in fallback: the ledger answered from a new memory (said when it is back)
        self.syncs = 0
        self.failures = 0
        self._failures_before = 0  # failures before the current outage began
        self._wanted = trio.Event()
        self._contended = False
        self._short = False  # a request waits here for seats the last sync did not grant
        self.synced_from = -math.inf  # when the last sync that the ledger answered began
        self._elsewhere: dict[str, int] = {}  # per resource: seats in use on the other replicas, at the last sync
        self._elsewhere_since: dict[str, float] = {}  # per resource: since when the oldest of those is in use (trio time)
        self._yielding: set[str] = set()  # resources a more urgent request waits for elsewhere, at the last sync
        self._given_back: set[str] = set()  # resources whose grant a freed seat lowered since this sync began
        self._keys: dict[str, KeySeats] = {}
        # Wall clock minus trio's clock (set at the first sync): arrivals are compared across processes.
        self._epoch: float | None = None

    def key_seats(self, name: str, cap: int) -> KeySeats:
        """The seats of API key ``name``'s cap on this replica (made at first use; a reload may change the cap)."""
        seats = self._keys.get(name)
        if seats is None:
            seats = self._keys[name] = KeySeats(self, name, cap)
        if seats.cap != cap:
            seats.cap = cap
            self.stir(seats)
        return seats

    def stir(self, key: Sparse) -> None:
        """Something about an API key's resources changed here: the next sync carries them (router/quotas/ledger_roster.py)."""
        self._roster.stir(key)

    def tracks(self, key: Sparse) -> bool:
        """The ledger or a coming sync may still hear of ``key``'s resources: its object must not be replaced."""
        return self._roster.knows(key)

    @property
    def kept_keys(self) -> int:
        """API keys whose seats are kept here now."""
        return len(self._keys)

    def forget_idle_keys(self) -> int:
        """Drop the seats of API keys that hold nothing here or in the ledger (made again at their next request); how many went.

        What a key leaves behind once its grant went back is an object per
        key ever seen; it goes here, so what is kept follows the keys in use.
        """
        gone = [name for name, seats in self._keys.items() if seats.forgettable() and not self.tracks(seats)]
        for name in gone:
            del self._keys[name]
        return len(gone)

    def in_use_elsewhere(self, resource: str) -> int:
        """Seats of ``resource`` in use on the other live replicas, as the last sync found them."""
        return self._elsewhere.get(resource, 0)

    def in_use_elsewhere_since(self, resource: str) -> float | None:
        """Since when (``trio.current_time()``) the oldest use of ``resource`` on the other replicas counts; None: not said."""
        return self._elsewhere_since.get(resource)

    def granted(self, resource: str, cap: int) -> int:
        """Seats of ``resource`` this replica may use now (0 until the first sync or fallback)."""
        return min(cap, self._grants.get(resource, 0))

    def holds(self, resource: str) -> bool:
        """The ledger records a grant or a reserve of ``resource`` for this replica (as of its last answer)."""
        return self._grants.get(resource, 0) > 0 or resource in self._reserves

    def recovering_for(self) -> float:
        """Seconds grants stay at the fallback caps at most, the ledger being back (0: they do not)."""
        return self._recovery.left(trio.current_time())

    def settles_in(self, hold: float) -> float | None:
        """In fallback: seconds until a resource whose use outlives a lease by ``hold`` gets its static share; None: no fallback."""
        if self.mode != "fallback" or self._fallback_since is None:
            return None
        settled = self._fallback_since + max(self._settle_after, hold + self.config.lease_ttl)
        return max(0.0, settled - trio.current_time())

    def static(self, cap: int) -> int:
        """This replica's static share of ``cap``: what it may use once the ledger has been away long enough."""
        return math.floor(cap * self.config.static_share + 1e-9)

    def wake(self) -> None:
        """A request found its grant used up: sync now rather than at the next tick."""
        self._wanted.set()

    def status(self) -> ClusterStatus:
        return ClusterStatus(self.mode, self.replica, dict(self._grants), self.syncs, self.failures, self._fallback_since)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sync forever; the first sync (or the fallback) happens before ``started``."""
        await self.sync_once()
        task_status.started()
        while True:
            # While a request waits on another replica, seats it may need are given back sooner; while one
            # waits here for seats not yet granted, they are asked for again as soon.
            interval = self.config.sync_interval / 10 if self._contended or self._short else self.config.sync_interval
            with trio.move_on_after(interval):
                await self._wanted.wait()
            self._wanted = trio.Event()
            await self.sync_once()

    async def sync_once(self) -> None:
        """One round trip: ask for what the demand needs, apply what the ledger granted.

        In fallback a sync first only asks whether the ledger answers (cheap
        while Redis stays away); when it does, the sync carries every
        resource at once, so the ledger counts all this replica uses before
        it is counted as back.
        """
        now = trio.current_time()
        if self._epoch is None:
            self._epoch = time.time() - now  # wall clock minus trio's: other replicas' arrivals are on it
        if self.mode == "fallback":
            probed, why = await self._ask([], probe=True)
            if probed is None:
                keys = self._roster.take(now)
                self._failed(now, self._demands() + [d for key in keys for d in key.demands()], keys, why)
                return
            if probed.status == "epoch":
                self._lost(now, probed, [])
            self._full = True
        full, self._full = self._full, False
        keys = self._roster.take(now, everything=full)
        demands = self._demands()
        owners: list[Sparse | None] = [None] * len(demands)
        for key in keys:
            theirs = key.demands()
            demands += theirs
            owners += [key] * len(theirs)
        self._given_back = set()  # lowered before now: the wants below carry it
        clamped = self.mode == "fallback" or self._recovery.recovering(now)
        wants = []
        for demand in demands:
            want = self._want(demand, now, clamped)
            # Seats about to be given back are not used meanwhile: the ledger may record as few as
            # ``keep``, so no more are used here until it answers. A more urgent request waited
            # elsewhere at the last sync: every seat not in use now goes back.
            keep = max(want.target, demand.in_use) if demand.resource not in self._yielding else demand.in_use
            lowered = min(self._grants.get(demand.resource, 0), keep)
            if lowered < self._grants.get(demand.resource, 0):
                self._set(demand, lowered)
            wants.append(replace(want, keep=lowered))
        synced, why = await self._ask(wants)
        if synced is None:
            self._full |= full
            self._failed(now, demands, keys, why)
            return
        if synced.status == "epoch":
            self._lost(now, synced, keys)
            await self.sync_once()  # everything, at once: until then the ledger counts nothing of this replica
            return
        self._contended = synced.contended
        if self.mode == "starting":
            log.info("cluster: the shared ledger answers (replica %s); caps are shared", self.replica)
        elif self.mode == "fallback":
            # The outage's second and last line (the first is in _failed): nothing is logged per failed sync.
            away = now - self._fallback_since if self._fallback_since is not None else 0.0
            log.info(
                "cluster: the shared ledger is back after %.1f s away (%d syncs failed; replica %s)%s; caps are shared again",
                away, self.failures - self._failures_before, self.replica,
                ", with its memory lost: every grant is claimed again" if self._forgot else "",
            )
            self._recovery.began(now, lost=self._forgot)
            self._forgot = False
            self._bases = {}
            self._settles = set()
        self.mode = "ledger"
        self._fallback_since = None
        self.syncs += 1
        self.synced_from = now
        self._short = False
        if self._recovery.answered(synced, now):
            self.wake()  # every replica alive before has synced since the ledger came back: grow now
        if self._roster.poked(synced.poked):
            self.wake()  # a request waits elsewhere for a key's seats or budget held here: say what is in use
        self._apply(synced, demands, wants, owners)

    def _apply(self, synced: Synced, demands: list[Demand], wants: list[Want], owners: list[Sparse | None]) -> None:
        """The ledger's answer, resource by resource; then which keys the next sync carries again, and which are gone."""
        self._yielding = {d.resource for d, y in zip(demands, synced.yielding) if y}
        count = len(demands)
        urgent = synced.urgent or [NO_WAITER] * count
        urgent_since = synced.urgent_since or [math.inf] * count  # a store that does not say: ours first
        elsewhere_since = synced.elsewhere_since or [0.0] * count
        reserves = synced.reserves or [0] * count
        yielding = synced.yielding or [False] * count
        # News of the other's arrival is up to a sync old and their clocks may differ a little: within
        # this much, a request here counts as first (it takes the seat at once, no round trip).
        tolerance = self.config.sync_interval / 2
        applied: list[int] = []
        for i, (demand, seats, elsewhere) in enumerate(zip(demands, synced.grants, synced.elsewhere or [0] * count)):
            resource = demand.resource
            self._elsewhere[resource] = elsewhere
            if elsewhere_since[i] > 0:
                self._elsewhere_since[resource] = elsewhere_since[i] - (self._epoch or 0.0)
            else:
                self._elsewhere_since.pop(resource, None)
            if reserves[i]:
                self._reserves[resource] = reserves[i]
            else:
                self._reserves.pop(resource, None)
            self._short |= demand.waiting > 0 and seats < min(demand.cap, demand.in_use + demand.waiting)
            if resource in self._given_back:
                # A seat freed during the round trip went back: the answer, sent before, must not hand it out again.
                seats = min(seats, self._grants.get(resource, 0))
            self._set(demand, seats)
            applied.append(seats)
            if urgent[i] >= NO_WAITER:
                demand.yielding(None)
            else:
                local = urgent_since[i] - (self._epoch or 0.0) + tolerance
                demand.yielding(Yielding(urgent[i], self._giver(resource), local))
        carried: dict[Sparse, list[int]] = {}
        for i, key in enumerate(owners):
            if key is not None:
                carried.setdefault(key, []).append(i)
        for key, indices in carried.items():
            # Gone once the ledger holds nothing of it (no grant, reserve or use, nobody waiting here);
            # carried again while it waits, is waited for elsewhere, or is still going back.
            nothing = all(
                demands[i].in_use == 0 and demands[i].waiting == 0 and applied[i] == 0 and reserves[i] == 0
                and wants[i].keep == 0 and wants[i].reserve_keep == 0
                for i in indices
            )
            again = not nothing and any(
                demands[i].waiting > 0 or yielding[i] or urgent[i] < NO_WAITER or wants[i].target == 0 for i in indices
            )
            resources = tuple(demands[i].resource for i in indices)
            if nothing:
                for resource in resources:
                    self._forget(resource)
            self._roster.sent(key, resources, again=again, gone=nothing)

    async def _ask(self, wants: list[Want], *, probe: bool = False) -> tuple[Synced | None, str]:
        """One round trip to the ledger within half a lease: its answer, or None and why not."""
        ttl = self.config.lease_ttl
        # Redis must not run it once this replica has given up on it (a Redis stopped, then resumed): on
        # the wall clock, Redis's, read now (trio's may be virtual, and drifts from it).
        terms = SyncTerms(self._recovery.epoch, time.time() + ttl / 2, probe)
        with trio.move_on_after(ttl / 2):
            try:
                return await self._store.sync(self.replica, ttl, wants, self.incarnation, terms=terms), ""
            except Exception as error:  # any failure of the store: fall back, never fail requests for it
                return None, f"{type(error).__name__}: {error}"
        return None, f"no answer within {ttl / 2:g} s"

    def _lost(self, now: float, synced: Synced, keys: list[Sparse]) -> None:
        """The ledger answers from another memory (Redis restarted empty, or flushed): claim everything again, held."""
        if self.mode == "fallback":
            self._forgot = True  # said in the outage's last line
        else:
            log.warning(
                "cluster: the shared ledger has lost its memory (Redis restarted empty or flushed; replica %s): "
                "every grant is claimed again, held to what this replica uses until the replicas alive before have too",
                self.replica,
            )
        self._recovery.epoch = synced.epoch
        self._recovery.began(now, lost=True)
        self._roster.unsent(keys)
        self._full = True

    def _forget(self, resource: str) -> None:
        for table in (self._grants, self._reserves, self._elsewhere, self._elsewhere_since):
            table.pop(resource, None)

    def _want(self, demand: Demand, now: float, clamped: bool) -> Want:
        config = self.config
        block = config.block if demand.block is None else demand.block
        target = min(demand.cap, max(demand.in_use, demand.in_use + demand.waiting + block))
        if clamped:
            # Redis is back (or about to be) and the others may still run on their fallback caps,
            # which it does not count yet: claim no more than this replica's own fallback cap.
            target = min(target, max(demand.in_use, self._grants.get(demand.resource, 0)))
        share = 0.0 if clamped else demand.share
        # The reserve it may use until it hears the answer. None without a share (an idle key: it goes
        # back in one sync), nor in fallback, where the grant counts the reserve already (``_failed``).
        if share == 0 or self.mode == "fallback":
            self._reserves.pop(demand.resource, None)
        reserve_keep = self._reserves.get(demand.resource, 0)
        since = 0.0  # nobody waits, or a ticket with no arrival: first
        if self._epoch is not None and demand.best_waiting < NO_WAITER and math.isfinite(demand.oldest):
            since = max(0.0, demand.oldest + self._epoch)
        return Want(
            demand.resource,
            demand.cap,
            target,
            demand.best_waiting,
            demand.in_use,
            since=since,
            tolerance=config.sync_interval / 2,
            hold=demand.hold,
            used_since=0.0 if self._epoch is None or not math.isfinite(demand.used_since) else demand.used_since + self._epoch,
            share=share,
            reserve_keep=reserve_keep,
            sparse=demand.sparse,
        )

    def _giver(self, resource: str) -> Callable[[int], None]:
        def give_back(seats: int) -> None:
            """A seat freed here goes to a more urgent request elsewhere: record the lower grant, sync now."""
            self._grants[resource] = min(self._grants.get(resource, 0), seats)
            self._given_back.add(resource)
            self.wake()

        return give_back

    def _failed(self, now: float, demands: list[Demand], keys: list[Sparse], why: str) -> None:
        self.failures += 1
        self._short = False
        self._yielding = set()
        first = self.mode != "fallback"
        if first:
            # Once an outage: the syncs that fail after this one are counted, not logged.
            log.warning(
                "cluster: the shared ledger is away (%s; replica %s); each cap falls back to this replica's static share until it answers",
                why, self.replica,
            )
            self.mode = "fallback"
            self._fallback_since = now
            self._failures_before = self.failures - 1
            self._bases = {}
            self._away = 0.0
        away = 0.0 if self._fallback_since is None else now - self._fallback_since
        self._roster.unsent(keys)
        # Every key held here, not only those this sync carried, when the outage begins and when a
        # static share comes due; in between only the pools, endpoints and keys that stirred.
        if first or any(self._away < due <= away for due in self._settles):
            carried = set(keys)
            demands = demands + [d for key in self._roster.held() if key not in carried for d in key.demands()]
        self._away = away
        for demand in demands:
            # What was admitted under a larger grant must be over first: requests end by the e2e
            # deadline; a budget's admissions count for its window (``hold``) after they were made.
            due = max(self._settle_after, demand.hold + self.config.lease_ttl)
            self._settles.add(due)
            static = self.static(demand.cap)
            # At once: never more than the grant and reserve the ledger counted, nor the static share.
            # After the TTL every replica has fallen back: the static share itself.
            resource = demand.resource
            base = self._bases.setdefault(resource, self._grants.get(resource, 0) + self._reserves.get(resource, 0))
            self._set(demand, static if away >= due else min(base, static))
            demand.yielding(None)  # no news of the others: each replica serves its own share

    def _set(self, demand: Demand, seats: int) -> None:
        self._grants[demand.resource] = seats
        demand.apply(seats)


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
