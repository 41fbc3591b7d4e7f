"""The routes beyond chat, through the official SDKs, whole and streamed, on real sockets in front of the simulator.

OpenAI's Responses API and embeddings with the openai SDK, Anthropic's
Messages API and its token count with the anthropic SDK, rerank and the
tokenizer's routes over plain HTTP: each classed, capped and relayed as
chat is, and tailguard's own refusals in the route's API's shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import anthropic
import grpc
import httpx
import openai
import pytest

from tailguard.router.config import ClassConfig, Config, EndpointConfig, LimitsConfig, PoolConfig
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tailguard.sim import SimApp
from tests.helpers.engines import MODEL
from tests.helpers.front_ends import Faulty, FrontEnds, front_ends
from tests.helpers.router import two_pool_config

EMBED_MODEL = "sim-embed"
OUTPUT_CAP = 64


def pooling_engine() -> Faulty:
    """A simulated engine serving an embedding model (vLLM's --runner pooling --convert embed)."""
    backend = Faulty()
    backend.app = SimApp(backend.engine, model=EMBED_MODEL, runner="pooling", embedding_size=16)
    return backend


def storing_engine() -> Faulty:
    """A simulated generating engine that keeps Responses API responses (VLLM_ENABLE_RESPONSES_API_STORE=1)."""
    backend = Faulty()
    backend.app = SimApp(backend.engine, model=MODEL, enable_responses_api_store=True)
    return backend


def make_config(urls: list[str]) -> Config:
    """The interactive pool on two storing engines, batch on the first; an embeddings pool and class on the third."""
    base = two_pool_config(interactive_urls=[urls[0], urls[2]], batch_urls=[urls[0]], limits=LimitsConfig(output_cap_tokens=OUTPUT_CAP))
    embed = PoolConfig("embed", (EndpointConfig(urls[1], 16),), 16, 64, 32768, (EMBED_MODEL,), "throughput")
    klass = ClassConfig("embeddings", "embed", 2.0, 0, kinds=frozenset({"embeddings", "rerank"}))
    return dataclasses.replace(base, pools=(*base.pools, embed), classes=(*base.classes, klass), digest="sdk-routes")


@pytest.fixture(scope="module")
def service() -> Iterator[FrontEnds]:
    with front_ends([storing_engine(), pooling_engine(), storing_engine()], make_config) as running:
        yield running


@pytest.fixture
def sdk(service: FrontEnds) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=service.http_url + "/v1", api_key="none", max_retries=0, timeout=10) as client:
        yield client


@pytest.fixture
def claude(service: FrontEnds) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=service.http_url, api_key="none", max_retries=0, timeout=10) as client:
        yield client


def test_a_response_is_classed_capped_and_answered_whole(service: FrontEnds, sdk: openai.OpenAI) -> None:
    raw = sdk.responses.with_raw_response.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=500)
    response = raw.parse()
    assert response.status in ("completed", "incomplete") and response.output_text
    # Over the output cap: clamped, and the effective bound said.
    assert raw.headers["x-tailguard-max-tokens"] == str(OUTPUT_CAP)
    assert response.usage is not None and 0 < response.usage.output_tokens <= OUTPUT_CAP
    record = service.record(raw.headers["x-request-id"])
    assert record.request_class == "interactive" and record.outcome == "ok"
    assert record.completion_tokens == response.usage.output_tokens and record.input_tokens == response.usage.input_tokens


def test_a_streamed_response_is_relayed_to_its_completed_event(service: FrontEnds, sdk: openai.OpenAI) -> None:
    with sdk.responses.with_streaming_response.create(model=MODEL, input="Count to five.", max_output_tokens=12, stream=True) as raw:
        request_id = raw.headers["x-request-id"]
        events = list(raw.parse())
    types = [event.type for event in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in types
    final = events[-1].response  # type: ignore[union-attr]
    record = service.record(request_id)
    assert record.outcome == "ok" and record.stream and record.ttft_seconds is not None
    assert final.usage is not None and record.completion_tokens == final.usage.output_tokens


def test_a_message_is_answered_whole_and_streamed_through_the_anthropic_sdk(service: FrontEnds, claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL, max_tokens=16, system="Be brief.", messages=[{"role": "user", "content": "Say hello."}]
    )
    assert message.type == "message" and message.content and message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens") and 0 < message.usage.output_tokens <= 16
    with claude.messages.stream(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Count to five."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(block.text for block in final.content if block.type == "text")
    assert 0 < final.usage.output_tokens <= 12


def test_anthropic_sdk_counts_tokens_without_a_seat(service: FrontEnds, claude: anthropic.Anthropic) -> None:
    before = service.router.statistics().pool("interactive").in_flight
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Hello there, how are you?"}])
    assert counted.input_tokens > 0
    assert service.router.statistics().pool("interactive").in_flight == before


def test_tailguards_own_refusals_on_the_messages_route_are_anthropics_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404
    assert missing.value.body == {"type": "error", "error": {"type": "not_found_error", "message": missing.value.body["error"]["message"]}}  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as too_long:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "word " * 40_000}])
    assert too_long.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_embeddings_take_their_own_class_and_pool(service: FrontEnds, sdk: openai.OpenAI) -> None:
    raw = sdk.embeddings.with_raw_response.create(model=EMBED_MODEL, input=["first text", "second text"])
    embeddings = raw.parse()
    assert [item.index for item in embeddings.data] == [0, 1]
    assert all(len(item.embedding) == 16 for item in embeddings.data)
    assert raw.headers["x-tailguard-class"] == "embeddings" and raw.headers["x-tailguard-pool"] == "embed"
    assert service.record(raw.headers["x-request-id"]).outcome == "ok"


def test_rerank_is_served_under_each_of_vllms_names(service: FrontEnds) -> None:
    body = {"model": EMBED_MODEL, "query": "capital of France", "documents": ["Paris is the capital.", "Bananas are yellow."]}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        answer = httpx.post(service.http_url + path, json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert sorted(result["index"] for result in results) == [0, 1]
        assert answer.headers["x-tailguard-class"] == "embeddings"


def test_tokenize_and_detokenize_are_relayed_to_an_engine_of_the_model(service: FrontEnds) -> None:
    tokens = httpx.post(service.http_url + "/tokenize", json={"model": MODEL, "prompt": "hello world"}, timeout=10)
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    assert ids and tokens.json()["count"] == len(ids)
    logged = service.record(tokens.headers["x-request-id"])  # an access-log line, though it took no seat
    assert (logged.kind, logged.status, logged.outcome) == ("tokenize", 200, "ok") and logged.endpoint is not None
    text = httpx.post(service.http_url + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=10)
    assert text.status_code == 200 and isinstance(text.json()["prompt"], str)
    unknown = httpx.post(service.http_url + "/tokenize", json={"model": "no-such-model", "prompt": "x"}, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_conversation_continues_on_the_engine_that_keeps_its_responses(service: FrontEnds, sdk: openai.OpenAI) -> None:
    """vLLM keeps a stored response in the memory of the engine that made it: every later turn, lookup and
    cancellation must reach that engine (any other answers 404). Ten turns of different texts, which
    placement alone would spread over both interactive engines."""
    first = sdk.responses.with_raw_response.create(model=MODEL, input="Remember the number seven.", max_output_tokens=8)
    home = service.record(first.headers["x-request-id"]).endpoint
    previous = first.parse().id
    for turn in range(10):
        raw = sdk.responses.with_raw_response.create(
            model=MODEL, input=f"Turn {turn}: {'and then ' * turn}what was it?", max_output_tokens=8, previous_response_id=previous
        )
        record = service.record(raw.headers["x-request-id"])
        assert (record.endpoint, record.placement) == (home, "pinned")
        previous = raw.parse().id
    stored = sdk.responses.retrieve(previous)
    assert stored.id == previous and stored.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.responses.retrieve("resp_never_made_here")
    assert unknown.value.code == "response_not_found"
    # A streamed replay would hold the engine's probe connections for a background generation: refused.
    replay = httpx.get(f"{service.http_url}/v1/responses/{previous}?stream=true", timeout=10)
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"


def test_grpc_embed_goes_through_the_embeddings_class(service: FrontEnds) -> None:
    with grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        reply, call = stub.Embed.with_call(pb.EmbedRequest(model=EMBED_MODEL, input=["first text", "second text"]), timeout=10)
        assert [item.index for item in reply.data] == [0, 1] and all(len(item.embedding) == 16 for item in reply.data)
        assert reply.routing.request_class == "embeddings" and reply.routing.pool == "embed"
        assert reply.usage.prompt_tokens > 0
        assert dict(call.initial_metadata())["x-tailguard-class"] == "embeddings"
        with pytest.raises(grpc.RpcError) as empty:
            stub.Embed(pb.EmbedRequest(model=EMBED_MODEL), timeout=10)
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
