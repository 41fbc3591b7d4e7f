"""Input the router cannot forward is a 400 at the router, never sent on (issue 10).

Defect 1: a lone UTF-16 surrogate (``"\\ud866"``) made vLLM drop the
connection, which took the endpoint out. Defect 6: a 5,000-digit integer
(ValueError) or JSON nested ~1,000 deep (RecursionError) became a 500.
Defect 10: a bare line feed inside ``x-request-id`` split into a second
header; nothing but the router's own headers may reach the backend.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

from tailguard.router.admission import MAX_JSON_DEPTH, RouterRequest
from tailguard.router.config import Config, ServerConfig
from tailguard.router.errors import InvalidRequest
from tailguard.server.http.openai_wire import parse_completion_body
from tailguard.sim import Engine, SimApp, SimResponse
from tests.helpers.engines import MODEL
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, engines_on_sockets, tailguard

USER = {"role": "user", "content": "hello"}
LONE = "\\ud866"  # as it appears in a JSON body: an escape, not a character


def chat_body(**fields: object) -> bytes:
    """A chat body; ``@LONE@`` in any string becomes a lone-surrogate escape."""
    payload = {"model": MODEL, "messages": [USER], "max_tokens": 8, **fields}
    return json.dumps(payload).replace("@LONE@", LONE).encode()


def parse(body: bytes, kind: str = "chat") -> RouterRequest:
    return parse_completion_body(kind, body, request_id="r-1")  # type: ignore[arg-type]


# -- lone surrogates and other text that is not valid Unicode -----------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(messages=[{"role": "user", "content": "hi @LONE@ there"}]), "messages[0].content"),
        (chat_body(messages=[USER, {"role": "user", "content": [{"type": "text", "text": "@LONE@"}]}]), "messages[1].content[0].text"),
        (chat_body(messages=[{"role": "user", "content": "hi", "name": "@LONE@"}]), "messages[0].name"),
        (chat_body(messages=[{"role": "@LONE@", "content": "hi"}]), "messages[0].role"),
        (chat_body(tools=[{"type": "function", "function": {"name": "f", "description": "x@LONE@"}}]), "tools[0].function.description"),
        (chat_body(response_format={"type": "json_schema", "json_schema": {"schema": {"enum": ["a", "@LONE@"]}}}), "response_format.json_schema.schema.enum[1]"),
        (chat_body(stop=["@LONE@"]), "stop[0]"),
        (chat_body(model="m@LONE@"), "model"),
        (chat_body(logit_bias={"@LONE@": 1}), 'logit_bias["\\ud866"]'),
        (json.dumps({"prompt": "once @LONE@"}).replace("@LONE@", LONE).encode(), "prompt"),
        (json.dumps({"prompt": ["fine", "@LONE@"]}).replace("@LONE@", LONE).encode(), "prompt[1]"),
    ],
)
def test_a_lone_surrogate_anywhere_is_refused_naming_the_field(body: bytes, param: str) -> None:
    kind = "completion" if b'"prompt"' in body else "chat"
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as caught:
        parse(body, kind)
    assert caught.value.param == param
    # The message itself is safe to send: escaping it to UTF-8 never fails.
    str(caught.value).encode("utf-8")


def test_raw_surrogate_bytes_are_refused_and_a_surrogate_pair_is_an_emoji() -> None:
    # json.loads decodes bytes with "surrogatepass": CESU-style bytes give a lone surrogate too.
    with pytest.raises(InvalidRequest, match="surrogate"):
        parse(b'{"messages": [{"role": "user", "content": "\xed\xa1\xa6"}]}')
    paired = parse(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert paired.messages is not None and paired.messages[0]["content"] == "\N{GRINNING FACE}"


@pytest.mark.parametrize(
    ("literal", "param"),
    [("NaN", "temperature"), ("Infinity", "temperature"), ("-Infinity", "temperature"), ("1e999", "temperature")],
)
def test_non_finite_numbers_are_refused(literal: str, param: str) -> None:
    body = json.dumps({"messages": [USER], "temperature": "@N@"}).replace('"@N@"', literal).encode()
    with pytest.raises(InvalidRequest, match="not a finite number") as caught:
        parse(body)
    assert caught.value.param == param


# -- huge integers and deep nesting: 400, never ValueError / RecursionError ----


@pytest.mark.parametrize(
    "template",
    [
        '{"messages": [USER], "seed": DIGITS}',
        '{"messages": [USER], "x": {"y": [1, DIGITS]}}',
        '{"messages": [USER], "max_tokens": DIGITS}',
        '{"messages": [{"role": "user", "content": "hi", "n": -DIGITS}]}',
    ],
)
def test_a_5000_digit_integer_anywhere_is_a_clean_400(template: str) -> None:
    body = template.replace("USER", json.dumps(USER)).replace("DIGITS", "9" * 5000).encode()
    with pytest.raises(InvalidRequest, match="more than 4300 digits"):
        parse(body)


def test_integers_over_64_bits_are_refused_and_64_bit_ones_pass() -> None:
    with pytest.raises(InvalidRequest, match="over 64 bits") as caught:
        parse(chat_body(seed=10**30))
    assert caught.value.param == "seed"
    assert parse(chat_body(seed=2**64 - 1, logit_bias={"42": -100})).params["seed"] == 2**64 - 1


def nested(depth: int) -> str:
    """JSON text of ``depth`` lists, one inside the other."""
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 500, 995, 5_000, 100_000])
def test_deep_nesting_is_a_clean_400(depth: int) -> None:
    body = (f'{{"messages": [{json.dumps(USER)}], "extra": {nested(depth)}}}').encode()
    with pytest.raises(InvalidRequest, match=f"nested too deeply \\(at most {MAX_JSON_DEPTH} levels") as caught:
        parse(body)
    assert caught.value.param in (None, "extra[0][0][0][0][0][0][0][0][0]...")


def test_nesting_a_real_schema_needs_passes() -> None:
    # The body is level 1 and "extra" level 2: 99 more levels fit exactly.
    parse((f'{{"messages": [{json.dumps(USER)}], "extra": {nested(MAX_JSON_DEPTH - 1)}}}').encode())
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(20):  # an object schema twenty levels deep is ~40 JSON levels
        schema = {"type": "object", "properties": {"child": schema}}
    parse(chat_body(response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}))


def test_a_wrong_max_tokens_is_described_not_dumped() -> None:
    with pytest.raises(InvalidRequest, match="must be an integer, got a list") as caught:
        parse((f'{{"messages": [{json.dumps(USER)}], "max_tokens": {nested(900)}}}').encode())
    assert caught.value.param == "max_tokens"


# -- RouterRequest guards what any front end builds ----------------------------


@pytest.mark.parametrize("request_id", ["a\nx-injected: 1", "a\rb", "a\x00b", "a\x7fb", "a b", "", "é", "x" * 129])
def test_a_request_id_that_is_no_safe_header_value_is_refused(request_id: str) -> None:
    with pytest.raises(InvalidRequest, match="request id") as caught:
        RouterRequest(kind="chat", request_id=request_id, messages=[USER])
    assert caught.value.param == "x-request-id"


@pytest.mark.parametrize(("value", "name"), [({1, 2}, "set"), (b"raw", "bytes"), (object(), "object")])
def test_values_json_cannot_carry_are_refused(value: object, name: str) -> None:
    with pytest.raises(InvalidRequest, match=f"not a JSON value \\({name}\\)") as caught:
        RouterRequest(kind="chat", request_id="r", messages=[USER], params={"extra": [value]})
    assert caught.value.param == "extra[0]"
    with pytest.raises(InvalidRequest, match="key that is not a string"):
        RouterRequest(kind="chat", request_id="r", messages=[USER], params={"extra": {1: "a"}})


# -- fuzz: whatever the body, InvalidRequest or something the backend can read --

_SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)
_TEXT = st.text(st.one_of(st.characters(), _SURROGATE), max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=12,
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | _TEXT},
    optional={"content": _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2), "name": _TEXT},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(_MESSAGE, min_size=1, max_size=3), params=st.dictionaries(_TEXT, _JSON, max_size=3))
def test_any_body_is_refused_cleanly_or_forwardable_as_utf8_json(messages: list[dict[str, Any]], params: dict[str, Any]) -> None:
    # ensure_ascii (json's default) writes a lone surrogate as its escape, as an attacker would.
    body = json.dumps({**params, "messages": messages, "max_tokens": 8}).encode()
    try:
        request = parse(body)
    except InvalidRequest:
        return
    forwarded = {**request.params, "model": request.model, "messages": list(request.messages or ()), "max_tokens": 8}
    json.dumps(forwarded, ensure_ascii=False, allow_nan=False).encode("utf-8")  # never raises


# -- through the real HTTP server ---------------------------------------------


@dataclass
class RecordingBackend:
    """A simulated engine that remembers every completion request it received."""

    app: SimApp
    received: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        if path.startswith("/v1/") and method == "POST":
            self.received.append((path, dict(headers), body))
        return await self.app.handle(method, path, headers, body)


@asynccontextmanager
async def router_with_recorder() -> AsyncIterator[tuple[str, RecordingBackend]]:
    """tailguard on a free port whose interactive pool's one engine records its requests."""
    engine = Engine(QUICK)
    recorder = RecordingBackend(SimApp(engine, model=MODEL))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with engines_on_sockets([recorder.handle, QUICK]) as backends:
            config: Config = two_pool_config(interactive_urls=[backends.urls[0]], batch_urls=[backends.urls[1]])
            config = dataclasses.replace(config, server=ServerConfig(max_body_bytes=64 * 1024))
            async with tailguard(config) as running:
                yield running.http_url, recorder
        nursery.cancel_scope.cancel()


def assert_openai_400(response: httpx.Response, needle: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert needle in error["message"]
    return error


async def test_http_bad_bodies_are_400_and_never_reach_the_backend() -> None:
    async with router_with_recorder() as (url, recorder), httpx.AsyncClient(base_url=url) as client:
        headers = {"content-type": "application/json"}
        lone = await client.post("/v1/chat/completions", content=chat_body(messages=[{"role": "user", "content": "@LONE@"}]), headers=headers)
        assert assert_openai_400(lone, "lone UTF-16 surrogate")["param"] == "messages[0].content"
        digits = ('{{"messages": [{}], "seed": {}}}'.format(json.dumps(USER), "7" * 5000)).encode()
        assert_openai_400(await client.post("/v1/chat/completions", content=digits, headers=headers), "4300 digits")
        deep = (f'{{"messages": [{json.dumps(USER)}], "x": {nested(5000)}}}').encode()
        assert_openai_400(await client.post("/v1/chat/completions", content=deep, headers=headers), "nested too deeply")
        assert recorder.received == []
        # The pool was never touched: a good request right after is served.
        ok = await client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 4})
        assert ok.status_code == 200 and len(recorder.received) == 1


async def raw_request(url: str, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send hand-made request bytes (what no client library would write); h11 reads the answer."""
    parts = urlsplit(url)
    reader = h11.Connection(h11.CLIENT)
    reader.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    reader.send(h11.EndOfMessage())
    stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 80)
    async with stream:
        await stream.send_all(head + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        status, headers, content = 0, {}, b""
        with trio.fail_after(10):
            while True:
                event = reader.next_event()
                if event is h11.NEED_DATA:
                    reader.receive_data(await stream.receive_some())
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    headers = {k.decode(): v.decode("latin-1") for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    content += event.data
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return status, headers, content


_EXPECTED_BACKEND_HEADERS = {
    "host", "accept", "accept-encoding", "connection", "user-agent", "content-length", "content-type", "x-request-id", "x-tailguard-request-id",
}


async def test_http_header_tricks_inject_nothing_towards_the_backend() -> None:
    """Header lines llhttp (strict) refuses never reach the app: a bare LF, an
    obs-fold, a bare CR, NUL, DEL and other control bytes are a 400 from the
    server itself. What it lets through inside a value (a tab, a non-ASCII
    byte) is refused by the app's own check of the request id, naming it."""
    body = json.dumps({"messages": [USER], "max_tokens": 4}).encode()
    start = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    async with router_with_recorder() as (url, recorder):
        # A clean request: only the request id among the caller's headers is forwarded.
        status, headers, _ = await raw_request(url, start + b"x-request-id: abc\r\nauthorization: Bearer k\r\nx-custom: 1\r\n", body)
        assert status == 200 and headers["x-request-id"] == "abc"
        [(_, seen, _)] = recorder.received
        # vLLM's own id is the router's, one per attempt; the caller's rides beside it.
        assert seen["x-tailguard-request-id"] == "abc" and seen["x-request-id"] != "abc" and set(seen) <= _EXPECTED_BACKEND_HEADERS
        for value in (b"abc\tdef", b"abc\xe9"):
            status, headers, content = await raw_request(url, start + b"x-request-id: " + value + b"\r\n", body)
            assert status == 400, value
            error = json.loads(content)["error"]
            assert error["param"] == "x-request-id" and error["type"] == "invalid_request_error"
            assert headers["x-request-id"] != value.decode("latin-1")  # a fresh id, not the caller's
        for value in (b"abc\nx-injected: yes", b"abc\x01def", b"abc\x7fdef", b"abc\r\n x-injected: yes", b"abc\x00def", b"abc\rx-injected: yes"):
            status, headers, content = await raw_request(url, start + b"x-request-id: " + value + b"\r\n", body)
            assert status == 400, value  # the parser refuses the line itself
            assert "x-request-id" not in headers and json.loads(content)["error"]["param"] is None
        assert len(recorder.received) == 1  # only the clean request reached the backend


async def test_a_request_the_http_parser_refuses_has_its_access_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 20: requests refused by the HTTP server itself (400 before the app) left no trace in the access log."""
    start = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nbad header without a colon\r\n"
    async with router_with_recorder() as (url, recorder):
        with caplog.at_level(logging.INFO, logger="tailguard.access"):
            status, _, content = await raw_request(url, start, b"{}")
            assert status == 400 and b"malformed HTTP request" in content
            await trio.testing.wait_all_tasks_blocked()
    [line] = [r for r in caplog.records if r.name == "tailguard.access"]
    fields = line.fields  # type: ignore[attr-defined]
    assert (fields["status"], fields["outcome"], fields["reason"]) == (400, "rejected", "invalid_request")
    assert "malformed HTTP request" in fields["error"] and not recorder.received


# -- the work a body may cause: messages, content parts, JSON values (issue 32) ---


@pytest.mark.parametrize(
    ("payload", "needle", "param"),
    [
        ({"messages": [{"role": "user", "content": "a"}] * 100_000}, "more than the 4096", "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 100_000}]}, "4096 content parts", "messages"),
        ({"messages": [USER], "tools": [{"a": {"b": [1, 2]}}] * 15_000}, "16384 JSON values", None),
        ({"messages": [USER], "allowed_token_ids": list(range(20_000))}, "16384 JSON values", None),
    ],
    ids=["100k messages", "100k empty parts", "60k values of tools", "20k values of a list"],
)
def test_bodies_that_cost_more_than_any_real_request_are_refused(payload: dict[str, object], needle: str, param: str | None) -> None:
    with pytest.raises(InvalidRequest, match=needle) as refused:
        parse(json.dumps({"max_tokens": 8, **payload}).encode())
    assert refused.value.param == param


def test_the_bounds_leave_real_requests_alone() -> None:
    """A long agent session, a large tool schema and a long prompt of token ids are served."""
    session = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i}"} for i in range(2000)]
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}} for i in range(200)]
    assert len(parse(chat_body(messages=session, tools=tools)).messages or ()) == 2000
    ids = parse(json.dumps({"prompt": list(range(100_000)), "max_tokens": 8}).encode(), "completion")
    assert ids.prompt_token_ids() == 100_000
    with pytest.raises(InvalidRequest, match="over 64 bits") as huge:
        parse(json.dumps({"prompt": [1, 2, 1 << 70], "max_tokens": 8}).encode(), "completion")
    assert huge.value.param == "prompt"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "", "content": "hi"}]}, "messages"),
        ({"prompt_cache_key": 12345}, "prompt_cache_key"),
        ({"user": {"id": "u-1"}}, "user"),
    ],
    ids=["empty role", "numeric prompt_cache_key", "object user"],
)
def test_fields_the_router_reads_must_have_their_types(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse(chat_body(**fields))
    assert refused.value.param == param


async def test_http_a_repeated_class_header_is_refused_not_guessed() -> None:
    async with router_with_recorder() as (url, recorder):
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        head += b"x-tailguard-class: interactive\r\nx-tailguard-class: batch\r\n"
        status, _, content = await raw_request(url, head, json.dumps({"messages": [USER], "max_tokens": 4}).encode())
        assert status == 400 and json.loads(content)["error"]["param"] == "x-tailguard-class"
        assert recorder.received == []
