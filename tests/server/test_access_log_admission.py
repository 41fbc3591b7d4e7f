"""The access log's admission times: when a request got its seat, and when (and for how much) its budget counted it.

A budget's minute counts from each request's admission, not from when it
was sent (a request may wait seconds for a seat or a grant), so a
benchmark that checks "no 60 s admits more than the budget" needs the
admission time in the log, comparable to the line's own ``ts`` (issue 32,
item 5: 20,449 by send time, 19,965 counting only what was admitted).
"""

from __future__ import annotations

import datetime
import json
import logging

import pytest
import trio

from tailguard.router.observe import Telemetry
from tailguard.router.quotas import Caller
from tailguard.server.log_format import JsonFormatter
from tailguard.server.logs import AccessLog
from tests.helpers.router import chat, router_over_engines, two_pool_config


def when(timestamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))


async def test_the_access_line_says_when_the_request_was_admitted_and_what_its_budget_counted(caplog: pytest.LogCaptureFixture) -> None:
    caller = Caller("metered", frozenset(), None, tokens_per_minute=10_000)
    access = logging.getLogger("test.access.admission")
    async with router_over_engines(two_pool_config(interactive_cap=1)) as fleet:
        telemetry = Telemetry([AccessLog(logger=access)])
        records = {}

        async def run(request_id: str, max_tokens: int) -> None:
            record = records[request_id] = telemetry.start(request_id, "http")
            record.caller = caller.name
            async with fleet.router.open(chat(max_tokens=max_tokens, request_id=request_id), arrival=record.arrival, caller=caller, record=record) as completion:
                await completion.read()
            telemetry.finish(record, None, status=200)

        with caplog.at_level(logging.INFO, logger=access.name):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "first", 200)  # holds the only seat: the second waits for it
                await trio.sleep(0.01)
                nursery.start_soon(run, "second", 8)
    second = records["second"]
    assert second.budget_at is not None and second.admitted_at is not None
    assert second.budget_at < second.admitted_at  # counted in its budget on arrival, seated when the first ended
    assert second.input_tokens is not None and second.completion_tokens is not None
    assert second.budget_tokens == second.input_tokens + second.completion_tokens  # settled to what it cost
    lines = {r.fields["request_id"]: json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == access.name}  # type: ignore[attr-defined]
    line = lines["second"]
    assert line["budget_tokens"] == second.budget_tokens
    # The same clock as the line's own "ts" (written as the request finished): the waits between them are the record's.
    finished = when(line["ts"])
    assert (finished - when(line["budget_at"])).total_seconds() == pytest.approx(second.finished_at - second.budget_at, abs=0.002)  # type: ignore[operator]
    assert (finished - when(line["admitted_at"])).total_seconds() == pytest.approx(second.finished_at - second.admitted_at, abs=0.002)  # type: ignore[operator]
    assert lines["first"]["budget_at"] is not None and lines["first"]["admitted_at"] is not None
