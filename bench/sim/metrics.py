"""The simulator's /metrics, in Prometheus text with vLLM's metric names.

Gauges and counters are read from the engine at scrape time (no per-token
bookkeeping); the latency histograms are observed once per finished request,
in the GPU's own time (raw intervals divided by the engine's time scale).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from .engine import Engine, Sequence

# vLLM's own bucket edges for these histograms (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class _EngineCollector(Collector):
    """Reads the engine's statistics when Prometheus scrapes."""

    def __init__(self, engine: Engine, model: str) -> None:
        self._engine = engine
        self._model = model

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()
        labels = ["model_name"]
        values = [self._model]

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
        yield gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", stats.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens_total)
        yield counter("vllm:request_aborted", "Requests aborted by their client.", stats.aborted_total)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits)


class SimMetrics:
    """One engine's metrics in its own registry (no global state)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Engine, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model))
        self._time_scale = engine.time_scale
        seconds = partial(Histogram, labelnames=["model_name"], registry=self.registry)  # both latencies: by model
        self._ttft = seconds("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS).labels(model)
        self._e2e = seconds("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", buckets=E2E_BUCKETS).labels(model)
        self._model = model

        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        engine.add_finish_hook(self._observe)

    def _observe(self, sequence: Sequence) -> None:
        if sequence.finish_reason == "abort" or sequence.finished_at is None:
            return
        scale = self._time_scale
        if sequence.first_token_at is not None:
            self._ttft.observe((sequence.first_token_at - sequence.arrival) / scale)
        self._e2e.observe((sequence.finished_at - sequence.arrival) / scale)
        self._success.labels(self._model, sequence.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
