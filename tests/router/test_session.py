"""router/session.py in virtual time: every way a request ends is finished once, with its outcome."""

from __future__ import annotations

import dataclasses
import logging
import uuid

import pytest
import trio
import trio.testing

from tailguard.router import ClientLeft, Sessions, checked_header, errors
from tailguard.router.admission import Routing
from tailguard.router.observe import RepeatedIds, RequestRecord, Telemetry
from tests.helpers.router import Fleet, chat, router_over_engines, two_pool_config


class Recorded:
    """Sessions over a fleet, with every finished record kept."""

    def __init__(self, fleet: Fleet, **kwargs: object) -> None:
        self.records: list[RequestRecord] = []
        self.sessions = Sessions(fleet.router, Telemetry([self.records.append]), "http", **kwargs)  # type: ignore[arg-type]

    def only(self) -> RequestRecord:
        assert len(self.records) == 1, self.records
        return self.records[0]


async def test_a_complete_answer_is_ok_once(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        recorded = Recorded(fleet)
        session = recorded.sessions.start("req-1")
        async with session:
            caller = session.authenticate(None)
            async with session.completion(chat(max_tokens=8, request_id=session.request_id), caller) as completion:
                assert (await completion.read()).startswith(b"{")
                facts = dict(session.routing_facts(completion.routing))
        record = recorded.only()
        assert (record.outcome, record.reason, record.status, record.request_id) == ("ok", None, 200, "req-1")
        assert facts["x-request-id"] == "req-1" and facts["x-tailguard-pool"] == "interactive"
        assert recorded.sessions.open_count == 0 and fleet.router.statistics().in_flight == 0


async def test_the_deadline_is_a_timeout_and_aborts_the_generation(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        recorded = Recorded(fleet)
        request = dataclasses.replace(chat(max_tokens=1000, stream=True), deadline=trio.current_time() + 2.0)
        session = recorded.sessions.start()
        with pytest.raises(errors.DeadlineExceeded):
            async with session, session.completion(request, session.authenticate(None)) as completion:
                async for _ in completion.chunks():
                    pass
        record = recorded.only()
        assert (record.outcome, record.reason, record.status) == ("timeout", "e2e_timeout", 504)
        assert record.e2e_seconds == pytest.approx(2.0)
        await trio.testing.wait_all_tasks_blocked()
        assert sum(e.statistics().aborted_total for e in fleet.engines.values()) == 1


async def test_a_client_that_left_is_cancelled_not_an_error(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        recorded = Recorded(fleet)
        session = recorded.sessions.start()
        async with session:  # ClientLeft ends here, swallowed: there is no one to answer
            async with session.completion(chat(max_tokens=100, stream=True), session.authenticate(None)) as completion:
                async for _ in completion.chunks():
                    session.left()  # what the HTTP watcher does on http.disconnect
            raise AssertionError("the relay went on after the client left")  # pragma: no cover
        record = recorded.only()
        assert (record.outcome, record.reason, record.status) == ("cancelled", "client_cancelled", 499)
        assert fleet.router.statistics().in_flight == 0

        # Gone before the completion began (while the body was read): same ending.
        session = recorded.sessions.start()
        async with session:
            raise ClientLeft
        assert recorded.records[-1].outcome == "cancelled"


async def test_cancelled_from_outside_is_cancelled_and_propagates(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        recorded = Recorded(fleet)
        with trio.move_on_after(0.5) as outer:  # a gRPC caller's cancel cancels an outer scope
            session = recorded.sessions.start()
            async with session, session.completion(chat(max_tokens=500, stream=True), session.authenticate(None)) as completion:
                async for _ in completion.chunks():
                    pass
        assert outer.cancelled_caught
        record = recorded.only()
        assert (record.outcome, record.reason) == ("cancelled", "client_cancelled")


async def test_a_bug_is_an_internal_error_logged_once_with_its_traceback(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        recorded = Recorded(fleet)
        session = recorded.sessions.start("bug-1")
        with caplog.at_level(logging.ERROR, logger="tailguard.session"), pytest.raises(errors.InternalError) as caught:
            async with session, session.completion(chat(max_tokens=8), session.authenticate(None)):
                int("9" * 5000)  # ValueError: what a 5,000-digit number once did
        assert isinstance(caught.value.__cause__, ValueError) and "bug-1" in caught.value.message
        record = recorded.only()
        assert (record.outcome, record.reason, record.status) == ("internal_error", "internal_error", 500)
        [line] = [r for r in caplog.records if r.name == "tailguard.session"]
        assert line.exc_info is not None
        assert line.fields == {"request_id": "bug-1"}  # type: ignore[attr-defined]
        assert fleet.router.statistics().in_flight == 0


async def test_a_router_error_wrapped_by_a_nursery_is_still_that_error(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        recorded = Recorded(fleet)
        session = recorded.sessions.start()
        with pytest.raises(errors.QueueFull):
            async with session:
                raise ExceptionGroup("from a nursery", [errors.QueueFull("full", retry_after=1.0)])
        assert (recorded.only().outcome, recorded.only().reason, recorded.only().status) == ("overloaded", "queue_full", 429)


async def test_an_error_after_the_head_keeps_the_status_the_caller_saw(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        recorded = Recorded(fleet)
        session = recorded.sessions.start()
        with pytest.raises(errors.BadBackendReply):
            async with session:
                session.record.status = 200  # the HTTP front end sent a stream's head
                raise errors.BadBackendReply("cut")
        assert (recorded.only().outcome, recorded.only().reason, recorded.only().status) == ("backend_error", "bad_backend_reply", 200)


async def test_request_ids_refused_recorded_and_repeats_counted(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        repeats: list[int] = []
        recorded = Recorded(fleet, repeated_ids=RepeatedIds(10.0), on_repeat=lambda: repeats.append(1))
        for supplied in ("abc\nx-injected: 1", "x" * 129, "has space", "é"):
            session = recorded.sessions.start(supplied)
            assert session.request_id != supplied and len(session.request_id) == 32
            with pytest.raises(errors.InvalidRequest) as refused:
                async with session:
                    raise AssertionError("a refused id must not get in")  # pragma: no cover
            assert refused.value.param == "x-request-id"
        assert {(r.outcome, r.reason, r.status) for r in recorded.records} == {("rejected", "invalid_request", 400)}
        assert recorded.sessions.request_id("retry-1")[0] == "retry-1" and not repeats
        assert recorded.sessions.request_id("retry-1") == ("retry-1", None) and repeats == [1]


async def test_fresh_request_ids_are_version_4_uuids_unique_within_and_between_sessions_objects(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        first, second = Recorded(fleet).sessions, Recorded(fleet).sessions  # as two front ends (or two workers) build theirs
        ids = [first.request_id(None)[0] for _ in range(5000)] + [second.request_id(None)[0] for _ in range(5000)]
    assert len(set(ids)) == len(ids)
    for fresh in ids[:10] + ids[-10:]:
        parsed = uuid.UUID(hex=fresh)
        assert parsed.hex == fresh and parsed.version == 4 and parsed.variant == uuid.RFC_4122


async def test_the_cap_on_open_sessions_refuses_at_once_with_a_hint(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        recorded = Recorded(fleet, max_open=2)
        sessions = recorded.sessions
        first, second = sessions.start(), sessions.start()
        async with first, second:
            assert sessions.open_count == 2
            third = sessions.start("third")
            with pytest.raises(errors.ServerBusy) as busy:
                async with third:
                    raise AssertionError("over the cap")  # pragma: no cover
            assert busy.value.retry_after == 1.0 and sessions.open_count == 2
        assert sessions.open_count == 0
        busy_record = next(r for r in recorded.records if r.request_id == "third")
        assert (busy_record.outcome, busy_record.reason, busy_record.status) == ("overloaded", "server_busy", 429)
        async with sessions.start():  # room again
            pass


def test_no_header_value_with_a_control_character_goes_out() -> None:
    assert checked_header("x-request-id", "req-1 ok") == "req-1 ok"
    for bad in ("a\nb", "a\rb", "a\x00b", "tab\there", "del\x7f", "naïve"):
        with pytest.raises(errors.InternalError, match="x-tailguard-pool"):
            checked_header("x-tailguard-pool", bad)


async def test_routing_facts_refuse_an_unsafe_value(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        session = Recorded(fleet).sessions.start()
        routing = Routing("r", "interactive", "pool\r\nx-injected: 1", "http://e", 5, None, 8, False, 0.0)
        with pytest.raises(errors.InternalError):
            session.routing_facts(routing)
