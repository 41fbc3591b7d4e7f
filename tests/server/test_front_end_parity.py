"""The same faults through both front ends end the same way: one outcome and reason, one table.

Each case makes the backend (or the router) fail one way, sends the same
request over HTTP and over gRPC, and checks that both requests were recorded
with the same outcome and reason -- the ones the error table gives -- and that
each wire answered what the table says for it (issue 10, defects 6, 7, 11).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from concurrent import futures

import grpc
import httpx
import pytest

from tailguard.router import error_spec, errors
from tailguard.router.config import Config, TimeoutsConfig
from tailguard.router.observe import RequestRecord
from tailguard.server.errors_map import ERROR_CODE_KEY, grpc_error, http_error
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tests.helpers.engines import MODEL
from tests.helpers.front_ends import SINK_FAILS, Faulty, FrontEnds, front_ends
from tests.helpers.router import two_pool_config

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
BATCH_TOKENS = 500  # over the interactive class's 128: the batch pool, whose endpoint refuses connections


def make_config(urls: list[str]) -> Config:
    # A hung non-streaming call ends at the end-to-end deadline (vLLM sends its
    # body only when done, so there is no first byte to time); keep it short.
    config = two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]], timeouts=TimeoutsConfig(end_to_end_timeout=3.0))
    interactive = dataclasses.replace(config.pools[0], first_byte_timeout=0.5)
    return dataclasses.replace(config, pools=(interactive, config.pools[1]))


@pytest.fixture(scope="module")
def backend() -> Faulty:
    return Faulty()


@pytest.fixture(scope="module")
def service(backend: Faulty) -> Iterator[FrontEnds]:
    with front_ends([backend, None], make_config) as running:
        yield running


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mode: str  # the backend's
    stream: bool
    expected: tuple[str, str | None]  # (outcome, reason)
    max_tokens: int = 8
    cancel: bool = False  # the client leaves after the first bytes
    breaks: str | None = None  # a RequestRecord method that raises: a bug in the relay
    error: type[errors.TailguardError] | None = None  # the error the table answers with

    @property
    def ids(self) -> str:
        return self.name


BACKEND_DOWN = ("backend_error", "backend_unavailable")
CASES = [
    Case("backend_5xx", "5xx", False, BACKEND_DOWN, error=errors.BackendUnavailable),
    Case("backend_5xx_stream", "5xx", True, BACKEND_DOWN, error=errors.BackendUnavailable),
    Case("connect_refused", "ok", False, BACKEND_DOWN, max_tokens=BATCH_TOKENS, error=errors.BackendUnavailable),
    Case("garbage_body", "garbage", False, ("backend_error", "bad_backend_reply"), error=errors.BadBackendReply),
    Case("garbage_stream", "garbage", True, ("backend_error", "bad_backend_reply"), error=errors.BadBackendReply),
    Case("stream_cut_before_done", "cut", True, ("backend_error", "bad_backend_reply"), error=errors.BadBackendReply),
    Case("in_stream_error_event", "error_event", True, ("backend_error", "backend_stream_error"), error=errors.BackendStreamError),
    # A framed event that is not JSON: HTTP relayed these as a 200 logged ok (issue 20, defect 5).
    Case("stream_event_not_json", "not_json", True, ("backend_error", "bad_backend_reply"), error=errors.BadBackendReply),
    Case("stream_event_binary", "binary", True, ("backend_error", "bad_backend_reply"), error=errors.BadBackendReply),
    Case("stream_event_bad_utf8", "bad_utf8", True, ("backend_error", "bad_backend_reply"), error=errors.BadBackendReply),
    # Bytes outside any data: line ending in "data: [DONE]": HTTP relayed it as a 200 logged ok, gRPC refused it (issue 32).
    Case("stream_junk_then_done", "junk_then_done", True, ("backend_error", "bad_backend_reply"), error=errors.BadBackendReply),
    Case("hung_answer", "hang", False, ("timeout", "e2e_timeout"), error=errors.DeadlineExceeded),
    Case("first_byte_timeout_stream", "hang", True, ("backend_error", "backend_timeout"), error=errors.BackendTimeout),
    Case("exception_in_a_sink", "ok", False, ("ok", None)),
    Case("exception_in_the_relay", "ok", True, ("internal_error", "internal_error"), breaks="saw_chunk", error=errors.InternalError),
    Case("exception_reading_a_body", "ok", False, ("internal_error", "internal_error"), breaks="saw_answer", error=errors.InternalError),
    Case("client_cancel", "slow", True, ("cancelled", "client_cancelled"), cancel=True),
]


def over_http(service: FrontEnds, case: Case, request_id: str) -> tuple[int, bytes]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": case.max_tokens, "stream": case.stream}
    with httpx.Client(base_url=service.http_url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": request_id}) as response:
            if case.cancel:
                next(response.iter_raw())
                return response.status_code, b""
            return response.status_code, response.read()


def over_grpc(service: FrontEnds, case: Case, request_id: str) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """The call's status, details and trailing metadata."""
    request = pb.ChatRequest(messages=[pb.Message(**m) for m in MESSAGES], options=pb.Options(max_tokens=case.max_tokens))
    metadata = [("x-request-id", request_id)]
    with grpc.insecure_channel(service.grpc_target) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        try:
            if not case.stream:
                stub.Chat(request, metadata=metadata, timeout=10)
            else:
                call = stub.ChatStream(request, metadata=metadata, timeout=10)
                if case.cancel:
                    next(call)
                    call.cancel()
                    return grpc.StatusCode.CANCELLED, "", {}
                list(call)
        except grpc.RpcError as error:
            return error.code(), error.details() or "", dict(error.trailing_metadata() or ())
    return grpc.StatusCode.OK, "", {}


def _events(body: bytes) -> list[str]:
    return [line[len("data: ") :] for line in body.decode().splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_both_front_ends_end_a_fault_alike(
    service: FrontEnds, backend: Faulty, case: Case, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    backend.mode = case.mode
    if case.breaks is not None:
        original = getattr(RequestRecord, case.breaks)

        def broken(record: RequestRecord, data: bytes) -> None:
            if record.request_id.startswith("broken-"):
                raise RuntimeError("a bug in the relay")
            original(record, data)

        monkeypatch.setattr(RequestRecord, case.breaks, broken)
    prefix = SINK_FAILS if case.name == "exception_in_a_sink" else "broken" if case.breaks else "parity"
    http_id, grpc_id = f"{prefix}-http-{case.name}", f"{prefix}-grpc-{case.name}"
    with caplog.at_level(logging.INFO):
        status, body = over_http(service, case, http_id)
        code, details, trailing = over_grpc(service, case, grpc_id)
        http_record, grpc_record = service.record(http_id), service.record(grpc_id)
    backend.mode = "ok"

    # The same ending, and the one the error table gives.
    assert (http_record.outcome, http_record.reason) == (grpc_record.outcome, grpc_record.reason) == case.expected
    assert (http_record.api, grpc_record.api) == ("http", "grpc")

    # Each wire answered what the table says for it.
    if case.cancel:
        assert (http_record.status, grpc_record.status) == (499, "CANCELLED")
    elif case.error is None:
        assert (status, code) == (200, grpc.StatusCode.OK) and json.loads(body)["choices"] and ERROR_CODE_KEY not in trailing
        assert (http_record.status, grpc_record.status) == (200, "OK")
    else:
        spec = error_spec.SPECS[[s.error for s in error_spec.SPECS].index(case.error)]
        assert code.name == spec.grpc_status == grpc_record.status, details
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
        # The code an HTTP caller reads in the body, in the trailers: no parsing of details.
        assert trailing[ERROR_CODE_KEY] == (spec.code or spec.error_type), trailing
        events = _events(body)
        if status == 200:  # a stream that began: it carries exactly one error event
            assert case.stream and http_record.status == 200
            errors_sent = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
            assert len(errors_sent) == 1
            if case.error is errors.BackendStreamError:  # the backend's own event, relayed; nothing added
                assert errors_sent[0]["message"] == "EngineCore died" and events[-1] == "[DONE]"
            else:  # tailguard's, as the last event
                assert errors_sent[0]["code"] == spec.code and "error" in json.loads(events[-1])
        else:
            assert status == spec.http_status == http_record.status
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"} and (error["type"], error["code"]) == (spec.error_type, spec.code)

    bug_lines = [r for r in caplog.records if r.name == "tailguard.session" and r.levelno == logging.ERROR]
    if case.breaks is not None:  # a bug: logged once per request, with its traceback
        assert sorted(r.fields["request_id"] for r in bug_lines) == sorted([http_id, grpc_id])  # type: ignore[attr-defined]
        assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in bug_lines)
    else:
        assert not bug_lines
    if case.name == "exception_in_a_sink":
        assert sum("telemetry sink" in r.getMessage() for r in caplog.records) == 2


def example_of(spec: error_spec.ErrorSpec) -> errors.TailguardError:
    """An instance of the row's class as the router raises it (a retry hint where it carries one)."""
    if issubclass(spec.error, errors.BackendRejected):
        return spec.error("the engine said no", status=422, error_type="BadRequestError", code="bad_schema")
    if issubclass(spec.error, errors.Overloaded):
        return spec.error("example", retry_after=2.0)
    return spec.error("example")


@pytest.fixture(scope="module")
def aborting_server() -> Iterator[str]:
    """A gRPC server whose one method aborts as tailguard's front end does, with the error the
    request names: every row of the table, on a real wire, without a fault to provoke each."""
    by_name = {spec.error.__name__: example_of(spec) for spec in error_spec.SPECS}

    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        rendered = grpc_error(by_name[request.decode()])
        context.set_trailing_metadata(rendered.trailing_metadata)
        context.abort(rendered.code, rendered.details)
        raise AssertionError("abort returned")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    method = grpc.unary_unary_rpc_method_handler(handler)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Errors", {"Raise": method}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("spec", error_spec.SPECS, ids=[s.error.__name__ for s in error_spec.SPECS])
def test_every_error_rows_code_reaches_grpc_trailing_metadata(aborting_server: str, spec: error_spec.ErrorSpec) -> None:
    """``x-tailguard-error-code`` carries what HTTP's body has in ``error.code`` (its type where the
    row has none), for every row: a caller tells queue_full from caller_concurrency_limit (both
    RESOURCE_EXHAUSTED) without reading the details."""
    error = example_of(spec)
    with grpc.insecure_channel(aborting_server) as channel:
        call = channel.unary_unary("/t.Errors/Raise", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as caught:
            call(spec.error.__name__.encode(), timeout=10)
    trailing = dict(caught.value.trailing_metadata())
    body = http_error(error).body["error"]
    assert isinstance(body, dict)
    assert trailing[ERROR_CODE_KEY] == (body["code"] or body["type"])
    if issubclass(spec.error, errors.BackendRejected):
        assert trailing[ERROR_CODE_KEY] == "bad_schema"  # the engine's own code, as HTTP relays it
    else:
        assert trailing[ERROR_CODE_KEY] == (spec.code or spec.error_type)
        assert caught.value.code().name == spec.grpc_status
    assert ("retry-after" in trailing) == (error_spec.retry_after(error) is not None)


def test_every_ending_is_counted_in_metrics(service: FrontEnds) -> None:
    """The battery's outcomes, internal errors included, are on /metrics (run after it)."""
    page = httpx.get(service.http_url + "/metrics", timeout=10).text
    for outcome in ("internal_error", "backend_error", "cancelled"):
        assert f'outcome="{outcome}"' in page
    for reason in ("internal_error", "bad_backend_reply", "backend_stream_error", "backend_timeout", "backend_unavailable"):
        assert f'reason="{reason}"' in page
