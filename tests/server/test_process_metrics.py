"""``GET /metrics`` carries the process's own series (prometheus_client's ProcessCollector, server/metrics.py)."""

from __future__ import annotations

import os
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, engines_on_sockets, tailguard


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ProcessCollector reads /proc")
async def test_metrics_page_has_the_process_series() -> None:
    async with engines_on_sockets([QUICK, QUICK]) as backends:
        config = two_pool_config(interactive_urls=[backends.urls[0]], batch_urls=[backends.urls[1]])
        async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
            page = await client.get("/metrics")
    assert page.status_code == 200
    values = {sample.name: sample.value for family in text_string_to_metric_families(page.text) for sample in family.samples}
    assert values["process_cpu_seconds_total"] > 0
    assert values["process_resident_memory_bytes"] > 10 * 2**20  # an interpreter with tailguard loaded: tens of MB
    assert values["process_open_fds"] >= 3
    # This process's, read from /proc/self: tailguard serves in the test's own process here.
    assert values["process_start_time_seconds"] > 0 and values["process_max_fds"] == os.sysconf("SC_OPEN_MAX")
