"""Endpoint choice within a pool: which endpoint with room a new seat (or a retry) goes to.

A pool asks its ``policy``; the policy sees only the candidates (endpoints
of the pool with room, those a retry was already tried on left out) and
the request's ticket, and picks one or none. One object per pool, built
once: a choice costs a method call, nothing more.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .endpoint import Endpoint
    from .pool import Ticket


class EndpointPolicy(Protocol):
    """How a pool picks an endpoint for a seat."""

    def choose(self, candidates: Sequence[Endpoint], ticket: Ticket | None, *, borrowed: bool) -> Endpoint | None:
        """The endpoint of ``candidates`` the seat goes to, or None.

        ``ticket`` is None for a retry (a lease keeps no ticket); ``borrowed``:
        the seat serves another pool's request (lent).
        """
        ...


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

    def choose(self, candidates: Sequence[Endpoint], ticket: Ticket | None, *, borrowed: bool) -> Endpoint | None:
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


def no_key(ticket: Ticket | None) -> bytes | None:
    """No request has a prefix key (until the ticket carries one)."""
    return None


class PrefixAffinity:
    """The request's prefix home by rendezvous hashing of its key, within a load bound; least loaded without a key.

    Each candidate's weight is a stable hash of (key, URL); the highest
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
    Borrowed seats and requests without a key go to ``LeastLoaded``.
    """

    def __init__(self, rng: random.Random, *, c: float = 1.25, key_of: Callable[[Ticket | None], bytes | None] = no_key) -> None:
        if c < 1:
            raise ValueError(f"the load bound factor must be at least 1, not {c}")
        self.c = c
        self._key_of = key_of
        self._fallback = LeastLoaded(rng)

    def choose(self, candidates: Sequence[Endpoint], ticket: Ticket | None, *, borrowed: bool) -> Endpoint | None:
        key = self._key_of(ticket)
        if borrowed or key is None:
            return self._fallback.choose(candidates, ticket, borrowed=borrowed)
        return self.place(candidates, key)

    def place(self, candidates: Sequence[Endpoint], key: bytes) -> Endpoint | None:
        """The first endpoint in ``key``'s rendezvous order within the load bound, or None without candidates."""
        if not candidates:
            return None
        bound = self.bound(candidates)
        # The first eligible in rendezvous order. For c >= 1 the least loaded is always eligible ("or" guards rounding).
        eligible = [e for e in candidates if e.placement_load + 1 <= bound] or candidates
        return max(eligible, key=lambda e: (rendezvous_weight(key, e.url), e.url))

    def bound(self, candidates: Sequence[Endpoint]) -> int:
        """The most load an endpoint may hold after taking the request: ``ceil(c * mean load, this request counted)``."""
        total = sum(e.placement_load for e in candidates) + 1
        return math.ceil(self.c * total / len(candidates))


def rendezvous_order(key: bytes, candidates: Sequence[Endpoint]) -> list[Endpoint]:
    """``candidates`` by their rendezvous weight for ``key``, highest first (URL breaks a tie)."""
    return sorted(candidates, key=lambda e: (rendezvous_weight(key, e.url), e.url), reverse=True)


def rendezvous_weight(key: bytes, url: str) -> bytes:
    """A stable pseudo-random weight of (key, endpoint): equal on every process."""
    return hashlib.blake2b(key + url.encode(), digest_size=8).digest()
