"""Endpoint choice within a pool: which endpoint with room a new seat (or a retry) goes to.

A pool asks its ``policy``; the policy sees the pool's endpoints (it
seats only on those with room, those a retry was already tried on left
out) and the request's prefix key, and answers a :class:`Placement` (the
endpoint and how it was chosen) or none. One object per pool, built
once: a choice costs a method call and, with affinity, one small hash
per usable endpoint.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

from .endpoint import Endpoint, url_seed

if TYPE_CHECKING:
    from ..config import PlacementConfig

# How a seat's endpoint was chosen (Lease.placement, RequestRecord.placement; metrics and the access log use these names):
# "home": the key's home, where it spilled on its first placement here if that endpoint is still usable, else its first
# rendezvous choice among the pool's usable endpoints; "spilled": another (the home over the load bound, at its cap, or already
# tried); "no_key": affinity, but the request has no key; "hot_key": affinity, but its key is more of the recent traffic
# than one endpoint's share (its prefix is cached on every engine soon: placed by load); "borrowed": a seat
# lent by another pool; "least_loaded": the pool places by load alone (``placement = "least_loaded"``).
# "pinned": the one endpoint that keeps the state the request continues (router/fleet/response_homes.py).
PlacementKind = Literal["home", "spilled", "no_key", "hot_key", "borrowed", "least_loaded", "pinned"]
PLACEMENT_KINDS: tuple[PlacementKind, ...] = ("home", "spilled", "no_key", "hot_key", "borrowed", "least_loaded", "pinned")


class Placement(NamedTuple):
    """The endpoint a seat goes to, and how it was chosen."""

    endpoint: Endpoint
    kind: PlacementKind


class EndpointPolicy(Protocol):
    """How a pool picks an endpoint for a seat."""

    def choose(
        self,
        endpoints: Sequence[Endpoint],
        key: bytes | None,
        *,
        borrowed: bool,
        exclude: Collection[Endpoint] = (),
        need: int = 1,
        isolate: bool = True,
    ) -> Placement | None:
        """Where the seat goes among ``endpoints`` (the pool's) with room, none of ``exclude``; or None.

        ``key`` is the request's prefix key (None without one); ``borrowed``:
        the seat serves another pool's request (lent); ``exclude``: the
        endpoints a retry was already tried on; ``need``: the seats the
        request takes together (its n sequences).
        """
        ...


def with_room(endpoints: Sequence[Endpoint], exclude: Collection[Endpoint], need: int = 1) -> list[Endpoint]:
    """The endpoints that may take ``need`` seats now (usable, under their caps with them), those of ``exclude`` left out."""
    if need != 1:
        return [e for e in endpoints if e.room_for(need) and e not in exclude]
    if exclude:
        return [e for e in endpoints if e.has_room and e not in exclude]
    return [e for e in endpoints if e.has_room]


class LeastLoaded:
    """The least loaded endpoint (recent failures counted as load, ties at random), lent seats packed apart.

    A borrowed seat's request runs beside its lender's own: a short
    request lent a batch seat shares every step with that engine's long
    prefills. So borrowed seats are packed onto the endpoint that already
    holds the most of them, and the pool's own requests go to an endpoint
    holding none when one has room; ties to the least loaded. Any
    endpoint with room beats none (work-conserving).
    """

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(
        self,
        endpoints: Sequence[Endpoint],
        key: bytes | None,
        *,
        borrowed: bool,
        exclude: Collection[Endpoint] = (),
        need: int = 1,
        isolate: bool = True,
    ) -> Placement | None:
        endpoint = self.pick(with_room(endpoints, exclude, need), borrowed=borrowed, isolate=isolate)
        return None if endpoint is None else Placement(endpoint, "borrowed" if borrowed else "least_loaded")

    def pick(self, candidates: Sequence[Endpoint], *, borrowed: bool, isolate: bool = True) -> Endpoint | None:
        """The endpoint of ``candidates`` (all with room) the seat goes to, or None (``isolate`` False: by load alone)."""
        if not isolate:
            return self._least_loaded(candidates)
        if borrowed:
            most = max((e.borrowed for e in candidates), default=0)
            return self._least_loaded([e for e in candidates if e.borrowed == most])
        return self._least_loaded([e for e in candidates if not e.borrowed] or candidates)

    def _least_loaded(self, candidates: Sequence[Endpoint]) -> Endpoint | None:
        """The endpoint with the fewest requests in flight, recent failures counted as such (ties at random), or None."""
        if not candidates:
            return None
        least = min(e.placement_load for e in candidates)
        return self._rng.choice([e for e in candidates if e.placement_load == least])


class PrefixAffinity:
    """The request's prefix home by rendezvous hashing of its key, within a load bound; least loaded without a key.

    Each usable endpoint's weight is a stable hash of (key, URL); the highest
    weight is the key's home, so every worker and replica picks the same
    engine without sharing state, and an endpoint leaving remaps only the
    keys it held (each others' home stays the highest). Bounded loads
    (Mirrokni et al., consistent hashing with bounded loads): an endpoint
    is eligible only if its load after taking the request stays within
    ``ceil(c * average)``, the average over the candidates with this
    request counted, so a hot prefix spills down its rendezvous order
    instead of queueing on one engine. The least loaded candidate is
    always within the bound (c >= 1), so any endpoint with room beats none.
    Load is ``placement_load`` (recent failures counted, as LeastLoaded does).
    Requests without a key go to ``LeastLoaded``.

    Nothing to share must cost nothing: a key this policy has not placed
    before (every request of unique prompts) is most likely cached nowhere,
    so its bound is the tightest (c = 1: at most the mean), which keeps
    unique traffic as level as least loaded keeps it, in rendezvous order
    still, so its second request finds the first. A key placed before
    follows its rendezvous order within ``c`` x the mean, except one that
    spilled on its first placement: it goes back where it spilled (that
    engine holds its prefix) while that endpoint is usable and within the
    bound. An endpoint that leaves and comes back (ejection, DNS) gets its
    keys back. Least recently used keys are forgotten first past
    ``remember`` keys. That memory is this process's own: the rendezvous
    order alone is what workers and replicas agree on.

    A key hotter than one engine's share (more than 1/N of the last
    ``HOT_WINDOW`` keyed first placements over N usable endpoints: a system prompt
    every request starts with, as in the Mooncake trace) outgrows a home:
    holding it at ``c`` x the mean costs that engine ``c`` x the work. It
    gets a set instead ("hot_key"): the first ``ceil(c x share x N)`` (at
    least 2) engines of its rendezvous order, the least loaded of them
    within the load bound, the set growing down that order while none is.
    So a hot prefix lives on a small, stable set that follows its load (all
    N for a prefix every request has), not scattered over every engine.

    Lending composes as a filter before affinity, never after: the lending
    rule (LeastLoaded's) packs borrowed seats onto the endpoints holding
    the most of them and keeps the pool's own requests off those while
    another has room, because a borrowed request shares every engine step
    with its neighbours (a short request beside long prefills), and that
    isolation is what lending promised. Within what the rule allows, the
    key's rendezvous order picks: a borrowed request goes to its prefix
    home among the lender's endpoints of the pack (the first borrowed seat
    starts the pack at its home, so a borrower's conversation that keeps
    borrowing keeps hitting one lender engine's cache), and the pool's own
    requests go home unless their home holds borrowed seats (then they
    spill down the order, and come back when those end). Affinity first
    would scatter borrowed seats over every engine of the lender.
    """

    HOT_WINDOW = 256

    def __init__(self, rng: random.Random, *, c: float = 1.1, remember: int = 65_536) -> None:
        if c < 1:
            raise ValueError(f"the load bound factor must be at least 1, not {c}")
        self.c = c
        self._fallback = LeastLoaded(rng)
        self._remember = remember
        # Keys placed before: the URL a key spilled to on its first placement (its prefix is cached there), or None
        # where it went to its rendezvous home (it follows the rendezvous order, as every replica's does).
        self._placed: OrderedDict[bytes, str | None] = OrderedDict()
        self._recent: deque[bytes] = deque(maxlen=self.HOT_WINDOW)  # the last keyed placements' keys
        self._recent_counts: Counter[bytes] = Counter()

    def choose(
        self,
        endpoints: Sequence[Endpoint],
        key: bytes | None,
        *,
        borrowed: bool,
        exclude: Collection[Endpoint] = (),
        need: int = 1,
        isolate: bool = True,
    ) -> Placement | None:
        if key is None:
            endpoint = self._fallback.pick(with_room(endpoints, exclude, need), borrowed=borrowed, isolate=isolate)
            return None if endpoint is None else Placement(endpoint, "borrowed" if borrowed else "no_key")
        return self.place(endpoints, key, exclude, borrowed=borrowed, need=need, isolate=isolate)

    def place(
        self,
        endpoints: Sequence[Endpoint],
        key: bytes,
        exclude: Collection[Endpoint] = (),
        *,
        borrowed: bool = False,
        need: int = 1,
        isolate: bool = True,
    ) -> Placement | None:
        """The key's home if it has room, the lending rule allows it and it is within the load bound, else the first such in rendezvous order; or None.

        "home" when it is the key's home (where it went before, else the
        first of the usable endpoints, room or not), "spilled" when
        another, "borrowed" for a lent seat.
        """
        known = key in self._placed
        placed = self._placed.get(key)
        home_weight = b""
        home_url: str | None = None
        placed_usable = False
        usable = 0
        weights: list[bytes] = []  # every usable endpoint's weight for the key: a hot key's set is the highest
        ranked: list[_Ranked] = []
        for e in endpoints:  # one pass, each property read once: this is every keyed request's path
            if not e.usable:
                continue
            usable += 1
            weight = seeded_weight(e.rendezvous_seed, key)  # rendezvous_weight(key, e.url), the URL hashed once
            weights.append(weight)
            if weight > home_weight:
                home_weight, home_url = weight, e.url
            placed_usable = placed_usable or e.url == placed
            if (e.in_flight < e.seats if need == 1 else e.room_for(need)) and e not in exclude:  # room, usable already known
                ranked.append((weight, e.url, e, e.placement_load))
        if placed_usable:
            home_url = placed  # while its endpoint is away the rendezvous order decides; it comes back with it
        if not ranked:
            return None
        if isolate and any(r[2].borrowed for r in ranked):  # the lending rule; none lent (the usual case): no filter
            ranked = _lending_rule(ranked, borrowed=borrowed)
        share = self._hot_share(key, usable, count=not borrowed and not exclude)
        if share:
            endpoint = self._in_hot_set(ranked, weights, share, need)
            return Placement(endpoint, "borrowed" if borrowed else "hot_key")
        c = self.c if known else 1.0  # a key new here is most likely cached nowhere: keep level
        bound = math.ceil(c * (sum(r[3] for r in ranked) + need) / len(ranked))  # self.bound, loads read once
        # The home if eligible (load + need <= bound), else the first eligible in rendezvous order.
        # For c >= 1 the least loaded always is ("or" guards rounding).
        eligible = [r for r in ranked if r[3] + need <= bound] or ranked
        endpoint = next((r[2] for r in eligible if r[1] == home_url), None) or max(eligible, key=_rank)[2]
        if known:
            self._placed.move_to_end(key)
        else:
            self._note(key, None if endpoint.url == home_url else endpoint.url)
        if borrowed:
            return Placement(endpoint, "borrowed")
        return Placement(endpoint, "home" if endpoint.url == home_url else "spilled")

    def _hot_share(self, key: bytes, endpoints: int, *, count: bool) -> float:
        """``key``'s share of the window when it is more than one of ``endpoints`` usable endpoints' share, else 0;
        ``count``: this placement joins the window.

        Only a request's own first placement counts (not a retry's, not a
        lent seat's), so the window is the traffic, not the attempts.
        """
        counts, recent = self._recent_counts, self._recent
        full = len(recent) == self.HOT_WINDOW
        share = counts[key] / self.HOT_WINDOW if full and endpoints > 1 and counts[key] * endpoints > self.HOT_WINDOW else 0.0
        if not count:
            return share
        if full:
            oldest = recent[0]
            counts[oldest] -= 1
            if not counts[oldest]:
                del counts[oldest]
        recent.append(key)
        counts[key] += 1
        return share

    def _in_hot_set(self, ranked: list[_Ranked], weights: list[bytes], share: float, need: int) -> Endpoint:
        """Where a hot key's request goes: the least loaded endpoint of its set within the load bound.

        Its set is the first ``ceil(c x share x N)`` (at least 2) of the N
        usable endpoints in the key's rendezvous order: its prefix is cached
        on as many engines as its load needs, the same ones on every replica,
        more as its share grows. When none of the set is within the bound
        (``ceil(c x mean load)``, this request counted, as for any key), the
        set grows down the rendezvous order: the first endpoint within it.
        """
        size = min(len(weights), max(2, math.ceil(self.c * share * len(weights))))
        cut = sorted(weights, reverse=True)[size - 1]  # the set: weights at least this
        bound = math.ceil(self.c * (sum(r[3] for r in ranked) + need) / len(ranked))
        within = [r for r in ranked if r[3] + need <= bound] or ranked
        members = [r for r in within if r[0] >= cut]
        if not members:
            return max(within, key=_rank)[2]
        least = min(r[3] for r in members)
        return max((r for r in members if r[3] == least), key=_rank)[2]

    def _note(self, key: bytes, spilled_to: str | None) -> None:
        """Remember a key new here: where it spilled, or None for its rendezvous home; the least recently used go first."""
        self._placed[key] = spilled_to
        if len(self._placed) > self._remember:
            self._placed.popitem(last=False)

    def bound(self, candidates: Sequence[Endpoint]) -> int:
        """The most load an endpoint may hold after taking the request: ``ceil(c * mean load, this request counted)``."""
        total = sum(e.placement_load for e in candidates) + 1
        return math.ceil(self.c * total / len(candidates))


_Ranked = tuple[bytes, str, "Endpoint", int]  # (rendezvous weight, URL, endpoint, placement load)


def _lending_rule(ranked: list[_Ranked], *, borrowed: bool) -> list[_Ranked]:
    """LeastLoaded's packing, before affinity: a lent seat among those holding the most lent; the pool's own off them when it can."""
    if borrowed:
        most = max(r[2].borrowed for r in ranked)
        return [r for r in ranked if r[2].borrowed == most]
    return [r for r in ranked if not r[2].borrowed] or ranked



def policy_for(placement: PlacementConfig, rng: random.Random) -> EndpointPolicy:
    """The policy a pool's ``placement`` config asks for."""
    if placement.mode == "least_loaded":
        return LeastLoaded(rng)
    return PrefixAffinity(rng, c=placement.load_factor)


def _rank(ranked: _Ranked) -> tuple[bytes, str]:
    return ranked[0], ranked[1]


def rendezvous_order(key: bytes, candidates: Sequence[Endpoint]) -> list[Endpoint]:
    """``candidates`` by their rendezvous weight for ``key``, highest first (URL breaks a tie)."""
    return sorted(candidates, key=lambda e: (rendezvous_weight(key, e.url), e.url), reverse=True)


def rendezvous_weight(key: bytes, url: str) -> bytes:
    """A stable pseudo-random weight of (key, endpoint), equal on every process: blake2b of the URL, then the key."""
    return seeded_weight(url_seed(url), key)


def seeded_weight(seed: hashlib.blake2b, key: bytes) -> bytes:
    """The weight of ``key`` on the endpoint whose seed this is (a copy of the seed's state goes on with the key: ~1 us)."""
    weight = seed.copy()
    weight.update(key)
    return weight.digest()
