"""Prometheus metrics at ``GET /metrics``: one explicit registry per process, no globals.

Per-request histograms and counters are fed by :meth:`Metrics.observe` (a
telemetry sink); pool, endpoint and backend gauges are read from the router
at scrape time by a collector, so they are never stale and cost nothing
between scrapes. Buckets resolve both 20 ms (an interactive TTFT) and 60 s
(a long generation). The garbage collector's pauses are timed by a
``gc.callbacks`` hook that lives as long as the :class:`Metrics` object.
The process's own series (``process_cpu_seconds_total``,
``process_resident_memory_bytes``, ``process_open_fds``, ...: the ones
every Prometheus client exports, which the default registry would carry but
this one does not) come from prometheus_client's ``ProcessCollector`` on the
same registry, so each ``--workers`` process shows its own on its own port.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from tailguard.router import Router, RouterStatistics
from tailguard.router.observe import LoopLag, RequestRecord
from tailguard.server.caller_series import CallerSeries
from tailguard.server.placement_metrics import PlacementCounts

CONTENT_TYPE = CONTENT_TYPE_LATEST

SECONDS_BUCKETS = (
    0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75,
    1.0, 1.5, 2.5, 4.0, 6.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0,
)  # fmt: skip
# Actual over predicted: 1 is a perfect prediction; the buckets resolve a few per cent near it, and 8x either way.
RATIO_BUCKETS = (0.125, 0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)
PER_TOKEN_BUCKETS = (0.002, 0.005, 0.008, 0.012, 0.016, 0.02, 0.025, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# 0.1 ms (a young collection of a few thousand objects) to 200 ms (a full one over a big heap).
GC_PAUSE_BUCKETS = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2,
)  # fmt: skip

_REQUEST_LABELS = ("class", "pool", "outcome")


class Metrics:
    """tailguard's metrics on their own registry; ``render()`` is the scrape."""

    def __init__(self, router: Router, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _REQUEST_LABELS, buckets=buckets, registry=r)

        self.queue = histogram(
            "tailguard_request_queue_seconds", "Arrival to admission: time waiting for a seat in the pool.", SECONDS_BUCKETS
        )
        self.ttft = histogram(
            "tailguard_request_ttft_seconds", "Arrival to the first streamed token (streaming requests, and whole answers assembled from a stream).", SECONDS_BUCKETS
        )
        self.decode = histogram(
            "tailguard_request_decode_seconds", "First streamed token to the end: generation after prefill.", SECONDS_BUCKETS
        )
        self.per_token = histogram(
            "tailguard_request_time_per_output_token_seconds",
            "Decode time per output token after the first (streaming requests).",
            PER_TOKEN_BUCKETS,
        )
        self.e2e = histogram("tailguard_request_e2e_seconds", "Arrival to the last byte or the error.", SECONDS_BUCKETS)
        self.prompt_tokens = histogram(
            "tailguard_request_prompt_tokens", "tailguard's estimate of prompt tokens (what caps, classes and budgets use; not the engine's count), of requests that were sized.", TOKEN_BUCKETS
        )
        self.completion_tokens = histogram(
            "tailguard_request_completion_tokens",
            "Completion tokens: the backend's usage when it reports one, else streamed events.",
            TOKEN_BUCKETS,
        )
        self.requests = Counter("tailguard_requests", "Finished requests by class, pool and outcome.", _REQUEST_LABELS, registry=r)
        self.rejections = Counter(
            "tailguard_rejections",
            "Requests that did not end well, by reason (input_cap, queue_full, queue_timeout, no_backend, "
            "e2e_timeout, client_cancelled, ...).",
            ("class", "pool", "reason"),
            registry=r,
        )
        self.clamped = Counter(
            "tailguard_max_tokens_clamped", "Requests whose max_tokens was lowered to the output cap.", ("class", "pool"), registry=r
        )
        self.first_byte_prediction = Histogram(
            "tailguard_first_byte_prediction_ratio",
            "A stream's time from call to the engine's first byte over what its engine's learnt model predicted (1: exact).",
            ("pool",),
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.service_prediction = Histogram(
            "tailguard_service_prediction_ratio",
            "A served request's seconds from its seat to its end over what its class's service time predicted at admission (1: exact).",
            ("class",),
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.engine_queue = Histogram(
            "tailguard_engine_queue_seconds",
            "Seconds a request waited in its engine's own queue, as the engine reported it (vLLM's --enable-per-request-metrics): "
            "above 0, tailguard seats more there than the engine runs at once.",
            ("pool",),
            buckets=(0.0, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 60.0),
            registry=r,
        )
        self.objective = Counter(
            "tailguard_objective_requests",
            "Requests judged against their class's objective (docs/objectives.md), by whether they met it (met: true, false).",
            ("class", "met"),
            registry=r,
        )
        self.reloads = Counter("tailguard_config_reloads", "Config reloads by result (ok, failed).", ("result",), registry=r)
        self.repeated_ids = Counter(
            "tailguard_duplicate_request_ids",
            "Caller-supplied x-request-ids seen again within the window: client retries.",
            registry=r,
        )
        # Per caller (the API key's name, never the key; anonymous callers as one): at most
        # [metrics] caller_series of them by name, the rest as one (server/caller_series.py).
        self.callers = CallerSeries(
            SECONDS_BUCKETS, lambda: router.config.metrics.caller_series, lambda: router.caller_names, lambda: router.caller_in_flight
        )
        for result in ("ok", "failed"):
            self.reloads.labels(result)
        self._children: dict[tuple[str, str, str], tuple[Any, ...]] = {}
        r.register(_RouterCollector(router, self.callers))
        r.register(_LoopLagCollector(router.loop_lag))
        self.placements = PlacementCounts(lambda: (endpoint.url for endpoint in router.endpoints))
        r.register(self.placements)
        self.gc_pauses = GcPauses()
        r.register(self.gc_pauses)
        ProcessCollector(registry=r)  # this process's CPU, memory, fds and start time (Linux /proc; nothing elsewhere)
        gc.callbacks.append(self.gc_pauses.on_gc)
        # The hook must not keep this object alive, nor outlive it: it is
        # removed by close(), or when this object is garbage.
        self._unhook = weakref.finalize(self, _remove_gc_callback, self.gc_pauses.on_gc)

    def close(self) -> None:
        """Stop timing the garbage collector (idempotent; also done when this object is garbage)."""
        self._unhook()

    def observe(self, record: RequestRecord) -> None:
        """Telemetry sink: one finished request."""
        outcome = record.outcome or "ok"
        key = (record.request_class, record.pool, outcome)
        children = self._children.get(key)
        if children is None:  # .labels() costs a lock and a tuple build: cache per label set
            children = tuple(
                metric.labels(*key)
                for metric in (self.queue, self.ttft, self.decode, self.per_token, self.e2e, self.prompt_tokens, self.completion_tokens, self.requests)
            )
            self._children[key] = children
        queue, ttft, decode, per_token, e2e, prompt_tokens, completion_tokens, requests = children
        requests.inc()
        for histogram, value in (
            (queue, record.queue_seconds),
            (ttft, record.ttft_seconds),
            (decode, record.decode_seconds),
            (per_token, record.time_per_output_token),
            (e2e, record.e2e_seconds),
            (prompt_tokens, record.prompt_tokens),
            (completion_tokens, record.completion_tokens),
        ):
            if value is not None:
                histogram.observe(value)
        self._observe_caller(record)
        if record.reason is not None:
            self.rejections.labels(record.request_class, record.pool, record.reason).inc()
        if record.clamped:
            self.clamped.labels(record.request_class, record.pool).inc()
        if record.first_byte_seconds is not None and record.first_byte_predicted:
            self.first_byte_prediction.labels(record.pool).observe(record.first_byte_seconds / record.first_byte_predicted)
        if record.service_predicted and (served := record.service_seconds) is not None:
            self.service_prediction.labels(record.request_class).observe(served / record.service_predicted)
        if record.engine_queue is not None:
            self.engine_queue.labels(record.pool).observe(record.engine_queue)
        if record.objective_met is not None:
            self.objective.labels(record.request_class, "true" if record.objective_met else "false").inc()
        self.placements.count(record)

    def _observe_caller(self, record: RequestRecord) -> None:
        """The caller's share: its tokens, its wait, its rejections (a request with no valid key is nobody's)."""
        if record.reason != "unauthenticated":
            self.callers.observe(record)

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("ok" if ok else "failed").inc()

    def repeated_request_id(self) -> None:
        self.repeated_ids.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove_gc_callback(callback: Callable[[str, dict[str, int]], None]) -> None:
    with contextlib.suppress(ValueError):  # someone else removed it
        gc.callbacks.remove(callback)


class GcPauses(Collector):
    """``tailguard_gc_pause_seconds{generation}``: how long each garbage collection stopped the process.

    :meth:`on_gc` is a ``gc.callbacks`` hook: it runs inside a collection, on
    whatever thread allocated the object that triggered it, so it is cheap
    (two clock reads, a bisect, two additions) and takes no lock. That is why
    this is a collector over plain counters and not a ``prometheus_client``
    ``Histogram``: ``Histogram.observe`` takes a non-reentrant
    ``threading.Lock``, and a collection can start on a thread that holds
    that very lock (a scrape reading the histogram) -- a deadlock. Counters
    without a lock are exact because collections never overlap: CPython runs
    one at a time (a free-threaded build stops the world for it). The clock
    is ``time.perf_counter``: a collection is outside any Trio run.
    """

    NAME = "tailguard_gc_pause_seconds"
    DOC = "Garbage-collector pauses by generation (0 youngest, 2 full): the whole process stops for each."

    def __init__(self, buckets: tuple[float, ...] = GC_PAUSE_BUCKETS) -> None:
        self._bounds = buckets
        self._counts = [[0] * (len(buckets) + 1) for _ in range(3)]  # per bucket, not cumulative; the last is +Inf
        self._sums = [0.0, 0.0, 0.0]
        self._started: float | None = None

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks`` hook: time from "start" to "stop" of one collection."""
        if phase == "start":
            self._started = time.perf_counter()
            return
        started, self._started = self._started, None
        if started is None:  # hooked in mid-collection
            return
        pause = time.perf_counter() - started
        generation = info["generation"]
        self._counts[generation][bisect.bisect_left(self._bounds, pause)] += 1
        self._sums[generation] += pause

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.NAME, self.DOC, labels=("generation",))

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.NAME, self.DOC, labels=("generation",))
        bounds = [*(str(float(b)) for b in self._bounds), "+Inf"]
        for generation, (counts, total) in enumerate(zip(self._counts, self._sums, strict=True)):
            cumulative = itertools.accumulate(list(counts))  # a copy: a collection may count meanwhile
            family.add_metric((str(generation),), list(zip(bounds, cumulative, strict=True)), total)
        yield family


class _LoopLagCollector(Collector):
    """``tailguard_event_loop_lag_seconds``: how late the Trio loop's monitor woke, each tick (router/observe/loop_lag.py).

    A histogram of every wake-up since start (its P99 under load says how
    long the loop stalls), and a gauge of the latest and the worst.
    """

    def __init__(self, lag: LoopLag) -> None:
        self._lag = lag

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        stats = self._lag.statistics()
        family = HistogramMetricFamily(
            "tailguard_event_loop_lag_seconds",
            f"How late the event loop woke a task sleeping {stats.tick:g} s, once a tick: its stalls (the router's "
            "verdicts about engines discount them).",
            labels=(),
        )
        family.add_metric((), [(str(float(bound)) if bound != float("inf") else "+Inf", count) for bound, count in stats.buckets], stats.total)
        yield family
        latest = GaugeMetricFamily("tailguard_event_loop_lag_last_seconds", "The event loop monitor's latest lag.", labels=())
        latest.add_metric((), stats.last)
        yield latest
        worst = GaugeMetricFamily("tailguard_event_loop_lag_max_seconds", "The event loop monitor's worst lag since start.", labels=())
        worst.add_metric((), stats.worst)
        yield worst


class _RouterCollector(Collector):
    """Gauges read from the router at scrape time."""

    def __init__(self, router: Router, callers: CallerSeries) -> None:
        self._router = router
        self._callers = callers

    def describe(self) -> Iterator[Metric]:
        return iter(())  # label sets change with the config: describe nothing, collect all

    def collect(self) -> Iterator[Metric]:
        stats = self._router.statistics()
        info = _gauge("tailguard_config_info", "The loaded config's digest (value 1).", ("digest",))
        info.add_metric((stats.config_digest,), 1)
        yield info
        draining = _gauge("tailguard_draining", "1 while shutting down: new requests get 503.", ())
        draining.add_metric((), int(stats.draining))
        yield draining
        yield from _pools(stats)
        yield from _endpoints(stats)
        retries = CounterMetricFamily(
            "tailguard_backend_retries", "Calls that failed before any response and were tried again on another endpoint.", labels=("pool",)
        )
        for name, count in (stats.retries or {}).items():
            retries.add_metric((name,), count)
        yield retries
        yield from _sharing(stats)
        yield from _prompt_ratios(stats)
        yield from _attainment(self._router)
        clients = _gauge("tailguard_backend_clients", "Open HTTP clients to backends (retired ones still closing included).", ())
        clients.add_metric((), stats.backend_clients)
        yield clients
        yield from self._callers.collect(stats.caller_in_flight, stats.budgets_left)


def _attainment(router: Router) -> Iterator[Metric]:
    """Each class's objective, and the share of its last minute's requests that met it."""
    klass = ("class",)
    attainment = _gauge("tailguard_class_attainment", "The share of the class's requests judged in the last 60 s that met its objective.", klass)
    target = _gauge("tailguard_class_attainment_target", "The share that must meet it: the objective's percentile / 100.", klass)
    judged = _gauge("tailguard_class_judged", "Requests of the class judged against its objective in the last 60 s.", klass)
    objective = _gauge(
        "tailguard_class_objective_seconds", "The class's objective: ttft, itl (per output token) and e2e targets.", ("class", "target")
    )
    share = _gauge(
        "tailguard_class_throughput_share", "The class's share of the output tokens of every class's requests judged in the last 60 s.", klass
    )
    for shown in router.attainment():
        target.add_metric((shown.name,), shown.target)
        if shown.throughput_share is not None:
            share.add_metric((shown.name,), shown.throughput_share)
        judged.add_metric((shown.name,), shown.judged)
        if shown.attainment is not None:
            attainment.add_metric((shown.name,), shown.attainment)
    for config in router.config.classes:
        for name, seconds in (("ttft", config.objective.ttft), ("itl", config.objective.itl), ("e2e", config.objective.e2e)):
            if seconds is not None:
                objective.add_metric((config.name, name), seconds)
    yield from (attainment, target, judged, share, objective)


def _gauge(name: str, doc: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _pools(stats: RouterStatistics) -> Iterator[Metric]:
    """Each pool's seats, queue and healthy endpoints."""
    pool = ("pool",)
    pool_gauges = {
        "in_flight": _gauge("tailguard_pool_in_flight", "Requests holding a seat in the pool.", pool),
        "max_concurrency": _gauge("tailguard_pool_max_concurrency", "The pool's concurrency cap.", pool),
        "queue_length": _gauge("tailguard_pool_queue_length", "Requests waiting for a seat.", pool),
        "max_queue": _gauge("tailguard_pool_max_queue", "The pool's queue bound; beyond it, 429.", pool),
        "healthy_endpoints": _gauge(
            "tailguard_pool_healthy_endpoints", "Endpoints that may take requests (healthy and not ejected).", pool
        ),
    }
    for p in stats.pools:
        values = {
            "in_flight": p.in_flight,
            "max_concurrency": p.max_concurrency,
            "queue_length": p.queue.waiting,
            "max_queue": p.queue.max_waiting,
            "healthy_endpoints": p.healthy_endpoints,
        }
        for key, family in pool_gauges.items():
            family.add_metric((p.name,), values[key])
    yield from pool_gauges.values()


def _endpoints(stats: RouterStatistics) -> Iterator[Metric]:
    """Each endpoint's seats and health as tailguard sees them, and its engine's own load as scraped."""
    endpoint = ("pool", "endpoint")
    in_flight = _gauge("tailguard_endpoint_in_flight", "Requests tailguard has running on the endpoint.", endpoint)
    cap = _gauge("tailguard_endpoint_max_concurrency", "The endpoint's concurrency cap.", endpoint)
    healthy = _gauge("tailguard_endpoint_healthy", "1 when the endpoint passes its health check.", endpoint)
    running = _gauge("tailguard_backend_requests_running", "The engine's own running count (vllm:num_requests_running).", endpoint)
    waiting = _gauge("tailguard_backend_requests_waiting", "The engine's own queue (vllm:num_requests_waiting).", endpoint)
    kv = _gauge("tailguard_backend_kv_cache_usage_ratio", "The engine's KV-cache usage, 0 to 1.", endpoint)
    scrape_ok = _gauge("tailguard_backend_scrape_ok", "1 when the last scrape of the engine's /metrics worked.", endpoint)
    hit_ratio = _gauge(
        "tailguard_backend_prefix_cache_hit_ratio",
        "The engine's prefix-cache hits over queries (tokens) between tailguard's last two scrapes; absent when it looked nothing up.",
        endpoint,
    )
    queried = CounterMetricFamily(
        "tailguard_backend_prefix_cache_queried_tokens", "Prompt tokens the engine looked up in its prefix cache (vllm:prefix_cache_queries).", labels=endpoint
    )
    hit = CounterMetricFamily(
        "tailguard_backend_prefix_cache_hit_tokens", "Of them, tokens found cached (vllm:prefix_cache_hits).", labels=endpoint
    )
    ejected = _gauge("tailguard_endpoint_ejected", "1 while outlier detection has the endpoint out.", endpoint)
    ejections = CounterMetricFamily(
        "tailguard_endpoint_ejections", "Times outlier detection took the endpoint out.", labels=endpoint
    )
    failures = _gauge("tailguard_endpoint_failures_in_a_row", "The endpoint's current run of failed requests.", endpoint)
    busy = CounterMetricFamily(
        "tailguard_endpoint_busy", "503s before any byte from the engine: its own queue full (--max-num-queued-reqs).", labels=endpoint
    )
    refused = _gauge("tailguard_endpoint_key_refused", "1 while the engine refuses tailguard's key (api_key_env): down.", endpoint)
    base = _gauge("tailguard_endpoint_first_byte_base_seconds", "The engine's learnt time to a stream's first byte with nothing queued.", endpoint)
    per_token = _gauge(
        "tailguard_endpoint_first_byte_seconds_per_token", "The engine's learnt seconds a queued prompt token adds to a stream's first byte.", endpoint
    )
    context = _gauge(
        "tailguard_endpoint_context_tokens", "Tokens of context tailguard's requests running on the endpoint hold (prompt and max_tokens).", endpoint
    )
    fill = _gauge(
        "tailguard_endpoint_fill",
        "How busy placement takes the engine to be: the larger of its seats taken and its context at 660 tokens a seat, over its cap.",
        endpoint,
    )
    for e in stats.endpoints:
        labels = (e.pool, e.url)
        in_flight.add_metric(labels, e.in_flight)
        context.add_metric(labels, e.context_tokens)
        fill.add_metric(labels, e.fill)
        cap.add_metric(labels, e.max_concurrency)
        healthy.add_metric(labels, int(e.healthy))
        ejected.add_metric(labels, int(e.ejected))
        ejections.add_metric(labels, e.ejections)
        failures.add_metric(labels, e.failures_in_a_row)
        busy.add_metric(labels, e.busy_answers)
        refused.add_metric(labels, int(e.key_refused))
        base.add_metric(labels, e.first_byte_base)
        per_token.add_metric(labels, e.first_byte_seconds_per_token)
        if e.load is None:
            continue
        scrape_ok.add_metric(labels, int(e.load.ok))
        for family, value in (
            (running, e.load.running),
            (waiting, e.load.waiting),
            (kv, e.load.kv_cache_usage),
            (hit_ratio, e.load.prefix_cache_hit_ratio),
            (queried, e.load.prefix_cache_queries),
            (hit, e.load.prefix_cache_hits),
        ):
            if value is not None:
                family.add_metric(labels, value)
    yield from (in_flight, cap, healthy, running, waiting, kv, scrape_ok, hit_ratio, queried, hit, ejected, ejections, failures, busy, refused)
    yield from (base, per_token, context, fill)


def _prompt_ratios(stats: RouterStatistics) -> Iterator[Metric]:
    """What the engines' usage taught of the prompt estimate, per model and kind of text (router/admission/prompt_ratios.py)."""
    labels = ("model", "kind")
    ratio = _gauge(
        "tailguard_prompt_estimate_ratio",
        "The factor admission multiplies the model's estimate of this kind of text by (learnt real/estimated tokens, in [1, max_ratio]).",
        labels,
    )
    learnt = _gauge(
        "tailguard_prompt_estimate_learnt_ratio",
        "The learnt quantile of real/estimated prompt tokens before the clamp (below 1: the rule overcounts this model).",
        labels,
    )
    observations = CounterMetricFamily(
        "tailguard_prompt_estimate_observations", "Answers whose usage taught the model's ratio for this kind of text.", labels=labels
    )
    for row in stats.prompt_ratios:
        key = (row.model, row.kind)
        ratio.add_metric(key, row.ratio)
        learnt.add_metric(key, row.learnt)
        observations.add_metric(key, row.observations)
    yield from (ratio, learnt, observations)


def _sharing(stats: RouterStatistics) -> Iterator[Metric]:
    """Lending and rebalancing: seats lent now, borrowing and moves so far, the assignment."""
    lent = _gauge("tailguard_pool_lent_seats", "Seats of the pool serving other pools' requests now (lending).", ("pool",))
    for name, seats in (stats.lent or {}).items():
        lent.add_metric((name,), seats)
    yield lent
    borrowed = CounterMetricFamily(
        "tailguard_pool_borrowed", "Requests of the pool seated on a lender's idle seat.", labels=("pool", "lender")
    )
    for (name, lender), count in stats.borrowed.items():
        borrowed.add_metric((name, lender), count)
    yield borrowed
    moves = CounterMetricFamily(
        "tailguard_endpoint_moves", "Endpoints rebalancing moved from one pool to another.", labels=("from", "to")
    )
    for (source, target), count in stats.moves.items():
        moves.add_metric((source, target), count)
    yield moves
    assigned = _gauge("tailguard_endpoint_assignment", "1 for the pool each endpoint serves now (rebalancing moves it).", ("pool", "endpoint"))
    for e in stats.endpoints:
        assigned.add_metric((e.pool, e.url), 1)
    yield assigned
    if stats.cluster is not None:
        mode = _gauge("tailguard_cluster_mode", "1 for the shared ledger's mode now: ledger, fallback (static shares) or starting.", ("mode",))
        for name in ("ledger", "fallback", "starting"):
            mode.add_metric((name,), int(stats.cluster.mode == name))
        yield mode
        grants = _gauge("tailguard_cluster_grant_seats", "Seats of each cluster-wide cap this replica may use now.", ("resource",))
        for resource, seats in stats.cluster.grants.items():
            grants.add_metric((resource,), seats)
        yield grants
    moving = _gauge(
        "tailguard_endpoint_moving", "1 while an endpoint finishes its old pool's requests before joining another.", ("endpoint", "from", "to")
    )
    for url, (source, target) in stats.moving.items():
        moving.add_metric((url, source, target), 1)
    yield moving
