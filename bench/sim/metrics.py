"""The simulator's /metrics, in Prometheus text with vLLM 0.32's metric names, labels and buckets.

Gauges and counters are read from the engine at scrape time (no per-token
bookkeeping). Histograms are observed as vLLM observes them
(vllm/v1/metrics/loggers.py, stats.py), in the GPU's own time (raw
intervals divided by the engine's time scale):

- ``time_to_first_token_seconds`` at a request's first token (an aborted
  request's too), ``inter_token_latency_seconds`` for every later token
  (a step's decodes share one gap, observed as a count);
- at a request's end (not an abort: vLLM's frontend drops the state of a
  request its client abandoned, so it is counted nowhere),
  ``e2e_request_latency_seconds`` and the phases ``request_queue_time``
  (arrival to first scheduled), ``request_prefill_time`` (to the first
  token), ``request_decode_time`` (to the last token) and
  ``request_inference_time`` (first scheduled to the last token), and
  ``request_success_total`` by ``finished_reason`` (every reason vLLM
  exports, "abort" included, starts at 0).

Every engine series has vLLM's ``engine`` label ("0": one engine core) and
``model_name``; ``admission_rejections_total`` (the 503s of a full queue) has
``model_name`` and ``reason``, as vLLM's frontend counts it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from .engine import Engine
from .sequence import Sequence as EngineSequence

ENGINE_INDEX = "0"  # vLLM's engine label: the engine core's index (one core, no data parallelism)
# vLLM's own bucket edges (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # every request_success series vLLM exports
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


class _Histogram:
    """A histogram that takes many equal observations at once (a step's inter-token gaps)."""

    __slots__ = ("name", "doc", "edges", "counts", "total", "observed")

    def __init__(self, name: str, doc: str, edges: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self.edges = tuple(edges)
        self.counts = [0] * (len(self.edges) + 1)  # the last: over every edge (+Inf)
        self.total = 0.0
        self.observed = 0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.edges, value)] += count
        self.total += value * count
        self.observed += count

    def family(self, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for edge, count in zip(self.edges, self.counts):
            cumulative += count
            buckets.append((str(edge), float(cumulative)))
        buckets.append(("+Inf", float(self.observed)))
        family = HistogramMetricFamily(self.name, self.doc, labels=labels)
        family.add_metric(values, buckets, self.total)
        return family


class _EngineCollector(Collector):
    """Reads the engine's statistics and the histograms when Prometheus scrapes."""

    def __init__(self, engine: Engine, model: str, metrics: SimMetrics) -> None:
        self._engine = engine
        self._model = model
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()
        params = self._engine.params
        labels = ["engine", "model_name"]
        values = [ENGINE_INDEX, self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens_total)
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=["engine", "finished_reason", "model_name"]
        )
        for reason in FINISHED_REASONS:
            success.add_metric([ENGINE_INDEX, reason, self._model], self._metrics.finished.get(reason, 0))
        yield success
        rejections = CounterMetricFamily(
            "vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.", labels=["model_name", "reason"]
        )
        for reason in ADMISSION_REASONS:
            rejections.add_metric([self._model, reason], self._metrics.rejected.get(reason, 0))
        yield rejections
        for histogram in self._metrics.histograms:
            yield histogram.family(labels, values)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "engine", "kv_cache_size_tokens", "num_gpu_blocks"],
        )
        blocks = params.kv_cache_tokens // params.block_size
        info.add_metric([str(params.block_size), str(params.prefix_caching), ENGINE_INDEX, str(params.kv_cache_tokens), str(blocks)], 1.0)
        yield info


class SimMetrics:
    """One engine's metrics in its own registry (no global state)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Engine, model: str) -> None:
        self._time_scale = engine.time_scale
        self.finished: dict[str, int] = {}  # request_success by finished_reason
        self.rejected: dict[str, int] = {}  # admission_rejections by reason
        self._ttft = _Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self._itl = _Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self._e2e = _Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        self._queue = _Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self._prefill = _Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self._decode = _Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        self._inference = _Histogram(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS
        )
        self.histograms = (self._ttft, self._itl, self._e2e, self._queue, self._inference, self._prefill, self._decode)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model, self))
        engine.add_token_hook(self._on_tokens)
        engine.add_finish_hook(self._on_finish)

    def admission_rejected(self, reason: str) -> None:
        """A request the engine's queue limit refused (vLLM's ``record_admission_rejection``)."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _on_tokens(self, firsts: list[EngineSequence], gaps: dict[float, int]) -> None:
        scale = self._time_scale
        for sequence in firsts:
            assert sequence.first_token_at is not None
            self._ttft.observe((sequence.first_token_at - sequence.arrival) / scale)
        for gap, count in gaps.items():
            self._itl.observe(gap / scale, count)

    def _on_finish(self, sequence: EngineSequence) -> None:
        reason = sequence.finish_reason
        if reason == "abort" or reason is None or sequence.finished_at is None:
            return
        scale = self._time_scale
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self._e2e.observe((sequence.finished_at - sequence.arrival) / scale)
        scheduled, first, last = sequence.scheduled_at, sequence.first_token_at, sequence.last_token_at
        if scheduled is None or first is None or last is None:
            return
        self._queue.observe((scheduled - sequence.arrival) / scale)
        self._prefill.observe((first - scheduled) / scale)
        self._decode.observe((last - first) / scale)
        self._inference.observe((last - scheduled) / scale)

    def render(self) -> bytes:
        return generate_latest(self.registry)
