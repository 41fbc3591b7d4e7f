"""``/v1/responses`` as vLLM 0.32 serves it (shapes checked against a running vLLM: tests/real_vllm/test_routes_differential.py)."""

from __future__ import annotations

import openai
import pytest
import trio
import trio.testing

from tailguard.sim import EngineSpec, serve_engine
from tailguard.sim.tokens import count_chat_tokens
from tests.helpers.engines import MODEL
from tests.sim.apps import FAST, app_client, named_events

STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


async def test_a_whole_response_is_vllms_response_object(autojump_clock: trio.testing.MockClock) -> None:
    """instructions and input are the chat the engine runs; max_output_tokens its max_tokens, echoed; "incomplete" at it."""
    async with app_client() as (engine, client):
        body = {"model": MODEL, "instructions": "be brief", "input": "hello there", "max_output_tokens": 3}
        reply = await client.post("/v1/responses", json=body)
        assert engine.statistics().prompt_tokens_total == count_chat_tokens(["be brief", "hello there"])
    answer = reply.json()
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert answer["id"].startswith("resp_") and answer["object"] == "response"
    assert (answer["status"], answer["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert (answer["instructions"], answer["max_output_tokens"], answer["tool_choice"], answer["background"]) == ("be brief", 3, "none", False)
    (message,) = answer["output"]
    assert (message["type"], message["role"], message["status"]) == ("message", "assistant", "completed")
    (part,) = message["content"]
    assert part["type"] == "output_text" and len(part["text"].split()) == 3 and part["logprobs"] is None
    usage = answer["usage"]
    prompt = count_chat_tokens(["be brief", "hello there"])
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (prompt, 3, prompt + 3)
    # the prompt's full 16-token blocks were cached anew (vLLM's num_cache_creation_tokens)
    written = prompt // 16 * 16
    assert usage["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": written, "input_tokens_per_turn": [], "cached_tokens_per_turn": []}
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0
    assert "metrics" not in answer  # only with --enable-per-request-metrics, as vLLM's exclude_if drops a null


async def test_list_input_items_and_parts_are_counted_as_messages(autojump_clock: trio.testing.MockClock) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "hello "}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        {"role": "user", "content": "more"},
    ]
    async with app_client(enable_per_request_metrics=True) as (_, client):
        answer = (await client.post("/v1/responses", json={"input": items, "max_output_tokens": 2})).json()
    assert answer["usage"]["input_tokens"] == count_chat_tokens(["hello there", "hi", "more"])
    assert set(answer["metrics"]) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second", "speculative_decoding"}


async def test_a_stream_is_vllms_named_events_opened_before_the_first_token(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client() as (engine, client):
        async with client.stream("POST", "/v1/responses", json={"input": "hi", "max_output_tokens": 3, "stream": True}) as reply:
            chunks = reply.aiter_bytes()
            first = await chunks.__anext__()
            assert engine.statistics().generation_tokens_total == 0  # created and in_progress come before the prefill
            text = (first + b"".join([chunk async for chunk in chunks])).decode()
    assert reply.headers["content-type"] == "text/event-stream"
    events = named_events(text)
    assert [name for name, _ in events] == STREAM_EVENTS
    assert all(data["type"] == name for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    created, completed = events[0][1]["response"], events[-1][1]["response"]
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert completed["output"][0]["content"][0]["text"] == deltas == events[7][1]["text"]
    assert completed["status"] == "incomplete" and completed["usage"]["output_tokens"] == 3
    assert "[DONE]" not in text


async def test_closing_a_response_stream_aborts_its_sequence(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client() as (engine, client):
        async with client.stream("POST", "/v1/responses", json={"input": "hi", "max_output_tokens": 1000, "stream": True}) as reply:
            async for _ in reply.aiter_bytes():
                if engine.statistics().generation_tokens_total >= 5:
                    break
        stats = engine.statistics()
        assert (stats.running, stats.waiting, stats.aborted_total, stats.kv_used_tokens) == (0, 0, 1, 0)


async def test_without_a_store_nothing_is_found_and_background_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client() as (engine, client):
        made = (await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})).json()  # store: true, ignored
        found = await client.get(f"/v1/responses/{made['id']}")
        cancelled = await client.post(f"/v1/responses/{made['id']}/cancel")
        continued = await client.post("/v1/responses", json={"input": "hi", "previous_response_id": made["id"]})
        background = await client.post("/v1/responses", json={"input": "hi", "background": True})
        wrong = await client.post(f"/v1/responses/{made['id']}")
        assert engine.statistics().prompt_tokens_total == made["usage"]["input_tokens"]
    for reply in (found, cancelled, continued):
        assert reply.status_code == 404
        assert reply.json()["error"]["param"] == "response_id" and reply.json()["error"]["type"] == "invalid_request_error"
    assert found.json()["error"]["message"] == f"Response with id '{made['id']}' not found."
    assert (background.status_code, background.json()["error"]["param"]) == (400, "background")
    assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in background.json()["error"]["message"]
    assert (wrong.status_code, wrong.headers["allow"]) == (405, "GET")


async def test_the_store_keeps_continues_queues_and_cancels_responses(autojump_clock: trio.testing.MockClock) -> None:
    async with app_client(enable_responses_api_store=True) as (engine, client):
        made = (await client.post("/v1/responses", json={"input": "hello", "max_output_tokens": 2})).json()
        assert (await client.get(f"/v1/responses/{made['id']}")).json() == made
        synchronous = await client.post(f"/v1/responses/{made['id']}/cancel")
        assert (synchronous.status_code, synchronous.json()["error"]["message"]) == (400, "Cannot cancel a synchronous response.")
        later = (await client.post("/v1/responses", json={"input": "more", "previous_response_id": made["id"], "max_output_tokens": 2})).json()
        said = made["output"][0]["content"][0]["text"]
        assert later["usage"]["input_tokens"] == count_chat_tokens(["hello", said, "more"])
        assert later["previous_response_id"] == made["id"]
        queued = (await client.post("/v1/responses", json={"input": "x", "max_output_tokens": 5, "background": True})).json()
        assert (queued["status"], queued["output"], queued["usage"], queued["background"]) == ("queued", [], None, True)
        await trio.sleep(1)  # the engine runs it alone
        assert (await client.get(f"/v1/responses/{queued['id']}")).json()["status"] == "incomplete"
        long = (await client.post("/v1/responses", json={"input": "x", "max_output_tokens": 1000, "background": True})).json()
        await trio.sleep(0.1)
        cancelled = (await client.post(f"/v1/responses/{long['id']}/cancel")).json()
        assert cancelled["status"] == "cancelled" and (await client.get(f"/v1/responses/{long['id']}")).json()["status"] == "cancelled"
        stats = engine.statistics()
        assert (stats.running, stats.aborted_total) == (0, 1)
        # a background stream: the usual events, and its reader leaving does not stop it
        body = {"input": "x", "max_output_tokens": 50, "background": True, "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as reply:
            first = named_events((await reply.aiter_bytes().__anext__()).decode())
        await trio.sleep(1)
        kept = (await client.get(f"/v1/responses/{first[0][1]['response']['id']}")).json()
        assert (kept["status"], kept["usage"]["output_tokens"], engine.statistics().aborted_total) == ("incomplete", 50, 1)


@pytest.mark.parametrize(
    ("body", "status", "kind", "param"),
    [
        ({"max_output_tokens": 2}, 400, "Bad Request", "body.input"),
        ({"input": 5}, 400, "Bad Request", "body.input"),
        ({"input": "hi", "max_output_tokens": "ten"}, 400, "Bad Request", "body.max_output_tokens"),
        ({"input": "hi", "model": "gpt-9"}, 404, "NotFoundError", "model"),
        ({"input": "hi", "max_output_tokens": 5000}, 400, "BadRequestError", "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "BadRequestError", "max_tokens"),
        ({"input": []}, 400, "BadRequestError", None),
        ({"input": "hi", "temperature": -1}, 400, "BadRequestError", "temperature"),
        ({"input": "hi", "background": True, "store": False}, 400, "BadRequestError", "background"),
        ({"input": "a" * 16356}, 400, "invalid_request_error", "input"),  # 4,096 tokens: no room for one more
        ({"input": "a" * 16400}, 400, "BadRequestError", "input_text"),
    ],
)
async def test_refusals_are_vllms(
    autojump_clock: trio.testing.MockClock, body: dict[str, object], status: int, kind: str, param: str | None
) -> None:
    async with app_client() as (engine, client):
        reply = await client.post("/v1/responses", json=body)
        assert engine.statistics().prompt_tokens_total == 0
    assert reply.status_code == status
    assert (reply.json()["error"]["type"], reply.json()["error"]["param"], reply.json()["error"]["code"]) == (kind, param, status)


async def test_the_openai_sdk_reads_whole_and_streamed_responses() -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_engine, EngineSpec(port=0, params=FAST.replace(base_ms=1.0)))
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as sdk:
                whole = await sdk.responses.create(model=MODEL, input="hello", max_output_tokens=4)
                assert whole.status == "incomplete" and whole.usage is not None and whole.usage.output_tokens == 4
                assert len(whole.output_text.split()) == 4
                stream = await sdk.responses.create(model=MODEL, input="hello", max_output_tokens=3, stream=True)
                kinds = [event.type async for event in stream]
                # in real time a step's tokens may wait for the reader and go as one delta, as vLLM's do
                deltas = kinds.count("response.output_text.delta")
                assert 1 <= deltas <= 3 and [k for k in kinds if k.endswith("delta")] == ["response.output_text.delta"] * deltas
                assert [k for k in kinds if not k.endswith("delta")] == [k for k in STREAM_EVENTS if not k.endswith("delta")]
            nursery.cancel_scope.cancel()
