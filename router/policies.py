"""Endpoint choice within a pool: which endpoint with room a new seat (or a retry) goes to.

A pool asks its ``policy``; the policy sees only the candidates (endpoints
of the pool with room, those a retry was already tried on left out) and
the request's ticket, and picks one or none. One object per pool, built
once: a choice costs a method call, nothing more.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
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
