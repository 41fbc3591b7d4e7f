"""``/tokenize`` and ``/detokenize`` as vLLM 0.32 serves them (against a running vLLM: tests/real_vllm/test_routes_differential.py)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tailguard.sim.tokens import ASSISTANT_PRIMING_TOKENS, count_chat_tokens
from tests.helpers.engines import MODEL
from tests.sim.apps import app_client


async def test_tokenize_then_detokenize_gives_an_ascii_text_back(autojump_clock: trio.testing.MockClock) -> None:
    text = "Hello there, general Kenobi!"
    async with app_client(api_key="k") as (_, client):  # outside /v1: no key asked
        tokens = (await client.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})).json()
        back = (await client.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})).json()
        words = (await client.post("/detokenize", json={"tokens": [0, 1, 2, 10**12]})).json()
    assert (tokens["count"], tokens["max_model_len"], len(tokens["tokens"])) == (7, 4096, 7)
    assert "".join(tokens["token_strs"]) == text and back == {"prompt": text}
    assert words == {"prompt": " the of and"}  # output token ids decode to their words; an id of no token to nothing


async def test_tokenize_counts_a_chat_as_the_engine_does(autojump_clock: trio.testing.MockClock) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    async with app_client() as (_, client):
        chat = (await client.post("/tokenize", json={"messages": messages})).json()
        bare = (await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
        both = (await client.post("/tokenize", json={"prompt": "x", "messages": messages})).json()
        served = (await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})).json()
    assert chat["count"] == served["usage"]["prompt_tokens"] == count_chat_tokens(["be brief", "hello there"]) == both["count"]
    assert bare["count"] == chat["count"] - ASSISTANT_PRIMING_TOKENS and chat["token_strs"] is None


@pytest.mark.parametrize(
    ("path", "body", "status", "kind", "param"),
    [
        ("/tokenize", {"model": "x", "prompt": "a"}, 404, "NotFoundError", "model"),
        ("/tokenize", {"model": MODEL}, 400, "Bad Request", "body.prompt"),
        ("/tokenize", {"prompt": [1, 2]}, 400, "Bad Request", "body.prompt"),
        ("/detokenize", {"model": "x", "tokens": [1]}, 404, "NotFoundError", "model"),
        ("/detokenize", {"model": MODEL}, 400, "Bad Request", "body.tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "Bad Request", "body.tokens.0"),
        ("/detokenize", {"tokens": [3, -1]}, 400, "Bad Request", "body.tokens.1"),
    ],
)
async def test_refusals_are_vllms(autojump_clock: trio.testing.MockClock, path: str, body: dict[str, object], status: int, kind: str, param: str) -> None:
    async with app_client() as (_, client):
        reply = await client.post(path, json=body)
        wrong_method = await client.get(path)
    error = reply.json()["error"]
    assert (reply.status_code, error["type"], error["param"], error["code"]) == (status, kind, param, status)
    assert (wrong_method.status_code, wrong_method.headers["allow"]) == (405, "POST")
