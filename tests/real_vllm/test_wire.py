"""What a caller gets through tailguard, compared with the same request sent straight to vLLM."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from bench.vllm.engines import SERVED_MODEL, RealEngine
from tests.real_vllm.conftest import TailguardFactory, pool_config

CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Say something about routers."}], "max_tokens": 8, "temperature": 0}
VARIES = {"id", "created", "metrics"}  # fresh per answer, wherever it comes from (metrics: the engine's own timings)


def shape(value: Any) -> Any:
    """A JSON value's keys and types, recursively (values of scalars dropped): what clients parse."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def without(answer: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    return {key: value for key, value in answer.items() if key not in keys}


def events(response: httpx.Response) -> tuple[list[dict[str, Any]], bool]:
    """A stream's JSON events, and whether it ended with ``data: [DONE]`` as its last event."""
    payloads = [line[len("data: ") :] for line in response.text.split("\n") if line.startswith("data: ")]
    done = bool(payloads) and payloads[-1] == "[DONE]"
    return [json.loads(payload) for payload in payloads if payload != "[DONE]"], done


def test_whole_answer_is_vllms_key_for_key(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    engine = engines[0]
    direct = httpx.post(f"{engine.url}/v1/chat/completions", json=CHAT, headers=engine.headers(), timeout=60)
    with tailguard(pool_config([engine.url])) as tg:
        relayed = httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, timeout=60)
    assert direct.status_code == relayed.status_code == 200
    ours, theirs = relayed.json(), direct.json()
    assert shape(ours) == shape(theirs)
    assert without(ours, VARIES) == without(theirs, VARIES)  # greedy on the same engine: the same words, usage, fingerprint


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_is_vllms_event_for_event(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory, include_usage: bool) -> None:
    """Usage only when asked, [DONE] last, and vLLM's system_fingerprint kept (D1: it rides on the usage event)."""
    engine = engines[0]
    body: dict[str, Any] = {**CHAT, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    direct = httpx.post(f"{engine.url}/v1/chat/completions", json=body, headers=engine.headers(), timeout=60)
    with tailguard(pool_config([engine.url])) as tg:
        relayed = httpx.post(f"{tg.url}/v1/chat/completions", json=body, timeout=60)
    theirs, their_done = events(direct)
    ours, our_done = events(relayed)
    assert their_done and our_done
    assert [shape(event) for event in ours] == [shape(event) for event in theirs]
    assert [without(event, VARIES) for event in ours] == [without(event, VARIES) for event in theirs]
    assert ("usage" in ours[-1]) is include_usage
    assert any(event.get("system_fingerprint") for event in ours)


def test_openai_sdk_whole_and_stream(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    with tailguard(pool_config([engine.url for engine in engines])) as tg:
        client = openai.OpenAI(base_url=f"{tg.url}/v1", api_key="unused", max_retries=0)
        whole = client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
        chunks = list(
            client.chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True, stream_options={"include_usage": True}
            )
        )
        completion = client.completions.create(model=SERVED_MODEL, prompt="Once upon", max_tokens=4)
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    assert whole.system_fingerprint and whole.system_fingerprint.startswith("vllm-")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert completion.choices[0].finish_reason == "length" and completion.usage is not None


def test_models_lists_what_vllm_says(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """D6: /v1/models keeps vLLM's max_model_len, which clients use to size prompts."""
    engine = engines[0]
    theirs = httpx.get(f"{engine.url}/v1/models", headers=engine.headers(), timeout=10).json()["data"][0]
    with tailguard(pool_config([engine.url])) as tg:
        listed = httpx.get(f"{tg.url}/v1/models", timeout=10)
        one = httpx.get(f"{tg.url}/v1/models/{SERVED_MODEL}", timeout=10)
    assert listed.status_code == one.status_code == 200
    ours = listed.json()["data"][0]
    assert ours["id"] == theirs["id"] == SERVED_MODEL
    assert ours["max_model_len"] == theirs["max_model_len"] == 4096
    assert one.json()["max_model_len"] == 4096


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"temperature": -1}, "temperature"), ({"max_tokens": 5000}, "max_tokens"), ({"top_p": 7}, "top_p")],
)
def test_vllms_400_passed_through_in_openais_types(
    engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory, extra: dict[str, Any], param: str
) -> None:
    """D5: vLLM's 4xx keeps its status, message and param; its type ("BadRequestError") becomes OpenAI's."""
    engine = engines[0]
    body = {**CHAT, **extra}
    direct = httpx.post(f"{engine.url}/v1/chat/completions", json=body, headers=engine.headers(), timeout=30)
    # max_tokens over the engine's context: tailguard's own cap and context would stop it first, so both are lifted.
    with tailguard(pool_config([engine.url], max_model_len=16384, output_cap=8192)) as tg:
        relayed = httpx.post(f"{tg.url}/v1/chat/completions", json=body, timeout=30)
    assert direct.status_code == relayed.status_code == 400
    theirs, ours = direct.json()["error"], relayed.json()["error"]
    assert theirs["type"] == "BadRequestError"
    assert ours["type"] == "invalid_request_error"
    assert ours["message"] == theirs["message"] and ours["param"] == theirs["param"] == param


def test_vllms_context_length_400_is_context_length_exceeded(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """D5: a prompt vLLM finds over its context (tailguard's estimate did not) gets tailguard's own code for it."""
    engine = engines[0]
    body = {**CHAT, "messages": [{"role": "user", "content": "deadbeef" * 1300}]}  # ~5,200 real tokens, ~2,600 estimated
    with tailguard(pool_config([engine.url], max_model_len=16384, input_cap=16000)) as tg:
        whole = httpx.post(f"{tg.url}/v1/chat/completions", json=body, timeout=30)
        streamed = httpx.post(f"{tg.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30)
    for answer in (whole, streamed):
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "input_tokens" and "maximum context length is 4096" in error["message"]


def test_stream_upstream_keeps_ttft_and_vllms_nulls(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """D4: with stream_upstream = true, the whole body assembled from the stream has vLLM's null fields, and ttft is logged."""
    engine = engines[0]
    direct = httpx.post(f"{engine.url}/v1/chat/completions", json=CHAT, headers=engine.headers(), timeout=60).json()
    with tailguard(pool_config([engine.url], pool_extra="stream_upstream = true")) as tg:
        relayed = httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": "assembled-1"}, timeout=60)
        line = tg.access("assembled-1")
    assert relayed.status_code == 200
    ours = relayed.json()
    assert shape(ours) == shape(direct)
    assert ours["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert line["ttft_ms"] is not None and line["ttft_ms"] > 0


def test_access_log_carries_vllms_own_timings(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """vLLM's --enable-per-request-metrics: its queue, first-token and token-gap times in the access line, whole and streamed
    (the stream's ride on the usage event tailguard asks for, though this caller did not)."""
    engine = engines[0]
    with tailguard(pool_config([engine.url])) as tg:
        whole = httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": "timed-1"}, timeout=60)
        streamed = httpx.post(f"{tg.url}/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "timed-2"}, timeout=60)
        assert whole.status_code == streamed.status_code == 200
        assert whole.json()["metrics"]["time_to_first_token_ms"] > 0  # relayed as vLLM sent it
        lines = tg.access("timed-1"), tg.access("timed-2")
    for line in lines:
        assert line["engine_queue_ms"] is not None and line["engine_queue_ms"] >= 0
        assert line["engine_ttft_ms"] > 0 and line["engine_itl_ms"] > 0
        assert line["engine_ttft_ms"] <= line["e2e_ms"]


def test_access_log_carries_vllms_prompt_tokens(engines: tuple[RealEngine, RealEngine], tailguard: TailguardFactory) -> None:
    """D7: the access line has vLLM's usage.prompt_tokens beside tailguard's estimate, each named for what it is."""
    engine = engines[0]
    with tailguard(pool_config([engine.url])) as tg:
        whole = httpx.post(f"{tg.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": "counted-1"}, timeout=60).json()
        streamed = httpx.post(f"{tg.url}/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "counted-2"}, timeout=60)
        assert streamed.status_code == 200
        first, second = tg.access("counted-1"), tg.access("counted-2")
    assert first["prompt_tokens"] == whole["usage"]["prompt_tokens"] == second["prompt_tokens"]
    assert first["prompt_tokens_est"] > 0 and first["prompt_tokens_est"] != first["prompt_tokens"]
