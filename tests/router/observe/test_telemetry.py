"""Telemetry in virtual time: records, metrics per outcome, per-key caps and the drain."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import trio
import trio.testing

from tailguard.router import Router, errors
from tailguard.router.admission import RouterRequest
from tailguard.router.config import TimeoutsConfig
from tailguard.router.observe import RepeatedIds, RequestRecord, Telemetry, is_valid_request_id, outcome_of
from tailguard.router.quotas import Caller
from tailguard.server.app import drain_router
from tailguard.server.logs import AccessLog, access_fields
from tailguard.server.metrics import Metrics
from tests.helpers.router import INTERACTIVE_URL, chat, router_over_engines, two_pool_config

LONG_TEXT = "The quarterly report covers revenue, costs and outlook in detail. " * 200


class Observed:
    """A router's requests run through telemetry into real metrics, as the front ends do."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.metrics = Metrics(router)
        self.records: list[RequestRecord] = []
        self.telemetry = Telemetry([self.metrics.observe, self.records.append])

    async def run(self, request: RouterRequest, *, caller: Caller | None = None) -> RequestRecord:
        """One request to its end, finished on its record with the error it raised (if any)."""
        record = self.telemetry.start(request.request_id, "http")
        error: errors.TailguardError | None = None
        kwargs = {} if caller is None else {"caller": caller}
        if caller is not None:  # as the session names it
            record.caller = caller.name
        try:
            with trio.CancelScope(deadline=self.router.deadline_for(request, record.arrival)) as scope:
                async with self.router.open(request, arrival=record.arrival, record=record, **kwargs) as completion:
                    if request.stream:
                        async for _ in completion.chunks():
                            pass
                    else:
                        await completion.read()
            if scope.cancelled_caught:
                error = errors.DeadlineExceeded("deadline")
        except errors.TailguardError as raised:
            error = raised
        self.telemetry.finish(record, error, status=200 if error is None else 500)
        return record

    def value(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_queue_wait_histogram_reflects_virtual_waits(autojump_clock: trio.testing.MockClock) -> None:
    config = two_pool_config(interactive_cap=1, interactive_timeout=30.0)
    async with router_over_engines(config) as fleet:
        observed = Observed(fleet.router)
        records: list[RequestRecord] = []

        async def one(index: int) -> None:
            usage = {"stream_options": {"include_usage": True}}  # exact token counts
            records.append(await observed.run(chat(max_tokens=100, stream=True, request_id=f"r{index}", params=usage)))

        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(one, index)
                await trio.sleep(0.001)  # a fixed arrival order
        waits = sorted(r.queue_seconds or 0.0 for r in records)
        service = records[0].e2e_seconds or 0.0
        assert waits[0] < 0.01 and service > 0.5
        # With one seat, each request waits for the ones before it to finish.
        assert waits[1] == pytest.approx(records[0].e2e_seconds, abs=0.05)
        assert waits[2] == pytest.approx(waits[1] + service, rel=0.1)
        labels = {"class": "interactive", "pool": "interactive", "outcome": "ok"}
        assert observed.value("tailguard_request_queue_seconds_count", **labels) == 3
        assert observed.value("tailguard_request_queue_seconds_sum", **labels) == pytest.approx(sum(waits))
        # The 1 s bucket holds the short waits only; the 2.5 s bucket holds all three.
        assert observed.value("tailguard_request_queue_seconds_bucket", le="1.0", **labels) == sum(w <= 1.0 for w in waits)
        assert observed.value("tailguard_request_queue_seconds_bucket", le="2.5", **labels) == 3
        for record in records:
            assert record.completion_tokens == 100 and record.ttft_seconds is not None
            assert (record.queue_seconds or 0) < (record.ttft_seconds or 0) < (record.e2e_seconds or 0)
            assert record.time_per_output_token == pytest.approx((record.decode_seconds or 0) / 99)
        assert observed.value("tailguard_request_completion_tokens_sum", **labels) == 300


async def test_each_outcome_moves_its_counter(autojump_clock: trio.testing.MockClock) -> None:
    timeouts = TimeoutsConfig(end_to_end_timeout=60.0)
    config = two_pool_config(interactive_cap=1, max_queue=1, interactive_timeout=0.5, timeouts=timeouts)
    async with router_over_engines(config) as fleet:
        observed = Observed(fleet.router)
        clamped = await observed.run(chat(max_tokens=5000))
        assert clamped.outcome == "ok" and clamped.clamped and clamped.max_tokens == 1024 and clamped.pool == "batch"
        assert observed.value("tailguard_max_tokens_clamped_total", **{"class": "batch", "pool": "batch"}) == 1

        too_long = await observed.run(chat("word " * 40_000))
        assert (too_long.outcome, too_long.reason, too_long.request_class) == ("rejected", "input_cap", "none")
        assert observed.value("tailguard_rejections_total", **{"class": "none", "pool": "none", "reason": "input_cap"}) == 1

        # A batch request that outlives its caller's deadline: a timeout.
        deadline = trio.current_time() + 5.0
        timed_out = await observed.run(dataclasses.replace(chat(LONG_TEXT, max_tokens=1024), deadline=deadline))
        assert (timed_out.outcome, timed_out.reason) == ("timeout", "e2e_timeout")
        assert timed_out.e2e_seconds == pytest.approx(5.0)
        assert observed.value("tailguard_rejections_total", **{"class": "batch", "pool": "batch", "reason": "e2e_timeout"}) == 1

        # One seat busy, one waiter: the next is queue_full, the waiter queue_timeout.
        results: dict[str, RequestRecord] = {}

        async def run(name: str, request: RouterRequest) -> None:
            results[name] = await observed.run(request)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "running", chat(max_tokens=128, request_id="a"))
            await trio.sleep(0.01)
            nursery.start_soon(run, "waiting", chat(max_tokens=8, request_id="b"))
            await trio.sleep(0.01)
            nursery.start_soon(run, "full", chat(max_tokens=8, request_id="c"))
        assert results["full"].reason == "queue_full" and results["full"].outcome == "overloaded"
        assert results["waiting"].reason == "queue_timeout" and results["waiting"].queue_seconds is None
        assert results["waiting"].e2e_seconds == pytest.approx(0.5, abs=0.02)
        assert results["running"].outcome == "ok"
        interactive = {"class": "interactive", "pool": "interactive"}
        assert observed.value("tailguard_rejections_total", reason="queue_full", **interactive) == 1
        assert observed.value("tailguard_rejections_total", reason="queue_timeout", **interactive) == 1
        assert observed.value("tailguard_requests_total", outcome="overloaded", **interactive) == 2
        assert observed.value("tailguard_requests_total", outcome="ok", **interactive) == 1
        text = observed.metrics.render().decode()
        assert 'tailguard_pool_max_concurrency{pool="interactive"} 1.0' in text
        assert f'tailguard_endpoint_in_flight{{endpoint="{INTERACTIVE_URL}",pool="interactive"}} 0.0' in text


async def test_client_cancellation_is_counted(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        observed = Observed(fleet.router)
        record = observed.telemetry.start("gone", "http")
        with trio.move_on_after(0.2):
            async with fleet.router.open(chat(max_tokens=128, stream=True), record=record) as completion:
                async for _ in completion.chunks():
                    pass
        observed.telemetry.finish(record, None, status=499, client_gone=True)
        observed.telemetry.finish(record, None, status=200)  # a second finish is ignored
        assert (record.outcome, record.reason, record.status) == ("cancelled", "client_cancelled", 499)
        assert 0 < (record.completion_tokens or 0) < 128
        assert observed.value("tailguard_requests_total", **{"class": "interactive", "pool": "interactive", "outcome": "cancelled"}) == 1
        assert fleet.router.statistics().in_flight == 0


def test_every_router_error_has_an_outcome_and_a_reason() -> None:
    cases = {
        errors.PromptTooLong("x"): ("rejected", "input_cap"),
        errors.MaxTokensTooLarge("x"): ("rejected", "max_tokens_cap"),
        errors.InvalidRequest("x"): ("rejected", "invalid_request"),
        errors.Unauthenticated("x"): ("rejected", "unauthenticated"),
        errors.Forbidden("x"): ("rejected", "forbidden"),
        errors.ModelNotFound("x"): ("rejected", "model_not_found"),
        errors.QueueFull("x", retry_after=1): ("overloaded", "queue_full"),
        errors.QueueTimeout("x", retry_after=1): ("overloaded", "queue_timeout"),
        errors.NoBackend("x", retry_after=1): ("overloaded", "no_backend"),
        errors.Draining("x", retry_after=1): ("overloaded", "draining"),
        errors.CallerOverLimit("x", retry_after=1): ("overloaded", "caller_limit"),
        errors.DeadlineExceeded("x"): ("timeout", "e2e_timeout"),
        errors.BackendRejected("x", status=400): ("rejected", "backend_rejected"),
        errors.BackendUnavailable("x"): ("backend_error", "backend_unavailable"),
        errors.BackendTimeout("x"): ("backend_error", "backend_timeout"),
        errors.BadBackendReply("x"): ("backend_error", "bad_backend_reply"),
        errors.BackendStreamError("x"): ("backend_error", "backend_stream_error"),
        errors.BodyTooLarge("x"): ("rejected", "body_too_large"),
        errors.ServerBusy("x", retry_after=1): ("overloaded", "server_busy"),
        errors.InternalError("x"): ("internal_error", "internal_error"),
    }
    for error, expected in cases.items():
        assert outcome_of(error) == expected, error
    assert outcome_of(None) == ("ok", None)
    assert outcome_of(errors.QueueFull("x", retry_after=1), client_gone=True) == ("cancelled", "client_cancelled")


async def test_per_key_cap_and_class_override(autojump_clock: trio.testing.MockClock) -> None:
    capped = Caller("etl", frozenset({"batch"}), 1)
    async with router_over_engines(two_pool_config()) as fleet:
        router = fleet.router
        async with router.open(chat(max_tokens=8), caller=capped):
            with pytest.raises(errors.CallerOverLimit, match="'etl' already has 1 requests in flight") as caught:
                async with router.open(chat(max_tokens=8), caller=capped):
                    pass  # pragma: no cover
            assert caught.value.retry_after == 1.0
            assert router.statistics().caller_in_flight == {"etl": 1}
            # Another caller is not held back by etl's cap.
            async with router.open(chat(max_tokens=8), caller=Caller("web", frozenset(), 1)):
                pass
        assert router.statistics().caller_in_flight == {}
        # Forcing a short request into the batch pool: allowed for etl, refused to web.
        async with router.open(chat(max_tokens=8, forced_class="batch"), caller=capped) as completion:
            assert completion.routing.pool == "batch" and completion.record.caller == "etl"
        with pytest.raises(errors.Forbidden, match="'web' may not force the class 'batch'"):
            async with router.open(chat(max_tokens=8, forced_class="batch"), caller=Caller("web", frozenset(), None)):
                pass  # pragma: no cover
        assert router.statistics().caller_in_flight == {}


async def test_drain_refuses_new_work_and_waits_for_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config()) as fleet:
        router = fleet.router
        finished: list[float] = []

        async def long_stream() -> None:
            async with router.open(chat(max_tokens=128, stream=True)) as completion:
                async for _ in completion.chunks():
                    pass
            finished.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream)
            await trio.sleep(0.05)
            start = trio.current_time()
            assert await drain_router(router, timeout=30.0)
            drained_at = trio.current_time()
            assert finished and drained_at == pytest.approx(finished[0]) and drained_at > start
            assert router.health()["status"] == "unavailable" and router.health()["draining"]
            with pytest.raises(errors.Draining):
                async with router.open(chat(max_tokens=8)):
                    pass  # pragma: no cover

    async with router_over_engines(two_pool_config()) as fleet:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_stream_forever, fleet.router)
            await trio.sleep(0.05)
            start = trio.current_time()
            assert not await drain_router(fleet.router, timeout=0.3)
            assert trio.current_time() - start == pytest.approx(0.3)
            nursery.cancel_scope.cancel()


async def long_stream_forever(router: Router) -> None:
    async with router.open(chat(LONG_TEXT, max_tokens=1024, stream=True)) as completion:
        async for _ in completion.chunks():
            pass


def test_repeated_ids_within_the_window_are_counted_and_memory_is_bounded() -> None:
    ids = RepeatedIds(10.0, max_ids=3)
    assert not ids.observe("a", now=0.0)
    assert ids.observe("a", now=5.0)  # a retry 5 s later
    assert not ids.observe("a", now=16.0)  # 11 s after the last sighting: a new request
    for name, at in (("b", 17.0), ("c", 18.0), ("d", 19.0)):
        ids.observe(name, now=at)
    assert not ids.observe("a", now=19.5)  # pushed out by the bound
    assert ids.repeats == 1
    assert not RepeatedIds(0.0).observe("x", now=0.0)
    assert is_valid_request_id("req-123_abc.def:1") and not is_valid_request_id("has space")
    assert not is_valid_request_id("x" * 129) and not is_valid_request_id("")


def test_access_line_has_the_facts_and_no_prompt_unless_enabled(caplog: pytest.LogCaptureFixture) -> None:
    record = RequestRecord("req-1", "http", arrival=10.0, caller="webapp", kind="chat", stream=True)
    record.prompt_text = "my secret prompt"
    record.request_class, record.pool, record.endpoint = "interactive", "interactive", INTERACTIVE_URL
    record.prompt_tokens, record.requested_max_tokens, record.max_tokens = 12, None, 256
    record.admitted_at, record.first_token_at, record.finished_at = 10.25, 10.5, 12.0
    record.outcome, record.status, record.completion_tokens = "ok", 200, 64
    fields = access_fields(record)
    assert fields["queue_ms"] == 250.0 and fields["ttft_ms"] == 500.0 and fields["decode_ms"] == 1500.0
    assert fields["e2e_ms"] == 2000.0 and fields["max_tokens"] == 256 and fields["max_tokens_requested"] is None
    assert fields["tenant"] == fields["caller"] == "webapp"  # its fair share and budgets are the key's
    assert "prompt" not in fields
    assert access_fields(record, log_prompts=True)["prompt"] == "my secret prompt"
    with caplog.at_level(logging.INFO, logger="tailguard.access"):
        AccessLog()(record)
        AccessLog(enabled=False)(record)
    assert len(caplog.records) == 1 and caplog.records[0].fields["request_id"] == "req-1"  # type: ignore[attr-defined]
    assert "secret" not in caplog.text


def test_a_failing_sink_does_not_fail_the_request(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    def broken(record: RequestRecord) -> None:
        raise RuntimeError("boom")

    telemetry = Telemetry([broken, lambda r: seen.append(r.request_id)])
    record = RequestRecord("r", "grpc", arrival=0.0)

    async def finish() -> None:
        telemetry.finish(record, None, status="OK")

    trio.run(finish)
    assert seen == ["r"] and "telemetry sink" in caplog.text


def test_record_counts_stream_tokens_without_usage() -> None:
    record = dataclasses.replace(RequestRecord("r", "http", arrival=0.0), kind="chat", stream=True)

    async def feed() -> None:
        record.saw_chunk(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n')
        record.saw_chunk(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[{"delta":{"content":"b"}}]}\n\n')
        record.saw_chunk(b"data: [DONE]\n\n")

    trio.run(feed)
    record.finish_tokens()
    assert record.completion_tokens == 2


def test_record_reads_cached_tokens_from_the_usage_event_only_when_sent() -> None:
    with_details = RequestRecord("r", "http", arrival=0.0, stream=True)
    without = RequestRecord("s", "http", arrival=0.0, stream=True)

    async def feed() -> None:
        with_details.saw_chunk(
            b'data: {"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":2,"total_tokens":102,'
            b'"prompt_tokens_details":{"cached_tokens":96}}}\n\ndata: [DONE]\n\n'
        )
        without.saw_chunk(b'data: {"choices":[{"text":"cached_tokens: 5"}]}\n\n')
        without.saw_chunk(b'data: {"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":2}}\n\n')

    trio.run(feed)
    assert (with_details.input_tokens, with_details.cached_tokens, with_details.completion_tokens) == (100, 96, 2)
    assert (without.input_tokens, without.cached_tokens) == (100, None)  # vLLM without --enable-prompt-tokens-details
    fields = access_fields(with_details)
    assert fields["cached_tokens"] == 96 and fields["placement"] is None
