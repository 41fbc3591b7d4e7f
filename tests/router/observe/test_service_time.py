"""Service time: a class's seated-to-end seconds per token asked, and the queue deadline it shortens (virtual time)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tailguard.router.config import ClassConfig, LimitsConfig
from tailguard.router.errors import QueueTimeout
from tailguard.router.observe import RequestRecord, ServiceTime
from tests.helpers.router import chat, router_over_engines, run_to_end, two_pool_config, with_digest

BATCH = ClassConfig("batch", "batch", 100.0, 1)


def served(seated: float, ended: float, max_tokens: int, outcome: str = "ok") -> RequestRecord:
    record = RequestRecord("r", "http", arrival=0.0)
    record.left_queue_at, record.finished_at, record.max_tokens = seated, ended, max_tokens
    record.outcome = outcome  # type: ignore[assignment]
    return record


def test_a_class_learns_its_seconds_a_token_asked_from_the_requests_it_served() -> None:
    service = ServiceTime()
    assert service.predict("batch", 1000) == 0.0  # nothing served yet: nothing predicted
    service.observe(served(10.0, 14.0, 400), BATCH)  # 0.01 s a token asked
    assert service.predict("batch", 1000) == pytest.approx(10.0)
    service.observe(served(0.0, 1.0, 0), BATCH)  # no max_tokens: says nothing
    service.observe(served(0.0, 100.0, 400, outcome="error"), BATCH)  # a failure says nothing of its length
    service.observe(served(0.0, 100.0, 400), None)  # refused before it had a class
    assert service.predict("batch", 1000) == pytest.approx(10.0)
    for _ in range(200):  # the engines got twice as slow: the mean follows
        service.observe(served(0.0, 8.0, 400), BATCH)
    assert service.predict("batch", 1000) == pytest.approx(20.0, rel=0.01)
    service.forget({"interactive"})
    assert service.predict("batch", 1000) == 0.0


async def test_a_request_that_cannot_end_in_time_waits_only_until_its_deadline_less_its_service(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Batch has one seat and waits up to 100 s of its 120 s objective. A served job teaches the class's pace; a
    # long job then holds the seat. A job asking for many tokens is refused once waiting longer would leave it
    # too little time to run (before: it waited until the seat freed, and would have run past 120 s); a short
    # job still waits for the seat and is served.
    base = two_pool_config(batch_cap=1, batch_timeout=100.0, limits=LimitsConfig(output_cap_tokens=20_000))
    config = with_digest(base, "service-time")
    async with router_over_engines(config) as fleet:
        learnt = RequestRecord("learn", "http", trio.current_time())  # as a front end's session keeps it
        async with fleet.router.open(chat("warm up", max_tokens=400, request_id="learn"), record=learnt) as completion:
            await completion.read()
        learnt.finished_at, learnt.outcome = trio.current_time(), "ok"
        fleet.router.judge(learnt)  # the telemetry sink every front end runs first
        outcomes: dict[str, tuple[str, float]] = {}

        async def send(request_id: str, max_tokens: int) -> None:
            sent = trio.current_time()
            try:
                await run_to_end(fleet.router, chat(f"job {request_id}", max_tokens=max_tokens, request_id=request_id))
                outcomes[request_id] = ("served", trio.current_time() - sent)
            except QueueTimeout:
                outcomes[request_id] = ("refused", trio.current_time() - sent)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "holder", 4_000)
            await trio.testing.wait_all_tasks_blocked()
            for request_id, max_tokens in (("long", 12_000), ("short", 200)):
                nursery.start_soon(send, request_id, max_tokens)
                await trio.testing.wait_all_tasks_blocked()
    holder_took = outcomes["holder"][1]
    assert outcomes["long"][0] == "refused" and outcomes["long"][1] < holder_took  # before the seat freed
    assert outcomes["short"][0] == "served" and outcomes["short"][1] > holder_took  # it waited for it


