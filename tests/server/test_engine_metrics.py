"""The engine's own per-request timings (vLLM's --enable-per-request-metrics) on /metrics and in the access line."""

from __future__ import annotations

from tailguard.router import Router
from tailguard.router.observe import RequestRecord
from tailguard.server.logs import access_fields
from tailguard.server.metrics import Metrics
from tests.helpers.router import two_pool_config


def test_the_engines_queue_time_is_a_histogram_by_pool_and_every_timing_is_in_the_access_line() -> None:
    metrics = Metrics(Router(two_pool_config()))
    record = RequestRecord("r", "http", 0.0)
    record.pool, record.request_class, record.outcome = "batch", "batch", "ok"
    record.engine_queue, record.engine_ttft, record.engine_itl = 0.2, 0.05, 0.01
    metrics.observe(record)
    page = metrics.render().decode()
    metrics.close()
    assert 'tailguard_engine_queue_seconds_count{pool="batch"} 1.0' in page
    assert 'tailguard_engine_queue_seconds_bucket{le="0.1",pool="batch"} 0.0' in page
    assert 'tailguard_engine_queue_seconds_bucket{le="0.5",pool="batch"} 1.0' in page
    line = access_fields(record)
    assert (line["engine_queue_ms"], line["engine_ttft_ms"], line["engine_itl_ms"]) == (200.0, 50.0, 10.0)
