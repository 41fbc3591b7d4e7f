"""An OTLP/HTTP traces receiver on 127.0.0.1 for tests: what a collector would get, decoded.

It runs in a thread of its own (stdlib ``ThreadingHTTPServer``), so a test
in Trio, or one whose service runs in another thread, can read what
tailguard's exporter (a thread of the OpenTelemetry SDK) sent. Each POST to
``/v1/traces`` is parsed as an ``ExportTraceServiceRequest`` with
opentelemetry-proto and answered with an empty ``ExportTraceServiceResponse``.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it came over the wire, with its resource's attributes."""

    span: Span
    resource: dict[str, object]

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def attributes(self) -> dict[str, object]:
        return _attributes(self.span.attributes)


@dataclass
class Receiver:
    url: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, object]:
    return {pair.key: _value(pair.value) for pair in pairs}


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """A receiver on a free port; its ``url`` is the traces endpoint to configure."""
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            encoding = self.headers.get("content-encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            if self.path != PATH:
                self.send_response(404)
                self.end_headers()
                return
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            with receiver.lock:
                receiver.content_types.append(self.headers.get("content-type", ""))
                for resource_spans in request.resource_spans:
                    resource = _attributes(resource_spans.resource.attributes)
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(ReceivedSpan(span, resource) for span in scope_spans.spans)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}{PATH}")
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
