"""Health-check thresholds: an endpoint changes state only after enough probes in a row say so.

Envoy's ``unhealthy_threshold`` / ``healthy_threshold``, per pool. One missed
probe says little -- a packet lost, a GC pause, the router's own loop late --
and marking an engine down costs every request routed to it (with one
endpoint in a pool, every request of the pool). A probe the loop itself cut
short is no verdict at all (``None``): it neither counts towards down nor
breaks a run of passes.
"""

from __future__ import annotations

import weakref


class HealthStreaks:
    """Runs of probe results against each endpoint's current state (weakly keyed: a retired endpoint is forgotten)."""

    def __init__(self) -> None:
        self._streaks: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

    def judge(self, endpoint: object, healthy: bool, passed: bool | None, *, unhealthy_threshold: int, healthy_threshold: int) -> bool:
        """The endpoint's state after a probe that ``passed`` (None: no verdict), given its state ``healthy`` now."""
        if passed is None:
            return healthy
        if passed == healthy:
            self._streaks.pop(endpoint, None)
            return healthy
        streak = self._streaks.get(endpoint, 0) + 1
        if streak >= (healthy_threshold if passed else unhealthy_threshold):
            self._streaks.pop(endpoint, None)
            return passed
        self._streaks[endpoint] = streak
        return healthy

    def forget(self, endpoint: object) -> None:
        """Drop the endpoint's run: a verdict that needs no run (its first, or a miss that counts at once) was given."""
        self._streaks.pop(endpoint, None)

    def streak(self, endpoint: object) -> int:
        """Probes in a row that disagree with the endpoint's state (0: none)."""
        return self._streaks.get(endpoint, 0)
