"""The backends' own load, read from each endpoint's vLLM ``/metrics``.

The router's queue shows who waits in front of the GPUs; vLLM's gauges show
who waits inside them, and its prefix-cache counters show whether placement
keeps prompts where they are cached. :func:`scrape` reads every endpoint's
/metrics at once and leaves a :class:`BackendLoad` on ``endpoint.load``, so
whoever exports gauges reads plain numbers and never touches HTTP::

    await scrape(endpoints, timeout=2.0)     # e.g. every 5 s, in the router's nursery
    load = endpoint.load                     # None until the first scrape ends
    if load is not None and load.ok:
        ...load.running, load.waiting, load.kv_cache_usage (each may be None)
        ...load.prefix_cache_hit_ratio       # hits / queries since the previous scrape

A backend without /metrics (or not vLLM at all) is normal: its load has
``ok=False`` and no numbers, one INFO line says so, and nothing raises.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import trio
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("tailguard.backend_load")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # vLLM V1 (0.10 and later)
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"  # older vLLM: the same gauge
# vLLM V1's prefix-cache counters, in prompt tokens (vllm/v1/metrics/loggers.py). prometheus_client
# serves a counter's samples with ``_total``; both spellings are read.
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
GPU_PREFIX_CACHE_QUERIES = "vllm:gpu_prefix_cache_queries"  # V1 before the rename: the same counters
GPU_PREFIX_CACHE_HITS = "vllm:gpu_prefix_cache_hits"
GPU_PREFIX_CACHE_HIT_RATE = "vllm:gpu_prefix_cache_hit_rate"  # V0's gauge: blocks, since the engine started
_LOAD_NAMES = (RUNNING, WAITING, KV_CACHE_USAGE, GPU_CACHE_USAGE)
_NAMES = (
    *_LOAD_NAMES, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, GPU_PREFIX_CACHE_QUERIES, GPU_PREFIX_CACHE_HITS, GPU_PREFIX_CACHE_HIT_RATE,
)


@dataclass(frozen=True)
class BackendLoad:
    """One scrape of one endpoint: vLLM's own queue, as it reported it.

    ``ok`` is True when the scrape got Prometheus text carrying at least one
    of vLLM's load gauges; a gauge it did not carry is None. When ``ok`` is
    False every number is None: a failed scrape shows no numbers rather than
    stale ones. ``scraped_at`` is Trio time.

    The prefix-cache counters are the engine's totals since it started, in
    prompt tokens; ``prefix_cache_hit_ratio`` is hits over queries between
    the previous scrape and this one (:func:`hit_ratio`), None when the
    engine looked nothing up meanwhile, or this is the first good scrape.
    """

    running: float | None
    waiting: float | None
    kv_cache_usage: float | None  # fraction of the KV cache in use, 0..1
    ok: bool
    scraped_at: float
    prefix_cache_queries: float | None = None  # prompt tokens looked up in the prefix cache, ever
    prefix_cache_hits: float | None = None  # of them, tokens found cached, ever
    prefix_cache_hit_ratio: float | None = None  # 0..1, over the last scrape interval

    @classmethod
    def failed(cls, scraped_at: float) -> BackendLoad:
        return cls(running=None, waiting=None, kv_cache_usage=None, ok=False, scraped_at=scraped_at)


def parse_vllm_metrics(text: str, *, scraped_at: float, previous: BackendLoad | None = None) -> BackendLoad:
    """The load in a vLLM /metrics text; ``ok=False`` if it has none.

    Running, waiting and the prefix-cache counters are summed over label
    sets (one per model name or engine); KV-cache usage is the fullest one's.
    ``previous`` (the endpoint's last scrape) is the baseline of the hit
    ratio. Only the lines of the gauges and counters named above reach
    prometheus_client's parser: parsing all ~100 KB of vLLM's
    histograms blocks the event loop ~15 ms per endpoint per scrape, which
    the router's tail latency would pay; selecting lines by name first is
    ~50 times cheaper (measured). Unrelated broken lines therefore do not
    spoil the scrape.
    """
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_NAMES))
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(wanted):
            for sample in family.samples:
                value = float(sample.value)
                name = sample.name.removesuffix("_total")  # a counter's sample (``_created`` is no value: skipped)
                if name not in _NAMES or not math.isfinite(value):
                    continue
                sums[name] = sums.get(name, 0.0) + value
                maxima[name] = max(maxima.get(name, value), value)
    except ValueError:  # the parser's only error for malformed text
        return BackendLoad.failed(scraped_at)
    if not any(name in sums for name in _LOAD_NAMES):
        return BackendLoad.failed(scraped_at)
    queries = sums.get(PREFIX_CACHE_QUERIES, sums.get(GPU_PREFIX_CACHE_QUERIES))
    hits = sums.get(PREFIX_CACHE_HITS, sums.get(GPU_PREFIX_CACHE_HITS))
    ratio = hit_ratio(queries, hits, previous)
    if queries is None:  # V0: no counters, its own ratio since start (-1 without prefix caching)
        v0 = maxima.get(GPU_PREFIX_CACHE_HIT_RATE)
        ratio = v0 if v0 is not None and 0.0 <= v0 <= 1.0 else None
    return BackendLoad(
        running=sums.get(RUNNING),
        waiting=sums.get(WAITING),
        kv_cache_usage=maxima.get(KV_CACHE_USAGE, maxima.get(GPU_CACHE_USAGE)),
        ok=True,
        scraped_at=scraped_at,
        prefix_cache_queries=queries,
        prefix_cache_hits=None if queries is None else hits,
        prefix_cache_hit_ratio=ratio,
    )


def hit_ratio(queries: float | None, hits: float | None, previous: BackendLoad | None) -> float | None:
    """Hits over queries since ``previous``'s counters; None without a baseline or without queries meanwhile.

    Counters that went down mean the engine restarted: its totals are then
    the interval's, as Prometheus's ``rate()`` reads a reset. Clamped to
    0..1, so a replica's mixed-up counters cannot show an impossible ratio.
    """
    if queries is None or hits is None or previous is None:
        return None
    before_queries, before_hits = previous.prefix_cache_queries, previous.prefix_cache_hits
    if before_queries is None or before_hits is None:
        return None
    asked, found = queries - before_queries, hits - before_hits
    if asked < 0 or found < 0:
        asked, found = queries, hits
    if asked <= 0:
        return None
    return min(1.0, max(0.0, found / asked))


class MetricsSource(Protocol):
    """What a scrape needs of an endpoint (router/fleet/endpoint.py's ``Endpoint`` is one): its URL, its /metrics, where the load goes."""

    url: str
    load: BackendLoad | None

    @property
    def probe(self) -> _MetricsProbe: ...


class _MetricsProbe(Protocol):
    async def metrics_text(self) -> str | None: ...


async def scrape(endpoints: Iterable[MetricsSource], *, timeout: float) -> None:
    """Scrape every endpoint's /metrics concurrently; set each ``endpoint.load``.

    Each scrape gets ``timeout`` seconds and the call returns when all have
    ended, so it takes at most ``timeout``. Keep that below the health
    check's timeout: a health probe waits for the probe connection while a
    scrape holds it. Never raises for a backend's failure. Logs once when an
    endpoint's load becomes unavailable and once when it comes back, not on
    every scrape.
    """
    async with trio.open_nursery() as nursery:
        for endpoint in endpoints:
            nursery.start_soon(_scrape_one, endpoint, timeout)


async def _scrape_one(endpoint: MetricsSource, timeout: float) -> None:
    text: str | None = None
    with trio.move_on_after(timeout) as scope:
        text = await endpoint.probe.metrics_text()
    now = trio.current_time()
    previous = endpoint.load
    load = BackendLoad.failed(now) if text is None else parse_vllm_metrics(text, scraped_at=now, previous=previous)
    endpoint.load = load
    if load.ok:
        if previous is not None and not previous.ok:
            log.info("endpoint %s: /metrics reports vLLM's load again", endpoint.url)
        return
    if previous is not None and not previous.ok:
        return
    if scope.cancelled_caught:
        reason = f"did not answer in {timeout:g} s"
    elif text is None:
        reason = "is unavailable (unreachable, not 200, or too large)"
    else:
        reason = "carries no vLLM load gauges"
    log.info("endpoint %s: /metrics %s; no engine-side load is shown for it meanwhile", endpoint.url, reason)
