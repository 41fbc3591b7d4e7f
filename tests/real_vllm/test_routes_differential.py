"""The simulator's routes beyond completions against real vLLM 0.32: the same requests to both, compared where a client
depends on them.

Responses (``/v1/responses``, its named event stream, ``GET`` and ``cancel``
without a store), Anthropic messages (``/v1/messages``, its event stream,
``count_tokens``, errors in Anthropic's shape), ``/tokenize`` and
``/detokenize``, and a pooling engine (the tiny model under ``--runner
pooling --convert embed`` beside the simulator under the same flags):
embeddings, rerank, score. Compared: status, content type, the keys and JSON
types of answers and of each kind of stream event, the order of event names
(a run of deltas counted once: tokens a reader has not taken yet go as one
delta on both), and the status, type, param and code of refusals. The words,
the token counts and the vectors' values are each engine's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.vllm.engines import SERVED_MODEL, RealEngine
from tests.real_vllm.sim_process import start_sim
from tests.real_vllm.test_differential import post, shape
from tests.real_vllm.test_engine_faults import fill
from tests.sim.apps import named_events

EMBEDDING_SIZE = 256  # the tiny model's hidden size: what its embeddings have


@pytest.fixture(scope="module")
def sim(engine_logs: Path) -> Iterator[RealEngine]:
    """The simulator as engines[1] runs: its key, seats, context, block and flags."""
    engine = start_sim(engine_logs, "routes", ("--enable-prompt-tokens-details", "--enable-per-request-metrics", "--scheduling-policy", "priority"))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def sim_pooling(engine_logs: Path) -> Iterator[RealEngine]:
    """The simulator as the pooling engine runs: an embedding model of the tiny model's hidden size."""
    engine = start_sim(engine_logs, "pooling", ("--runner", "pooling", "--convert", "embed", "--embedding-size", str(EMBEDDING_SIZE)))
    yield engine
    engine.stop()


def event_shapes(response: httpx.Response) -> tuple[list[str], dict[str, list[Any]]]:
    """A named event stream's event names in order (a run of one name counted once) and each name's data shapes."""
    events = named_events(response.text)
    names: list[str] = []
    shapes: dict[str, list[Any]] = {}
    for name, data in events:
        if not names or names[-1] != name:
            names.append(name)
        seen = shapes.setdefault(name, [])
        if shape(data) not in seen:
            seen.append(shape(data))
    return names, shapes


def assert_same_answer(real: httpx.Response, simulated: httpx.Response) -> None:
    assert simulated.status_code == real.status_code == 200, (real.text[:300], simulated.text[:300])
    kind = real.headers["content-type"].split(";")[0]
    assert simulated.headers["content-type"].split(";")[0] == kind
    if kind == "text/event-stream":
        assert event_shapes(simulated) == event_shapes(real)
    else:
        assert shape(simulated.json()) == shape(real.json())


def assert_same_refusal(real: httpx.Response, simulated: httpx.Response) -> None:
    """The same status; vLLM's OpenAI shape (type, param, code) or Anthropic's (its type and the error's type)."""
    assert simulated.status_code == real.status_code >= 400, (real.text[:300], simulated.text[:300])
    theirs, ours = real.json(), simulated.json()
    if theirs.get("type") == "error":  # translate_error_response
        assert (ours["type"], ours["error"]["type"], sorted(ours["error"])) == ("error", theirs["error"]["type"], sorted(theirs["error"]))
    elif isinstance(theirs.get("error"), dict):
        fields = ("type", "param", "code")
        assert [ours["error"][f] for f in fields] == [theirs["error"][f] for f in fields], (theirs, ours)
    else:
        assert ours == theirs


RESPONSE = {"model": SERVED_MODEL, "input": "hello there", "max_output_tokens": 4, "ignore_eos": True}
RESPONSES = {
    "text": RESPONSE,
    "instructions": {**RESPONSE, "instructions": "be brief"},
    "items": {
        **RESPONSE,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
            {"role": "user", "content": "more"},
        ],
    },
    "logprobs": {**RESPONSE, "include": ["message.output_text.logprobs"], "top_logprobs": 2},
    "store_false": {**RESPONSE, "store": False},
}


@pytest.mark.parametrize("name", sorted(RESPONSES))
@pytest.mark.parametrize("stream", [False, True])
def test_responses_answer_as_vllms(engines: tuple[RealEngine, RealEngine], sim: RealEngine, name: str, stream: bool) -> None:
    body = {**RESPONSES[name], "stream": stream}
    real, simulated = post(engines[1], "/v1/responses", body), post(sim, "/v1/responses", body)
    assert_same_answer(real, simulated)
    if not stream:
        assert simulated.json()["status"] == real.json()["status"] == "incomplete"


MESSAGE = {"model": SERVED_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}
MESSAGES = {
    "text": MESSAGE,
    "system": {**MESSAGE, "system": "be brief"},
    "blocks": {
        **MESSAGE,
        "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more"},
        ],
    },
    "cached": {**MESSAGE, "messages": [{"role": "user", "content": "hi " * 300}]},  # the second run reads cached blocks
}


@pytest.mark.parametrize("name", sorted(MESSAGES))
@pytest.mark.parametrize("stream", [False, True])
def test_messages_answer_as_vllms(engines: tuple[RealEngine, RealEngine], sim: RealEngine, name: str, stream: bool) -> None:
    body = {**MESSAGES[name], "stream": stream}
    real, simulated = post(engines[1], "/v1/messages", body), post(sim, "/v1/messages", body)
    assert_same_answer(real, simulated)
    if not stream:
        assert simulated.json()["stop_reason"] == real.json()["stop_reason"] == "max_tokens"
        assert set(simulated.json()["usage"]) == set(real.json()["usage"])


def test_count_tokens_answers_as_vllms(engines: tuple[RealEngine, RealEngine], sim: RealEngine) -> None:
    body = {"model": SERVED_MODEL, "system": "be brief", "messages": MESSAGE["messages"]}
    real, simulated = post(engines[1], "/v1/messages/count_tokens", body), post(sim, "/v1/messages/count_tokens", body)
    assert_same_answer(real, simulated)
    answered = post(sim, "/v1/messages", {**body, "max_tokens": 1}).json()["usage"]
    counted = simulated.json()["input_tokens"]
    assert counted == sum(answered.get(key, 0) for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))


LONG_TEXT = "deadbeef " * 3000  # over 4,096 tokens for either tokenizer
REFUSALS = {
    "responses_no_input": ("/v1/responses", {"model": SERVED_MODEL}),
    "responses_input_not_text": ("/v1/responses", {"input": 5}),
    "responses_bad_item": ("/v1/responses", {"input": [{"foo": 1}]}),
    "responses_max_not_a_number": ("/v1/responses", {"input": "hi", "max_output_tokens": "ten"}),
    "responses_unknown_model": ("/v1/responses", {"model": "gpt-9", "input": "hi"}),
    "responses_max_over_context": ("/v1/responses", {"input": "hi", "max_output_tokens": 5000}),
    "responses_max_zero": ("/v1/responses", {"input": "hi", "max_output_tokens": 0}),
    "responses_empty_input": ("/v1/responses", {"input": []}),
    "responses_prompt_over_context": ("/v1/responses", {"input": LONG_TEXT}),
    "responses_temperature": ("/v1/responses", {"input": "hi", "temperature": -1}),
    "responses_background_without_store": ("/v1/responses", {"input": "hi", "background": True}),
    "responses_background_store_false": ("/v1/responses", {"input": "hi", "background": True, "store": False}),
    "responses_previous_unknown": ("/v1/responses", {"input": "hi", "previous_response_id": "resp_nope"}),
    "responses_stream_unknown_model": ("/v1/responses", {"model": "gpt-9", "input": "hi", "stream": True}),
    "messages_no_max_tokens": ("/v1/messages", {"model": SERVED_MODEL, "messages": MESSAGE["messages"]}),
    "messages_max_tokens_zero": ("/v1/messages", {**MESSAGE, "max_tokens": 0}),
    "messages_no_model": ("/v1/messages", {k: v for k, v in MESSAGE.items() if k != "model"}),
    "messages_empty_model": ("/v1/messages", {**MESSAGE, "model": ""}),
    "messages_bad_role": ("/v1/messages", {**MESSAGE, "messages": [{"role": "bot", "content": "hi"}]}),
    "messages_unknown_model": ("/v1/messages", {**MESSAGE, "model": "claude-9"}),
    "messages_unknown_model_stream": ("/v1/messages", {**MESSAGE, "model": "claude-9", "stream": True}),
    "messages_max_over_context": ("/v1/messages", {**MESSAGE, "max_tokens": 5000}),
    "messages_empty": ("/v1/messages", {**MESSAGE, "messages": []}),
    "messages_prompt_over_context": ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": LONG_TEXT}]}),
    "messages_temperature_stream": ("/v1/messages", {**MESSAGE, "temperature": -1, "stream": True}),
    "count_unknown_model": ("/v1/messages/count_tokens", {"model": "claude-9", "messages": MESSAGE["messages"]}),
    "count_no_messages": ("/v1/messages/count_tokens", {"model": SERVED_MODEL}),
    "count_empty": ("/v1/messages/count_tokens", {"model": SERVED_MODEL, "messages": []}),
    "tokenize_unknown_model": ("/tokenize", {"model": "x", "prompt": "hi"}),
    "tokenize_nothing": ("/tokenize", {"model": SERVED_MODEL}),
    "tokenize_ids": ("/tokenize", {"prompt": [1, 2, 3]}),
    "detokenize_unknown_model": ("/detokenize", {"model": "x", "tokens": [1]}),
    "detokenize_no_tokens": ("/detokenize", {"model": SERVED_MODEL}),
    "detokenize_not_ids": ("/detokenize", {"tokens": ["a"]}),
    "detokenize_negative": ("/detokenize", {"tokens": [-1]}),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_are_vllms(engines: tuple[RealEngine, RealEngine], sim: RealEngine, name: str) -> None:
    path, body = REFUSALS[name]
    assert_same_refusal(post(engines[1], path, body), post(sim, path, body))


def test_responses_paths_without_a_store_and_keys_answer_as_vllms(engines: tuple[RealEngine, RealEngine], sim: RealEngine) -> None:
    """No store (VLLM_ENABLE_RESPONSES_API_STORE unset): a kept id is never found; FastAPI's 405s; the key is a bearer."""
    for engine in (engines[1], sim):
        made = post(engine, "/v1/responses", RESPONSE).json()["id"]
        found = httpx.get(f"{engine.url}/v1/responses/{made}", headers=engine.headers(), timeout=10)
        cancelled = httpx.post(f"{engine.url}/v1/responses/{made}/cancel", headers=engine.headers(), timeout=10)
        assert [found.status_code, found.json()["error"]["param"], cancelled.status_code] == [404, "response_id", 404], engine.name
        assert found.json()["error"]["message"] == f"Response with id '{made}' not found.", engine.name
        for method, path, allow in (("GET", "/v1/responses", "POST"), ("DELETE", f"/v1/responses/{made}", "GET"), ("GET", "/detokenize", "POST")):
            wrong = httpx.request(method, f"{engine.url}{path}", headers=engine.headers(), timeout=10)
            assert (wrong.status_code, wrong.json(), wrong.headers.get("allow")) == (405, {"detail": "Method Not Allowed"}, allow), engine.name
        by_x_api_key = httpx.post(f"{engine.url}/v1/messages", json=MESSAGE, headers={"x-api-key": engine.key or ""}, timeout=10)
        assert (by_x_api_key.status_code, by_x_api_key.json()) == (401, {"error": "Unauthorized"}), engine.name


TOKENIZE = {
    "prompt": ("/tokenize", {"model": SERVED_MODEL, "prompt": "hello there"}),
    "prompt_strs": ("/tokenize", {"prompt": "hello there", "return_token_strs": True}),
    "chat": ("/tokenize", {"messages": [{"role": "user", "content": "hello there"}]}),
    "chat_no_generation_prompt": ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}),
    "detokenize": ("/detokenize", {"model": SERVED_MODEL, "tokens": [100, 200, 300]}),
    "detokenize_nothing": ("/detokenize", {"tokens": []}),
}


@pytest.mark.parametrize("name", sorted(TOKENIZE))
def test_tokenizer_routes_answer_as_vllms(engines: tuple[RealEngine, RealEngine], sim: RealEngine, name: str) -> None:
    path, body = TOKENIZE[name]
    assert_same_answer(post(engines[1], path, body), post(sim, path, body))
    assert httpx.post(f"{sim.url}{path}", json=body, timeout=10).status_code == 200  # outside /v1: no key asked


POOLING_ROUTES = ("/v1/embeddings", "/pooling", "/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score")
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")


def test_each_runner_serves_its_own_routes_only(
    engines: tuple[RealEngine, RealEngine], sim: RealEngine, pooling_engine: RealEngine, sim_pooling: RealEngine
) -> None:
    """A generative engine has no pooling routes and a pooling one no generation routes: FastAPI's 404 on both."""
    body = {"model": SERVED_MODEL, "input": "hi", "query": "q", "documents": ["a"], "text_1": "a", "text_2": "b", "messages": []}
    for engine, absent in ((engines[1], POOLING_ROUTES), (sim, POOLING_ROUTES), (pooling_engine, GENERATION_ROUTES), (sim_pooling, GENERATION_ROUTES)):
        for path in absent:
            reply = post(engine, path, body)
            assert (reply.status_code, reply.json()) == (404, {"detail": "Not Found"}), (engine.name, path)


DOCUMENTS = ["hello there", "nothing at all", "hello"]
POOLING = {
    "embeddings": ("/v1/embeddings", {"model": SERVED_MODEL, "input": "hello there"}),
    "embeddings_texts": ("/v1/embeddings", {"input": ["hello there", "general kenobi"]}),
    "embeddings_base64": ("/v1/embeddings", {"input": ["hello there"], "encoding_format": "base64"}),
    "embeddings_ids": ("/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]}),
    "embeddings_chat": ("/v1/embeddings", {"messages": [{"role": "user", "content": "hello"}]}),
    "pooling": ("/pooling", {"input": "hello"}),
    "rerank": ("/rerank", {"model": SERVED_MODEL, "query": "hello", "documents": DOCUMENTS}),
    "rerank_v1_top_n": ("/v1/rerank", {"query": "hello", "documents": DOCUMENTS, "top_n": 2}),
    "rerank_v2": ("/v2/rerank", {"query": "hello", "documents": DOCUMENTS}),
    "score": ("/score", {"text_1": "hello", "text_2": DOCUMENTS}),
    "score_v1_pairs": ("/v1/score", {"queries": ["hello", "x"], "documents": ["hello there", "y"]}),
}


@pytest.mark.parametrize("name", sorted(POOLING))
def test_pooling_answers_as_vllms(pooling_engine: RealEngine, sim_pooling: RealEngine, name: str) -> None:
    path, body = POOLING[name]
    real, simulated = post(pooling_engine, path, body), post(sim_pooling, path, body)
    assert_same_answer(real, simulated)
    theirs, ours = real.json(), simulated.json()
    if "results" in theirs:  # rerank: as many results, best first
        assert len(ours["results"]) == len(theirs["results"])
        for results in (theirs["results"], ours["results"]):
            assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    else:
        assert [item["index"] for item in ours["data"]] == [item["index"] for item in theirs["data"]]
        for key in ("embedding", "data"):
            if key in theirs["data"][0] and isinstance(theirs["data"][0][key], list):
                assert len(ours["data"][0][key]) == len(theirs["data"][0][key]) == EMBEDDING_SIZE
            if key in theirs["data"][0] and isinstance(theirs["data"][0][key], str):  # base64 of float32s
                assert len(ours["data"][0][key]) == len(theirs["data"][0][key])


POOLING_REFUSALS = {
    "no_input": ("/v1/embeddings", {"model": SERVED_MODEL}),
    "unknown_model": ("/v1/embeddings", {"model": "x", "input": "hi"}),
    "empty_text": ("/v1/embeddings", {"input": ""}),
    "no_texts": ("/v1/embeddings", {"input": []}),
    "dimensions": ("/v1/embeddings", {"input": "hi", "dimensions": 8}),
    "over_context": ("/v1/embeddings", {"input": LONG_TEXT}),
    "rerank_no_documents": ("/rerank", {"query": "hi"}),
    "rerank_empty_documents": ("/rerank", {"query": "hi", "documents": []}),
    "rerank_unknown_model": ("/rerank", {"model": "x", "query": "hi", "documents": ["a"]}),
    "score_uneven": ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}),
}


@pytest.mark.parametrize("name", sorted(POOLING_REFUSALS))
def test_pooling_refusals_are_vllms(pooling_engine: RealEngine, sim_pooling: RealEngine, name: str) -> None:
    path, body = POOLING_REFUSALS[name]
    assert_same_refusal(post(pooling_engine, path, body), post(sim_pooling, path, body))


BUSY_REQUESTS = {
    "responses": ("/v1/responses", RESPONSE),
    "responses_stream": ("/v1/responses", {**RESPONSE, "stream": True}),
    "messages": ("/v1/messages", MESSAGE),
    "messages_stream": ("/v1/messages", {**MESSAGE, "stream": True}),
    "count_tokens": ("/v1/messages/count_tokens", {"model": SERVED_MODEL, "messages": MESSAGE["messages"]}),
}


def test_a_full_queue_refuses_the_new_routes_as_vllm_does(busy_engine: RealEngine, engine_logs: Path) -> None:
    """vLLM's queue-full 503 (--max-num-queued-reqs 1, one request in): the Responses API's in the OpenAI shape, the
    Messages API's and count_tokens' in Anthropic's (``"type": "Service Unavailable"``); no Retry-After."""
    busy_sim = start_sim(engine_logs, "busy", ("--max-num-seqs", "1", "--max-num-queued-reqs", "1"))
    try:
        answers: dict[str, dict[str, httpx.Response]] = {}
        for engine in (busy_engine, busy_sim):
            with fill(engine):
                answers[engine.name] = {
                    name: httpx.post(f"{engine.url}{path}", json=body, headers=engine.headers(), timeout=20)
                    for name, (path, body) in BUSY_REQUESTS.items()
                }
    finally:
        busy_sim.stop()
    for name in BUSY_REQUESTS:
        real, simulated = answers[busy_engine.name][name], answers[busy_sim.name][name]
        assert real.status_code == 503 and "retry-after" not in real.headers and "retry-after" not in simulated.headers, name
        assert_same_refusal(real, simulated)
