"""One engine's seats split between the pools it serves: its own endpoint and its shares.

Rebalancing with ``seat_step`` below 1 (``[rebalance]``) moves seats of an
engine, not the engine: the engine's own endpoint stays in its pool with a
lower cap, and a *share* -- an :class:`~router.endpoint.Endpoint` for the
same URL, with the seats moved as its cap -- serves the busier pool.

The caps of an engine's endpoints add up to the engine's cap (a move lowers
one and raises another by as much), and each may use its cap only while the
others' running requests leave room for it (:meth:`SeatSplit.room_for`):
the engine's cap, less what the others run now. A lowered cap takes no seat
from a running request; the seats it gave up reach the share only as those
requests end, and whatever the caps say, the engine never runs more than
its cap in all. This is the draining of a whole-engine move, seat by seat,
and it needs no task: every seat freed on the engine offers the others'
pools what it opened (``SeatSplit.freed``).

A share dropped (its last seats moved back, or a reload) leaves its pool at
once and stays in the split, holding the seats its running requests hold,
until it is idle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class Seated(Protocol):
    """What a split reads and sets on its members (an ``Endpoint``): named here so this module need not import endpoint.py, which imports it."""

    max_concurrency: int
    in_flight: int
    pool_name: str | None
    split: SeatSplit[Any] | None


Member = TypeVar("Member", bound=Seated)


class SeatSplit(Generic[Member]):
    """The endpoints that hold seats of one engine: the engine's own, and its shares (one per pool)."""

    def __init__(self, engine: Member, wake: Callable[[Member], None]) -> None:
        self.engine = engine
        self.shares: list[Member] = []  # serving a pool, or dropped (cap 0, no pool) while requests still run
        self._wake = wake  # offer the waiters of the pool a member serves the room a freed seat opened

    @property
    def members(self) -> list[Member]:
        return [self.engine, *self.shares]

    @property
    def cap(self) -> int:
        """The engine's seats: every member's cap together."""
        return sum(member.max_concurrency for member in self.members)

    def room_for(self, member: Member) -> int:
        """Seats ``member`` may hold now: the engine's cap less what the others run (never below 0)."""
        others = sum(m.in_flight for m in self.members if m is not member)
        return max(0, self.cap - others)

    def share_in(self, pool: str) -> Member | None:
        """The share serving ``pool`` now, if any."""
        return next((share for share in self.shares if share.pool_name == pool), None)

    @property
    def serving(self) -> list[Member]:
        """The shares serving a pool now (not the dropped ones still draining)."""
        return [share for share in self.shares if share.pool_name is not None]

    def freed(self, member: Member) -> None:
        """A request on ``member`` ended: forget a dropped share gone idle, and offer the others' pools the seat."""
        if member is not self.engine and member.pool_name is None and not member.in_flight:
            self.forget(member)
        for other in self.members:
            if other is not member and other.pool_name is not None:
                self._wake(other)

    def forget(self, share: Member) -> None:
        """``share`` holds no seat of the engine any more; the engine is whole again once no share is left."""
        if share in self.shares:
            self.shares.remove(share)
            share.split = None
        if not self.shares:
            self.engine.split = None

    def drop(self, share: Member) -> int:
        """``share`` leaves its pool; its seats go back to the engine's own endpoint. Returns the seats it had."""
        seats = share.max_concurrency
        self.engine.max_concurrency += seats
        share.max_concurrency = 0
        share.pool_name = None
        if not share.in_flight:
            self.forget(share)
        return seats
