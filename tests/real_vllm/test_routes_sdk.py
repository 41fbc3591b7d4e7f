"""The routes beyond chat through tailguard in front of real vLLM 0.32, driven with the official SDKs.

The Responses API and embeddings with the openai SDK, the Messages API and
its token count with the anthropic SDK, rerank and the tokenizer's routes
over HTTP: whole and streamed, classed and capped as chat is, the engines'
answers relayed (usage counted from them), tailguard's own refusals in each
API's shape. The generating engines are ``engines``; the pooling one is the
tiny model served as an embedding model.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from bench.vllm.engines import SERVED_MODEL, RealEngine
from tests.real_vllm.conftest import TAILGUARD_KEY_ENV, TailguardFactory, pool_config

OUTPUT_CAP = 24


def routes_config(generating: list[str], pooling: str) -> str:
    """One generating pool (class ``all``), and the pooling engine's pool with a class for embeddings and rerank."""
    embed = f"""
[pools.embed]
max_concurrency = 4
max_queue = 16
max_model_len = 4096
models = ["{SERVED_MODEL}"]
api_key_env = "{TAILGUARD_KEY_ENV}"
endpoints = [{{ url = "{pooling}", max_concurrency = 4 }}]

[classes.embeddings]
kinds = ["embeddings", "rerank"]
pool = "embed"
queue_timeout = 10.0
"""
    text = pool_config(generating, output_cap=OUTPUT_CAP, classes_before=embed)
    return text.replace("[limits]\n", "[limits]\ndefault_max_tokens = 16\n", 1)  # under the small output cap


@pytest.fixture
def routes(engines: tuple[RealEngine, RealEngine], pooling_engine: RealEngine, tailguard: TailguardFactory) -> Iterator[str]:
    with tailguard(routes_config([engine.url for engine in engines], pooling_engine.url)) as tg:
        yield tg.url


def test_responses_whole_and_streamed_through_the_openai_sdk(routes: str) -> None:
    client = openai.OpenAI(base_url=f"{routes}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.responses.with_raw_response.create(model=SERVED_MODEL, input="hello there", instructions="Be brief.", max_output_tokens=500)
    whole = raw.parse()
    assert raw.headers["x-tailguard-max-tokens"] == str(OUTPUT_CAP)  # over the cap: clamped, and said
    assert whole.status in ("completed", "incomplete") and whole.usage is not None and 0 < whole.usage.output_tokens <= OUTPUT_CAP
    events = list(client.responses.create(model=SERVED_MODEL, input="hello there", max_output_tokens=8, stream=True))
    types = [event.type for event in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in types
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and 0 < final.usage.output_tokens <= 8


def test_messages_whole_streamed_and_counted_through_the_anthropic_sdk(routes: str) -> None:
    client = anthropic.Anthropic(base_url=routes, api_key="unused", max_retries=0, timeout=60)
    message = client.messages.create(model=SERVED_MODEL, max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "hello"}])
    assert message.type == "message" and message.content and 0 < message.usage.output_tokens <= 8
    with client.messages.stream(model=SERVED_MODEL, max_tokens=8, messages=[{"role": "user", "content": "hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(block.text for block in final.content if block.type == "text")
    assert 0 < final.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model=SERVED_MODEL, messages=[{"role": "user", "content": "hello"}])
    assert counted.input_tokens > 0
    # tailguard's own refusal there is Anthropic's: the prompt over the input cap.
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(model=SERVED_MODEL, max_tokens=8, messages=[{"role": "user", "content": "word " * 20_000}])
    assert too_long.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_embeddings_and_rerank_on_the_pooling_engine(routes: str) -> None:
    client = openai.OpenAI(base_url=f"{routes}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.embeddings.with_raw_response.create(model=SERVED_MODEL, input=["first text", "second text"])
    embeddings = raw.parse()
    assert [item.index for item in embeddings.data] == [0, 1] and len(embeddings.data[0].embedding) > 0
    assert raw.headers["x-tailguard-class"] == "embeddings" and raw.headers["x-tailguard-pool"] == "embed"
    ranked = httpx.post(f"{routes}/v1/rerank", json={"model": SERVED_MODEL, "query": "hello", "documents": ["hello there", "goodbye"]}, timeout=60)
    assert ranked.status_code == 200, ranked.text
    assert sorted(result["index"] for result in ranked.json()["results"]) == [0, 1]


def test_tokenize_and_detokenize_are_relayed(routes: str) -> None:
    tokens = httpx.post(f"{routes}/tokenize", json={"model": SERVED_MODEL, "prompt": "hello world"}, timeout=60)
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    text = httpx.post(f"{routes}/detokenize", json={"model": SERVED_MODEL, "tokens": ids}, timeout=60)
    assert text.status_code == 200 and "hello" in text.json()["prompt"]
