"""The simulator against real vLLM 0.32: the same requests to both, compared where the router depends on them.

Shapes (keys and JSON types of answers and stream events), refusals (status,
type, param of a catalogue of bad inputs), the metric names the router reads,
and prefix-cache hits for the same sequence of prompts (token-id prompts, so
both count the same tokens; the simulator's block size set to the engine's
128). A vLLM release that changes one of these fails here, not in front of a
user. What still differs, and what it does to the router, is listed in
docs/simulator.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.vllm.engines import SERVED_MODEL, RealEngine, free_port
from tests.real_vllm.sim_process import start_sim
from tests.real_vllm.test_wire import events

BLOCK = 128  # vLLM's KV block on CPU
LONGEST_TOKEN = 80  # the tiny model's longest token, in characters: vLLM's bound on a text before it tokenizes it
# What the router reads of an engine's /metrics (router/backend/load.py; V0's names are fallbacks only): family names.
ROUTER_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)


@pytest.fixture(scope="module")
def sim(engine_logs: Path) -> Iterator[RealEngine]:
    """The simulator started as an engine like engines[1]: same name, key, seats, context, block, flags."""
    engine = start_sim(engine_logs, "sim", ("--enable-prompt-tokens-details", "--enable-per-request-metrics", "--scheduling-policy", "priority"))
    yield engine
    engine.stop()


def shape(value: Any, key: str = "") -> Any:
    """A JSON value's keys and types, recursively: what clients parse. A list is the set of its items' shapes (the
    two models' words differ in count and bytes); a completion's ``top_logprobs`` maps tokens to floats, whatever
    the tokens."""
    if isinstance(value, dict):
        if key == "top_logprobs_entry":
            return {"<token>": sorted({type(item).__name__ for item in value.values()})}
        return {name: shape(item, name) for name, item in value.items()}
    if isinstance(value, list):
        if all(not isinstance(item, (dict, list)) for item in value):
            return "list of scalars"  # a token's bytes (empty for part of a character), text offsets, ...
        inner = "top_logprobs_entry" if key == "top_logprobs" else ""
        shapes: list[Any] = []
        for item in value:
            if shape(item, inner) not in shapes:
                shapes.append(shape(item, inner))
        return shapes
    return type(value).__name__


def families(engine: RealEngine) -> set[str]:
    """The metric family names on an engine's /metrics, as a Prometheus parser (and the router) reads them."""
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return {family.name for family in text_string_to_metric_families(text)}


def post(engine: RealEngine, path: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(f"{engine.url}{path}", json=body, headers={**engine.headers(), **headers}, timeout=120)


def stream_shapes(response: httpx.Response) -> tuple[list[str], list[Any]]:
    """A stream's kinds of event (each shape once, sorted: the models' words differ in count, and vLLM's n choices
    finish a step apart or together), and the shapes of its first and last events (the role, the usage or finish)."""
    parsed, done = events(response)
    assert done, response.text[-300:]
    return sorted({repr(shape(event)) for event in parsed}), [shape(parsed[0]), shape(parsed[-1])]


CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5, "ignore_eos": True}
COMPLETION = {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
ANSWERS = {
    "chat": ("/v1/chat/completions", CHAT),
    "chat_n2": ("/v1/chat/completions", {**CHAT, "n": 2}),
    "chat_logprobs": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
    "chat_over_context": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi " * 10}], "max_tokens": 4090}),
    "completion": ("/v1/completions", COMPLETION),
    "completion_logprobs": ("/v1/completions", {**COMPLETION, "logprobs": 2}),
    "completion_token_ids": ("/v1/completions", {**COMPLETION, "prompt": list(range(100, 140))}),
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_whole_answers_have_vllms_keys_and_types(engines: tuple[RealEngine, RealEngine], sim: RealEngine, name: str) -> None:
    path, body = ANSWERS[name]
    real, simulated = post(engines[1], path, body), post(sim, path, body)
    assert (
        (simulated.status_code, simulated.headers["content-type"])
        == (real.status_code, real.headers["content-type"])
        == (200, "application/json")
    )
    assert shape(simulated.json()) == shape(real.json())
    assert [c["finish_reason"] for c in simulated.json()["choices"]] == [c["finish_reason"] for c in real.json()["choices"]]


@pytest.mark.parametrize("name", sorted(ANSWERS))
@pytest.mark.parametrize("include_usage", [False, True])
def test_streams_have_vllms_events(engines: tuple[RealEngine, RealEngine], sim: RealEngine, name: str, include_usage: bool) -> None:
    path, body = ANSWERS[name]
    body = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if include_usage else {})}
    real, simulated = post(engines[1], path, body), post(sim, path, body)
    assert simulated.status_code == real.status_code == 200
    assert simulated.headers["content-type"].split(";")[0] == real.headers["content-type"].split(";")[0] == "text/event-stream"
    assert stream_shapes(simulated) == stream_shapes(real)


LONG_TEXT = "deadbeef " * 3000  # over 4,096 tokens for either tokenizer
BAD = {
    "negative_temperature": ("/v1/chat/completions", {**CHAT, "temperature": -1}),
    "top_p_over_1": ("/v1/chat/completions", {**CHAT, "top_p": 7}),
    "max_tokens_over_context": ("/v1/chat/completions", {**CHAT, "max_tokens": 5000}),
    "max_tokens_zero": ("/v1/chat/completions", {**CHAT, "max_tokens": 0}),
    "max_tokens_not_a_number": ("/v1/chat/completions", {**CHAT, "max_tokens": "ten"}),
    "temperature_not_a_number": ("/v1/chat/completions", {**CHAT, "temperature": "hot"}),
    "prompt_over_context": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG_TEXT}]}),
    "completion_prompt_over_context": ("/v1/completions", {**COMPLETION, "prompt": LONG_TEXT}),
    "unknown_model": ("/v1/chat/completions", {**CHAT, "model": "gpt-9"}),
    "stream_options_without_stream": ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}),
    "no_messages": ("/v1/chat/completions", {"model": SERVED_MODEL, "max_tokens": 5}),
    "n_zero": ("/v1/chat/completions", {**CHAT, "n": 0}),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_are_refused_as_vllm_refuses_them(engines: tuple[RealEngine, RealEngine], sim: RealEngine, name: str) -> None:
    path, body = BAD[name]
    real, simulated = post(engines[1], path, body), post(sim, path, body)
    assert simulated.status_code == real.status_code and real.status_code >= 400, (real.text, simulated.text)
    theirs, ours = real.json()["error"], simulated.json()["error"]
    assert (ours["type"], ours["param"], ours["code"]) == (theirs["type"], theirs["param"], theirs["code"]), (theirs, ours)


def test_paths_and_methods_answer_as_fastapi_does(engines: tuple[RealEngine, RealEngine], sim: RealEngine) -> None:
    for engine in (engines[1], sim):
        missing = httpx.get(f"{engine.url}/v1/nope", headers=engine.headers(), timeout=10)
        wrong = httpx.get(f"{engine.url}/v1/chat/completions", headers=engine.headers(), timeout=10)
        unauthorised = httpx.post(f"{engine.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"}), engine.name
        assert (wrong.status_code, wrong.json(), wrong.headers.get("allow")) == (405, {"detail": "Method Not Allowed"}, "POST"), engine.name
        assert (unauthorised.status_code, unauthorised.json()) == (401, {"error": "Unauthorized"}), engine.name


def test_models_and_request_ids(engines: tuple[RealEngine, RealEngine], sim: RealEngine) -> None:
    real = httpx.get(f"{engines[1].url}/v1/models", headers=engines[1].headers(), timeout=10)
    simulated = httpx.get(f"{sim.url}/v1/models", headers=sim.headers(), timeout=10)
    assert shape(simulated.json()) == shape(real.json())
    assert simulated.json()["data"][0]["max_model_len"] == real.json()["data"][0]["max_model_len"] == 4096
    for engine in (engines[1], sim):
        answer = post(engine, "/v1/chat/completions", CHAT, **{"x-request-id": "differential-7"})
        assert "x-request-id" not in answer.headers, engine.name  # vLLM takes it as its request id, does not echo it
        assert answer.json()["id"].startswith("chatcmpl-"), engine.name


def test_the_metrics_the_router_reads_exist_on_both(engines: tuple[RealEngine, RealEngine], sim: RealEngine) -> None:
    for engine in (engines[1], sim):
        names = families(engine)
        assert set(ROUTER_METRICS) <= names, (engine.name, set(ROUTER_METRICS) - names)
        assert "vllm:request_success" in names and "vllm:gpu_cache_usage_perc" not in names, engine.name


def test_prefix_cache_hits_match_for_the_same_prompts(engines: tuple[RealEngine, RealEngine], sim: RealEngine) -> None:
    """Full 128-token blocks are cached; a repeated prompt recomputes its last token; an unrelated one hits nothing."""
    base = 1000 + 7 * (free_port() % 500)  # fresh token ids per run: nothing cached from an earlier run
    first = list(range(base, base + 300))
    longer = [*first, *range(base + 2000, base + 2200)]
    other = list(range(base + 3000, base + 3260))
    sequence = [first, first, longer, other, longer, first[:256]]
    seen: dict[str, list[tuple[int, float]]] = {}
    for engine in (engines[1], sim):
        hits = []
        for prompt in sequence:
            before = engine.metrics().get("vllm:prefix_cache_hits", 0.0)
            answer = post(engine, "/v1/completions", {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1})
            cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            hits.append((cached, engine.metrics().get("vllm:prefix_cache_hits", 0.0) - before))
        seen[engine.name] = hits
    assert seen["sim"] == seen["b"]
