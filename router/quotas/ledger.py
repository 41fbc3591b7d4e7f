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
from collections.abc import Callable
from dataclasses import replace

import trio

from ..config import ClusterConfig
from .key_seats import KeySeats
from .ledger_recovery import Recovery
from .ledger_roster import Roster, Sparse
from .ledger_terms import NO_WAITER, ClusterStatus, Demand, LedgerStore, Synced, SyncTerms, Want, Yielding

# The share of a sync's wait (half a lease) after which Redis must not run it: the replica gives up at the whole.
DEADLINE_SHARE = 0.9

log = logging.getLogger("tailguard.cluster")

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
        # the wall clock, Redis's, read now (trio's may be virtual, and drifts from it). The deadline is a
        # tenth of the wait before the give-up: Redis compares whole milliseconds, and a Redis resumed within
        # one of the give-up ran a stale sync (tests/router/quotas/test_ledger.py, once in a fresh clone's
        # run); one it runs in that last tenth answers LateSync, and the replica falls back as it would.
        terms = SyncTerms(self._recovery.epoch, time.time() + DEADLINE_SHARE * ttl / 2, probe)
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
