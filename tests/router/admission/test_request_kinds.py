"""The request kinds beyond chat: the Responses and Messages APIs, embeddings and rerank, as the core reads them."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.admission import RouterRequest, decide, size_prompt
from tailguard.router.config import Config, EstimateConfig, parse_config
from tailguard.router.errors import InvalidRequest, ModelNotFound, Overloaded, PromptTooLong
from tailguard.router.observe import RequestRecord
from tailguard.router.quotas import ANONYMOUS
from tailguard.router.request_path import backend_body
from tailguard.server.http.openai_wire import parse_completion_body
from tailguard.sim.canned import canned_transport
from tests.helpers.config_text import BASE, edit, problems_of
from tests.helpers.router import INTERACTIVE_URL, router_over_engines, two_pool_config

ESTIMATE = EstimateConfig()
# BASE, with a third pool serving an embedding model and a class that takes the pooling kinds.
WITH_EMBEDDINGS = BASE + """
[pools.embed]
max_concurrency = 32
max_model_len = 32768
models = ["e"]
endpoints = [{ url = "http://127.0.0.1:8009", max_concurrency = 32 }]

[classes.embeddings]
kinds = ["embeddings", "rerank"]
pool = "embed"
queue_timeout = 2.0
priority = 0
"""


def parsed(kind: str, payload: dict[str, object]) -> RouterRequest:
    return parse_completion_body(kind, json.dumps(payload).encode(), request_id="r")  # type: ignore[arg-type]


def test_a_messages_request_needs_max_tokens_and_keeps_system_for_the_engine() -> None:
    with pytest.raises(InvalidRequest) as missing:
        parsed("messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert missing.value.param == "max_tokens"
    request = parsed("messages", {"model": "m", "system": "Be brief.", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]})
    assert request.max_tokens == 50 and request.params["system"] == "Be brief."
    body, drop_usage = backend_body(request, "m", 40, stream=True)
    assert body["max_tokens"] == 40 and body["system"] == "Be brief." and body["stream"] is True
    assert "stream_options" not in body and not drop_usage  # Anthropic's stream carries its usage already


def test_a_responses_request_is_bounded_by_max_output_tokens_and_its_input_forwarded_as_sent() -> None:
    with pytest.raises(InvalidRequest) as missing:
        parsed("responses", {"model": "m"})
    assert missing.value.param == "input"
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}]
    request = parsed("responses", {"model": "m", "input": items, "instructions": "Be brief.", "max_output_tokens": 64, "stream": True})
    assert request.max_tokens == 64 and request.stream
    body, _ = backend_body(request, "m", 32, stream=True)
    assert body["max_output_tokens"] == 32 and "max_tokens" not in body and "stream_options" not in body
    assert body["input"] == items and body["instructions"] == "Be brief."


def test_the_system_prompt_and_instructions_count_in_the_prompts_size() -> None:
    long_system = "You are a careful assistant. " * 200
    bare = parsed("messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    with_system = parsed("messages", {"model": "m", "max_tokens": 5, "system": long_system, "messages": [{"role": "user", "content": "hi"}]})
    assert size_prompt(with_system, ESTIMATE).tokens > size_prompt(bare, ESTIMATE).tokens + 1000
    as_text = parsed("responses", {"model": "m", "input": long_system})
    as_items = parsed("responses", {"model": "m", "input": "hi", "instructions": long_system})
    assert size_prompt(as_text, ESTIMATE).tokens > 1000 and size_prompt(as_items, ESTIMATE).tokens > 1000


def test_pooling_requests_have_no_output_bound_or_stream_on_the_wire() -> None:
    embeddings = parsed("embeddings", {"model": "e", "input": ["a", "b"], "encoding_format": "float"})
    body, _ = backend_body(embeddings, "e", 1, stream=False)
    assert body == {"model": "e", "input": ["a", "b"], "encoding_format": "float"}
    rerank = parsed("rerank", {"model": "e", "query": "q", "documents": ["x", {"text": "y"}], "top_n": 1})
    assert rerank.pooled_inputs() == [["q", "x"], ["q", "y"]]
    with pytest.raises(InvalidRequest) as empty:
        parsed("rerank", {"model": "e", "query": "q", "documents": []})
    assert empty.value.param == "documents"
    with pytest.raises(InvalidRequest) as too_many:
        parsed("embeddings", {"model": "e", "input": ["x"] * 2049})
    assert too_many.value.param == "input"


def decided(config: Config, request: RouterRequest) -> tuple[str, int]:
    """The class and max_tokens admission decides (no engine is asked)."""
    router = Router(config)
    record = RequestRecord(request.request_id, "http", 0.0)
    admitted = decide(request, ANONYMOUS, config, router.pools, record, 0.0)
    return admitted.klass.name, admitted.ticket.max_tokens


async def test_embeddings_and_rerank_take_their_own_class_and_generations_never_do() -> None:
    config = parse_config(WITH_EMBEDDINGS)
    assert decided(config, parsed("embeddings", {"model": "e", "input": "x " * 3000})) == ("embeddings", 1)
    assert decided(config, parsed("rerank", {"model": "e", "query": "q", "documents": ["d"]}))[0] == "embeddings"
    # A short chat stays interactive; a long one batch: the embeddings class is no catch-all for them.
    assert decided(config, parsed("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}))[0] == "interactive"
    assert decided(config, parsed("responses", {"model": "m", "input": "hi", "max_output_tokens": 4000}))[0] == "batch"
    await trio.lowlevel.checkpoint()


async def test_without_a_class_for_embeddings_they_are_not_found_and_each_input_is_capped() -> None:
    with pytest.raises(ModelNotFound) as none:
        decided(parse_config(BASE), parsed("embeddings", {"model": "m", "input": "x"}))
    assert "kinds" in none.value.message
    config = parse_config(WITH_EMBEDDINGS)
    # Many inputs under the cap pass (the body bounds the batch); one over the cap is refused.
    assert decided(config, parsed("embeddings", {"model": "e", "input": ["word " * 100] * 500}))[0] == "embeddings"
    with pytest.raises(PromptTooLong):
        decided(config, parsed("embeddings", {"model": "e", "input": ["short", "word " * 40_000]}))
    await trio.lowlevel.checkpoint()


def test_kinds_is_checked_and_each_kind_needs_a_catch_all() -> None:
    (problem,) = problems_of(WITH_EMBEDDINGS.replace('kinds = ["embeddings", "rerank"]', 'kinds = ["embedings"]'))
    assert problem.startswith("classes.embeddings.kinds: ") and "not a request kind" in problem
    (problem,) = problems_of(WITH_EMBEDDINGS.replace('pool = "embed"\n', 'pool = "embed"\nmax_prompt_tokens = 100\n'))
    assert problem.startswith("classes.embeddings: ") and "embeddings or rerank request" in problem
    # A class for embeddings alone after the generation catch-all is reachable: it is the only one that takes them.
    assert [k.name for k in parse_config(WITH_EMBEDDINGS).classes] == ["interactive", "batch", "embeddings"]
    (problem,) = problems_of(edit('[classes.batch]\npool = "batch"', '[classes.batch]\nkinds = ["chat"]\npool = "batch"'))
    assert "catch-all" in problem


async def test_a_responses_streams_prefill_ends_at_its_first_output_event_not_its_first_byte(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM sends response.created before the prefill: the seat's prefill backlog and first-byte model wait for output."""
    request = RouterRequest(kind="responses", request_id="r1", max_tokens=8, stream=True, params={"input": "hello " * 200})
    async with router_over_engines(two_pool_config()) as fleet:
        endpoint = fleet.router.endpoint(INTERACTIVE_URL)
        backlogs: list[tuple[bytes, int]] = []
        with trio.CancelScope(deadline=fleet.router.deadline_for(request)):
            async with fleet.router.open(request) as completion:
                async for chunk in completion.chunks():
                    backlogs.append((chunk, endpoint.prefill_backlog))
                record = completion.record
    opening, during = backlogs[0]
    assert b"response.created" in opening and b"response.output_text.delta" not in opening
    assert during > 0  # the prompt still in prefill while the caller holds response.created
    assert backlogs[-1][1] == 0 and record.first_byte_seconds is not None and record.first_byte_seconds > 0


async def test_a_turn_waiting_for_its_pinned_engine_lets_the_requests_behind_it_take_a_sibling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A continued Responses turn waits for the one engine that keeps its response; a chat queued behind it
    takes the other engine's freed seat at once instead of waiting behind it (before: the pool's queue stalled)."""
    urls = ["http://interactive-a:8000", "http://interactive-b:8000"]
    config = two_pool_config(interactive_cap=1, interactive_urls=urls, interactive_timeout=60.0)
    async with router_over_engines(config) as fleet:
        router = fleet.router
        first_turn = RouterRequest(kind="responses", request_id="t1", max_tokens=4, params={"input": "hi"})
        async with router.open(first_turn) as completion:
            await completion.read()
            home, response_id = completion.routing.endpoint, completion.payload["id"]
        seated: dict[str, str] = {}
        events = {name: trio.Event() for name in ("x", "y", "t2", "c")}

        async def hold(request: RouterRequest) -> None:
            async with router.open(request) as held:
                seated[request.request_id] = held.routing.endpoint
                events[request.request_id].set()
                await trio.sleep_forever()

        def chat_request(request_id: str, max_tokens: int) -> RouterRequest:
            return RouterRequest(kind="chat", request_id=request_id, messages=[{"role": "user", "content": "go"}], max_tokens=max_tokens, stream=True)

        scopes = {name: trio.CancelScope() for name in ("x", "y")}

        async def held_until_cancelled(name: str) -> None:
            with scopes[name]:
                await hold(chat_request(name, 120))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for name in scopes:
                    nursery.start_soon(held_until_cancelled, name)
                    await events[name].wait()
                assert set(seated.values()) == set(urls)  # both engines busy
                turn = RouterRequest(kind="responses", request_id="t2", max_tokens=4, stream=True, params={"input": "again", "previous_response_id": response_id})
                nursery.start_soon(hold, turn)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(hold, chat_request("c", 4))
                await trio.testing.wait_all_tasks_blocked()
                other = next(name for name in scopes if seated[name] != home)
                scopes[other].cancel()  # the sibling of the pinned engine frees its seat
                await events["c"].wait()
                assert seated["c"] == seated[other] and not events["t2"].is_set()
                nursery.cancel_scope.cancel()


async def test_a_pinned_turn_whose_engine_is_busy_waits_out_the_busy_spell(autojump_clock: trio.testing.MockClock) -> None:
    """The engine keeping the response answers 503 (its own queue full): the turn waits for the busy spell to end
    between tries, then its queue deadline refuses it 503 (before: re-seated on the same engine in a tight loop)."""
    attempts = {"busy": False, "count": 0}

    def wrap(url: str, transport: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            if attempts["busy"] and request.url.path == "/v1/responses":
                attempts["count"] += 1
                if attempts["count"] > 50:
                    raise RuntimeError("the busy engine was asked in a tight loop")
                body = {"error": {"message": "queue full", "type": "ServiceUnavailable", "code": 503}}
                return httpx.Response(503, json=body, headers={"retry-after": "2"})
            return await transport.handle_async_request(request)

        return canned_transport(handle)

    urls = ["http://interactive-a:8000", "http://interactive-b:8000"]
    async with router_over_engines(two_pool_config(interactive_urls=urls, interactive_timeout=3.0), wrap=wrap) as fleet:
        first = RouterRequest(kind="responses", request_id="t1", max_tokens=4, params={"input": "hi"})
        async with fleet.router.open(first) as completion:
            await completion.read()
            response_id = completion.payload["id"]
        attempts["busy"] = True
        turn = RouterRequest(kind="responses", request_id="t2", max_tokens=4, params={"input": "again", "previous_response_id": response_id})
        with pytest.raises(Overloaded):
            async with fleet.router.open(turn) as completion:
                await completion.read()
    assert 1 <= attempts["count"] <= 3  # one try a busy spell (2 s) within its 3 s queue deadline


def test_an_agents_tool_results_and_calls_count_in_the_prompts_size() -> None:
    """Claude-Code-style turns carry files in tool_result blocks and edits in tool_use input: they are the prompt."""
    file_text = "def handler(event):\\n    return event\\n" * 2000
    as_text = parsed("messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": file_text}]})
    as_tool_result = parsed("messages", {"model": "m", "max_tokens": 8, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.py", "note": file_text}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": file_text}]}]},
    ]})
    text_tokens = size_prompt(as_text, ESTIMATE).tokens
    assert size_prompt(as_tool_result, ESTIMATE).tokens > 1.8 * text_tokens  # the result and the call's input, each about the file


def test_a_rerank_counts_each_document_once() -> None:
    document = "word " * 2000
    rerank = parsed("rerank", {"model": "e", "query": "q", "documents": [document]})
    embeddings = parsed("embeddings", {"model": "e", "input": ["q", document]})
    assert size_prompt(rerank, ESTIMATE).tokens == size_prompt(embeddings, ESTIMATE).tokens


async def test_a_turn_classed_long_still_continues_on_the_engine_keeping_its_response(autojump_clock: trio.testing.MockClock) -> None:
    """Turn 1 is short (interactive); turn 2 brings a document (batch by size): it runs where turn 1's response
    is kept, as that pool's own, not on a batch engine that would answer 404 (before: placed in the batch pool)."""
    async with router_over_engines(two_pool_config(), responses_store=True) as fleet:
        first = RouterRequest(kind="responses", request_id="t1", max_tokens=16, params={"input": "hi"})
        async with fleet.router.open(first) as completion:
            await completion.read()
            response_id, home = completion.payload["id"], completion.routing.endpoint
        document = "Here is the contract text to summarise. " * 120
        turn = RouterRequest(kind="responses", request_id="t2", max_tokens=64, params={"input": document, "previous_response_id": response_id})
        async with fleet.router.open(turn) as completion:
            await completion.read()
            assert completion.payload["status"] in ("completed", "incomplete")
            assert (completion.routing.request_class, completion.routing.endpoint, completion.record.placement) == ("batch", home, "pinned")


def test_a_background_response_is_refused_it_would_run_outside_any_seat() -> None:
    with pytest.raises(InvalidRequest) as refused:
        parsed("responses", {"model": "m", "input": "hi", "background": True})
    assert refused.value.param == "background"
    assert parsed("responses", {"model": "m", "input": "hi", "background": False}).params["background"] is False
