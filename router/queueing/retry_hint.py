"""The Retry-After a refusal carries: when a seat is expected, not a constant.

A constant hint sends every client that obeys it back at the same moment,
into the same full queue. A queue refusal (full, timed out, refused early)
says instead how long the queue ahead takes to drain at the pool's measured
rate (the estimate fail-fast already makes), clamped to [floor, 60] s, and
spreads the clients out: each hint is that wait times a uniform draw in
[1, 1.5), so the retries of one burst arrive over half the wait again, never
sooner than a seat is expected. Where nothing is measured yet (a fresh pool,
before its first releases) the hint is the configured floor, spread the same
way: a floor sent as it is brought a fresh pool's whole first burst back in
one instant (``python -m bench retry``: the openai SDK retried them together).
``Retry-After`` is whole seconds on HTTP (rounded up, at least 1); gRPC's
``grpc-retry-pushback-ms`` carries the same value to the millisecond, and so
does HTTP's ``retry-after-ms``.
"""

from __future__ import annotations

import math
import random

__all__ = ["CEILING", "RetryHints", "whole_seconds"]

CEILING = 60.0  # longest hint given: past it a client should rather go elsewhere or give up
SPREAD = 0.5  # hints are spread over [wait, wait * (1 + SPREAD))


def whole_seconds(hint: float) -> int:
    """``Retry-After`` is whole seconds: at least 1, rounded up (a client told 1 s for 0.4 s comes back no sooner)."""
    return max(1, math.ceil(hint))


class RetryHints:
    """Retry-After values for one queue, spread by its own random source (seeded in tests)."""

    __slots__ = ("_random", "computed")

    def __init__(self, rng: random.Random | None = None) -> None:
        self._random = rng if rng is not None else random.Random()
        self.computed = True  # False ([timeouts] retry_after_hint = "fixed"): every hint is the floor, as before

    def for_queue(self, ahead: int, drain_rate: float | None, floor: float) -> float:
        """After a queue refusal: ``ahead`` + 1 seats freed at ``drain_rate`` a second, spread; the floor, spread, when the rate is unknown."""
        if drain_rate is None or drain_rate <= 0:
            return self.spread(floor, floor)
        return self.spread((ahead + 1) / drain_rate, floor)

    def spread(self, wait: float, floor: float) -> float:
        """``wait`` clamped to [floor, CEILING], times a draw in [1, 1 + SPREAD), and never past CEILING."""
        if not self.computed:
            return floor
        ceiling = max(CEILING, floor)  # a configured floor above 60 s is kept, unspread
        base = min(max(wait, floor, 0.0), ceiling)
        if not math.isfinite(base):
            return ceiling
        return min(base * (1.0 + SPREAD * self._random.random()), ceiling)
