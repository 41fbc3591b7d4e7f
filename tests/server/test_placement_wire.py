"""Placement hints over the wire: the openai SDK's prompt_cache_key, user and session header; gRPC's session metadata."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import openai
import pytest

from tailguard.router.config import Config, TimeoutsConfig
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tests.helpers.engines import MODEL
from tests.helpers.grpc_service import Service, grpc_service
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK

QUESTIONS = [f"Question {i}: what does clause {i} of the contract say about delivery?" for i in range(8)]


def config(urls: list[str]) -> Config:
    """Interactive over the first three engines, batch over the fourth."""
    return two_pool_config(interactive_urls=urls[:3], batch_urls=urls[3:], timeouts=TimeoutsConfig(health_check_interval=0.1))


@pytest.fixture
def service() -> Iterator[Service]:
    with grpc_service([QUICK] * 4, config) as running:
        yield running


def engines_used(service: Service, send: Callable[[str], None]) -> int:
    """How many of the interactive engines served ``send`` of each question."""
    before = [engine.statistics().finished_total for engine in service.engines[:3]]
    for question in QUESTIONS:
        send(question)
    after = [engine.statistics().finished_total for engine in service.engines[:3]]
    assert sum(after) - sum(before) == len(QUESTIONS)
    return sum(a > b for a, b in zip(after, before))


def test_one_hint_one_engine_and_no_hint_spreads(service: Service) -> None:
    with openai.OpenAI(base_url=service.http_url + "/v1", api_key="none", max_retries=0, timeout=10) as sdk:

        def ask(question: str, **hints: object) -> None:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=2, **hints)  # type: ignore[call-overload]

        assert engines_used(service, ask) > 1  # unlike prompts, no hint: their keys spread
        assert engines_used(service, lambda q: ask(q, extra_headers={"x-session-id": "conversation-1"})) == 1
        assert engines_used(service, lambda q: ask(q, extra_body={"prompt_cache_key": "conversation-2"})) == 1
        assert engines_used(service, lambda q: ask(q, user="user-3")) == 1
    with grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)

        def call(question: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
            message = pb.ChatRequest(messages=[pb.Message(role="user", content=question)], options=pb.Options(max_tokens=2))
            stub.Chat(message, metadata=metadata, timeout=10)

        assert engines_used(service, call) > 1
        assert engines_used(service, lambda q: call(q, (("x-session-id", "conversation-4"),))) == 1
