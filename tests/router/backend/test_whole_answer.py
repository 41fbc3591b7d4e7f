"""Whole answers put together from vLLM's stream (a pool's stream_upstream, issue 20 defect 4)."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
import trio.testing

from tailguard.router.backend import assemblable, assemble, sse_objects
from tailguard.router.errors import BadBackendReply
from tailguard.router.observe import RequestRecord
from tests.helpers.engines import MODEL
from tests.helpers.router import chat
from tests.router.backend.test_real_vllm import A, B, complete, config, engines, router_over


def sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"


def test_a_chat_stream_folds_into_the_whole_answer_tool_calls_and_logprobs_included() -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": MODEL}
    stream = sse(
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "Par"}, "logprobs": {"content": [{"token": "Par", "logprob": -0.1}]}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "is"}, "logprobs": {"content": [{"token": "is", "logprob": -0.2}]}}]},
        {**head, "choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}]}}]},
        {**head, "choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": None}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}},
    )
    body = assemble("chat", sse_objects([stream[:17], stream[17:]]))
    assert body["object"] == "chat.completion" and (body["id"], body["created"], body["model"]) == ("chatcmpl-1", 7, MODEL)
    first, second = body["choices"]
    assert first["message"] == {"role": "assistant", "content": "Paris"} and first["finish_reason"] == "stop"
    assert [t["token"] for t in first["logprobs"]["content"]] == ["Par", "is"]
    assert second["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert second["finish_reason"] == "tool_calls" and body["usage"]["completion_tokens"] == 3


def test_a_completion_stream_folds_into_text_and_logprobs() -> None:
    part = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}
    stream = sse(
        {**part, "choices": [{"index": 0, "text": "Hel", "logprobs": {"tokens": ["Hel"], "token_logprobs": [-1.0], "top_logprobs": [None], "text_offset": [0]}}]},
        {**part, "choices": [{"index": 0, "text": "lo", "logprobs": {"tokens": ["lo"], "token_logprobs": [-2.0], "top_logprobs": [None], "text_offset": [3]}, "finish_reason": "length"}]},
    )
    [choice] = assemble("completion", sse_objects([stream]))["choices"]
    assert choice["text"] == "Hello" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["Hel", "lo"] and choice["logprobs"]["text_offset"] == [0, 3]


def test_vllms_per_request_metrics_keep_their_whole_answer_nulls() -> None:
    # --enable-per-request-metrics: the stream's usage event drops nulls; vLLM's whole answer (model_dump) keeps them.
    head = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 7, "model": MODEL, "system_fingerprint": "vllm-0.32.0-abc"}
    timings = {"time_to_first_token_ms": 4.5, "generation_time_ms": 9.0, "queue_time_ms": 0.2, "mean_itl_ms": 3.0, "tokens_per_second": 300.0}
    stream = sse(
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}, "metrics": timings},
    )
    assert assemble("chat", sse_objects([stream]))["metrics"] == {**timings, "speculative_decoding": None}
    plain = sse({**head, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]})
    assert assemble("chat", sse_objects([plain]))["metrics"] is None  # an engine without the flag: null, as its whole answer


def test_what_a_stream_cannot_reproduce_is_sent_as_asked() -> None:
    assert assemblable({"temperature": 0.3, "n": 2, "logprobs": True, "best_of": 1})
    for params in ({"prompt_logprobs": 1}, {"echo": True}, {"use_beam_search": True}, {"best_of": 3}):
        assert not assemblable(params), params
    with pytest.raises(BadBackendReply):
        sse_objects([b"data: [1, 2]\n\n"])


async def test_a_whole_answer_asked_as_a_stream_is_the_same_answer_with_a_first_byte(autojump_clock: trio.testing.MockClock) -> None:
    async with engines(None) as [app]:
        seen: list[bool] = []

        async def recording(request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("completions"):
                seen.append(json.loads(request.content)["stream"])
            from tailguard.sim import SimTransport

            return await SimTransport(app).handle_async_request(request)

        async with router_over({A: recording}, config(pool_extra="stream_upstream = true")) as router:
            record = RequestRecord("whole", "http", trio.current_time())
            body = json.loads(await complete(router, chat(max_tokens=6, request_id="whole"), record))
    assert seen == [True]  # vLLM was asked for a stream
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] == 6
    assert record.completion_tokens == 6 and record.first_token_at is not None


async def test_a_hung_engine_costs_a_whole_answer_its_first_byte_timeout_not_its_deadline(autojump_clock: trio.testing.MockClock) -> None:
    async def hangs(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("completions"):
            await trio.sleep_forever()
        return httpx.Response(200)

    async with engines(None) as [app]:
        cfg = config((A, B), pool_extra="stream_upstream = true\nfirst_byte_timeout = 2.0")
        async with router_over({A: hangs, B: app}, cfg) as router:
            started = trio.current_time()
            for i in range(4):  # each lands on the hung engine or the good one; none waits out the 120 s deadline
                assert json.loads(await complete(router, chat(max_tokens=4, request_id=f"r{i}")))["choices"]
            assert trio.current_time() - started <= 4 * 2.0 + 1.0
