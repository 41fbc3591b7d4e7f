"""The HTTP front end's routes: 404 for a path it does not serve, 405 only for a known one asked wrongly.

Unknown paths (``POST /nope``, ``POST /v1/embeddings``) are 404 in OpenAI's
error shape, whatever the method, so the openai SDK raises ``NotFoundError``;
a known path with a method it does not take is 405 with an ``Allow`` header.
``GET /v1/models/{id}`` answers OpenAI's model object, or 404
``model_not_found``. All on real sockets, through the real SDK where it has
a call for the route.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator

import httpx
import openai
import pytest

from tailguard.router.config import ApiKeyConfig, AuthConfig, Config
from tests.helpers.engines import MODEL
from tests.helpers.front_ends import Faulty, FrontEnds, front_ends
from tests.helpers.router import two_pool_config

KEY = "sk-routes"


def make_config(urls: list[str]) -> Config:
    config = two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[0]])
    return dataclasses.replace(config, auth=AuthConfig((ApiKeyConfig("tester", hashlib.sha256(KEY.encode()).hexdigest()),)))


@pytest.fixture(scope="module")
def service() -> Iterator[FrontEnds]:
    with front_ends([Faulty()], make_config) as running:
        yield running


@pytest.fixture
def client(service: FrontEnds) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.http_url, headers={"authorization": f"Bearer {KEY}"}, timeout=10) as http:
        yield http


@pytest.fixture
def sdk(service: FrontEnds) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=service.http_url + "/v1", api_key=KEY, max_retries=0, timeout=10) as sdk:
        yield sdk


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == code
    assert isinstance(error, dict)
    return error


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/nope"), ("GET", "/nope"), ("POST", "/v1/audio/speech"), ("DELETE", "/v1/files/x"), ("POST", "/v1/chat/completions/extra")],
)
def test_an_unknown_path_is_404_in_openais_shape(client: httpx.Client, method: str, path: str) -> None:
    response = client.request(method, path, json={"input": "x"})
    error = assert_openai_error(response, 404)
    assert error["message"] == f"Invalid URL ({method} {path})"
    assert "allow" not in response.headers


def test_an_unknown_path_is_404_without_a_key_too(service: FrontEnds) -> None:
    """A route that does not exist needs no key to say so (a known one does: 401)."""
    assert_openai_error(httpx.post(service.http_url + "/v1/audio/speech", json={}, timeout=10), 404)
    assert httpx.get(service.http_url + f"/v1/models/{MODEL}", timeout=10).status_code == 401


def test_the_sdk_raises_not_found_for_a_route_tailguard_does_not_serve(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.audio.speech.create(model=MODEL, voice="alloy", input="hello")
    assert raised.value.status_code == 404


def test_embeddings_without_a_class_that_takes_them_are_not_found_and_say_how(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.embeddings.create(model=MODEL, input="hello")
    assert "kinds" in str(raised.value)


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("POST", "/health", "GET, HEAD"),
        ("POST", "/metrics", "GET, HEAD"),
        ("DELETE", "/v1/models", "GET"),
        ("POST", f"/v1/models/{MODEL}", "GET"),
        ("POST", "/v1/limits", "GET"),
    ],
)
def test_a_known_path_with_the_wrong_method_is_405_with_allow(client: httpx.Client, method: str, path: str, allow: str) -> None:
    response = client.request(method, path)
    error = assert_openai_error(response, 405)
    assert response.headers["allow"] == allow
    assert f"use {allow.replace(', ', ' or ')}" in str(error["message"])


def test_a_model_is_retrieved_as_openais_model_object(client: httpx.Client, sdk: openai.OpenAI) -> None:
    listed = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [MODEL]
    one = client.get(f"/v1/models/{MODEL}")
    assert one.status_code == 200 and one.json() == listed[0]
    assert set(one.json()) == {"id", "object", "created", "owned_by", "max_model_len"} and one.json()["object"] == "model"
    assert one.json()["max_model_len"] > 0  # vLLM's field, which clients size prompts by (issue 33, D6)
    model = sdk.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "tailguard") and model.created > 1_600_000_000


@pytest.mark.parametrize("model", ["no-such-model", "org/no-such-model"])
def test_an_unknown_model_is_404_model_not_found(client: httpx.Client, sdk: openai.OpenAI, model: str) -> None:
    error = assert_openai_error(client.get(f"/v1/models/{model}"), 404, "model_not_found")
    assert error["param"] == "model" and model in str(error["message"])
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.models.retrieve(model)
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/chat/completions"), ("GET", "/v1/models")])
@pytest.mark.parametrize("second", [f"Bearer {KEY}", "Bearer sk-someone-else"], ids=["same_key", "another_key"])
def test_two_authorization_headers_are_refused_as_ambiguous(service: FrontEnds, method: str, path: str, second: str) -> None:
    """Before: the last of two Authorization headers named the caller (issue 20, defect 6)."""
    headers = [("authorization", "Bearer sk-someone-else"), ("authorization", second), ("x-request-id", f"two-keys-{path}-{second[-4:]}")]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with httpx.Client(base_url=service.http_url, timeout=10) as http:
        response = http.request(method, path, headers=headers, json=body if method == "POST" else None)
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert "ambiguous" in error["message"] and KEY not in error["message"]
    if method == "POST":
        record = service.record(f"two-keys-{path}-{second[-4:]}")
        assert (record.outcome, record.reason, record.status) == ("rejected", "unauthenticated", 401)


@pytest.mark.parametrize("path", ["/metrics", "/health"])
def test_head_answers_the_head_a_get_would_without_its_body(client: httpx.Client, path: str) -> None:
    """Monitoring probes and curl -I ask with HEAD: before, /metrics answered 405."""
    got = client.get(path)
    head = client.head(path)
    assert head.status_code == got.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    assert int(head.headers["content-length"]) > 0
