"""The gRPC front end over a real socket: generated sync and aio clients."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import httpx
import pytest
import trio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tailguard.router.config import ApiKeyConfig, AuthConfig, Config, TimeoutsConfig
from tailguard.router.quotas import hash_key
from tailguard.server.grpc.gate import FLOOR
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tests.helpers.front_ends import Faulty, front_ends
from tests.helpers.grpc_service import Service, grpc_service, wait_for
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK

SLOW = QUICK.replace(base_ms=10.0)  # ~10 ms a token


def config(urls: list[str], **kwargs: object) -> Config:
    timeouts = kwargs.pop("timeouts", TimeoutsConfig(health_check_interval=0.1))
    base = two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]], timeouts=timeouts, **kwargs)  # type: ignore[arg-type]
    # GET /health only: at a 0.1 s interval "auto" would send a completion probe a turn while a long unary call
    # runs, and these tests count the engines' finished requests.
    return dataclasses.replace(base, pools=tuple(dataclasses.replace(p, health_check="http") for p in base.pools))


@contextmanager
def trio_stopped(token: trio.lowlevel.TrioToken) -> Iterator[threading.Event]:
    """The service's Trio thread stopped for the block (at most 30 s); the event is set while it is.

    An answer that comes while the event is set came with the router's loop
    stopped, whatever the machine's speed: no window of seconds to hope for.
    """
    stopped, resume = threading.Event(), threading.Event()

    def stall() -> None:
        stopped.set()
        resume.wait(30)
        stopped.clear()

    token.run_sync_soon(stall)
    assert stopped.wait(30), "the Trio thread never stopped"
    try:
        yield stopped
    finally:
        resume.set()


def chat(text: str = "What is the capital of France?", **options: object) -> pb.ChatRequest:
    return pb.ChatRequest(messages=[pb.Message(role="user", content=text)], options=pb.Options(**options))


@pytest.fixture
def service() -> Service:  # type: ignore[misc]
    with grpc_service([QUICK, QUICK], config) as running:
        yield running


@pytest.fixture
def stub(service: Service) -> pb_grpc.CompletionsStub:
    with grpc.insecure_channel(service.grpc_target) as channel:
        yield pb_grpc.CompletionsStub(channel)


def test_unary_and_streaming_chat_and_completion(service: Service, stub: pb_grpc.CompletionsStub) -> None:
    reply, call = stub.Chat.with_call(chat(max_tokens=12), metadata=[("x-request-id", "grpc-1")])
    metadata = dict(call.initial_metadata())
    assert metadata["x-request-id"] == "grpc-1" and metadata["x-tailguard-pool"] == "interactive"
    assert metadata["x-tailguard-max-tokens"] == "12"
    assert reply.usage.completion_tokens == 12 and reply.finish_reason == "length"
    assert reply.routing.request_class == "interactive" and reply.routing.request_id == "grpc-1"

    chunks = list(stub.ChatStream(chat(max_tokens=12)))
    assert chunks[0].routing.pool == "interactive"
    assert "".join(c.content for c in chunks) == reply.content
    assert chunks[-1].usage.completion_tokens == 12
    assert any(c.finish_reason == "length" for c in chunks)

    text = stub.Complete(pb.CompletionRequest(prompt="Once upon a time", options=pb.Options(max_tokens=5000)))
    assert text.routing.max_tokens == 1024 and text.routing.max_tokens_clamped and text.routing.pool == "batch"
    assert text.usage.completion_tokens == 1024
    streamed = list(stub.CompleteStream(pb.CompletionRequest(prompt="Once upon a time", options=pb.Options(max_tokens=4))))
    assert len("".join(c.content for c in streamed).split()) == 4
    assert service.engines[0].statistics().finished_total == 3  # two chats and the short completion
    assert service.engines[1].statistics().finished_total == 1  # the clamped completion


def test_http_and_grpc_agree_on_class_pool_and_max_tokens(service: Service, stub: pb_grpc.CompletionsStub) -> None:
    cases = [("short", 64), ("short", None), ("long " * 900, 32), ("short", 4000)]
    for text, max_tokens in cases:
        options = {} if max_tokens is None else {"max_tokens": max_tokens}
        over_grpc = stub.Chat(chat(text, **options)).routing
        body: dict[str, object] = {"messages": [{"role": "user", "content": text}], **options}
        over_http = httpx.post(service.http_url + "/v1/chat/completions", json=body, timeout=30).headers
        assert (over_grpc.request_class, over_grpc.pool, str(over_grpc.max_tokens)) == (
            over_http["x-tailguard-class"],
            over_http["x-tailguard-pool"],
            over_http["x-tailguard-max-tokens"],
        )


def test_limits_match_the_http_document(service: Service, stub: pb_grpc.CompletionsStub) -> None:
    limits = stub.GetLimits(pb.GetLimitsRequest())
    document = httpx.get(service.http_url + "/v1/limits").json()
    assert limits.input_cap_tokens == document["input_cap_tokens"] == 8192
    assert limits.output_cap_tokens == document["output_cap_tokens"]
    assert [c.name for c in limits.classes] == [c["name"] for c in document["classes"]]
    assert limits.classes[0].max_output_tokens == 128 and not limits.classes[1].HasField("max_output_tokens")
    assert limits.estimate.learn is document["estimate"]["learn"] is True  # the estimate grows with what the engines' usage taught
    for over_grpc, over_http in zip(limits.classes, document["classes"], strict=True):  # what each class is promised
        objective = over_http["objective"]
        assert (over_grpc.objective.e2e_s, over_grpc.objective.percentile) == (objective["e2e"], objective["percentile"])
        assert (over_grpc.objective.ttft_s if over_grpc.objective.HasField("ttft_s") else None) == objective["ttft"]
        assert (over_grpc.objective.itl_s if over_grpc.objective.HasField("itl_s") else None) == objective["itl"]


@pytest.mark.parametrize(
    ("request_", "code", "needle"),
    [
        (pb.ChatRequest(options=pb.Options(max_tokens=8)), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
        (chat(max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (chat("word " * 40_000, max_tokens=8), grpc.StatusCode.INVALID_ARGUMENT, "input cap"),
        (chat(max_tokens=8, request_class="batch"), grpc.StatusCode.PERMISSION_DENIED, "may not force the class"),
        (pb.ChatRequest(model="gpt-9", messages=[pb.Message(role="user", content="x")]), grpc.StatusCode.NOT_FOUND, "not served"),
        (chat(max_tokens=8, n=9), grpc.StatusCode.INVALID_ARGUMENT, "one choice a call"),
    ],
)
def test_rejections_have_clear_status_codes(stub: pb_grpc.CompletionsStub, request_: pb.ChatRequest, code: grpc.StatusCode, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Chat(request_)
    assert caught.value.code() == code and needle in caught.value.details()


def test_overload_and_deadlines() -> None:
    def make(urls: list[str]) -> Config:
        return config(urls, interactive_cap=1, max_queue=1, interactive_timeout=0.3)

    with grpc_service([SLOW, QUICK], make) as service, grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        holder = stub.ChatStream(chat(max_tokens=128))  # ~1.3 s on the one interactive seat
        next(holder)
        queued = stub.Chat.future(chat("second", max_tokens=8))
        wait_for(lambda: service.running.router.statistics().waiting == 1)
        with pytest.raises(grpc.RpcError) as full:
            stub.Chat(chat("third", max_tokens=8))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(full.value.trailing_metadata())
        # The 1 s floor, spread (nothing is measured yet), in whole seconds and to the millisecond.
        assert trailing["retry-after"] in ("1", "2") and 1000 <= int(trailing["grpc-retry-pushback-ms"]) <= 1500
        with pytest.raises(grpc.RpcError) as timed_out:
            queued.result()
        assert timed_out.value.code() == grpc.StatusCode.UNAVAILABLE and "retry-after" in dict(timed_out.value.trailing_metadata())
        holder.cancel()

        # The caller's deadline, shorter than the generation: DEADLINE_EXCEEDED, and the engine aborts.
        engine = service.engines[1]
        with pytest.raises(grpc.RpcError) as late:
            stub.Chat(chat(max_tokens=1000), timeout=0.3)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: engine.statistics().aborted_total == 1 and engine.statistics().running == 0)
        wait_for(lambda: service.running.router.statistics().in_flight == 0)


def test_configured_deadline_and_client_cancel_abort_the_engine() -> None:
    def make(urls: list[str]) -> Config:
        return config(urls, timeouts=TimeoutsConfig(end_to_end_timeout=0.4, health_check_interval=0.1), interactive_timeout=0.2, batch_timeout=0.2)

    with grpc_service([SLOW, SLOW], make) as service, grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        with pytest.raises(grpc.RpcError) as late:
            list(stub.ChatStream(chat(max_tokens=1000)))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        batch = service.engines[1]
        wait_for(lambda: batch.statistics().aborted_total == 1 and batch.statistics().running == 0)

        stream = stub.ChatStream(chat(max_tokens=100))
        next(stream)
        stream.cancel()
        interactive = service.engines[0]
        wait_for(lambda: interactive.statistics().aborted_total == 1 and interactive.statistics().running == 0)
        wait_for(lambda: service.running.router.statistics().in_flight == 0)


def test_health_flips_when_a_pool_loses_its_endpoints(service: Service) -> None:
    with grpc.insecure_channel(service.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def status(name: str = "") -> int:
            return int(health.Check(health_pb2.HealthCheckRequest(service=name)).status)

        assert status() == health_pb2.HealthCheckResponse.SERVING
        assert status("tailguard.v1.Completions") == health_pb2.HealthCheckResponse.SERVING
        service.switches[1].up = False
        wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.CompletionsStub(channel).Chat(chat(max_tokens=500))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy endpoint" in caught.value.details()
        service.switches[1].up = True
        wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING)


def test_reflection_lists_the_service(service: Service) -> None:
    with grpc.insecure_channel(service.grpc_target) as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(replies).list_services_response.service}
    assert {"tailguard.v1.Completions", "grpc.health.v1.Health"} <= names


def test_aio_client_unary_and_stream(service: Service) -> None:
    async def main() -> tuple[str, str]:
        async with grpc.aio.insecure_channel(service.grpc_target) as channel:
            stub = pb_grpc.CompletionsStub(channel)
            reply = await stub.Chat(chat(max_tokens=10))
            pieces = [c.content async for c in stub.ChatStream(chat(max_tokens=10))]
            return reply.content, "".join(pieces)

    plain, streamed = asyncio.run(main())
    assert plain == streamed and len(plain.split()) == 10


def test_extra_parameters_pass_through(service: Service, stub: pb_grpc.CompletionsStub) -> None:
    request = chat(max_tokens=5, seed=7)
    request.options.extra.update({"ignore_eos": True, "min_tokens": 5})
    first = stub.Chat(request)
    second = stub.Chat(request)
    other_seed = stub.Chat(chat(max_tokens=5, seed=8))
    assert first.content == second.content != other_seed.content


def test_shutdown_lets_in_flight_streams_finish() -> None:
    with grpc_service([SLOW, QUICK], config) as service, grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        stream = stub.ChatStream(chat(max_tokens=60))  # ~0.6 s
        chunks = [next(stream)]
        service.token.run_sync_soon(service._shutdown.set)
        chunks.extend(stream)
        assert stream.code() == grpc.StatusCode.OK
        assert chunks[-1].usage.completion_tokens == 60
        with pytest.raises(grpc.RpcError) as refused:
            stub.Chat(chat(max_tokens=4), timeout=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_backend_failure_is_unavailable_with_a_retry_hint(service: Service, stub: pb_grpc.CompletionsStub) -> None:
    service.switches[0].fail_completions = True
    with pytest.raises(grpc.RpcError) as caught:
        stub.Chat(chat(max_tokens=8))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "engine failure" in caught.value.details()
    assert "retry-after" in dict(caught.value.trailing_metadata())
    wait_for(lambda: service.running.router.statistics().in_flight == 0)


def test_calls_over_the_cap_get_resource_exhausted_at_once_and_are_counted() -> None:
    """Issue 10, defect 5: beyond its cap of open calls gRPC answers at once, never a silent CANCELLED."""
    backend = Faulty("hold")  # streams of an event every 20 ms for a minute: calls stay open
    with front_ends([backend, Faulty()], lambda urls: config(urls), max_grpc_calls=4) as service:
        with grpc.insecure_channel(service.grpc_target) as channel:
            stub = pb_grpc.CompletionsStub(channel)
            holders = [stub.ChatStream(chat(max_tokens=8), metadata=[("x-request-id", f"hold-{i}")], timeout=60) for i in range(4)]
            for holder in holders:
                next(holder)
            # At once: well inside their own 10 s deadline (a late answer is DEADLINE_EXCEEDED), not grpc core's 30 s.
            over = [stub.Chat.future(chat(max_tokens=8), metadata=[("x-request-id", f"over-{i}")], timeout=10) for i in range(8)]
            for index, future in enumerate(over):
                with pytest.raises(grpc.RpcError) as refused:
                    future.result()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
                trailing = dict(refused.value.trailing_metadata())
                assert (trailing["retry-after"], trailing["grpc-retry-pushback-ms"], trailing["x-request-id"]) == ("1", "1000", f"over-{index}")
            assert not any(holder.done() for holder in holders)  # refused for the cap: the four still hold it
            for index in range(8):
                record = service.record(f"over-{index}")
                assert (record.outcome, record.reason, record.status) == ("overloaded", "server_busy", "RESOURCE_EXHAUSTED")
            page = service.metrics.render().decode()
            assert 'tailguard_rejections_total{class="none",pool="none",reason="server_busy"} 8.0' in page
            for holder in holders:
                holder.cancel()
            for index in range(4):
                assert service.record(f"hold-{index}").outcome == "cancelled"
            backend.mode = "ok"
            assert stub.Chat(chat(max_tokens=4), timeout=10).usage.completion_tokens == 4  # room again


def test_calls_over_the_cap_are_refused_while_the_trio_loop_is_stalled() -> None:
    """Issue 20, defect 1: a refusal over the cap costs the router nothing -- it comes with the Trio loop blocked."""
    backend = Faulty("slow")
    with front_ends([backend, Faulty()], lambda urls: config(urls), max_grpc_calls=2) as service:
        with grpc.insecure_channel(service.grpc_target) as channel:
            stub = pb_grpc.CompletionsStub(channel)
            holders = [stub.ChatStream(chat(max_tokens=8), timeout=30) for _ in range(2)]
            for holder in holders:
                next(holder)
            with trio_stopped(service.token) as stopped:
                over = [stub.Chat.future(chat(max_tokens=8), metadata=[("x-request-id", f"over-{i}")], timeout=30) for i in range(4)]
                for future in over:
                    with pytest.raises(grpc.RpcError) as refused:
                        future.result()
                    assert stopped.is_set()  # answered with the Trio loop stopped
                    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
                    assert dict(refused.value.trailing_metadata())["x-tailguard-error-code"] == "server_busy"
            for index in range(4):  # recorded (access log, metrics) once the loop runs again
                record = service.record(f"over-{index}")
                assert (record.outcome, record.reason, record.status) == ("overloaded", "server_busy", "RESOURCE_EXHAUSTED")
            for holder in holders:
                holder.cancel()


def test_calls_beyond_what_small_pools_can_hold_are_refused_on_the_asyncio_side() -> None:
    """Issue 20, defect 1: with pools of 1 seat and no queue, the gate is at most twice their room (2) plus 64, not the 1,000 cap.

    The gate starts at 64 (server/grpc/gate.py) and may grow to that ceiling
    (68) while nothing waits in grpc. The Trio loop is stopped while the calls
    arrive, until each has been refused or is held open by the gate (the open
    calls a refusal names, plus the refusals: all 100), so every call answered
    before the loop runs again was refused by the gate, never by the router.
    """
    with front_ends([Faulty(), Faulty()], lambda urls: config(urls, interactive_cap=1, batch_cap=1, max_queue=0), max_grpc_calls=1000) as service:
        with grpc.insecure_channel(service.grpc_target) as channel:
            stub = pb_grpc.CompletionsStub(channel)
            stub.Chat(chat(max_tokens=2), timeout=10)  # connected, and the gate has heard of the pools' room
            answered: dict[int, bool] = {}  # call -> answered with the Trio loop stopped
            held_open = [0]  # the most calls open a refusal named (while the loop is stopped they only add up)

            def on_answer(call: grpc.Future, index: int, stopped: threading.Event) -> None:
                answered.setdefault(index, stopped.is_set())
                named = re.match(r"tailguard has (\d+) grpc calls open", call.details() or "")
                held_open[0] = max(held_open[0], int(named[1]) if named else 0)

            with trio_stopped(service.token) as stopped:
                calls = [stub.Chat.future(chat(max_tokens=2), metadata=[("x-request-id", f"call-{i}")], timeout=30) for i in range(100)]
                for index, call in enumerate(calls):
                    call.add_done_callback(functools.partial(on_answer, index=index, stopped=stopped))
                every_call_in = time.monotonic() + 10  # a bound: were the gate to grow after its last refusal, the sum stays short
                while len(answered) + held_open[0] < len(calls) and time.monotonic() < every_call_in:
                    time.sleep(0.01)
            outcomes: list[str] = []
            for call in calls:
                try:
                    call.result()
                    outcomes.append("OK")
                except grpc.RpcError as refused:
                    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
                    outcomes.append(dict(refused.trailing_metadata())["x-tailguard-error-code"])
                    if outcomes[-1] == "server_busy":
                        assert re.match(r"tailguard has 6[4-8] grpc calls open, ", refused.details()), refused.details()
            busy = [i for i, outcome in enumerate(outcomes) if outcome == "server_busy"]
            assert 100 - (2 * 2 + 64) <= len(busy) <= 100 - 64, outcomes
            assert all(answered[i] for i in busy)  # at once, with the router's loop stopped
            assert outcomes.count("queue_full") + outcomes.count("OK") == 100 - len(busy) and "OK" in outcomes, outcomes
            wait_for(lambda: service.router.statistics().in_flight == 0)


def test_a_caller_whose_calls_are_mostly_refused_is_shed_and_another_caller_is_not() -> None:
    """Issue 20, defect 1: a flood the router refuses anyway is refused on the asyncio side (router/quotas/shed.py), per connection."""
    backend = Faulty("hold")  # the seat stays taken for the whole flood, even on a loaded machine (a 10 s stream did not)
    with front_ends([backend, Faulty()], lambda urls: config(urls, interactive_cap=1, max_queue=0), max_grpc_calls=1000) as service:
        own = [("grpc.use_local_subchannel_pool", 1)]  # a connection each (grpc shares one between channels by default)
        with grpc.insecure_channel(service.grpc_target, own) as flood, grpc.insecure_channel(service.grpc_target, own) as other:
            holder = pb_grpc.CompletionsStub(other).ChatStream(chat(max_tokens=8), timeout=30)
            next(holder)  # the one interactive seat is taken, and nothing may wait
            stub = pb_grpc.CompletionsStub(flood)
            details: list[str] = []
            for wave in range(8):  # 8 waves of 40 calls, each answered before the next: never over the gate
                futures = [stub.Chat.future(chat(max_tokens=2), metadata=[("x-request-id", f"flood-{wave}-{i}")], timeout=30) for i in range(40)]
                for future in futures:
                    with pytest.raises(grpc.RpcError) as refused:
                        future.result()
                    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    details.append(refused.value.details())
            shed = [i for i, d in enumerate(details) if d.startswith("tailguard sheds")]
            assert len(shed) > 100 and min(shed) >= 100, (len(shed), details[:2])  # only once 100 calls have shown a flood
            assert all(d.startswith("queue full") for i, d in enumerate(details) if i not in shed)
            record = service.record(f"flood-{shed[-1] // 40}-{shed[-1] % 40}")
            assert (record.outcome, record.reason, record.status) == ("overloaded", "server_busy", "RESOURCE_EXHAUSTED")
            with pytest.raises(grpc.RpcError) as other_refused:  # another connection: its own tally, not shed
                pb_grpc.CompletionsStub(other).Chat(chat(max_tokens=2), timeout=30)
            assert other_refused.value.details().startswith("queue full")
            holder.cancel()


def test_a_paced_class_streams_every_token_over_grpc_as_one_message_each() -> None:
    """relay_interval hands the gRPC side several events in one chunk: each still becomes its own message."""

    def paced(urls: list[str]) -> Config:
        made = config(urls)
        classes = tuple(dataclasses.replace(c, relay_interval=0.05) if c.name == "batch" else c for c in made.classes)
        return dataclasses.replace(made, classes=classes)

    with grpc_service([SLOW, SLOW], paced) as service, grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        reply = stub.Chat(chat(max_tokens=200, seed=7))
        assert reply.routing.request_class == "batch"
        chunks = list(stub.ChatStream(chat(max_tokens=200, seed=7)))
        assert chunks[0].routing.request_class == "batch"
        tokens = [c.content for c in chunks if c.content]
        assert len(tokens) == 200 and "".join(tokens) == reply.content
        assert chunks[-1].usage.completion_tokens == 200


def test_bytes_that_are_no_request_message_are_invalid_argument_without_internals() -> None:
    """Issue 20: malformed input was UNKNOWN with Python's exception text ("Unexpected <class '...DecodeError'>")."""
    with grpc_service([QUICK, QUICK], config) as service, grpc.insecure_channel(service.grpc_target) as channel:
        for method in ("Chat", "ChatStream", "Complete", "GetLimits"):
            call = channel.unary_unary(f"/tailguard.v1.Completions/{method}")  # raw bytes both ways
            with pytest.raises(grpc.RpcError) as refused:
                call(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)  # a length that runs past the end
            error = refused.value
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error.code(), error.details())
            assert "DecodeError" not in error.details() and "class" not in error.details()
            assert ("x-tailguard-error-code", "invalid_request_error") in error.trailing_metadata()
        # a well-formed call still works on the same channel
        reply = pb_grpc.CompletionsStub(channel).Chat(pb.ChatRequest(messages=[pb.Message(role="user", content="hi")], options=pb.Options(max_tokens=4)), timeout=10)
        assert reply.content


def test_a_budgeted_callers_answers_and_refusals_carry_the_rate_limits() -> None:
    def make(urls: list[str]) -> Config:
        base = config(urls)
        return dataclasses.replace(base, limits=dataclasses.replace(base.limits, anonymous_requests_per_minute=1))

    with grpc_service([QUICK, QUICK], make) as service, grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        _, call = stub.Chat.with_call(chat(max_tokens=4))
        assert dict(call.initial_metadata())["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(grpc.RpcError) as refused:
            stub.Chat(chat(max_tokens=4))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(refused.value.trailing_metadata())
        assert trailing["x-tailguard-error-code"] == "token_budget_exceeded" and trailing["x-ratelimit-limit-requests"] == "1"
        assert 55_000 <= int(trailing["grpc-retry-pushback-ms"]) <= 60_000


def test_a_flood_on_one_channel_is_answered_in_tailguards_words_and_counted() -> None:
    """Issue 32, item 2: 400 calls at once on one channel, far over the gate: each is served or refused server_busy, and counted.

    Before, grpc's own overload protection refused streams the client had
    been allowed to open (RST_STREAM REFUSED_STREAM: UNAVAILABLE, no access
    line, no metric): streams already answered still counted against the
    connection's limit until Python let go of them.
    """
    with front_ends([Faulty(), Faulty()], lambda urls: config(urls), max_grpc_calls=20) as service:
        with grpc.insecure_channel(service.grpc_target) as channel:
            stub = pb_grpc.CompletionsStub(channel)
            stub.Chat(chat(max_tokens=1), timeout=10)  # connected: the flood does not wait for the handshake
            started = time.monotonic()
            calls = [stub.Chat.future(chat(max_tokens=2), metadata=[("x-request-id", f"flood-{i}")], timeout=30) for i in range(400)]
            outcomes: dict[str, int] = {}
            for index, call in enumerate(calls):
                try:
                    call.result()
                    outcome = "OK"
                except grpc.RpcError as ended:
                    trailing = dict(ended.trailing_metadata() or ())
                    outcome = f"{ended.code().name} {trailing.get('x-tailguard-error-code')}"
                    if ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        assert trailing["grpc-retry-pushback-ms"] == "1000" and trailing["x-request-id"] == f"flood-{index}"
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
            elapsed = time.monotonic() - started
            assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED server_busy", "RESOURCE_EXHAUSTED queue_full"}, outcomes
            # The gate was reached (how often depends on how fast the engines answer the calls let in: a count is no bound).
            assert outcomes.get("RESOURCE_EXHAUSTED server_busy", 0) >= 1 and outcomes.get("OK", 0) >= 20, outcomes
            for index in range(400):
                assert service.record(f"flood-{index}").api == "grpc"  # its access-log line and metrics
            assert elapsed < 10.0, elapsed


def test_a_cold_gate_lets_its_floor_open_at_once_and_grows_while_no_call_waits_in_grpc() -> None:
    """Issue 32, item 2: the gate is measured (server/grpc/gate.py), not a fixed 1,000 a burst can swamp the loop with.

    A burst of 150 streams meets a gate at its floor: the rest hear
    server_busy at once. While the gate binds (the refused calls are retried)
    and grpc holds no call waiting to be picked up, it grows until all are in.
    """
    backend = Faulty("hold")
    with front_ends([backend, Faulty()], lambda urls: config(urls, interactive_cap=200, max_queue=0), max_grpc_calls=1000) as service:
        with grpc.insecure_channel(service.grpc_target) as channel:
            stub = pb_grpc.CompletionsStub(channel)
            opened: list[grpc.Future] = []

            def burst(count: int) -> tuple[int, list[str]]:
                calls = [stub.ChatStream(chat(max_tokens=8), timeout=60) for _ in range(count)]
                admitted, refused = 0, []
                for call in calls:
                    try:
                        next(call)
                        admitted += 1
                        opened.append(call)
                    except grpc.RpcError as error:
                        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
                        refused.append(error.details())
                return admitted, refused

            admitted, refused = burst(150)
            assert FLOOR <= admitted < 100, admitted
            assert all("all its gate lets open now" in details for details in refused), refused[:1]
            deadline = time.monotonic() + 10.0
            while admitted < 150 and time.monotonic() < deadline:
                time.sleep(0.25)  # a tick of the gate
                admitted += burst(150 - admitted)[0]
            assert admitted == 150
            for call in opened:
                call.cancel()
            wait_for(lambda: service.router.statistics().in_flight == 0)


@pytest.mark.parametrize("keys", [False, True], ids=["auth off", "auth on"])
def test_the_shed_counts_a_caller_whatever_authorization_value_it_sends(keys: bool) -> None:
    """Issue 32, item 9: the shed keys on the key's name (or, without one, the connection), never on the raw header.

    Before, each call with a value of its own was a caller of its own to the
    shed: a flood that sent a new ``Authorization`` with every call was never
    shed (0 of 320 here). Auth off, the header means nothing; auth on, one key
    spelled several ways is still one caller.
    """
    backend = Faulty("hold")

    def make(urls: list[str]) -> Config:
        base = config(urls, interactive_cap=1, max_queue=0)
        return dataclasses.replace(base, auth=AuthConfig(keys=(ApiKeyConfig("flooder", hash_key("k-1")), ApiKeyConfig("other", hash_key("k-2")))) if keys else base.auth)

    spellings = ("Bearer k-1", "bearer k-1", "BEARER  k-1", "Bearer k-1 ")
    with front_ends([backend, Faulty()], make, max_grpc_calls=1000) as service:
        with grpc.insecure_channel(service.grpc_target) as channel:
            holder = pb_grpc.CompletionsStub(channel).ChatStream(chat(max_tokens=8), metadata=[("authorization", "Bearer k-2")], timeout=30)
            next(holder)  # the one interactive seat is taken, and nothing may wait
            stub = pb_grpc.CompletionsStub(channel)
            details: list[str] = []
            for wave in range(8):  # 8 waves of 40 calls, each answered before the next: never over the gate
                futures = [
                    stub.Chat.future(chat(max_tokens=2), metadata=[("authorization", spellings[i % 4] if keys else f"Bearer {wave}-{i}")], timeout=30)
                    for i in range(40)
                ]
                for future in futures:
                    with pytest.raises(grpc.RpcError) as refused:
                        future.result()
                    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    details.append(refused.value.details())
            shed = [d for d in details if d.startswith("tailguard sheds")]
            assert len(shed) > 100, details[-1]
            holder.cancel()


def _with_extra(**extra: object) -> pb.ChatRequest:
    request = chat(max_tokens=4)
    request.options.extra.update(extra)
    return request


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (chat(max_tokens=4, temperature=1e300), "options.temperature is out of range: a float field holds finite numbers up to"),
        (chat(max_tokens=4, top_p=float("nan")), "options.top_p is out of range"),
        (_with_extra(temperature=float("inf")), "options.extra.temperature is not a finite number"),
        (_with_extra(logit_bias={"50256": float("-inf")}), "options.extra.logit_bias[\"50256\"] is not a finite number"),
    ],
)
def test_a_number_out_of_a_fields_range_is_invalid_argument_naming_the_field(stub: pb_grpc.CompletionsStub, request_: pb.ChatRequest, needle: str) -> None:
    """Issue 32, item 10: not "an integer out of range" (a Struct's 1e300 was made a 301-digit integer), nor INTERNAL (infinity in a Struct)."""
    with pytest.raises(grpc.RpcError) as caught:
        stub.Chat(request_)
    assert (caught.value.code(), caught.value.details()[: len(needle)]) == (grpc.StatusCode.INVALID_ARGUMENT, needle)


def test_a_large_double_in_extra_goes_on_as_a_float_as_over_http(stub: pb_grpc.CompletionsStub) -> None:
    """1e300 is a double like any other: only doubles that are integers exactly go to the engine as integers.

    (repetition_penalty: vLLM takes any finite positive one; a temperature of 1e300 it refuses, over [0, 2].)
    """
    assert stub.Chat(_with_extra(repetition_penalty=1e300, min_tokens=2.0)).usage.completion_tokens == 4
