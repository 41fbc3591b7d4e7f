"""Issue 32, item 9: an engine that echoes ``Authorization`` hands no caller tailguard's key, and no caller the engine's address.

Both front ends over one router, the engine on 127.0.0.1 quoting the header
it was sent in each way it can fail: a 400 passed through, a 401 (the key
refused), a 500, a 503, an error event inside a stream, a stream event that
is not JSON. The key must be in no answer and no log record; the engine's
URL in no answer (the logs keep it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping

import grpc
import httpx
import pytest

from tailguard.router.config import BackendAccess, Config, TimeoutsConfig
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tailguard.sim import SimResponse
from tailguard.sim.app import JSON_HEADERS, SSE_HEADERS
from tests.helpers.engines import MODEL
from tests.helpers.front_ends import Faulty, FrontEnds, _Events, front_ends
from tests.helpers.router import two_pool_config

KEY = "sk-tailguard-backend-0123456789abcdef"
MODES = ["echo_400", "echo_500", "echo_503", "echo_event", "echo_bad_event", "echo_401"]  # 401 last: it takes the engine out


class Echoing(Faulty):
    """A backend that quotes the request's Authorization header in whatever it answers (``mode``)."""

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> SimResponse:
        if not self.mode.startswith("echo_") or not path.endswith("completions"):
            return await super().handle(method, path, headers, body)
        quoted = f"request had authorization: {headers.get('authorization')}"
        status = {"echo_400": 400, "echo_401": 401, "echo_500": 500, "echo_503": 503}.get(self.mode)
        if status is not None:
            error = {"object": "error", "message": quoted, "type": "BadRequestError", "param": quoted, "code": status}
            return SimResponse(status, list(JSON_HEADERS), json.dumps(error).encode())
        if self.mode == "echo_event":
            event = {"error": {"message": quoted, "type": "InternalServerError", "code": 500}}
            events = [b"data: " + json.dumps(event).encode() + b"\n\n", b"data: [DONE]\n\n"]
        else:  # a stream event that is not JSON, quoting the key within the 40 bytes a refusal shows
            events = [f"data: {headers.get('authorization')} is not JSON\n\n".encode(), b"data: [DONE]\n\n"]
        return SimResponse(200, list(SSE_HEADERS), stream=_Events(events))


def make_config(urls: list[str]) -> Config:
    config = two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]], timeouts=TimeoutsConfig(end_to_end_timeout=3.0))
    access = BackendAccess(api_key_env="TAILGUARD_TEST_BACKEND_KEY", api_key=KEY)
    interactive = config.pools[0]
    endpoints = tuple(dataclasses.replace(e, access=access) for e in interactive.endpoints)
    return dataclasses.replace(config, pools=(dataclasses.replace(interactive, endpoints=endpoints, access=access), config.pools[1]))


@pytest.fixture(scope="module")
def backend() -> Echoing:
    return Echoing()


@pytest.fixture(scope="module")
def service(backend: Echoing) -> Iterator[FrontEnds]:
    with front_ends([backend, Faulty()], make_config) as running:
        yield running


def over_http(service: FrontEnds, stream: bool, request_id: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": stream}
    with httpx.Client(base_url=service.http_url, timeout=10) as client:
        response = client.post("/v1/chat/completions", json=body, headers={"x-request-id": request_id})
        return f"{response.status_code} {dict(response.headers)} {response.text}"


def over_grpc(service: FrontEnds, stream: bool) -> str:
    request = pb.ChatRequest(messages=[pb.Message(role="user", content="hello")], options=pb.Options(max_tokens=8))
    with grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        try:
            if stream:
                return str(list(stub.ChatStream(request, timeout=10)))
            return str(stub.Chat(request, timeout=10))
        except grpc.RpcError as error:
            return f"{error.code()} {error.details()} {error.trailing_metadata()}"


def test_no_answer_and_no_log_line_holds_the_backend_key_or_the_engines_address(
    service: FrontEnds, backend: Echoing, caplog: pytest.LogCaptureFixture
) -> None:
    engine_address = service.router.pool("interactive").endpoints[0].url.removeprefix("http://")
    answers: dict[str, str] = {}
    with caplog.at_level(logging.DEBUG):
        for mode in MODES:
            backend.mode = mode
            stream = mode in ("echo_event", "echo_bad_event")
            answers[f"{mode} http"] = over_http(service, stream, f"{mode}-http")
            answers[f"{mode} grpc"] = over_grpc(service, stream)
    for name, answer in answers.items():
        assert KEY not in answer, name
        assert engine_address not in answer, name
    assert "[redacted]" in answers["echo_400 http"]  # the engine's words still reach the caller, without the key
    leaked = [r for r in caplog.records if KEY in r.getMessage() or KEY in json.dumps(getattr(r, "fields", {}), default=str)]
    assert not leaked, [r.getMessage() for r in leaked]
    # What the access log writes: the engine's URL kept (the operator's), never the key.
    records = [service.record(f"{mode}-http") for mode in MODES]
    assert all(record.error is not None and KEY not in record.error for record in records)
    assert engine_address in (service.record("echo_500-http").error or "") and records[0].endpoint is not None
