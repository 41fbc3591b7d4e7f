"""A request of ``n`` choices is n sequences on the engine: n seats, n x max_tokens, for both front ends."""

from __future__ import annotations

import dataclasses
import json

import grpc
import openai
import pytest
import trio
import trio.testing
from google.protobuf.struct_pb2 import Struct
from openai.types.chat import ChatCompletionMessageParam

from tailguard.router import errors
from tailguard.router.admission import RouterRequest
from tailguard.router.config import Config, LimitsConfig, TimeoutsConfig
from tailguard.router.quotas import Caller
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tailguard.sim import PROFILES
from tests.helpers.engines import MODEL, in_process_engine
from tests.helpers.grpc_service import grpc_service
from tests.helpers.router import INTERACTIVE_URL, chat, router_over_engines, run_to_end, two_pool_config
from tests.helpers.sockets import QUICK


def with_n(n: int, *, max_tokens: int = 64, stream: bool = False, request_id: str = "r", **params: object) -> RouterRequest:
    return chat(max_tokens=max_tokens, stream=stream, request_id=request_id, params={"n": n, "ignore_eos": True, **params})


async def test_the_simulator_runs_n_sequences_and_answers_n_choices(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(PROFILES["latency"]) as (engine, client):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 3, "ignore_eos": True}
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
        assert len({c["message"]["content"] for c in whole["choices"]}) > 1  # each its own output
        assert whole["usage"]["completion_tokens"] == 15 and whole["usage"]["prompt_tokens"] < 15  # the prompt counted once
        assert engine.statistics().max_running_seen == 3
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        ends = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
        assert ends == {0: "length", 1: "length", 2: "length"}
        assert events[-1]["usage"]["completion_tokens"] == 15
        assert streamed.text.endswith("data: [DONE]\n\n")


async def test_n_sequences_take_n_seats_and_the_engine_never_runs_past_its_cap(autojump_clock: trio.testing.MockClock) -> None:
    """Three requests of n = 4 on an 8-seat endpoint: two run (8 seats), the third waits; the engine runs 8 at most."""
    config = two_pool_config(interactive_cap=8)
    config = dataclasses.replace(config, classes=(dataclasses.replace(config.classes[0], max_output_tokens=None), config.classes[1]))
    async with router_over_engines(config) as fleet:
        router = fleet.router
        results: list[object] = []

        async def one(index: int) -> None:
            results.append(await run_to_end(router, with_n(4, max_tokens=200, request_id=f"r{index}")))

        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(one, index)
            await trio.sleep(0.5)  # virtual: both seated requests are decoding
            interactive = next(p for p in router.statistics().pools if p.name == "interactive")
            assert (interactive.in_flight, interactive.queue.waiting) == (8, 1)
        assert len(results) == 3
        assert fleet.engine(INTERACTIVE_URL).statistics().max_running_seen == 8
        assert router.statistics().in_flight == 0


async def test_n_counts_in_the_class_and_over_the_limits_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config(interactive_cap=4, batch_cap=16)) as fleet:
        router = fleet.router
        _, one = await run_to_end(router, with_n(1, max_tokens=100))
        assert one.request_class == "interactive"
        _, four = await run_to_end(router, with_n(4, max_tokens=100))  # 400 tokens of output: not an interactive request
        assert four.request_class == "batch"
        with pytest.raises(errors.InvalidRequest, match="limits.max_n") as over:
            await run_to_end(router, with_n(9))
        assert over.value.param == "n"
        with pytest.raises(errors.InvalidRequest, match="integer") as wrong:
            await run_to_end(router, with_n("2"))  # type: ignore[arg-type]
        assert wrong.value.param == "n"
        with pytest.raises(errors.InvalidRequest) as best_of:
            await run_to_end(router, with_n(1, best_of=9))
        assert best_of.value.param == "best_of" or "9" in str(best_of.value)
    small = two_pool_config(interactive_cap=4, batch_cap=4, limits=LimitsConfig(max_n=8))
    async with router_over_engines(small) as fleet:
        with pytest.raises(errors.InvalidRequest, match="runs for one request \\(4\\)"):  # never seatable: refused, not queued
            await run_to_end(fleet.router, with_n(6))
        assert fleet.router.statistics().in_flight == 0


async def test_a_budget_reserves_every_choice(autojump_clock: trio.testing.MockClock) -> None:
    """prompt + n x max_tokens is reserved: with 700 tokens a minute, n = 4 x 200 can never fit (400), n = 1 x 200 is served."""
    budgeted = Caller("tenant", frozenset(), None, tokens_per_minute=700)
    async with router_over_engines(two_pool_config()) as fleet:
        router = fleet.router
        with pytest.raises(errors.InvalidRequest, match="each of its n choices"):
            async with router.open(with_n(4, max_tokens=200), caller=budgeted):
                pass
        request = with_n(1, max_tokens=200, request_id="r2")
        with trio.CancelScope(deadline=router.deadline_for(request)):
            async with router.open(request, caller=budgeted) as completion:
                await completion.read()
        left = router.statistics().budgets_left["tenant"].remaining_tokens
        assert left is not None and left < 700 - 200  # the one served request's prompt and output, settled


def test_both_front_ends_count_n_alike() -> None:
    """HTTP (the openai SDK): n within the limit is served, n choices, over it refused naming ``n``; gRPC answers one choice a call."""

    def make(urls: list[str]) -> Config:
        return two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]], timeouts=TimeoutsConfig(health_check_interval=0.1))

    with grpc_service([QUICK, QUICK], make) as service:
        client = openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2)
        assert [c.index for c in reply.choices] == [0, 1] and reply.usage is not None and reply.usage.completion_tokens == 8
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=32)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "n"
        client.close()
        with grpc.insecure_channel(service.grpc_target) as channel:
            stub = pb_grpc.CompletionsStub(channel)
            # A gRPC answer carries one choice: n > 1 is refused, whether in the field or in extra.
            for options in (pb.Options(max_tokens=4, n=2), pb.Options(max_tokens=4, extra=struct(n=2))):
                with pytest.raises(grpc.RpcError) as grpc_refused:
                    stub.Chat(pb.ChatRequest(messages=[pb.Message(role="user", content="hi")], options=options))
                assert grpc_refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "one choice a call" in (grpc_refused.value.details() or "")
            reply = stub.Chat(pb.ChatRequest(messages=[pb.Message(role="user", content="hi")], options=pb.Options(max_tokens=4, n=1)))
            assert reply.usage.completion_tokens == 4


def struct(**fields: object) -> Struct:
    value = Struct()
    value.update(fields)
    return value
