"""The ``tailguard_caller_*`` series, bounded: the callers with the most traffic under their names, the rest as one.

Every series a Prometheus server scrapes costs it memory for as long as it
is kept, and a label whose values grow without bound (every API key ever
seen) is the first thing Prometheus's own guidance warns against. So at
most ``[metrics] caller_series`` callers have series of their own; what
every other caller does is summed under ``caller="(other)"`` (a value no key
name can take: names are letters, digits, ``_``, ``.`` and ``-``). The
OpenTelemetry SDK's cardinality limit and Mimir's cost attribution do the
same: the first callers seen take the free places, the rest overflow into
one series. With at most that many keys every key keeps its own, as before.

Which callers: a free place goes to the next caller that finishes a
request; every ``TURN`` seconds the ranking is looked at again, by traffic
(tokens served, plus one a request, halved each turn so it follows recent
use), and a caller without a series takes the place of the named caller
with the least traffic when it has more than twice as much. The factor
keeps two callers of similar traffic from swapping every turn. A caller
whose key a reload removed loses its series once its last request has
ended; requests of callers no key names (a removed key's last ones) count
under ``(other)``.

Counters stay counters. A caller's counts are never moved: when its series
goes (displaced, or its key removed) its history goes with it, and
``(other)`` counts only what callers without a series did while they had
none, so ``(other)`` never goes down, no series ever does, and a sum over
``caller`` of ``rate()`` or ``increase()`` counts every token once (folding
a displaced caller's totals into ``(other)`` would add them a second time).
A caller that gets a series again later starts a new one from 0, with a new
``_created`` timestamp: ``rate()`` takes it as a counter reset, as it would
a restart. ``tailguard_caller_in_flight`` sums the unnamed callers' requests
under ``(other)``; ``tailguard_caller_budget_remaining`` is shown for named
callers only (a sum of what is left of several budgets means nothing).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from tailguard.router.observe import RequestRecord
from tailguard.router.quotas import ANONYMOUS, RateLimits

OTHER = "(other)"
TURN = 60.0  # seconds between re-rankings (the requests' clock: trio.current_time())
_SWAP_FACTOR = 2.0  # a caller without a series displaces the least busy named one with more than this times its traffic


@dataclass(frozen=True)
class CallerSeriesStatistics:
    """How many callers have series of their own, the bound, and how many callers' traffic is being ranked."""

    named: int
    limit: int
    ranked: int


class _Counts:
    """One series set's counts: tokens, the queue-wait histogram (per bucket, not cumulative), rejections by reason."""

    __slots__ = ("buckets", "completion", "created", "prompt", "queue_sum", "rejections")

    def __init__(self, buckets: int) -> None:
        self.prompt = 0
        self.completion = 0
        self.buckets = [0] * (buckets + 1)  # the last is +Inf
        self.queue_sum = 0.0
        self.rejections: dict[str, int] = {}
        self.created = time.time()  # the _created samples: a series that starts again is a new one


class CallerSeries:
    """Counts per caller for /metrics, at most ``limit()`` callers by name.

    ``known()`` is every caller a request may be now (the keys' names);
    ``in_flight()`` the callers with a request queued or running, and how many.
    """

    def __init__(
        self,
        bounds: tuple[float, ...],
        limit: Callable[[], int],
        known: Callable[[], Container[str]],
        in_flight: Callable[[], Mapping[str, int]],
    ) -> None:
        self._bounds = bounds
        self._limit = limit
        self._known = known
        self._in_flight = in_flight
        self._named: dict[str, _Counts] = {}
        self._other = _Counts(len(bounds))
        self._recent: dict[str, float] = {}  # traffic of the current turn, per caller
        self._scores: dict[str, float] = {}  # traffic of the turns before, halved each turn
        self._next_turn: float | None = None

    # -- the hot path -----------------------------------------------------------

    def observe(self, record: RequestRecord) -> None:
        """One finished request of an authenticated caller: its tokens, its wait, its rejection."""
        caller = record.caller
        counts = self._named.get(caller)
        if counts is None:
            counts = self._place(caller)
        tokens = 0
        if record.prompt_tokens is not None and record.admitted_at is not None:  # served: a refused prompt cost nothing
            tokens = record.input_tokens or record.prompt_tokens
            counts.prompt += tokens
        if record.completion_tokens:
            counts.completion += record.completion_tokens
            tokens += record.completion_tokens
        waited = record.queue_seconds
        if waited is not None:
            counts.buckets[bisect.bisect_left(self._bounds, waited)] += 1
            counts.queue_sum += waited
        reason = record.reason
        if reason is not None:
            counts.rejections[reason] = counts.rejections.get(reason, 0) + 1
        self._recent[caller] = self._recent.get(caller, 0.0) + 1.0 + tokens
        now = record.finished_at
        if now is not None:
            if self._next_turn is None:
                self._next_turn = now + TURN
            elif now >= self._next_turn:
                self.turn(now)

    def _place(self, caller: str) -> _Counts:
        """A series of its own for a caller that has none, if a place is free and a key names it; else ``(other)``."""
        if len(self._named) < self._limit() and self._may_name(caller):
            counts = self._named[caller] = _Counts(len(self._bounds))
            return counts
        return self._other

    def _may_name(self, caller: str) -> bool:
        return caller in self._known() or caller == ANONYMOUS.name

    # -- the ranking ----------------------------------------------------------------

    def turn(self, now: float) -> None:
        """Rank the callers again: removed keys' series go, the busiest callers without one take the quietest places."""
        self._next_turn = now + TURN
        named = self._named
        # Halved each turn; a caller without a series whose traffic has faded below a request's is forgotten.
        scores = {name: score / 2 for name, score in self._scores.items() if name in named or score >= 2.0}
        for name, traffic in self._recent.items():
            scores[name] = scores.get(name, 0.0) + traffic
        self._scores, self._recent = scores, {}
        self._drop_removed()
        limit = self._limit()
        quietest = sorted(named, key=lambda name: scores.get(name, 0.0))
        while len(named) > limit:  # the bound was lowered
            del named[quietest.pop(0)]
        waiting = sorted((name for name in scores if name not in named and self._may_name(name)), key=scores.__getitem__, reverse=True)
        for name in waiting:
            if len(named) >= limit:
                if not quietest or scores[name] <= _SWAP_FACTOR * scores.get(quietest[0], 0.0):
                    break
                del named[quietest.pop(0)]
            named[name] = _Counts(len(self._bounds))
        for name in [name for name in scores if name not in named and not self._may_name(name)]:
            del scores[name]

    def _drop_removed(self) -> None:
        """The series of callers no key names any more go, once their last request has ended."""
        in_flight = self._in_flight()
        for name in [name for name in self._named if not self._may_name(name) and name not in in_flight]:
            del self._named[name]
            self._scores.pop(name, None)

    def statistics(self) -> CallerSeriesStatistics:
        return CallerSeriesStatistics(len(self._named), self._limit(), len(self._scores.keys() | self._recent.keys()))

    # -- the scrape -------------------------------------------------------------------

    def collect(self, in_flight: Mapping[str, int], budgets_left: Mapping[str, RateLimits]) -> Iterator[Metric]:
        """The families, as the counts stand; ``in_flight`` and ``budgets_left`` are the router's now."""
        self._drop_removed()
        series = [*self._named.items(), (OTHER, self._other)]
        tokens = CounterMetricFamily(
            "tailguard_caller_tokens",
            "Tokens served per API key name: prompt and completion (the backend's usage; the estimate if it gave none). "
            f'At most [metrics] caller_series callers by name, the rest under caller="{OTHER}".',
            labels=("caller", "kind"),
        )
        queue = HistogramMetricFamily(
            "tailguard_caller_queue_seconds", "Arrival to admission per API key name: the wait its fair share gave it.", labels=("caller",)
        )
        rejections = CounterMetricFamily(
            "tailguard_caller_rejections", "Requests that did not end well per API key name, by reason.", labels=("caller", "reason")
        )
        bounds = [*(str(float(b)) for b in self._bounds), "+Inf"]
        for name, counts in series:
            tokens.add_metric((name, "prompt"), counts.prompt, created=counts.created)
            tokens.add_metric((name, "completion"), counts.completion, created=counts.created)
            cumulative = list(zip(bounds, _accumulate(counts.buckets), strict=True))
            queue.add_metric((name,), cumulative, counts.queue_sum)
            queue.samples.append(Sample("tailguard_caller_queue_seconds_created", {"caller": name}, counts.created))
            for reason, count in list(counts.rejections.items()):
                rejections.add_metric((name, reason), count, created=counts.created)
        yield from (tokens, queue, rejections)
        callers = GaugeMetricFamily(
            "tailguard_caller_in_flight", "Requests in flight (queued or running) per API key name.", labels=("caller",)
        )
        other = 0
        for name, count in in_flight.items():
            if name in self._named:
                callers.add_metric((name,), count)
            else:
                other += count
        callers.add_metric((OTHER,), other)
        yield callers
        left = GaugeMetricFamily(
            "tailguard_caller_budget_remaining",
            "What is left of each API key's budget over the last minute (tokens, requests), across the replicas under [cluster]; "
            "keys with a series of their own that used their budget here in the last minute.",
            labels=("caller", "budget"),
        )
        for name, limits in budgets_left.items():
            if name not in self._named:
                continue
            if limits.limit_tokens is not None:
                left.add_metric((name, "tokens"), limits.remaining_tokens)
            if limits.limit_requests is not None:
                left.add_metric((name, "requests"), limits.remaining_requests)
        yield left


def _accumulate(counts: list[int]) -> list[int]:
    total, out = 0, []
    for count in counts:
        total += count
        out.append(total)
    return out
