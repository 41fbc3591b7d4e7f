"""``/v1/messages`` and ``/v1/messages/count_tokens`` as vLLM 0.32 serves them (against a running vLLM:
tests/real_vllm/test_routes_differential.py)."""

from __future__ import annotations

import anthropic
import pytest
import trio
import trio.testing

from tailguard.sim import EngineSpec, serve_engine
from tailguard.sim.tokens import count_chat_tokens
from tests.helpers.engines import MODEL
from tests.sim.apps import FAST, app_client, named_events

STREAM_EVENTS = [
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_delta",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
]
BODY = {"model": MODEL, "max_tokens": 3, "system": "be brief", "messages": [{"role": "user", "content": "hello there"}]}


async def test_a_whole_message_is_vllms_model_dump_without_nulls(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client() as (engine, client):
        reply = await client.post("/v1/messages", json=BODY, headers={"x-request-id": "m-1"})
        assert engine.statistics().prompt_tokens_total == count_chat_tokens(["be brief", "hello there"])
    answer = reply.json()
    assert reply.status_code == 200
    assert list(answer) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]  # no stop_sequence: it is null
    assert (answer["id"], answer["type"], answer["role"], answer["stop_reason"]) == ("chatcmpl-m-1", "message", "assistant", "max_tokens")
    (block,) = answer["content"]
    assert block["type"] == "text" and len(block["text"].split()) == 3
    assert answer["usage"] == {"input_tokens": count_chat_tokens(["be brief", "hello there"]), "output_tokens": 3}


async def test_blocks_are_joined_and_cached_tokens_reported_apart(autojump_clock: trio.testing.MockClock) -> None:
    """With --enable-prompt-tokens-details, cache reads and writes leave input_tokens (vLLM's _build_anthropic_usage)."""
    long = "word " * 40
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": long}, {"type": "text", "text": "please"}]}],
    }
    async with app_client(enable_prompt_tokens_details=True) as (_, client):
        first = (await client.post("/v1/messages", json=body)).json()["usage"]
        again = (await client.post("/v1/messages", json=body)).json()["usage"]
    prompt = count_chat_tokens(["be brief", long + "please"])
    blocks = prompt // 16 * 16
    assert first == {"input_tokens": prompt - blocks, "output_tokens": 2, "cache_creation_input_tokens": blocks, "cache_read_input_tokens": 0}
    assert again == {"input_tokens": prompt - blocks, "output_tokens": 2, "cache_creation_input_tokens": 0, "cache_read_input_tokens": blocks}


async def test_a_stream_is_vllms_anthropic_events(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client() as (_, client):
        reply = await client.post("/v1/messages", json={**BODY, "stream": True})
    events = named_events(reply.text)
    assert reply.headers["content-type"] == "text/event-stream"
    assert [name for name, _ in events] == STREAM_EVENTS and all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    prompt = count_chat_tokens(["be brief", "hello there"])
    assert start["usage"] == {"input_tokens": prompt, "output_tokens": 0} and start["content"] == [] and start["stop_reason"] is None
    assert events[1][1] == {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
    assert all(data["delta"]["type"] == "text_delta" for name, data in events if name == "content_block_delta")
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"input_tokens": prompt, "output_tokens": 3},
    }


async def test_closing_a_message_stream_aborts_its_sequence(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client() as (engine, client):
        async with client.stream("POST", "/v1/messages", json={**BODY, "max_tokens": 1000, "stream": True}) as reply:
            async for _ in reply.aiter_bytes():
                if engine.statistics().generation_tokens_total >= 5:
                    break
        stats = engine.statistics()
        assert (stats.running, stats.aborted_total, stats.kv_used_tokens) == (0, 1, 0)


async def test_count_tokens_counts_the_chat_the_engine_would_run(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client() as (engine, client):
        reply = await client.post("/v1/messages/count_tokens", json={k: v for k, v in BODY.items() if k != "max_tokens"})
        missing = await client.post("/v1/messages/count_tokens", json={"model": MODEL})
        assert engine.statistics().prompt_tokens_total == 0
    tokens = count_chat_tokens(["be brief", "hello there"])
    assert reply.json() == {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}
    assert (missing.status_code, missing.json()["error"]["param"]) == (400, "body.messages")


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        # The chat's refusals, translated to Anthropic's shape
        ({**BODY, "model": "claude-9"}, 404, {"type": "error", "error": {"type": "NotFoundError", "message": "The model `claude-9` does not exist. Valid aliases: sim-llama-3.1-8b."}}),
        ({**BODY, "max_tokens": 5000}, 400, {"type": "error", "error": {"type": "BadRequestError", "message": "max_completion_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. (parameter=max_completion_tokens, value=5000)"}}),
        ({"model": MODEL, "max_tokens": 3, "messages": []}, 400, {"type": "error", "error": {"type": "BadRequestError", "message": "Cannot apply chat template to an empty conversation. Provide at least one message."}}),
        ({**BODY, "temperature": -1}, 400, {"type": "error", "error": {"type": "BadRequestError", "message": "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"}}),
    ],
)  # fmt: skip
async def test_the_chats_refusals_come_in_anthropics_shape(
    autojump_clock: trio.testing.MockClock, body: dict[str, object], status: int, error: dict[str, object]
) -> None:
    async with app_client() as (_, client):
        reply = await client.post("/v1/messages", json=body)
        streamed = await client.post("/v1/messages", json={**body, "stream": True})
    assert (reply.status_code, reply.json()) == (streamed.status_code, streamed.json()) == (status, error)


@pytest.mark.parametrize(
    ("body", "param", "line"),
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "body.max_tokens", "'type': 'missing'"),
        ({**BODY, "max_tokens": 0}, "body.max_tokens", "'msg': 'Value error, max_tokens must be positive', 'input': '0', 'ctx': {'error': ValueError('max_tokens must be positive')}"),
        ({**BODY, "model": ""}, "body.model", "'msg': 'Value error, Model is required'"),
        ({**BODY, "messages": [{"role": "bot", "content": "hi"}]}, "body.messages.0.role", "'type': 'literal_error'"),
    ],
)  # fmt: skip
async def test_the_request_models_errors_stay_in_vllms_openai_shape(
    autojump_clock: trio.testing.MockClock, body: dict[str, object], param: str, line: str
) -> None:
    async with app_client() as (_, client):
        reply = await client.post("/v1/messages", json=body)
    error = reply.json()["error"]
    assert (reply.status_code, error["type"], error["param"], error["code"]) == (400, "Bad Request", param, 400)
    assert error["message"].startswith("1 validation error:\n") and line in error["message"]


async def test_a_full_queue_is_a_503_in_anthropics_shape(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client(FAST.replace(max_num_queued_reqs=1)) as (_, client):
        async with client.stream("POST", "/v1/messages", json={**BODY, "max_tokens": 100, "stream": True}) as holding:
            await holding.aiter_bytes().__anext__()
            busy = await client.post("/v1/messages", json=BODY)
            counted = await client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": BODY["messages"]})
    assert busy.status_code == counted.status_code == 503
    assert busy.json()["type"] == "error" and busy.json()["error"]["type"] == "Service Unavailable"


async def test_the_anthropic_sdk_reads_whole_and_streamed_messages() -> None:
    """Over a socket (the SDK's HTTP client is not httpx's); this SDK sends its key as a bearer token, which vLLM's
    --api-key reads."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_engine, EngineSpec(port=0, params=FAST.replace(base_ms=1.0), api_key="k"))
            async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0) as sdk:
                whole = await sdk.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hello"}])
                assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 4
                async with sdk.messages.stream(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hello"}]) as stream:
                    text = "".join([piece async for piece in stream.text_stream])
                    final = await stream.get_final_message()
                assert len(text.split()) == 3 and final.usage.output_tokens == 3 and final.stop_reason == "max_tokens"
            nursery.cancel_scope.cancel()


async def test_an_x_api_key_header_alone_is_refused_as_vllm_refuses_it(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM's --api-key reads only ``Authorization: Bearer``, on /v1 (and /v2, /inference, /cohere) paths."""
    async with app_client(api_key="k") as (_, client):
        refused = await client.post("/v1/messages", json=BODY, headers={"x-api-key": "k"})
        served = await client.post("/v1/messages", json=BODY, headers={"authorization": "Bearer k"})
    assert (refused.status_code, refused.json(), served.status_code) == (401, {"error": "Unauthorized"}, 200)
