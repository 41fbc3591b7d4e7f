"""Outlier detection, in Envoy's terms: passive health checking of each host from its live traffic.

A host (endpoint) is ejected after ``consecutive_failures`` failed requests
in a row (Envoy's consecutive 5xx), or when its failure percentage over the
last ``failure_window`` requests is at least ``failure_ratio`` and more than
twice its siblings' (Envoy's failure-percentage detection, judged against
the pool). An ejection lasts ``base_ejection_time`` times the ejections in a
row, at most ``max_ejection_time``; at most ``max_ejection_percent`` of a
pool's hosts are ejected at once. When the time runs out the host is
half-open (``Endpoint.ejected``): one request at a time until one succeeds,
and a failure then ejects it again at once.
"""

from __future__ import annotations

import logging
import math

import trio

from ..config import OutlierDetectionConfig
from ..errors import BackendError
from .endpoint import Endpoint
from .pool import Pool

log = logging.getLogger("tailguard.router")


def record_success(pool: Pool, endpoint: Endpoint) -> None:
    """The endpoint answered properly (a 4xx included): its run of failures ends, and a trial passes."""
    endpoint.failures_in_a_row = 0
    if endpoint.half_open:
        endpoint.half_open = False
        pool.queue.dispatch()  # its full cap is back
    outlier = pool.config.outlier_detection
    if outlier.failure_ratio:
        _note_outcome(endpoint, False, outlier.failure_window, outlier.failure_min_requests)


def record_failure(pool: Pool, endpoint: Endpoint) -> float | None:
    """Count a failed request; eject the endpoint after enough in a row.

    Returns the ejection's length in seconds, or None when the endpoint
    stays in: not enough failures yet, or the pool already has its
    ``max_ejection_percent`` of endpoints ejected (rounded down, so the
    only endpoint of a pool is never ejected by live traffic alone).
    """
    outlier = pool.config.outlier_detection
    if endpoint.ejected:
        return None  # requests that were running when it was ejected say nothing new
    endpoint.failures_in_a_row += 1
    if outlier.failure_ratio:
        _note_outcome(endpoint, True, outlier.failure_window, outlier.failure_min_requests)
    on_trial, endpoint.half_open = endpoint.half_open, False
    if not on_trial and endpoint.failures_in_a_row < outlier.consecutive_failures and not _failure_percentage_over(pool, endpoint):
        return None
    allowed = math.floor(len(pool.endpoints) * outlier.max_ejection_percent / 100 + 1e-9)
    if sum(e.ejected for e in pool.endpoints) + 1 > allowed:
        return None
    return _eject(endpoint, outlier)


def report_failure(pool: Pool, endpoint: Endpoint, error: BackendError) -> None:
    """A call to ``endpoint`` failed: count it (``record_failure``) and log an ejection, with why."""
    if not pool.holds(endpoint):
        return  # moved or removed by a reload meanwhile: its new pool judges it
    # Read before the verdict: an ejection starts the endpoint's record afresh.
    in_a_row, failed, seen = endpoint.failures_in_a_row + 1, endpoint.recent_failures + 1, endpoint.outcomes + 1
    on_trial = endpoint.half_open
    seconds = record_failure(pool, endpoint)
    if seconds is not None:
        outlier = pool.config.outlier_detection
        if on_trial:
            why = "its first request back from an ejection failed"
        elif in_a_row >= outlier.consecutive_failures:
            why = f"{in_a_row} failures in a row"
        else:
            why = f"{failed} of its last {min(seen, outlier.failure_window)} requests failed"
        log.warning("endpoint %s ejected from pool %s for %g s: %s (last: %s)", endpoint.url, pool.name, seconds, why, error.log_text)


def _failure_percentage_over(pool: Pool, endpoint: Endpoint) -> bool:
    """The failure-ratio rule: at least ``failure_ratio`` of its recent requests failed, and
    more than twice the share of the pool's other endpoints (a fault of the traffic, or of
    something all share, is not this engine's)."""
    outlier = pool.config.outlier_detection
    if not outlier.failure_ratio or endpoint.outcomes < outlier.failure_min_requests:
        return False
    share = endpoint.recent_failures / endpoint.outcomes
    if share < outlier.failure_ratio:
        return False
    others = [e for e in pool.endpoints if e is not endpoint and not e.ejected]
    seen = sum(e.outcomes for e in others)
    rest = sum(e.recent_failures for e in others) / seen if seen else 0.0
    return share > 2 * rest


def _eject(endpoint: Endpoint, outlier: OutlierDetectionConfig) -> float:
    """Take it out for base x (times ejected), at most the maximum; returns the seconds.

    The multiplier forgets an endpoint's past once it has gone a whole
    ``max_ejection_time`` without an ejection.
    """
    now = trio.current_time()
    if now - endpoint.ejection_ended_at > outlier.max_ejection_time:
        endpoint.ejections_in_a_row = 0
    endpoint.ejections_in_a_row += 1
    endpoint.ejections += 1
    seconds = min(outlier.base_ejection_time * endpoint.ejections_in_a_row, outlier.max_ejection_time)
    endpoint.ejected_until = now + seconds
    endpoint.failures_in_a_row = 0
    endpoint.outcome_window.clear()  # back from the ejection with a clean record
    endpoint.recent_failures = endpoint.failure_load = 0
    return seconds


def _note_outcome(endpoint: Endpoint, failed: bool, window: int, evidence: int) -> None:
    """One request's verdict, into the window of the last ``window``; failures weigh on
    placement once the window holds ``evidence`` verdicts (one failure proves nothing)."""
    outcomes = endpoint.outcome_window
    outcomes.append(failed)
    endpoint.recent_failures += failed
    while len(outcomes) > window:
        endpoint.recent_failures -= outcomes.popleft()
    endpoint.failure_load = endpoint.recent_failures if len(outcomes) >= evidence else 0
