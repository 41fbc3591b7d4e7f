"""The simulator's OpenAI API: shapes, errors, streaming, disconnects, metrics."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio
import trio.testing
from openai.types.chat import ChatCompletionMessageParam

from tailguard.sim import PROFILES, EngineSpec, serve_engine
from tailguard.sim.__main__ import build_parser
from tests.helpers.engines import MODEL, in_process_engine
from tests.helpers.sockets import engines_on_sockets

FAST = PROFILES["latency"].replace(max_model_len=4096, kv_cache_tokens=100_000)


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


async def test_chat_stream_and_plain_agree(autojump_clock: trio.testing.MockClock) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 12}
    async with in_process_engine(FAST) as (_, client):
        plain = (await client.post("/v1/chat/completions", json=request)).json()
        streamed = await client.post(
            "/v1/chat/completions", json={**request, "stream": True, "stream_options": {"include_usage": True}}
        )
    assert plain["object"] == "chat.completion"
    assert plain["choices"][0]["finish_reason"] == "length"
    # without --enable-prompt-tokens-details vLLM 0.32 sends the details as null (and nothing in a stream's usage)
    assert plain["usage"] == {
        "prompt_tokens": 3 + 4 + 3,
        "completion_tokens": 12,
        "total_tokens": 22,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    fingerprint = plain["system_fingerprint"]
    assert fingerprint.startswith("vllm-0.32.0-")
    assert streamed.headers["content-type"] == "text/event-stream"
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == plain["choices"][0]["message"]["content"]
    assert len(content.split()) == 12
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # vLLM 0.32 puts the fingerprint on the usage event when one follows, else on each choice's last event
    assert chunks[-1]["system_fingerprint"] == fingerprint
    assert all("system_fingerprint" not in c for c in chunks[:-1])


async def test_completion_prompt_forms_and_token_rule(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(FAST) as (_, client):
        text = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "abcdefgh", "max_tokens": 3})).json()
        listed = (await client.post("/v1/completions", json={"prompt": ["abcdefgh"], "max_tokens": 3})).json()
        ids = (await client.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 1})).json()
        cjk = (await client.post("/tokenize", json={"prompt": "你好世界, hello"})).json()
    assert text["object"] == "text_completion" and text["usage"]["prompt_tokens"] == 2
    assert listed["choices"][0]["text"] == text["choices"][0]["text"]
    assert ids["usage"]["prompt_tokens"] == 5
    # Four CJK characters, one token each; ", hello" is 7 bytes, two tokens.
    assert cjk["count"] == 6 and cjk["max_model_len"] == 4096


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error'"),
        (b"\xff\xfe\x00", 400, "JSON decode error"),
        (b"[1, 2]", 400, "Input should be a valid dictionary or object to extract fields from"),
        (json.dumps({"messages": []}).encode(), 400, "Cannot apply chat template to an empty conversation"),
        (json.dumps({"prompt": "x"}).encode(), 400, "'type': 'missing', 'loc': 'body.messages'"),
        (json.dumps({"messages": [{"content": "x"}]}).encode(), 400, "role"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400, "content"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}).encode(), 400, "unable to parse string as an integer"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 400, "at least 1"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3.5}).encode(), 400, "got a number with a fractional part"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "x"}).encode(), 400, "Input should be a valid boolean"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}).encode(), 400, "n must be at least 1"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}).encode(),
            400,
            "max_tokens=5000 cannot be greater than max_model_len=4096",
        ),
        (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "does not exist"),
    ],
)
async def test_bad_requests_get_vllm_style_errors(
    autojump_clock: trio.testing.MockClock, body: bytes, status: int, needle: str
) -> None:
    async with in_process_engine(FAST) as (engine, client):
        response = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert engine.statistics().waiting == 0 and engine.statistics().running == 0
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["code"] == status


async def test_routes_models_health_and_methods(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(FAST) as (_, client):
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 4096
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/v1/chat/completions")).status_code == 405
        assert (await client.get("/nowhere")).status_code == 404


async def test_routing_errors_are_fastapis_and_the_model_card_vllms(autojump_clock: trio.testing.MockClock) -> None:
    """Starlette's bare 404 and 405 (with Allow), and vLLM 0.32's model card, fields and all."""
    async with in_process_engine(FAST) as (_, client):
        missing = await client.get("/v1/nowhere")
        wrong = await client.get("/v1/completions")
        post_health = await client.post("/health")
        post_models = await client.post("/v1/models")
        card = (await client.get("/v1/models")).json()["data"][0]
        version = (await client.get("/version")).json()
        metrics_by_post = await client.post("/metrics")
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert (wrong.status_code, wrong.json(), wrong.headers["allow"]) == (405, {"detail": "Method Not Allowed"}, "POST")
    assert (post_health.status_code, post_health.headers["allow"]) == (405, "GET")
    assert (post_models.status_code, post_models.headers["allow"]) == (405, "GET")
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert (card["owned_by"], card["root"], card["parent"]) == ("vllm", MODEL, None)
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"] is True
    assert version == {"version": "0.32.0"}
    assert metrics_by_post.status_code == 200  # a mounted app: any method


async def test_metrics_use_vllm_names_and_move(autojump_clock: trio.testing.MockClock) -> None:
    params = FAST.replace(max_num_seqs=1)
    async with in_process_engine(params) as (engine, client):
        async with trio.open_nursery() as nursery:
            async def complete() -> None:
                await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50})

            for _ in range(3):
                nursery.start_soon(complete)
            await trio.sleep(0.05)
            busy = (await client.get("/metrics")).text
            assert 'vllm:num_requests_running{engine="0",model_name="sim-llama-3.1-8b"} 1.0' in busy
            assert 'vllm:num_requests_waiting{engine="0",model_name="sim-llama-3.1-8b"} 2.0' in busy
            assert float(_metric(busy, "vllm:kv_cache_usage_perc")) > 0
        done = (await client.get("/metrics")).text
        assert engine.statistics().finished_total == 3
    assert _metric(done, "vllm:time_to_first_token_seconds_count") == "3.0"
    assert _metric(done, "vllm:e2e_request_latency_seconds_count") == "3.0"
    assert _metric(done, "vllm:generation_tokens_total") == "150.0"
    assert _metric(done, "vllm:num_requests_running") == "0.0"


def _metric(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return line.rsplit(" ", 1)[1]
    raise AssertionError(f"{name} not in metrics")


async def test_closing_an_in_process_stream_aborts_the_sequence(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(FAST) as (engine, client):
        async with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1000, "stream": True}) as r:
            async for _ in r.aiter_bytes():
                if engine.statistics().generation_tokens_total >= 5:
                    break
        assert engine.statistics().running == 0
        assert engine.statistics().aborted_total == 1


async def test_socket_client_disconnect_frees_the_seat_within_a_step() -> None:
    aborted = trio.Event()
    with trio.fail_after(10):
        async with engines_on_sockets([FAST.replace(max_num_seqs=2)]) as backends:
            engine = backends.engines[0]
            assert engine is not None
            engine.add_finish_hook(lambda s: aborted.set() if s.finish_reason == "abort" else None)
            async with httpx.AsyncClient(base_url=backends.urls[0]) as client:
                for body in ({"prompt": "x", "max_tokens": 3000, "stream": True}, {"prompt": "x", "max_tokens": 3000}):
                    aborted = trio.Event()
                    with trio.move_on_after(0.3):  # hang up mid-generation
                        async with client.stream("POST", "/v1/completions", json=body) as response:
                            async for _ in response.aiter_bytes():
                                pass
                    await aborted.wait()
                    stats = engine.statistics()
                    assert stats.running == 0 and stats.kv_used_tokens == 0
            assert engine.statistics().aborted_total == 2


async def test_socket_server_refuses_oversize_and_garbage() -> None:
    with trio.fail_after(10):
        async with engines_on_sockets([FAST]) as backends:
            port = int(backends.urls[0].rsplit(":", 1)[1])
            for raw, expected in [
                (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n", b"413"),
                (b"GARBAGE\r\n\r\n", b"400"),
            ]:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(raw)
                reply = b""
                while chunk := await stream.receive_some(65536):
                    reply += chunk
                assert reply.split(b" ", 2)[1] == expected
                await stream.aclose()


async def test_openai_sdk_over_a_real_socket() -> None:
    with trio.fail_after(20):
        async with engines_on_sockets([FAST.replace(base_ms=1.0)]) as backends:
            base_url = backends.urls[0] + "/v1"
            client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story"}]
            reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
            assert reply.usage is not None and reply.usage.completion_tokens == 8
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, stream=True
            )
            pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
            assert "".join(pieces) == reply.choices[0].message.content
            with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len"):
                await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10_000)

            def sync_calls() -> tuple[str, list[str]]:
                with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as sync:
                    text = sync.completions.create(model=MODEL, prompt="Once", max_tokens=4).choices[0].text
                    streamed = [c.choices[0].text for c in sync.completions.create(model=MODEL, prompt="Once", max_tokens=4, stream=True)]
                return text, streamed

            text, streamed = await trio.to_thread.run_sync(sync_calls)
            assert len(text.split()) == 4 and "".join(streamed) == text
            await client.close()


async def test_a_burst_of_hang_ups_leaves_the_server_serving() -> None:
    with trio.fail_after(20):
        async with engines_on_sockets([FAST.replace(base_ms=2.0)]) as backends:
            engine = backends.engines[0]
            assert engine is not None
            started = 0
            all_streaming = trio.Event()

            async def stream_until_cancelled(client: httpx.AsyncClient) -> None:
                nonlocal started
                body = {"prompt": "x", "max_tokens": 3000, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for _ in response.aiter_bytes():
                        started += 1
                        if started == 64:
                            all_streaming.set()
                        break
                    await trio.sleep_forever()

            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(base_url=backends.urls[0], limits=limits) as client:
                async with trio.open_nursery() as clients:
                    for _ in range(64):
                        clients.start_soon(stream_until_cancelled, client)
                    await all_streaming.wait()
                    clients.cancel_scope.cancel()  # everyone hangs up at once
                while engine.statistics().aborted_total < 64:
                    await trio.sleep(0.01)
                assert engine.statistics().running == 0
                after = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert after.status_code == 200


# -- vLLM's --api-key -------------------------------------------------------


async def test_an_api_key_guards_every_v1_path_and_nothing_else(autojump_clock: trio.testing.MockClock) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    async with in_process_engine(FAST, api_key="sk-sim") as (engine, client):
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic sk-sim"}, {"authorization": "Bearer"}):
                refused = await client.request(method, path, json=body, headers=headers)
                assert refused.status_code == 401 and refused.content == b'{"error": "Unauthorized"}', (path, headers)
        assert engine.statistics().prompt_tokens_total == 0  # refused before the engine saw anything
        # The scheme is case-insensitive (vLLM lower-cases it); the key is not.
        assert (await client.post("/v1/completions", json=body, headers={"authorization": "bearer sk-sim"})).status_code == 200
        assert (await client.post("/v1/completions", json=body, headers={"authorization": "Bearer SK-SIM"})).status_code == 401
        assert (await client.get("/v1/models", headers={"authorization": "Bearer sk-sim"})).status_code == 200
        # Outside /v1 nothing is guarded: probes and scrapers need no key.
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.post("/tokenize", json={"prompt": "hi"})).status_code == 200
    async with in_process_engine(FAST) as (_, client):  # no key: nothing is guarded
        assert (await client.post("/v1/completions", json=body)).status_code == 200


async def test_an_api_key_set_through_the_engine_spec_guards_the_socket() -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            spec = EngineSpec(port=0, params=FAST.replace(base_ms=1.0), api_key="sk-spec")
            port = await nursery.start(serve_engine, spec)
            base_url = f"http://127.0.0.1:{port}/v1"
            async with openai.AsyncOpenAI(base_url=base_url, api_key="sk-spec", max_retries=0) as good:
                reply = await good.completions.create(model=MODEL, prompt="Once", max_tokens=2)
                assert reply.usage is not None and reply.usage.completion_tokens == 2
            async with openai.AsyncOpenAI(base_url=base_url, api_key="sk-other", max_retries=0) as bad:
                with pytest.raises(openai.AuthenticationError):
                    await bad.completions.create(model=MODEL, prompt="Once", max_tokens=2)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as raw:
                assert (await raw.get("/health")).status_code == 200
            nursery.cancel_scope.cancel()


# -- vLLM's --max-num-queued-reqs --------------------------------------------


async def test_a_full_queue_is_vllms_503_at_once_without_retry_after(autojump_clock: trio.testing.MockClock) -> None:
    # vLLM counts requests in flight, waiting and running alike: one seat,
    # a cap of 2, so the third request is refused while two are in.
    params = FAST.replace(max_num_seqs=1, max_num_queued_reqs=2)
    async with in_process_engine(params) as (engine, client):

        async def long() -> None:
            assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 200})).status_code == 200

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(long)
            await trio.testing.wait_all_tasks_blocked()
            assert (engine.statistics().running, engine.statistics().waiting) == (1, 1)
            before = trio.current_time()
            for path, body in (
                ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
            ):
                refused = await client.post(path, json=body)
                assert refused.status_code == 503 and "retry-after" not in refused.headers
                assert refused.headers["content-type"] == "application/json"
                assert refused.json() == {
                    "error": {
                        "message": "The engine is currently busy and cannot accept new requests. "
                        "Please try again later or on a different instance.",
                        "type": "Service Unavailable",
                        "param": None,
                        "code": 503,
                    }
                }
            # the queue check comes before the renderer's: an over-long prompt is refused 503, not 400
            assert (await client.post("/v1/completions", json={"prompt": list(range(5000))})).status_code == 503
            assert trio.current_time() == before  # answered at once, not after a wait
            assert engine.statistics().prompt_tokens_total == 2 * 1  # the refused never entered the engine
            rejected = (await client.get("/metrics")).text
            assert 'vllm:admission_rejections_total{model_name="sim-llama-3.1-8b",reason="max_num_queued_reqs"} 4.0' in rejected
        # Both finished: the queue has room again.
        assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 200


async def test_a_full_queue_answers_503_over_a_socket_through_the_spec() -> None:
    params = FAST.replace(base_ms=1.0, max_num_seqs=1, max_num_queued_reqs=1)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_engine, EngineSpec(port=0, params=params, retry_after=2))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                body = {"prompt": "hi", "max_tokens": 100_000 // 40, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as first:
                    assert first.status_code == 200
                    async for _ in first.aiter_bytes():
                        break  # the first is generating: it holds the only place
                    refused = await client.post("/v1/completions", json={**body, "stream": False})
                    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
                    assert refused.json()["error"]["code"] == 503
            nursery.cancel_scope.cancel()


def test_the_queue_cap_is_validated_and_reaches_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="max_num_queued_reqs"):
        FAST.replace(max_num_queued_reqs=0)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = build_parser().parse_args(["--max-num-queued-reqs", "64", "--api-key", "k", "--retry-after", "5"])
    assert (args.max_num_queued_reqs, args.api_key, args.retry_after) == (64, "k", 5)
    plain = build_parser().parse_args([])
    assert (plain.max_num_queued_reqs, plain.api_key, plain.retry_after) == (None, None, None)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")  # as vLLM reads it
    assert build_parser().parse_args([]).api_key == "from-env"


# -- uvicorn's keep-alive timeout ---------------------------------------------

GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: sim\r\n\r\n"


async def _read_response(stream: trio.SocketStream) -> bytes:
    """One whole response (the simulator sends Content-Length), or what came before the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        assert chunk, "closed mid-body"
        body += chunk
    return head


async def test_an_idle_keep_alive_connection_is_closed_after_uvicorns_5_s(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_engine, EngineSpec(port=0, params=FAST))  # the default timeout
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(GET_HEALTH)
        assert (await _read_response(stream)).startswith(b"HTTP/1.1 200")
        await trio.sleep(4.9)  # reused before the timeout: served on the same connection
        await stream.send_all(GET_HEALTH)
        assert (await _read_response(stream)).startswith(b"HTTP/1.1 200")
        served = trio.current_time()
        assert await stream.receive_some(65536) == b""  # then idle: the server closes it
        assert trio.current_time() - served == pytest.approx(5.0)
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_the_keep_alive_timeout_is_configurable_and_waits_only_for_a_first_byte(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_engine, EngineSpec(port=0, params=FAST, keep_alive_timeout=1.0))
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(GET_HEALTH)
        await _read_response(stream)
        await trio.sleep(0.5)
        await stream.send_all(GET_HEALTH[:10])  # the next request has begun: no keep-alive timer now
        await trio.sleep(3.0)
        await stream.send_all(GET_HEALTH[10:])
        assert (await _read_response(stream)).startswith(b"HTTP/1.1 200")
        served = trio.current_time()
        assert await stream.receive_some(65536) == b""
        assert trio.current_time() - served == pytest.approx(1.0)
        await stream.aclose()
        nursery.cancel_scope.cancel()
    args = build_parser().parse_args(["--keep-alive-timeout", "2.5"])
    assert args.keep_alive_timeout == 2.5 and build_parser().parse_args([]).keep_alive_timeout == 5.0


# -- vLLM's 2026 wording ---------------------------------------------------------


async def test_a_lone_surrogate_is_vllms_400_not_a_dropped_connection(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(FAST) as (engine, client):
        for path, body in (
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "ab\\ud866cd"}], "max_tokens": 4}'),
            ("/v1/completions", b'{"prompt": "\\udfff", "max_tokens": 4, "stream": true}'),
            ("/tokenize", b'{"prompt": "x\\udfff"}'),
        ):
            refused = await client.post(path, content=body, headers={"content-type": "application/json"})
            assert refused.status_code == 400, path
            error = refused.json()["error"]
            assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] is None
            assert "can't encode character '\\ud866'" in error["message"] or "'\\udfff'" in error["message"]
            assert "surrogates not allowed" in error["message"]
        assert engine.statistics().prompt_tokens_total == 0


@pytest.mark.parametrize(
    ("body", "kind", "param", "message"),
    [
        (
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
            "BadRequestError",
            "stream_options",
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "stream": False, "stream_options": {"include_usage": True}},
            "BadRequestError",
            "stream_options",
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "BadRequestError",
            "max_tokens",
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        ),
        (  # text is tokenized only one token past the bound: "at least" (CJK: a token a character)
            {"messages": [{"role": "user", "content": "你" * 5000}]},
            "BadRequestError",
            "input_tokens",
            "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input "
            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
            "prompt. (parameter=input_tokens, value=4097)",
        ),
        (  # token ids are counted exactly (and "at least" only when the count is the bound plus one)
            {"prompt": list(range(5000))},
            "BadRequestError",
            "input_tokens",
            "This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, "
            "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value=5000)",
        ),
        (  # more characters than the context's tokens could hold: refused before tokenizing
            {"prompt": "x" * 20_000},
            "BadRequestError",
            "input_text",
            "This model's maximum context length is 4096 tokens. However, your prompt contains 20000 characters (more "
            "than 16384 characters, which is the upper bound for 4096 input tokens). Please reduce the length of the "
            "input prompt. (parameter=input_text, value=20000)",
        ),
        (
            {"prompt": "x", "max_tokens": 4097},
            "BadRequestError",
            "max_tokens",
            "max_tokens=4097 cannot be greater than max_model_len=4096. Please request fewer output tokens. "
            "(parameter=max_tokens, value=4097)",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000, "max_tokens": 5},
            "BadRequestError",
            "max_completion_tokens",
            "max_completion_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. "
            "(parameter=max_completion_tokens, value=5000)",
        ),
        (  # the prompt fills the context: nothing is left to generate
            {"prompt": list(range(4096))},
            "BadRequestError",
            "max_tokens",
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        ),
        (
            {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
            "NotFoundError",
            "model",
            "The model `gpt-9` does not exist. Valid aliases: sim-llama-3.1-8b.",
        ),
    ],
)
async def test_errors_in_vllms_2026_words_name_their_param(
    autojump_clock: trio.testing.MockClock, body: dict[str, object], kind: str, param: str, message: str
) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with in_process_engine(FAST) as (engine, client):
        response = await client.post(path, json=body)
        assert engine.statistics().prompt_tokens_total == 0
    error = response.json()["error"]
    assert (error["message"], error["type"], error["param"]) == (message, kind, param)
    assert response.status_code == error["code"]


async def test_a_longer_tokenizer_token_counts_a_long_text_before_refusing_it(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM refuses text untokenized only past max_model_len x the tokenizer's longest token (80 on the real suite's
    model): a 27,000-character prompt is refused by its tokens there, as the simulator does given that length."""
    body = {"prompt": "deadbeef " * 3000}
    async with in_process_engine(FAST) as (_, client):
        as_text = (await client.post("/v1/completions", json=body)).json()["error"]
    async with in_process_engine(FAST, max_chars_per_token=80) as (_, client):
        as_tokens = (await client.post("/v1/completions", json=body)).json()["error"]
    assert (as_text["param"], as_tokens["param"]) == ("input_text", "input_tokens")
    assert "at least 4097 input tokens" in as_tokens["message"]


async def test_empty_stream_options_without_stream_are_accepted(autojump_clock: trio.testing.MockClock) -> None:
    # vLLM's validator tests the value's truth: {} and null pass, as there.
    async with in_process_engine(FAST) as (_, client):
        choices: tuple[dict[str, object] | None, ...] = ({}, None)
        for options in choices:
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream_options": options}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
