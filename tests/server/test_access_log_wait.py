"""The access log's queue_ms: every request that waited for a seat shows its wait, admitted or not."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from tailguard.router import errors
from tailguard.router.admission import RouterRequest
from tailguard.router.observe import Telemetry
from tailguard.server.logs import AccessLog
from tests.helpers.router import chat, router_over_engines, two_pool_config


async def test_a_queue_timeout_logs_the_time_it_waited(autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    config = two_pool_config(interactive_cap=1, max_queue=1, interactive_timeout=0.5)
    access = logging.getLogger("test.access")
    async with router_over_engines(config) as fleet:
        telemetry = Telemetry([AccessLog(logger=access)])

        async def run(request: RouterRequest) -> None:
            record = telemetry.start(request.request_id, "http")
            error: errors.TailguardError | None = None
            try:
                async with fleet.router.open(request, arrival=record.arrival, record=record) as completion:
                    await completion.read()
            except errors.TailguardError as raised:
                error = raised
            telemetry.finish(record, error, status=200 if error is None else error_status(error))

        def error_status(error: errors.TailguardError) -> int:
            return 429 if isinstance(error, errors.QueueFull) else 503

        with caplog.at_level(logging.INFO, logger="test.access"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, chat(max_tokens=128, request_id="running"))  # holds the only seat past the waiter's 0.5 s
                await trio.sleep(0.01)
                nursery.start_soon(run, chat(max_tokens=8, request_id="waiting"))
                await trio.sleep(0.01)
                nursery.start_soon(run, chat(max_tokens=8, request_id="full"))
    lines = {r.fields["request_id"]: r.fields for r in caplog.records if r.name == "test.access"}  # type: ignore[attr-defined]
    assert lines["waiting"]["reason"] == "queue_timeout" and lines["waiting"]["status"] == 503
    assert lines["waiting"]["queue_ms"] == pytest.approx(500.0, abs=1.0)
    assert lines["full"]["reason"] == "queue_full" and lines["full"]["queue_ms"] == 0.0  # refused at once: waited nothing
    assert lines["running"]["outcome"] == "ok" and lines["running"]["queue_ms"] == 0.0
