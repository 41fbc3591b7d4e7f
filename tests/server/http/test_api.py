"""The OpenAI HTTP front end over real sockets: the SDK, every error row, disconnects."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from urllib.parse import urlsplit

import h11
import httpx
import openai
import pytest
import trio
import trio.lowlevel
from openai.types.chat import ChatCompletionMessageParam

from tailguard.router import Router
from tailguard.router.config import Config, LimitsConfig, ObjectiveConfig, ServerConfig, TimeoutsConfig
from tailguard.server.http import api as http_api
from tailguard.sim import SimResponse
from tests.helpers.engines import MODEL
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, Backends, engines_on_sockets, eventually, tailguard

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


def config_for(urls: list[str], **kwargs: object) -> Config:
    server = kwargs.pop("server", ServerConfig(max_body_bytes=64 * 1024))
    config = two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]], **kwargs)  # type: ignore[arg-type]
    return dataclasses.replace(config, server=server)  # type: ignore[arg-type]


async def test_openai_sdk_sees_routing_headers_streaming_and_not(two_engines: Backends) -> None:
    async with tailguard(config_for(two_engines.urls)) as running:
        client = openai.AsyncOpenAI(base_url=running.http_url + "/v1", api_key="unused", max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, extra_headers={"x-request-id": "req-123"}
        )
        reply = raw.parse()
        assert raw.headers["x-request-id"] == "req-123"
        assert raw.headers["x-tailguard-class"] == "interactive" and raw.headers["x-tailguard-pool"] == "interactive"
        assert raw.headers["x-tailguard-max-tokens"] == "16" and float(raw.headers["x-tailguard-queue-ms"]) >= 0
        assert reply.usage is not None and reply.usage.completion_tokens == 16

        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, stream=True)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces) == reply.choices[0].message.content

        clamped = await client.completions.with_raw_response.create(model=MODEL, prompt="Once upon a time", max_tokens=5000)
        assert clamped.headers["x-tailguard-max-tokens"] == "1024" and clamped.headers["x-tailguard-pool"] == "batch"
        assert clamped.parse().usage.completion_tokens == 1024  # type: ignore[union-attr]
        assert two_engines.engines[0].statistics().finished_total == 2  # type: ignore[union-attr]
        assert two_engines.engines[1].statistics().finished_total == 1  # type: ignore[union-attr]

        def sync_calls() -> str:
            with openai.OpenAI(base_url=running.http_url + "/v1", api_key="unused", max_retries=0) as sync:
                text = "".join(
                    c.choices[0].text for c in sync.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True)
                )
                assert sync.completions.create(model=MODEL, prompt="Hi", max_tokens=4).choices[0].text == text
                return text

        assert len((await trio.to_thread.run_sync(sync_calls)).split()) == 4
        await client.close()


async def test_models_health_and_limits(two_engines: Backends) -> None:
    async with tailguard(config_for(two_engines.urls)) as running:
        async with httpx.AsyncClient(base_url=running.http_url) as client:
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ready"
            limits = (await client.get("/v1/limits")).json()
            text = json.dumps(limits)
            assert "1024" in text and "8192" in text and "127.0.0.1" not in text


async def test_each_request_is_judged_against_its_class_objective_on_metrics_the_access_log_and_limits(
    two_engines: Backends, caplog: pytest.LogCaptureFixture
) -> None:
    """A lenient interactive objective is met, a batch deadline no long answer can keep is missed: each
    verdict shows in the access line, the per-class counters, the attainment gauges and /v1/limits."""
    config = config_for(two_engines.urls)
    interactive, batch = config.classes
    config = dataclasses.replace(
        config,
        classes=(
            dataclasses.replace(interactive, objective=ObjectiveConfig(ttft=5.0, itl=1.0, e2e=60.0, percentile=95.0)),
            dataclasses.replace(batch, objective=ObjectiveConfig(ttft=None, itl=None, e2e=0.001, throughput_share=0.5)),
        ),
    )
    async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        with caplog.at_level(logging.INFO):
            short = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "stream": True})
            long = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 400})
            assert (short.status_code, long.status_code) == (200, 200)
            assert (short.headers["x-tailguard-class"], long.headers["x-tailguard-class"]) == ("interactive", "batch")
            await eventually(lambda: len([r for r in caplog.records if r.name == "tailguard.access"]) == 2)
        lines = {r.fields["class"]: r.fields for r in caplog.records if r.name == "tailguard.access"}  # type: ignore[attr-defined]
        assert (lines["interactive"]["objective_met"], lines["batch"]["objective_met"]) == (True, False)
        assert lines["interactive"]["tpot_ms"] > 0 and lines["interactive"]["max_gap_ms"] > 0
        metrics = (await client.get("/metrics")).text
        for sample in (
            'tailguard_objective_requests_total{class="interactive",met="true"} 1.0',
            'tailguard_objective_requests_total{class="batch",met="false"} 1.0',
            'tailguard_class_attainment{class="interactive"} 1.0',
            'tailguard_class_attainment{class="batch"} 0.0',
            'tailguard_class_attainment_target{class="interactive"} 0.95',
            'tailguard_class_objective_seconds{class="interactive",target="ttft"} 5.0',
            'tailguard_class_objective_seconds{class="batch",target="e2e"} 0.001',
        ):
            assert sample in metrics, sample
        assert 'tailguard_class_objective_seconds{class="batch",target="ttft"}' not in metrics
        limits = (await client.get("/v1/limits")).json()
        assert limits["classes"][1]["objective"] == {"ttft": None, "itl": None, "e2e": 0.001, "percentile": 99.0, "throughput_share": 0.5}
        shown = limits["attainment"]
        assert (shown["interactive"]["attainment"], shown["interactive"]["on_target"]) == (1.0, True)
        assert (shown["batch"]["judged"], shown["batch"]["met"], shown["batch"]["on_target"]) == (1, 0, False)
        tokens = shown["interactive"]["tokens"] + shown["batch"]["tokens"]
        assert shown["batch"]["throughput_share"] == pytest.approx(shown["batch"]["tokens"] / tokens)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{oops", 400, "not valid JSON"),
        (b"\xff\xfe\xfd", 400, "JSON"),
        (b'"a string"', 400, "JSON object"),
        (json.dumps({"model": MODEL}).encode(), 400, "messages is required"),
        (json.dumps({"messages": []}).encode(), 400, "non-empty"),
        (json.dumps({"messages": "hello"}).encode(), 400, "messages"),
        (json.dumps({"messages": MESSAGES, "max_tokens": -5}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": MESSAGES, "max_tokens": 10**40}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": MESSAGES, "max_tokens": "many"}).encode(), 400, "integer"),
        (json.dumps({"messages": MESSAGES, "stream": "yes"}).encode(), 400, "boolean"),
        (json.dumps({"messages": MESSAGES, "model": "gpt-9"}).encode(), 404, "not served"),
        (json.dumps({"messages": [{"role": "user", "content": "word " * 9_000}]}).encode(), 400, "input cap"),
        (b"x" * (64 * 1024 + 1), 413, "body is over"),
    ],
)
async def test_bad_input_gets_a_clear_4xx(body: bytes, status: int, needle: str, two_engines: Backends) -> None:
    async with tailguard(config_for(two_engines.urls)) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        response = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}
        assert running.router.statistics().in_flight == 0
        assert (await client.get("/v1/chat/completions")).status_code == 405
        assert (await client.get("/nowhere")).status_code == 404


async def test_forced_class_is_forbidden_and_reject_mode_refuses(two_engines: Backends) -> None:
    config = config_for(two_engines.urls, limits=LimitsConfig(over_cap="reject"))
    async with tailguard(config) as running:
        client = openai.AsyncOpenAI(base_url=running.http_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.PermissionDeniedError, match="may not force the class"):
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, extra_headers={"x-tailguard-class": "batch"}
            )
        with pytest.raises(openai.BadRequestError, match="output cap of 1024") as caught:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2000)
        assert caught.value.code == "max_tokens_too_large"
        await client.close()


async def test_queue_full_is_429_and_queue_deadline_503_with_retry_after() -> None:
    slow = QUICK.replace(base_ms=10.0)  # 128 tokens hold the seat ~1.3 s
    async with engines_on_sockets([slow, QUICK]) as backends:
        config = config_for(backends.urls, interactive_cap=1, max_queue=1, interactive_timeout=0.3)
        async with tailguard(config) as running:
            client = openai.AsyncOpenAI(base_url=running.http_url + "/v1", api_key="unused", max_retries=0)
            async with trio.open_nursery() as nursery:
                hold = trio.Event()

                async def occupy() -> None:
                    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=128, stream=True)
                    async for _ in stream:
                        hold.set()

                outcomes: dict[str, openai.APIStatusError] = {}

                async def wait_in_queue() -> None:
                    try:
                        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
                    except openai.APIStatusError as error:
                        outcomes["queued"] = error

                nursery.start_soon(occupy)
                await hold.wait()
                nursery.start_soon(wait_in_queue)
                while running.router.statistics().waiting == 0:
                    await trio.sleep(0.005)
                with pytest.raises(openai.RateLimitError) as full:
                    await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
                assert full.value.code == "queue_full" and full.value.response.headers["retry-after"] in ("1", "2")
                assert 1000 <= int(full.value.response.headers["retry-after-ms"]) <= 1500  # the 1 s floor, spread: nothing measured yet
            timed_out = outcomes["queued"]
            assert timed_out.status_code == 503 and timed_out.code == "queue_timeout"
            assert timed_out.response.headers["retry-after"] in ("1", "2")
            assert 1000 <= int(timed_out.response.headers["retry-after-ms"]) <= 1500
            await eventually(lambda: running.router.statistics().in_flight == 0)
            await client.close()


async def _refuse_everything(method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
    if path == "/health":
        return SimResponse(200)
    return SimResponse(500, [("content-type", "application/json")], b'{"error": {"message": "CUDA out of memory"}}')


async def test_backend_failures_map_to_502_503_and_4xx_passes_through() -> None:
    async with engines_on_sockets([QUICK, _refuse_everything]) as backends:
        async with tailguard(config_for(backends.urls)) as running, httpx.AsyncClient(base_url=running.http_url) as client:
            # vLLM's own 400 (here: stream_options without stream is passed through untouched, and refused) comes back as is.
            body = {"messages": MESSAGES, "max_tokens": 8, "stream_options": {"include_usage": True}}
            passed = await client.post("/v1/chat/completions", json=body)
            assert passed.status_code == 400 and "stream=True" in passed.json()["error"]["message"]
            # A 5xx from the batch pool's only endpoint: 502, and one failure takes nothing out...
            failed = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 500})
            assert failed.status_code == 502 and failed.json()["error"]["code"] == "upstream_error"
            assert "CUDA out of memory" in failed.json()["error"]["message"] and "retry-after" in failed.headers
            # ...so the next batch request reaches the backend again, and /health still has it up.
            again = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 500})
            assert again.status_code == 502 and "CUDA out of memory" in again.json()["error"]["message"]
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["pools"]["batch"]["endpoints"][backends.urls[1]] == "up"
            # Short requests still flow on the interactive pool.
            ok = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8})
            assert ok.status_code == 200


async def test_end_to_end_deadline_is_504_or_a_final_error_event(two_engines: Backends) -> None:
    config = config_for(two_engines.urls, timeouts=TimeoutsConfig(end_to_end_timeout=0.5), batch_timeout=0.2, interactive_timeout=0.2)
    batch = two_engines.engines[1]
    assert batch is not None
    async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        plain = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1000})
        assert plain.status_code == 504 and plain.json()["error"]["type"] == "timeout"
        assert plain.headers["x-should-retry"] == "false"  # the openai SDK would retry a 5xx otherwise
        streamed = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1000, "stream": True})
        assert streamed.status_code == 200
        last = [line for line in streamed.text.splitlines() if line.startswith("data: ")][-1]
        assert json.loads(last[len("data: ") :])["error"]["code"] == "deadline_exceeded"
        await eventually(lambda: batch.statistics().aborted_total == 2 and not batch.statistics().running)
        await eventually(lambda: running.router.statistics().in_flight == 0)


async def test_client_disconnect_mid_stream_aborts_the_generation(two_engines: Backends) -> None:
    engine = two_engines.engines[0]
    assert engine is not None
    async with tailguard(config_for(two_engines.urls)) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        for _ in range(3):
            body = {"messages": MESSAGES, "max_tokens": 128, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    break  # hang up after the first bytes
        await eventually(lambda: engine.statistics().aborted_total == 3 and not engine.statistics().running)
        await eventually(lambda: running.router.statistics().in_flight == 0)
        assert engine.statistics().finished_total == 0


async def test_a_caller_who_leaves_a_non_streaming_request_aborts_the_generation(two_engines: Backends) -> None:
    """No byte goes to the caller before the end, so only the watch on its socket can notice it left."""
    engine = two_engines.engines[1]  # 4,000 tokens is the batch class's
    assert engine is not None
    async with tailguard(config_for(two_engines.urls)) as running:
        url = urlsplit(running.http_url)
        body = json.dumps({"messages": MESSAGES, "max_tokens": 4000}).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        for _ in range(2):
            stream = await trio.open_tcp_stream(url.hostname or "127.0.0.1", url.port or 80)
            await stream.send_all(head.encode() + body)
            await eventually(lambda: engine.statistics().running == 1)
            await stream.aclose()
            await eventually(lambda: not engine.statistics().running)
        await eventually(lambda: running.router.statistics().in_flight == 0)
        assert (engine.statistics().aborted_total, engine.statistics().finished_total) == (2, 0)


async def test_a_bug_is_a_logged_500_in_openai_shape_counted_never_an_empty_499(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 10, defect 6: an unexpected exception was an empty 500, logged as 499 client_cancelled."""

    def parse_bug(*args: object, **kwargs: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    def health_bug(self: object) -> None:
        raise KeyError("pools")

    monkeypatch.setattr(http_api, "parse_completion_body", parse_bug)
    monkeypatch.setattr(Router, "health", health_bug)
    async with engines_on_sockets([QUICK, QUICK]) as backends, tailguard(config_for(backends.urls)) as running:
        async with httpx.AsyncClient(base_url=running.http_url) as client:
            with caplog.at_level(logging.INFO):
                failed = await client.post("/v1/chat/completions", json={"messages": MESSAGES}, headers={"x-request-id": "bug-1"})
                health = await client.get("/health")
                await eventually(lambda: any(getattr(r, "fields", {}).get("request_id") == "bug-1" and r.name == "tailguard.access" for r in caplog.records))
            page = (await client.get("/metrics")).text
    for response in (failed, health):
        assert response.status_code == 500 and response.headers["x-should-retry"] == "false"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "internal_error"
    assert "bug-1" in failed.json()["error"]["message"] and failed.headers["x-request-id"] == "bug-1"
    access = next(r.fields for r in caplog.records if r.name == "tailguard.access" and r.fields["request_id"] == "bug-1")  # type: ignore[attr-defined]
    assert (access["outcome"], access["reason"], access["status"]) == ("internal_error", "internal_error", 500)
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info and r.exc_info[0] in (RecursionError, KeyError)]
    assert len(logged) == 2  # each bug once, with its traceback
    assert 'tailguard_requests_total{class="none",outcome="internal_error",pool="none"} 1.0' in page


async def test_body_too_large_is_its_own_reason() -> None:
    async with engines_on_sockets([QUICK, QUICK]) as backends, tailguard(config_for(backends.urls)) as running:
        async with httpx.AsyncClient(base_url=running.http_url) as client:
            response = await client.post("/v1/completions", content=b"x" * (64 * 1024 + 1))
            page = (await client.get("/metrics")).text
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert 'tailguard_rejections_total{class="none",pool="none",reason="body_too_large"} 1.0' in page


async def _relayed_frames(port: int, max_tokens: int) -> tuple[int, bytes, float]:
    """Stream a chat over a raw socket: (chunked frames tailguard sent, the body, seconds it took).

    Each frame of the chunked body is one send of the router's: what it relayed in one go.
    """
    payload = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True}
    connection = h11.Connection(h11.CLIENT)
    body = json.dumps(payload).encode()
    headers = [("host", "127.0.0.1"), ("content-type", "application/json"), ("content-length", str(len(body)))]
    start = trio.current_time()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(connection.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers)) or b"")
        await stream.send_all(connection.send(h11.Data(data=body)) or b"")
        await stream.send_all(connection.send(h11.EndOfMessage()) or b"")
        frames, received = 0, b""
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                frames += event.chunk_end
                received += event.data
            elif isinstance(event, h11.EndOfMessage):
                return frames, received, trio.current_time() - start


async def test_a_class_with_a_relay_interval_gets_its_stream_in_fewer_bigger_sends_and_loses_nothing() -> None:
    interval = 0.05
    async with engines_on_sockets([QUICK, QUICK]) as backends:
        config = config_for(backends.urls)
        classes = tuple(dataclasses.replace(c, relay_interval=interval) if c.name == "batch" else c for c in config.classes)
        async with tailguard(dataclasses.replace(config, classes=classes)) as running:
            with trio.fail_after(20):
                frames, body, seconds = await _relayed_frames(urlsplit(running.http_url).port or 80, max_tokens=300)  # over 128: batch
        events = [line for line in body.split(b"\n\n") if line.startswith(b"data: ")]
        chunks = [json.loads(event[len(b"data: ") :]) for event in events[:-1]]
        tokens = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert events[-1] == b"data: [DONE]" and sum(1 for t in tokens if t) == 300  # every token, whole events
        # One read of the engine per interval at most (the first event goes at once): the frames are bounded by the
        # time the stream took, whatever the machine's speed; unpaced, it is one frame per event (300 and more).
        assert frames <= seconds / interval + 3 < 300


async def test_the_service_a_class_is_predicted_to_need_is_checked_on_metrics_and_the_access_log(
    two_engines: Backends, caplog: pytest.LogCaptureFixture
) -> None:
    """The first batch request teaches its class's service time; the second is predicted from it, and the
    prediction is shown beside what happened (its queue deadline keeps that much for running)."""
    async with tailguard(config_for(two_engines.urls)) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        with caplog.at_level(logging.INFO):
            for i in range(2):
                answer = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 200})
                assert (answer.status_code, answer.headers["x-tailguard-class"]) == (200, "batch")
                await eventually(lambda: len([r for r in caplog.records if r.name == "tailguard.access"]) == i + 1)
        first, second = (r.fields for r in caplog.records if r.name == "tailguard.access")  # type: ignore[attr-defined]
        assert first["service_predicted_ms"] is None and first["service_ms"] > 0  # nothing learnt before it
        assert second["service_predicted_ms"] == pytest.approx(first["service_ms"], rel=0.01)  # its per-token mean, same max_tokens
        metrics = (await client.get("/metrics")).text
        assert 'tailguard_service_prediction_ratio_count{class="batch"} 1.0' in metrics
