"""``tailguard_placements_total``: how each seated request's endpoint was chosen, per pool and endpoint.

Placement inside a pool (router/fleet/policies.py) decides per request whether it
went to its prefix key's home, spilled past the load bound to a later
rendezvous choice, had no key, sat on a borrowed seat, or the pool places
by least load. A rising ``spilled`` share says the pool is too hot for
affinity to hold (docs/operations.md).

Counts come from finished records (a telemetry sink), once per request that
got a seat, under the endpoint and decision of its last attempt: a retry
moves the request (router/fleet/pool.py ``Lease.move``) and is not counted apart
(``tailguard_backend_retries`` counts those per pool). The endpoint label
follows DNS and rebalancing, so the counts are a collector over a dict, not
a ``prometheus_client.Counter`` (whose label sets live forever): at each
scrape the series of endpoints no longer in the fleet are dropped, as the
other per-endpoint series (read from the fleet at scrape time) vanish with
them. An endpoint that comes back starts again from 0, which Prometheus's
``rate()`` reads as a counter reset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from tailguard.router.observe import RequestRecord

NAME = "tailguard_placements"
DOC = (
    "Seated requests by how their endpoint was chosen (decision: home, spilled, no_key, hot_key, borrowed, least_loaded), "
    "counted once a request at its last attempt's endpoint."
)
LABELS = ("pool", "endpoint", "decision")


class PlacementCounts(Collector):
    """Counts of placement decisions; :meth:`count` is the telemetry sink, ``live_endpoints`` the fleet's URLs now."""

    def __init__(self, live_endpoints: Callable[[], Iterable[str]]) -> None:
        self._live = live_endpoints
        self._counts: dict[tuple[str, str, str], int] = {}

    def count(self, record: RequestRecord) -> None:
        """One finished request; one that never got a seat has no placement and is not counted."""
        if record.placement is None or record.endpoint is None:
            return
        key = (record.pool, record.endpoint, record.placement)
        self._counts[key] = self._counts.get(key, 0) + 1

    def describe(self) -> Iterator[Metric]:
        return iter(())  # label sets follow the fleet: describe nothing, collect all

    def collect(self) -> Iterator[Metric]:
        live = frozenset(self._live())
        for key in [key for key in self._counts if key[1] not in live]:
            del self._counts[key]
        family = CounterMetricFamily(NAME, DOC, labels=LABELS)
        for labels, count in self._counts.items():
            family.add_metric(labels, count)
        yield family
