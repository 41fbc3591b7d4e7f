"""How fast a lending endpoint answers its own streamed requests lately: lending stops while that is over budget.

A borrowed request shares every engine step with the lender's own. The
prefill bound (``LendConfig.prefills``) caps what one borrowed prompt adds
to a step; ``LendConfig.ttft_budget`` watches the effect itself: the time
from a seat's grant to the engine's first byte, for the lender's own
streamed requests (a non-streamed one's first byte is its whole answer, so
it says nothing about the first token), averaged over the last few.
"""

from __future__ import annotations

import math


class RecentMean:
    """A recent mean of a figure of one endpoint's own streams: its grant-to-first-byte seconds
    (``Endpoint.own_first_token``), or its seconds a token after the first (``Endpoint.own_token_gap``).

    Weighted 1/4, so a few slow answers in a row raise it past a budget
    and a few fast ones bring it back; evidence older than ``STALE_AFTER``
    seconds (no own request streamed since) is not held against lending.
    """

    WEIGHT = 0.25
    STALE_AFTER = 5.0

    __slots__ = ("mean", "observed_at")

    def __init__(self) -> None:
        self.mean = 0.0
        self.observed_at = -math.inf

    def observe(self, seconds: float, now: float) -> None:
        """One own stream's figure: ``seconds``."""
        if now >= self.stale_at:
            self.mean = seconds
        else:
            self.mean += self.WEIGHT * (seconds - self.mean)
        self.observed_at = now

    @property
    def stale_at(self) -> float:
        """When the evidence so far stops counting."""
        return self.observed_at + self.STALE_AFTER

    def over(self, budget: float, now: float) -> bool:
        """The recent mean exceeds ``budget`` seconds, on evidence that is still fresh."""
        return now < self.stale_at and self.mean > budget


class RecentPeak:
    """The most seats a pool's own requests held at once in the last one to two ``WINDOW``s.

    Lending ``when = "busier"`` keeps that many free for them: a seat lent
    to a long job is away for its whole generation, so a burst like the
    last one must still find its seats.
    """

    WINDOW = 30.0

    __slots__ = ("_current", "_previous", "_started")

    def __init__(self) -> None:
        self._current = 0
        self._previous = 0
        self._started = -math.inf

    def _roll(self, now: float) -> None:
        if now - self._started >= self.WINDOW:
            self._previous = self._current if now - self._started < 2 * self.WINDOW else 0
            self._current = 0
            self._started = now

    def observe(self, held: int, now: float) -> None:
        """The pool's own requests hold ``held`` seats now."""
        self._roll(now)
        self._current = max(self._current, held)

    def peak(self, now: float) -> int:
        self._roll(now)
        return max(self._current, self._previous)

    def forgotten_at(self) -> float:
        """When the peak seen so far is forgotten, if nothing more is observed (-inf: nothing to forget)."""
        if self._current:
            return self._started + 2 * self.WINDOW
        return self._started + self.WINDOW if self._previous else -math.inf
