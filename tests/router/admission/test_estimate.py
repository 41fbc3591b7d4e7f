"""The size estimate never undercounts (issue 10, defect 9).

The reference is the simulator's own tokenizer rule (``bench/sim/tokens.py``)
applied to everything vLLM renders into the prompt: message contents through
``count_chat_tokens``, and every other rendered field (a non-standard role,
``name``, ``tool_calls``, ``tool_call_id``, ``tools``, ``response_format``)
as the JSON text a chat template's ``tojson`` prints.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from tailguard.router.admission import RouterRequest, check_prompt, classify, estimate_prompt_tokens, estimate_text_tokens
from tailguard.router.config import Config, EstimateConfig, LimitsConfig, ServerConfig
from tailguard.router.errors import PromptTooLong
from tailguard.sim.tokens import count_chat_tokens, count_text_tokens
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import Backends, tailguard

DEFAULT = EstimateConfig()
CLASSES = two_pool_config().classes
EMOJI = "\N{GRINNING FACE}"
THAI = "\N{THAI CHARACTER SO SUA}"

# Roles whose name the simulator's 4 tokens a message already pay for.
_TEMPLATE_ROLES = ("system", "user", "assistant", "tool", "function", "developer")  # covered by per_message_tokens

# Whole scripts as well as arbitrary code points: hypothesis rarely draws a
# long run of one script by itself.
_SCRIPTS = st.sampled_from(["a-z ", "éüñç", "Привет", "مرحبا", "สวัสดี", "नमस्ते", "中文字", "かな", "한국어", EMOJI + "\N{ZERO WIDTH JOINER}", "\U0001d400"])
_TEXT = st.one_of(st.text(), _SCRIPTS.flatmap(lambda chars: st.text(st.sampled_from(chars), max_size=200)))
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
_TOOL_CALL = st.fixed_dictionaries(
    {"id": st.text(max_size=12), "type": st.just("function"), "function": st.fixed_dictionaries({"name": _TEXT, "arguments": _TEXT})}
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(_TEMPLATE_ROLES) | st.text(min_size=1, max_size=12)},
    optional={
        "content": st.none() | _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=3),
        "name": _TEXT,
        "tool_calls": st.lists(_TOOL_CALL, max_size=2),
        "tool_call_id": st.text(max_size=12),
    },
)
_TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": _TEXT, "parameters": _JSON})}), max_size=3)


def rendered(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def simulator_tokens(messages: list[dict[str, Any]], params: dict[str, Any]) -> int:
    """What the simulator's rule gives for everything a template would render."""
    contents = []
    tokens = 0
    for message in messages:
        content = message.get("content") or ""
        contents.append(content if isinstance(content, str) else "".join(part["text"] for part in content))
        for key, value in message.items():
            if key == "role" and value in _TEMPLATE_ROLES or key == "content" or value is None:
                continue
            tokens += count_text_tokens(rendered(value))
    for key in ("tools", "response_format", "tool_choice"):
        if params.get(key) is not None:
            tokens += count_text_tokens(rendered(params[key]))
    return tokens + count_chat_tokens(contents)


@settings(max_examples=400, deadline=None)
@given(text=_TEXT)
def test_any_text_is_the_simulators_count_exactly(text: str) -> None:
    # Exact, not only an upper bound: no script pays more than the rule, and
    # ASCII keeps its 4 characters a token, so normal traffic is classed as before.
    assert estimate_text_tokens(text, DEFAULT) == count_text_tokens(text)
    if text.isascii():
        assert estimate_text_tokens(text, DEFAULT) == math.ceil(len(text) / 4)


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(_MESSAGE, min_size=1, max_size=4),
    tools=st.none() | _TOOLS,
    response_format=st.none() | _JSON,
    temperature=st.floats(0, 2),
)
def test_a_chat_estimate_is_never_below_the_simulators_count(
    messages: list[dict[str, Any]], tools: list[Any] | None, response_format: object, temperature: float
) -> None:
    params = {"temperature": temperature, "tools": tools, "response_format": response_format, "tool_choice": "auto" if tools else None}
    params = {k: v for k, v in params.items() if v is not None}
    request = RouterRequest(kind="chat", request_id="r", messages=messages, params=params)
    estimate = estimate_prompt_tokens(request, DEFAULT)
    truth = simulator_tokens(messages, params)
    # How pessimistic: 1 token for the reply's turn (4 where the simulator adds 3), and at
    # most 1 per text part, each rounded up on its own (vLLM joins parts with a newline).
    parts = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), list))
    assert truth <= estimate <= truth + 1 + parts


@settings(max_examples=200, deadline=None)
@given(prompt=_TEXT | st.lists(_TEXT, min_size=1, max_size=3), suffix=st.none() | _TEXT)
def test_a_completion_estimate_is_never_below_the_simulators_count(prompt: str | list[str], suffix: str | None) -> None:
    params = {} if suffix is None else {"suffix": suffix}
    request = RouterRequest(kind="completion", request_id="r", prompt=prompt, params=params)
    texts = [prompt] if isinstance(prompt, str) else prompt
    truth = max(1, sum(count_text_tokens(t) for t in texts) + (count_text_tokens(suffix) if suffix else 0))
    assert estimate_prompt_tokens(request, DEFAULT) >= truth


def chat(content: str, **params: object) -> RouterRequest:
    return RouterRequest(kind="chat", request_id="r", messages=[{"role": "user", "content": content}], params=params)


def test_32700_emoji_are_over_the_input_cap() -> None:
    request = chat(EMOJI * 32_700)
    assert count_chat_tokens([EMOJI * 32_700]) == 32_707  # what the engine counted in the chaos run
    with pytest.raises(PromptTooLong, match="input cap of 8192"):
        check_prompt(estimate_prompt_tokens(request, DEFAULT), LimitsConfig())


@pytest.mark.parametrize(("char", "engine_count"), [(EMOJI, 1_907), (THAI, 1_432)])
def test_1900_emoji_or_thai_characters_are_not_interactive(char: str, engine_count: int) -> None:
    request = chat(char * 1_900)
    assert count_chat_tokens([char * 1_900]) == engine_count
    estimate = estimate_prompt_tokens(request, DEFAULT)
    assert estimate >= engine_count and classify(estimate, 16, CLASSES).name == "batch"
    # ASCII English of the same length stays interactive, as before.
    assert classify(estimate_prompt_tokens(chat("word " * 380), DEFAULT), 16, CLASSES).name == "interactive"


def big_tools(size: int) -> list[dict[str, Any]]:
    """Tools whose JSON is about ``size`` bytes, the way agent frameworks send them."""
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a record. " * 20,
            "parameters": {"type": "object", "properties": {"id": {"type": "string", "description": "The record's id."}}},
        },
    }
    return [tool] * (size // len(json.dumps(tool)) + 1)


def test_a_200_kb_tools_payload_is_counted_as_large() -> None:
    tools = big_tools(200_000)
    estimate = estimate_prompt_tokens(chat("hi", tools=tools, tool_choice="auto"), DEFAULT)
    assert estimate >= len(json.dumps(tools)) // 4 >= 50_000  # was 8 tokens: only "hi" was counted
    with pytest.raises(PromptTooLong):
        check_prompt(estimate, LimitsConfig())


def test_every_rendered_field_counts() -> None:
    base = estimate_prompt_tokens(chat("hi"), DEFAULT)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    for params in ({"response_format": schema}, {"guided_json": schema["json_schema"]}, {"documents": [{"text": "a" * 400}]}, {"chat_template": "x" * 400}):
        assert estimate_prompt_tokens(chat("hi", **params), DEFAULT) >= base + len(json.dumps(next(iter(params.values())))) // 4
    # Sampling parameters are not prompt: a logit_bias table does not move the class.
    assert estimate_prompt_tokens(chat("hi", logit_bias={str(i): -100 for i in range(300)}, stop=["\n"]), DEFAULT) == base
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"id": "x" * 400})}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi", "name": "n" * 400},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "r" * 400, "tool_call_id": "call_1"},
        {"role": "x" * 400, "content": [{"type": "text", "text": "t" * 400}, {"type": "image_url", "image_url": {"url": "data:"}}]},
    ]
    estimate = estimate_prompt_tokens(RouterRequest(kind="chat", request_id="r", messages=messages), DEFAULT)
    assert estimate >= 5 * 100 + 4 * 5


async def test_http_large_inputs_are_refused_or_sent_to_batch(two_engines: Backends) -> None:
    config: Config = two_pool_config(interactive_urls=[two_engines.urls[0]], batch_urls=[two_engines.urls[1]])
    config = dataclasses.replace(config, server=ServerConfig(max_body_bytes=1 << 20))
    async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url) as client:
        for body in (
            {"messages": [{"role": "user", "content": EMOJI * 32_700}]},
            {"messages": [{"role": "user", "content": "hi"}], "tools": big_tools(200_000), "max_tokens": 8},
        ):
            refused = await client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 400, refused.text  # as OpenAI and vLLM answer it
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "context_length_exceeded"
        thai = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": THAI * 1_900}], "max_tokens": 8})
        assert thai.status_code == 200 and thai.headers["x-tailguard-class"] == "batch"
        assert thai.json()["usage"]["prompt_tokens"] == 1_432  # the engine's count: far over interactive's 500
