"""Server-sent events: split a relayed byte stream back into ``data:`` payloads.

The HTTP front end relays a backend's SSE bytes untouched; the gRPC front end
needs the events themselves to turn them into protobuf chunks.
"""

from __future__ import annotations

DONE = "[DONE]"


class SseDecoder:
    """Incremental: feed chunks as they arrive, get the complete events' data."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        """The ``data`` of every event completed by ``chunk`` (multi-line data joined by newlines)."""
        buffer = self._pending + chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        *events, self._pending = buffer.split(b"\n\n")
        out: list[str] = []
        for event in events:
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines).decode("utf-8"))
        return out
