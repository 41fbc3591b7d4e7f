"""The router's garbage-collector pauses, from ``tailguard_gc_pause_seconds`` on its /metrics: scraped, and differenced per generation.

Percentiles and max are bucket upper bounds (a pause "<= 2 ms"), from the
histogram; the mean is exact.
"""

from __future__ import annotations

import collections
import math
import sys
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.client import HOST

GC_METRIC = "tailguard_gc_pause_seconds"
SCRAPE_TIMEOUT_S = 30.0

Buckets = dict[str, list[tuple[float, float]]]  # generation -> [(upper bound, cumulative count)], and "sum:G"


Scrape = tuple[Buckets, dict[str, float]] | None  # None: the router did not answer in time


async def scrape_gc(port: int) -> Scrape:
    """``tailguard_gc_pause_seconds`` from the router's /metrics: buckets and sums by generation."""
    began = time.perf_counter()
    try:
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
            page = (await client.get(f"http://{HOST}:{port}/metrics")).text
    except httpx.HTTPError as error:
        print(f"  (no /metrics from the router: {type(error).__name__} after {time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)
        return None
    if time.perf_counter() - began > 1.0:
        print(f"  (scraping /metrics took {time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)
    buckets: Buckets = collections.defaultdict(list)
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        if family.name != GC_METRIC:
            continue
        for sample in family.samples:
            generation = sample.labels["generation"]
            if sample.name.endswith("_bucket"):
                buckets[generation].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                sums[generation] = sample.value
    if not buckets:
        raise RuntimeError(f"the router's /metrics has no {GC_METRIC}: is it older than the GC pause metric?")
    return buckets, sums


@dataclass
class GcPauses:
    """One generation's pauses between two scrapes; percentiles and max are bucket upper bounds."""

    generation: str
    count: int
    per_s: float
    paused_ms_per_s: float  # the time the process stood still, per second of wall time
    mean_ms: float | None
    p50_le_ms: float | None
    p99_le_ms: float | None
    max_le_ms: float | None  # inf: above the largest bucket


def gc_delta(before: Scrape, after: Scrape, wall: float) -> list[GcPauses]:
    """Each generation's pauses between two scrapes (none when either failed)."""
    if before is None or after is None:
        return []
    rows = []
    for generation in sorted(after[0]):
        old = dict(before[0].get(generation, []))
        bounds = [b for b, _ in after[0][generation]]
        cumulative = [c - old.get(b, 0.0) for b, c in after[0][generation]]
        count = int(cumulative[-1]) if cumulative else 0
        total = after[1].get(generation, 0.0) - before[1].get(generation, 0.0)

        def rank(q: float) -> float | None:
            if count == 0:
                return None
            needed = max(1, math.ceil(q * count))
            return next(b for b, c in zip(bounds, cumulative, strict=True) if c >= needed) * 1000

        rows.append(
            GcPauses(generation, count, count / wall, total / wall * 1000, total / count * 1000 if count else None, rank(0.5), rank(0.99), rank(1.0))
        )
    return rows
