"""gRPC operations over a real socket: API keys, class override, per-key cap, timing metadata; one claim a test."""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Iterator, Sequence

import grpc
import httpx
import pytest

from tailguard.router.config import ApiKeyConfig, AuthConfig, Config
from tailguard.router.quotas import hash_key
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tests.helpers.grpc_service import Service, grpc_service, wait_for
from tests.helpers.sockets import QUICK
from tests.server.grpc.test_api import chat, config

WEB_KEY, ETL_KEY = "sk-web-grpc-0123", "sk-etl-grpc-4567"


def keyed_config(urls: list[str]) -> Config:
    keys = AuthConfig(
        keys=(
            ApiKeyConfig("webapp", hash_key(WEB_KEY)),
            ApiKeyConfig("etl", hash_key(ETL_KEY), frozenset({"batch"}), max_concurrency=1),
        )
    )
    return dataclasses.replace(config(urls), auth=keys)


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.fixture(scope="module")
def keyed() -> Iterator[Service]:
    """One service for the claims below (each leaves nothing in flight): webapp's key, and etl's of one seat, batch only."""
    with grpc_service([QUICK, QUICK.replace(base_ms=10.0)], keyed_config) as service:
        yield service


@pytest.fixture
def stub(keyed: Service) -> Iterator[pb_grpc.CompletionsStub]:
    with grpc.insecure_channel(keyed.grpc_target) as channel:
        yield pb_grpc.CompletionsStub(channel)


def rejections(service: Service, reason: str) -> float:
    """The service's refusals for ``reason`` so far, from its /metrics page."""
    page = service.running.metrics.render().decode()
    return sum(float(n) for n in re.findall(rf'^tailguard_rejections_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$', page, re.M))


def server_timing(metadata: Sequence[tuple[str, str]]) -> dict[str, float]:
    """The ``server-timing`` trailer as name -> milliseconds."""
    parts = dict(metadata)["server-timing"].split(", ")
    return {name: float(ms) for name, ms in (part.split(";dur=") for part in parts)}


def test_a_call_without_a_key_is_unauthenticated_and_counted(keyed: Service, stub: pb_grpc.CompletionsStub) -> None:
    before = rejections(keyed, "unauthenticated")
    with pytest.raises(grpc.RpcError) as missing:
        stub.Chat(chat(max_tokens=4))
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in missing.value.details()
    assert rejections(keyed, "unauthenticated") == before + 1


def test_an_unknown_key_is_unauthenticated_without_being_echoed_and_counted(keyed: Service, stub: pb_grpc.CompletionsStub) -> None:
    before = rejections(keyed, "unauthenticated")
    with pytest.raises(grpc.RpcError) as unknown:
        stub.Chat(chat(max_tokens=4), metadata=bearer("sk-nobody"))
    assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED and "sk-nobody" not in unknown.value.details()
    assert rejections(keyed, "unauthenticated") == before + 1


def test_a_class_the_key_may_not_use_is_permission_denied_and_counted(keyed: Service, stub: pb_grpc.CompletionsStub) -> None:
    before = rejections(keyed, "forbidden")
    with pytest.raises(grpc.RpcError) as forbidden:
        stub.Chat(chat(max_tokens=4, request_class="batch"), metadata=bearer(WEB_KEY))
    assert forbidden.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert rejections(keyed, "forbidden") == before + 1


def test_a_key_allowed_a_class_gets_it_by_asking(stub: pb_grpc.CompletionsStub) -> None:
    forced = stub.Chat(chat(max_tokens=4, request_class="batch"), metadata=bearer(ETL_KEY))
    assert forced.routing.request_class == "batch" and forced.routing.pool == "batch"


def test_a_unary_reply_says_its_queue_and_total_time_in_server_timing(stub: pb_grpc.CompletionsStub) -> None:
    reply, call = stub.Chat.with_call(chat(max_tokens=4), metadata=bearer(WEB_KEY))
    assert reply.routing.pool == "interactive"
    timing = server_timing(call.trailing_metadata())
    assert set(timing) == {"queue", "total"} and timing["total"] >= timing["queue"] >= 0


def test_a_stream_says_its_queue_first_token_and_total_time_in_server_timing(stub: pb_grpc.CompletionsStub) -> None:
    stream = stub.ChatStream(chat(max_tokens=6), metadata=bearer(WEB_KEY))
    assert "".join(c.content for c in stream)
    timing = server_timing(stream.trailing_metadata())
    assert set(timing) == {"queue", "ttft", "total"} and timing["total"] >= timing["ttft"]


def test_a_call_over_its_keys_cap_is_resource_exhausted_with_a_retry_hint_and_counted(keyed: Service, stub: pb_grpc.CompletionsStub) -> None:
    """etl's one seat taken by a long stream: its next call is refused, not queued."""
    before = rejections(keyed, "caller_limit")
    holding = stub.ChatStream(chat(max_tokens=120, request_class="batch"), metadata=bearer(ETL_KEY))
    first = threading.Event()

    def drain() -> None:
        for _ in holding:
            first.set()

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        assert first.wait(10)
        with pytest.raises(grpc.RpcError) as capped:
            stub.Chat(chat(max_tokens=4), metadata=bearer(ETL_KEY))
        assert capped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(capped.value.trailing_metadata())["retry-after"] == "1"
    finally:
        reader.join(30)
    wait_for(lambda: keyed.running.router.statistics().caller_in_flight == {})
    assert rejections(keyed, "caller_limit") == before + 1


def test_get_limits_needs_a_key_exactly_when_http_limits_does() -> None:
    """Issue 10, defect 10: GetLimits answered anyone while /v1/limits asked for a key."""
    with grpc_service([QUICK, QUICK], keyed_config) as service, grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        for metadata in ([], bearer("sk-nobody"), [("authorization", "Basic abc")]):
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetLimits(pb.GetLimitsRequest(), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert httpx.get(service.http_url + "/v1/limits", headers=dict(metadata)).status_code == 401
        limits = stub.GetLimits(pb.GetLimitsRequest(), metadata=bearer(WEB_KEY))
        http = httpx.get(service.http_url + "/v1/limits", headers=dict(bearer(WEB_KEY)))
        assert http.status_code == 200 and limits.input_cap_tokens == http.json()["input_cap_tokens"]
    with grpc_service([QUICK, QUICK], config) as service, grpc.insecure_channel(service.grpc_target) as channel:
        assert pb_grpc.CompletionsStub(channel).GetLimits(pb.GetLimitsRequest()).input_cap_tokens == 8192  # no keys: open
        assert httpx.get(service.http_url + "/v1/limits").status_code == 200
