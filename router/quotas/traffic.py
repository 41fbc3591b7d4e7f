"""The requests inside the router now: per caller, in all, and whether it still admits any."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from ..errors import CallerOverLimit
from .auth import Caller

if TYPE_CHECKING:
    from .ledger import AdmissionLedger


class Traffic:
    """Counts the request path keeps and the views read."""

    def __init__(self) -> None:
        self.requests_total = 0
        self.draining = False
        self.open_requests = 0
        self.idle = trio.Event()
        self.idle.set()
        self.caller_in_flight: dict[str, int] = {}
        self.retries: Counter[str] = Counter()  # per pool: failed calls tried again on another endpoint

    @asynccontextmanager
    async def holding(
        self, caller: Caller, budget: AdmissionLedger | None, retry_after: float, priority: int, deadline: float
    ) -> AsyncIterator[None]:
        """Count the request against its caller's cap and the drain, from queue to end.

        With ``[cluster]`` the key's cap is shared: the request takes a seat of
        this replica's grant, or waits (until ``deadline``, in class priority
        order) for a sync to grant one; it is refused when the cap is full
        across the replicas (``cluster.KeySeats``).
        """
        held = self.caller_in_flight.get(caller.name, 0)
        limit = caller.max_concurrency
        seats = None if limit is None or budget is None else budget.key_seats(caller.name, limit)
        if seats is None and limit is not None and held >= limit:
            raise CallerOverLimit(
                f"the caller {caller.name!r} already has {held} requests in flight, its cap; "
                f"retry after {retry_after:g} s",
                retry_after=retry_after,
            )
        self.open_requests += 1
        if self.open_requests == 1:
            self.idle = trio.Event()
        try:
            if seats is not None:
                await seats.take(priority, deadline, retry_after)
            self.caller_in_flight[caller.name] = self.caller_in_flight.get(caller.name, 0) + 1
            try:
                yield
            finally:
                if seats is not None:
                    seats.release()
                left = self.caller_in_flight[caller.name] - 1
                if left:
                    self.caller_in_flight[caller.name] = left
                else:
                    del self.caller_in_flight[caller.name]
        finally:
            self.open_requests -= 1
            if self.open_requests == 0:
                self.idle.set()
