"""[tracing]: every request's span tree, and its traceparent passed on to the engine.

In-memory tests build the HTTP front end over real sockets with the SDK's
in-memory exporter; the rest run tailguard's whole process, exporting over
OTLP/HTTP to a receiver on 127.0.0.1 (``tests/helpers/otlp_receiver.py``).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tailguard.router import Router
from tailguard.router.config import Config, ConfigError, TracingConfig, parse_config, render_config
from tailguard.router.observe import Telemetry
from tailguard.router.observe.tracing import Tracing
from tailguard.server.http.api import HttpApi
from tailguard.server.http.server import HttpSettings, serve as serve_http
from tailguard.server.reload import summarize
from tailguard.server.trace_switch import TracingSwitch
from tailguard.sim.app import SimApp
from tailguard.sim.engine import Engine
from tailguard.sim.http import serve as serve_sim
from tests.helpers.engines import MODEL
from tests.helpers.grpc_service import grpc_service
from tests.helpers.otlp_receiver import ReceivedSpan, otlp_receiver
from tests.helpers.router import two_pool_config
from tests.helpers.sockets import QUICK, tailguard

SHIPPED = Path(__file__).resolve().parents[3] / "config.toml"
# A caller's own trace: the router's root span must become its child.
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}


@dataclass
class Traced:
    url: str
    exporter: InMemorySpanExporter
    sims: list[SimApp | None]

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@asynccontextmanager
async def traced_http(
    *, sample_ratio: float = 1.0, interactive_up: bool = True, records: list[object] | None = None
) -> AsyncIterator[Traced]:
    """Two engines (interactive, batch) on sockets, a router and its HTTP front end, traced in memory.

    ``interactive_up=False``: the interactive pool's endpoint is a port nothing listens on (once its first probe passed).
    """
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingConfig(enabled=True, sample_ratio=sample_ratio), processor=SimpleSpanProcessor(exporter))
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        urls: list[str] = []
        sims: list[SimApp | None] = []
        async with trio.open_nursery() as gone:  # a pool "not up": up for its first probe, then nobody listens
            for up in (interactive_up, True):
                engine = Engine(QUICK)
                await (nursery if up else gone).start(engine.run)
                sim = SimApp(engine, model=MODEL)
                port = await (nursery if up else gone).start(serve_sim, sim.handle, "127.0.0.1", 0)
                sims.append(sim if up else None)
                urls.append(f"http://127.0.0.1:{port}")
            router = Router(two_pool_config(interactive_urls=[urls[0]], batch_urls=[urls[1]]))
            await router.check_health()  # endpoints take requests once a probe has passed
            gone.cancel_scope.cancel()
        telemetry = Telemetry([records.append] if records is not None else [])
        app = HttpApi(router, max_body_bytes=1 << 20, telemetry=telemetry, tracing=lambda: tracing)
        await nursery.start(app.run)
        binds = await nursery.start(
            lambda task_status: serve_http(app, "127.0.0.1", 0, settings=HttpSettings(), shutdown_trigger=shutdown.wait, task_status=task_status)
        )
        try:
            yield Traced(binds[0], exporter, sims)
        finally:
            shutdown.set()
            await router.aclose()
            tracing.shutdown()
            nursery.cancel_scope.cancel()


async def stream_chat(url: str, headers: dict[str, str] | None = None, **changes: object) -> tuple[int, bytes]:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, **changes}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers or {}) as response:
            return response.status_code, await response.aread()


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [span.name for span in spans]
    return named


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def traceparent_fields(value: str) -> tuple[str, str, str]:
    version, trace_id, parent_id, flags = value.split("-")
    assert version == "00"
    return trace_id, parent_id, flags


# -- the span tree, in memory -----------------------------------------------------------


async def test_a_streamed_request_is_one_tree_under_the_callers_trace_and_the_engine_joins_it() -> None:
    records: list[object] = []
    async with traced_http(records=records) as service:
        status, body = await stream_chat(service.url, {"traceparent": CALLER_TRACEPARENT})
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
        with trio.fail_after(5):
            while len(service.spans()) < 6:
                await trio.sleep(0.005)
        spans = by_name(service.spans())
        sim = service.sims[0]
        assert sim is not None
        received = list(sim.traceparents)

    root = spans["POST /v1/chat/completions"]
    call = spans[f"chat {MODEL}"]
    queue, relay, ttft, decode = spans["queue wait"], spans["relay"], spans["time to first token"], spans["decode"]
    assert set(spans) == {root.name, call.name, "queue wait", "relay", "time to first token", "decode"}

    # One trace, the caller's: the root is the caller's span's child.
    assert {format(span.context.trace_id, "032x") for span in spans.values()} == {CALLER_TRACE}
    assert root.parent is not None and format(root.parent.span_id, "016x") == CALLER_SPAN and root.parent.is_remote
    assert root.kind == SpanKind.SERVER and call.kind == SpanKind.CLIENT
    for child in (queue, call, relay):
        assert parent_of(child) == root.context.span_id
    for child in (ttft, decode):
        assert parent_of(child) == call.context.span_id

    # The engine was sent a traceparent naming the router's backend span as its parent.
    assert len(received) == 1
    trace_id, parent_id, flags = traceparent_fields(received[0])
    assert (trace_id, parent_id, flags) == (CALLER_TRACE, format(call.context.span_id, "016x"), "01")

    # Times nest: queue, then the call (first token, decode), the relay inside the root.
    assert root.start_time is not None and root.end_time is not None
    assert root.start_time <= queue.start_time <= queue.end_time <= call.start_time  # type: ignore[operator]
    assert ttft.start_time == call.start_time and ttft.end_time == decode.start_time == relay.start_time
    assert decode.end_time == call.end_time <= root.end_time  # type: ignore[operator]
    assert relay.end_time == root.end_time

    # The request's facts: GenAI conventions and tailguard's own.
    attributes = dict(root.attributes or {})
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 16
    assert attributes["gen_ai.usage.output_tokens"] == 16
    assert isinstance(attributes["gen_ai.usage.input_tokens"], int) and attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["tailguard.class"] == "interactive" and attributes["tailguard.pool"] == "interactive"
    assert attributes["tailguard.outcome"] == "ok" and "tailguard.reason" not in attributes and "error.type" not in attributes
    assert attributes["http.response.status_code"] == 200 and attributes["tailguard.stream"] is True
    assert root.status.status_code == StatusCode.UNSET
    call_attributes = dict(call.attributes or {})
    port = int(service_port(call_attributes["tailguard.endpoint"]))
    assert call_attributes["server.address"] == "127.0.0.1" and call_attributes["server.port"] == port
    assert call_attributes["gen_ai.operation.name"] == "chat" and call_attributes["gen_ai.request.max_tokens"] == 16
    assert call_attributes["gen_ai.usage.output_tokens"] == 16
    assert dict(queue.attributes or {})["tailguard.admitted"] is True


def service_port(url: object) -> str:
    assert isinstance(url, str)
    return url.rsplit(":", 1)[1]


async def test_the_effective_max_tokens_is_the_clamped_one() -> None:
    async with traced_http() as service:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as client:
            response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000})
        assert response.status_code == 200
        spans = by_name(service.spans())
    attributes = dict(spans["POST /v1/chat/completions"].attributes or {})
    assert attributes["tailguard.requested_max_tokens"] == 5000
    assert attributes["gen_ai.request.max_tokens"] == 1024 and attributes["tailguard.max_tokens_clamped"] is True
    assert attributes["tailguard.class"] == "batch"
    # A whole answer: no first-token children; the relay starts when the body was read.
    assert set(spans) == {"POST /v1/chat/completions", "queue wait", f"chat {MODEL}", "relay"}


async def test_an_unreachable_backend_marks_the_attempt_and_the_request_failed() -> None:
    async with traced_http(interactive_up=False) as service:
        status, _ = await stream_chat(service.url)
        assert status == 502
        spans = by_name(service.spans())
    root, call = spans["POST /v1/chat/completions"], spans[f"chat {MODEL}"]
    assert "relay" not in spans and "time to first token" not in spans
    assert root.status.status_code == StatusCode.ERROR and call.status.status_code == StatusCode.ERROR
    attributes = dict(root.attributes or {})
    assert (attributes["tailguard.outcome"], attributes["tailguard.reason"]) == ("backend_error", "backend_unavailable")
    assert attributes["error.type"] == "backend_unavailable" and attributes["http.response.status_code"] == 502
    assert dict(call.attributes or {})["error.type"] == "backend_unavailable"
    assert call.end_time is not None and root.end_time is not None and call.end_time <= root.end_time


async def test_a_refused_request_is_a_root_with_its_reason_and_no_backend_call() -> None:
    async with traced_http() as service:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as client:
            response = await client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "x" * 40_000}]})
        assert response.status_code == 400
        spans = service.spans()
    assert [span.name for span in spans] == ["POST /v1/chat/completions"]
    attributes = dict(spans[0].attributes or {})
    assert (attributes["tailguard.outcome"], attributes["error.type"], attributes["http.response.status_code"]) == ("rejected", "input_cap", 400)
    assert spans[0].status.status_code == StatusCode.UNSET  # the caller's mistake, not the service's failure


async def test_sampling_follows_the_callers_decision_and_the_ratio_for_its_own() -> None:
    async with traced_http(sample_ratio=0.0) as service:
        assert (await stream_chat(service.url))[0] == 200  # tailguard's own trace, ratio 0: dropped
        assert service.spans() == []
        assert (await stream_chat(service.url, {"traceparent": CALLER_TRACEPARENT}))[0] == 200  # sampled upstream: kept
        assert len(service.spans()) == 6
        sim = service.sims[0]
        assert sim is not None
        unsampled, sampled = list(sim.traceparents)
    # Dropped or not, the engine is told (the sampled bit clear: it records nothing either).
    assert int(traceparent_fields(unsampled)[2], 16) & 1 == 0
    assert traceparent_fields(sampled)[:1] == (CALLER_TRACE,) and int(traceparent_fields(sampled)[2], 16) & 1 == 1


# -- the whole process, exporting over OTLP/HTTP -----------------------------------------------


def tracing_config(urls: list[str], endpoint: str, **tracing: object) -> Config:
    config = two_pool_config(interactive_urls=urls[:1], batch_urls=urls[1:2])
    return dataclasses.replace(config, tracing=TracingConfig(enabled=True, endpoint=endpoint, service_name="tailguard-test", **tracing))  # type: ignore[arg-type]


def tree(spans: list[ReceivedSpan]) -> dict[str, str]:
    """Each span's name -> its parent's name ("" for the root, "(caller)" for a remote parent)."""
    names = {span.span_id: span.name for span in spans}
    return {span.name: names.get(span.parent_id, "(caller)" if span.parent_id else "") for span in spans}


async def test_spans_reach_a_real_otlp_receiver_and_the_exit_flushes_them() -> None:
    with otlp_receiver() as receiver:
        async with trio.open_nursery() as nursery:
            engines = [Engine(QUICK), Engine(QUICK)]
            sims = [SimApp(engine, model=MODEL) for engine in engines]
            urls = []
            for engine, sim in zip(engines, sims):
                await nursery.start(engine.run)
                urls.append(f"http://127.0.0.1:{await nursery.start(serve_sim, sim.handle, '127.0.0.1', 0)}")
            async with tailguard(tracing_config(urls, receiver.url)) as running:
                assert (await stream_chat(running.http_url, {"traceparent": CALLER_TRACEPARENT}))[0] == 200
            # tailguard has exited: its batch processor exported what it held on the way out.
            nursery.cancel_scope.cancel()
        spans = receiver.received()
    assert tree(spans) == {
        "POST /v1/chat/completions": "(caller)",
        "queue wait": "POST /v1/chat/completions",
        f"chat {MODEL}": "POST /v1/chat/completions",
        "time to first token": f"chat {MODEL}",
        "decode": f"chat {MODEL}",
        "relay": "POST /v1/chat/completions",
    }
    assert {span.trace_id for span in spans} == {CALLER_TRACE}
    assert all(span.resource["service.name"] == "tailguard-test" for span in spans)
    assert set(receiver.content_types) == {"application/x-protobuf"}
    root = next(span for span in spans if span.parent_id == CALLER_SPAN)
    assert root.attributes["tailguard.outcome"] == "ok" and root.attributes["gen_ai.request.max_tokens"] == 16
    call = next(span for span in spans if span.name == f"chat {MODEL}")
    assert traceparent_fields(sims[0].traceparents[-1])[1] == call.span_id


def test_a_grpc_callers_traceparent_metadata_is_the_parent() -> None:
    import grpc

    from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc

    with otlp_receiver() as receiver:
        with grpc_service([QUICK, QUICK], lambda urls: tracing_config(urls, receiver.url)) as service:
            with grpc.insecure_channel(service.grpc_target) as channel:
                stub = pb_grpc.CompletionsStub(channel)
                request = pb.ChatRequest(model=MODEL, messages=[pb.Message(role="user", content="Hi")], options=pb.Options(max_tokens=8))
                chunks = list(stub.ChatStream(request, metadata=(("traceparent", CALLER_TRACEPARENT),), timeout=10))
                assert chunks
        spans = receiver.received()  # the service stopped on leaving grpc_service: its spans were flushed
    names = tree(spans)
    assert names["tailguard.v1.Completions/ChatStream"] == "(caller)"
    assert names[f"chat {MODEL}"] == "tailguard.v1.Completions/ChatStream"
    root = next(span for span in spans if span.name == "tailguard.v1.Completions/ChatStream")
    assert root.trace_id == CALLER_TRACE and root.parent_id == CALLER_SPAN
    assert (root.attributes["rpc.system"], root.attributes["rpc.method"], root.attributes["rpc.grpc.status_code"]) == ("grpc", "ChatStream", 0)


# -- off costs nothing; on is switched live --------------------------------------------------


def test_with_tracing_off_the_sdk_is_never_imported() -> None:
    """The server's modules, a switch built from the shipped (off) [tracing]: no OpenTelemetry loaded."""
    program = (
        "import sys\n"
        "import tailguard.server.app, tailguard.server.cli, tailguard.server.http.api, tailguard.server.grpc.api\n"
        "from tailguard.router.config.load import load_config\n"
        "from tailguard.server.trace_switch import TracingSwitch\n"
        f"config = load_config({str(SHIPPED)!r})\n"
        "assert TracingSwitch(config.tracing, grace=lambda: 1.0)() is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry') or m == 'tailguard.router.observe.tracing'))\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


async def test_a_reload_switches_tracing_on_and_off_live(autojump_clock: trio.testing.MockClock) -> None:
    switch = TracingSwitch(TracingConfig(), grace=lambda: 120.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(switch.run)
        assert switch() is None
        on = TracingConfig(enabled=True, endpoint="http://127.0.0.1:9/v1/traces")
        switch.apply(on)
        first = switch()
        assert first is not None and first.config == on
        switch.apply(on)
        assert switch() is first  # the same table: the same tracer
        switch.apply(dataclasses.replace(on, sample_ratio=0.5))
        second = switch()
        assert second is not None and second is not first
        switch.apply(TracingConfig())
        assert switch() is None
        await trio.sleep(121)  # the retired tracers' requests are over: shut down meanwhile
        nursery.cancel_scope.cancel()


# -- [tracing] in config.toml -----------------------------------------------------------------


def shipped_with(table: str) -> str:
    return SHIPPED.read_text(encoding="utf-8") + "\n" + table


def test_tracing_is_off_in_the_shipped_config_and_its_commented_example_parses() -> None:
    text = SHIPPED.read_text(encoding="utf-8")
    assert parse_config(text).tracing == TracingConfig()
    start = text.index("# [tracing]")
    block = text[start : text.index("\n\n", start)].splitlines()
    example = [line[2:] for line in block if line == "# [tracing]" or (line.startswith("# ") and " = " in line)]
    config = parse_config(text + "\n" + "\n".join(example) + "\n")
    assert config.tracing.enabled and config.tracing.sample_ratio == 0.1
    assert config.tracing.headers == (("authorization", "Bearer ..."),)


def test_tracing_table_is_read_checked_and_shown_without_header_values() -> None:
    config = parse_config(shipped_with(
        '[tracing]\nenabled = true\nendpoint = "https://otel.example:4318/v1/traces"\nsample_ratio = 0.25\n'
        'service_name = "edge"\nheaders = { "X-Api-Key" = "s3cret" }\n'
    ))
    assert config.tracing == TracingConfig(True, "https://otel.example:4318/v1/traces", 0.25, "edge", (("x-api-key", "s3cret"),))
    shown = render_config(config)
    assert "x-api-key (values not shown)" in shown and "s3cret" not in shown
    with pytest.raises(ConfigError) as refused:
        parse_config(shipped_with(
            '[tracing]\nendpoint = "otel:4318"\nsample_ratio = 1.5\nservice_name = " "\nheaders = { "bad name" = "v", ok = 7, "x" = "line\\nbreak" }\nratio = 1\n'
        ))
    problems = "\n".join(refused.value.problems)
    for expected in (
        "tracing.endpoint: must be an http:// or https:// URL",
        "tracing.sample_ratio: must be at most 1",
        "tracing.service_name: must not be empty",
        'tracing.headers."bad name": must be an HTTP header name',
        "tracing.headers.ok: must be a string, got an integer (its value is not shown)",
        "tracing.headers.x: must be printable ASCII",
        "tracing.ratio: unknown key",
    ):
        assert expected in problems, problems
    assert "line" not in problems


def test_a_reload_summary_names_the_tracing_keys_that_changed() -> None:
    old = parse_config(SHIPPED.read_text(encoding="utf-8"))
    new = parse_config(shipped_with('[tracing]\nenabled = true\nheaders = { "authorization" = "Bearer t" }\n'))
    summary = summarize(old, new)
    assert "tracing.enabled" in summary and "tracing.headers" in summary and "Bearer" not in summary


async def test_a_reload_turns_tracing_on_for_the_requests_after_it(tmp_path: Path) -> None:
    from tailguard.router.config import load_config

    with otlp_receiver() as receiver:
        async with trio.open_nursery() as nursery:
            urls = []
            for _ in range(2):
                engine = Engine(QUICK)
                await nursery.start(engine.run)
                urls.append(f"http://127.0.0.1:{await nursery.start(serve_sim, SimApp(engine, model=MODEL).handle, '127.0.0.1', 0)}")
            shipped = SHIPPED.read_text(encoding="utf-8").replace("http://127.0.0.1:8001", urls[0]).replace("http://127.0.0.1:8002", urls[1])
            path = tmp_path / "config.toml"
            path.write_text(shipped)
            async with tailguard(load_config(path), path) as running:
                assert running.reloader is not None
                assert (await stream_chat(running.http_url, headers={"x-request-id": "before"}))[0] == 200
                path.write_text(shipped + f'\n[tracing]\nenabled = true\nendpoint = "{receiver.url}"\n')
                assert await running.reloader.reload()
                assert (await stream_chat(running.http_url, headers={"x-request-id": "after"}))[0] == 200
            nursery.cancel_scope.cancel()
        spans = receiver.received()
    roots = [span for span in spans if span.name == "POST /v1/chat/completions"]
    assert [root.attributes["tailguard.request_id"] for root in roots] == ["after"]


def test_the_tracing_page_s_toml_snippet_is_a_valid_tracing_table() -> None:
    page = (SHIPPED.parent / "docs" / "tracing.md").read_text(encoding="utf-8")
    snippet = page.split("```toml\n", 1)[1].split("```", 1)[0]
    tracing = parse_config(shipped_with(snippet)).tracing
    assert tracing.enabled and tracing.sample_ratio == 0.1 and tracing.endpoint.endswith(":4318/v1/traces")
