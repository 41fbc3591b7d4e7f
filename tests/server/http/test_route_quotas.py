"""The new routes pass the same door as chat: API keys and a key's request budget, refused in each API's shape.

A key allowed 3 requests a minute spends them across routes (a message, an
embedding, a response); the next is refused 429 with Retry-After: the
anthropic SDK raises RateLimitError on /v1/messages (Anthropic's shape), the
openai SDK on /v1/embeddings and /v1/responses (OpenAI's). Without the key,
each route answers 401 in its shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tailguard.router.config import ApiKeyConfig, AuthConfig, Config
from tests.helpers.engines import MODEL
from tests.helpers.front_ends import FrontEnds, front_ends
from tests.server.http.test_sdk_routes import EMBED_MODEL, make_config as routes_config, pooling_engine, storing_engine

KEY = "sk-budgeted"


def make_config(urls: list[str]) -> Config:
    key = ApiKeyConfig("budgeted", hashlib.sha256(KEY.encode()).hexdigest(), requests_per_minute=3)
    return dataclasses.replace(routes_config(urls), auth=AuthConfig((key,)), digest="route-quotas")


@pytest.fixture(scope="module")
def service() -> Iterator[FrontEnds]:
    with front_ends([storing_engine(), pooling_engine(), storing_engine()], make_config) as running:
        yield running


def test_a_keys_budget_is_spent_across_routes_and_refused_in_each_apis_shape(service: FrontEnds) -> None:
    sdk = openai.OpenAI(base_url=service.http_url + "/v1", api_key=KEY, max_retries=0, timeout=10)
    claude = anthropic.Anthropic(base_url=service.http_url, api_key=KEY, max_retries=0, timeout=10)
    claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    sdk.embeddings.create(model=EMBED_MODEL, input="hi")
    sdk.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    with pytest.raises(anthropic.RateLimitError) as anthropic_refused:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert anthropic_refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert float(anthropic_refused.value.response.headers["retry-after"]) > 0
    with pytest.raises(openai.RateLimitError) as openai_refused:
        sdk.embeddings.create(model=EMBED_MODEL, input="hi")
    assert openai_refused.value.code == "token_budget_exceeded"
    sdk.close()
    claude.close()


def test_without_the_key_each_route_answers_401_in_its_shape(service: FrontEnds) -> None:
    claude = anthropic.Anthropic(base_url=service.http_url, api_key="sk-wrong", max_retries=0, timeout=10)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    sdk = openai.OpenAI(base_url=service.http_url + "/v1", api_key="sk-wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        sdk.embeddings.create(model=EMBED_MODEL, input="hi")
    claude.close()
    sdk.close()


def test_anthropics_x_api_key_header_is_the_key_on_its_routes(service: FrontEnds) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    counted = httpx.post(service.http_url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY}, timeout=10)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    wrong = httpx.post(service.http_url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": "sk-wrong"}, timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    # Only on Anthropic's routes: OpenAI's take the Authorization header alone.
    elsewhere = httpx.post(service.http_url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, headers={"x-api-key": KEY}, timeout=10)
    assert elsewhere.status_code == 401
