"""Automatic rebalancing: movable endpoints follow the demand between pools.

A static split makes one class pay when the mix moves. Each look (every
``rebalance.interval`` s) measures every pool's *utilisation*: the demand of
the classes it is home to -- seats they hold (in this pool or borrowed from
another), requests waiting in the router's queue, and requests waiting in
vLLM's own (its scraped ``num_requests_waiting``) -- over the pool's seats.
Demand is in seats, so a pool of short requests and one of long requests
compare fairly: a seat is a seat of the same GPUs' batch.

An imbalance is one pool's utilisation above another's by more than
``threshold``. It must be seen at every look for ``hold_time`` seconds;
then one movable endpoint of the less-used pool moves to the busier, if
that leaves the donor at least one endpoint and the move would not at
once look like an imbalance the other way (the projected utilisations
after the move, by seats moved). After a move no other is considered for
``cooldown`` seconds. Together these keep an assignment from flapping.

Of the donor's movable endpoints, the one whose prefix cache is coldest
for the donor goes: the fewest seats placed on it as their prefix key's
home (``Endpoint.home_placements``) over the last ``HOME_WINDOW``
seconds, then the least busy. Its cached
prefixes are the ones the donor loses least by (prefix affinity sends
those keys to their next engine), and its running requests finish soonest.

With ``seat_step`` below 1 a move takes ``ceil(seat_step x cap)`` seats of
one movable engine, not all of it (router/fleet/seat_split.py): the engine keeps
serving its pool with the rest, and a share of it serves the busier pool;
the next move the same way grows that share, and a move back shrinks it
first (the seats go home) before any other endpoint is split. A move that
would leave the engine no seat of its own moves it whole. Hysteresis and
the projection are the same, by the seats actually moved: a step small
enough not to overshoot is made where a whole engine would flap.

This module decides; the router (``router.fleet.reconcile``) carries a move out:
the endpoint leaves its pool at once (no new requests of that pool), its
running requests finish and still count against its cap, and only when it
is idle does it join the new pool. Seats move at once in the books, and
reach the share only as the engine's running requests fall within its
lowered cap. A reload puts every endpoint back where the file says.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..config import Config, RebalanceConfig
from .endpoint import Endpoint
from .model_len import context_fits
from .pool import Pool


@dataclass(frozen=True)
class MoveChoice:
    """One endpoint, or some of its seats, to move, and why (for the log).

    ``seats`` None: the whole endpoint. Else that many seats: of an engine's
    own endpoint into its share in ``target`` (made if need be), or of a
    share (``endpoint.engine`` set) back to its engine's pool, ``target``.
    """

    endpoint: Endpoint
    source: Pool
    target: Pool
    source_utilisation: float
    target_utilisation: float
    seats: int | None = None


def demand(pools: Mapping[str, Pool], config: Config) -> dict[str, float]:
    """Each pool's demand, in seats: held by its classes anywhere, and waiting (router and vLLM)."""
    home = {klass.name: klass.pool for klass in config.classes}
    demand = {name: float(pool.queue.waiting) for name, pool in pools.items()}
    for pool in pools.values():
        for klass, seats in pool.class_in_flight.items():
            owner = home.get(klass)
            if owner in demand:
                demand[owner] += seats
        for endpoint in pool.endpoints:
            load = endpoint.load
            if load is not None and load.waiting:
                demand[pool.name] += load.waiting
    return demand


def _ratio(wanted: float, seats: int) -> float:
    """Utilisation: demand over seats (inf: demand and no seat; 0: neither)."""
    if seats > 0:
        return wanted / seats
    return math.inf if wanted else 0.0


# Seconds of home placements that say how warm an engine's cache is: a prefix nobody asked for in a minute
# has likely been evicted from a busy engine's KV cache (vLLM frees least recently used blocks first).
HOME_WINDOW = 60.0


class Warmth:
    """Each endpoint's home placements over a recent window: snapshots of the counts, one a look."""

    def __init__(self) -> None:
        # By endpoint, not URL: an engine's own endpoint and its share (router/fleet/seat_split.py) are counted apart.
        self._snapshots: collections.deque[tuple[float, dict[Endpoint, int]]] = collections.deque()

    def look(self, now: float, endpoints: Iterable[Endpoint]) -> None:
        """Note the counts now; forget snapshots older than HOME_WINDOW but the newest such (the window's start)."""
        self._snapshots.append((now, {e: e.home_placements for e in endpoints}))
        while len(self._snapshots) > 1 and self._snapshots[1][0] <= now - HOME_WINDOW:
            self._snapshots.popleft()

    def recent(self, endpoint: Endpoint) -> int:
        """Home placements on ``endpoint`` since the window began (all of them, for one seen first in it)."""
        start = self._snapshots[0][1] if self._snapshots else {}
        return endpoint.home_placements - start.get(endpoint, 0)


class Rebalancer:
    """Watches utilisation, look by look, and says when an endpoint should move."""

    def __init__(self) -> None:
        self._since: dict[tuple[str, str], float] = {}  # (busy, idle) -> when the imbalance was first seen
        self._last_move = -math.inf
        self.warmth = Warmth()

    def reset(self) -> None:
        """Forget imbalances seen so far (a reload changed the pools)."""
        self._since.clear()

    def moved(self, now: float) -> None:
        self._last_move = now
        self._since.clear()

    def look(self, now: float, pools: Mapping[str, Pool], config: Config) -> MoveChoice | None:
        """One look: update the imbalances seen, and return a move due now, if any."""
        settings = config.rebalance
        candidates = [pool for pool in pools.values() if pool.config.rebalance == "auto"]
        self.warmth.look(now, (e for pool in pools.values() for e in pool.endpoints))
        wanted = demand(pools, config)
        used = {name: _ratio(wanted[name], pool.seats) for name, pool in pools.items()}
        seen: set[tuple[str, str]] = set()
        for busy in candidates:
            for idle in candidates:
                if busy is not idle and used[busy.name] - used[idle.name] > settings.threshold:
                    seen.add((busy.name, idle.name))
        self._since = {pair: self._since.get(pair, now) for pair in seen}
        if now - self._last_move < settings.cooldown:
            return None
        due = sorted(
            (pair for pair, since in self._since.items() if now - since >= settings.hold_time),
            key=lambda pair: used[pair[1]] - used[pair[0]],  # the widest gap first
        )
        for busy_name, idle_name in due:
            choice = _best_move(pools[busy_name], pools[idle_name], wanted, settings, self.warmth)
            if choice is not None:
                return choice
        return None


def _best_move(
    target: Pool, source: Pool, wanted: Mapping[str, float], settings: RebalanceConfig, warmth: Warmth
) -> MoveChoice | None:
    """What of ``source`` moves to help ``target`` without flapping, or None.

    Seats of a share going home first, then the movable endpoints, coldest
    cache first (those already sharing with ``target`` before the others).
    A donor that lends to ``target`` moves whole engines only.
    """

    def choice(endpoint: Endpoint, seats: int, whole: bool) -> MoveChoice | None:
        target_after = _ratio(wanted[target.name], target.seats + seats)
        source_after = _ratio(wanted[source.name], source.seats - seats)
        if source_after - target_after > settings.threshold:
            return None  # the move would be undone at once: that is a flap
        used = _ratio(wanted[source.name], source.seats), _ratio(wanted[target.name], target.seats)
        return MoveChoice(endpoint, source, target, *used, seats=None if whole else seats)

    for share in source.endpoints:
        engine = share.engine
        if engine is not None and engine.pool_name == target.name and share.usable:
            seats = min(share.max_concurrency, settings.step_seats(_engine_cap(engine)))
            if seats < share.max_concurrency or len(source.endpoints) > 1:  # never empty a pool
                found = choice(share, seats, whole=False)
                if found is not None:
                    return found
    if not set(target.config.models) <= set(source.config.models):
        return None  # never move an engine to a pool whose models it does not serve
    movable: Sequence[Endpoint] = [
        e for e in source.endpoints if e.movable and e.usable and context_fits(e.max_model_len, target.config)
    ]  # a move into a pool whose max_model_len the engine does not reach would only idle it there
    # Sharing with the target already, then the coldest cache for the donor (it loses it least), then the least busy.
    # A donor that lends to the target gives it its spare seats already, under the lend rule's bounds on
    # what a borrowed request may stall (prefills, ttft_budget): a share would hand them over unbounded.
    # Measured on the real traces, seat shares of the interactive engine serving batch requests lifted
    # short TTFT P99 from 0.29-0.67x round robin's to 0.89-1.79x (bench/results/trace/trace-seat-shares.md).
    lends = target in source.lending.borrowers
    for endpoint in sorted(movable, key=lambda e: (_shares_with(e, target) is None, warmth.recent(e), e.in_flight, e.url)):
        step = settings.step_seats(_engine_cap(endpoint))
        if step < endpoint.max_concurrency and not lends:
            found = choice(endpoint, step, whole=False)
        elif len(source.endpoints) > 1 and all(share.pool_name == target.name for share in _serving(endpoint)):
            found = choice(endpoint, endpoint.max_concurrency, whole=True)  # never empty a pool
        else:
            continue
        if found is not None:
            return found
    return None


def _engine_cap(endpoint: Endpoint) -> int:
    """The seats of ``endpoint``'s engine, split between pools or not."""
    return endpoint.max_concurrency if endpoint.split is None else endpoint.split.cap


def _serving(endpoint: Endpoint) -> list[Endpoint]:
    """The shares of ``endpoint``'s engine serving a pool now."""
    return [] if endpoint.split is None else endpoint.split.serving


def _shares_with(endpoint: Endpoint, pool: Pool) -> Endpoint | None:
    """The share of ``endpoint``'s engine serving ``pool``, if any."""
    return None if endpoint.split is None else endpoint.split.share_in(pool.name)
