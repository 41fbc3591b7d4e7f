"""The engine's own per-request timings (vLLM's --enable-per-request-metrics) on /metrics and in the access line."""

from __future__ import annotations

import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.observe import RequestRecord
from tailguard.server.logs import access_fields
from tailguard.server.metrics import Metrics
from tests.helpers.router import BATCH_URL, chat, router_over_engines, run_to_end, two_pool_config


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


async def test_each_endpoints_context_and_fill_are_on_metrics_while_its_requests_run(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config(batch_cap=4)) as fleet:
        metrics = Metrics(fleet.router)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_to_end, fleet.router, chat("job", max_tokens=1_000))  # 1,000 + a few prompt tokens
            await trio.testing.wait_all_tasks_blocked()
            held = fleet.router.endpoint(BATCH_URL).context_tokens
            page = metrics.render().decode()
            nursery.cancel_scope.cancel()
        idle = metrics.render().decode()
        metrics.close()
    assert 1_000 < held < 1_100  # over the 660 tokens of one seat
    assert f'tailguard_endpoint_context_tokens{{endpoint="{BATCH_URL}",pool="batch"}} {float(held)}' in page
    assert f'tailguard_endpoint_fill{{endpoint="{BATCH_URL}",pool="batch"}} {held / 660 / 4}' in page  # over one seat of 4
    assert f'tailguard_endpoint_context_tokens{{endpoint="{BATCH_URL}",pool="batch"}} 0.0' in idle
