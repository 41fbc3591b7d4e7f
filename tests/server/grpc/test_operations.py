"""gRPC operations over a real socket: API keys, class override, per-key cap, timing metadata."""

from __future__ import annotations

import dataclasses
import threading

import grpc
import httpx
import pytest

from tailguard.router.config import ApiKeyConfig, AuthConfig, Config
from tailguard.router.quotas import hash_key
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tests.helpers.grpc_service import grpc_service, wait_for
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


def test_keys_classes_caps_and_server_timing() -> None:
    with grpc_service([QUICK, QUICK.replace(base_ms=10.0)], keyed_config) as service, grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            stub.Chat(chat(max_tokens=4))
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in missing.value.details()
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Chat(chat(max_tokens=4), metadata=bearer("sk-nobody"))
        assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED and "sk-nobody" not in unknown.value.details()
        with pytest.raises(grpc.RpcError) as forbidden:
            stub.Chat(chat(max_tokens=4, request_class="batch"), metadata=bearer(WEB_KEY))
        assert forbidden.value.code() == grpc.StatusCode.PERMISSION_DENIED

        reply, call = stub.Chat.with_call(chat(max_tokens=4), metadata=bearer(WEB_KEY))
        assert reply.routing.pool == "interactive"
        timing = dict(part.split(";dur=") for part in dict(call.trailing_metadata())["server-timing"].split(", "))
        assert set(timing) == {"queue", "total"} and float(timing["total"]) >= float(timing["queue"]) >= 0
        forced = stub.Chat(chat(max_tokens=4, request_class="batch"), metadata=bearer(ETL_KEY))
        assert forced.routing.request_class == "batch" and forced.routing.pool == "batch"

        stream = stub.ChatStream(chat(max_tokens=6), metadata=bearer(WEB_KEY))
        assert "".join(c.content for c in stream)
        timing = dict(part.split(";dur=") for part in dict(stream.trailing_metadata())["server-timing"].split(", "))
        assert set(timing) == {"queue", "ttft", "total"} and float(timing["total"]) >= float(timing["ttft"])

        # etl's one seat taken by a long stream: its next call is RESOURCE_EXHAUSTED with a retry hint.
        holding = stub.ChatStream(chat(max_tokens=120, request_class="batch"), metadata=bearer(ETL_KEY))
        first = threading.Event()

        def drain() -> None:
            for _ in holding:
                first.set()

        reader = threading.Thread(target=drain)
        reader.start()
        assert first.wait(10)
        with pytest.raises(grpc.RpcError) as capped:
            stub.Chat(chat(max_tokens=4), metadata=bearer(ETL_KEY))
        assert capped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(capped.value.trailing_metadata())["retry-after"] == "1"
        reader.join(30)
        wait_for(lambda: service.running.router.statistics().caller_in_flight == {})
        page = service.running.metrics.render().decode()
        assert 'tailguard_rejections_total{class="none",pool="none",reason="unauthenticated"} 2.0' in page
        assert 'reason="caller_limit"' in page and 'reason="forbidden"' in page


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
