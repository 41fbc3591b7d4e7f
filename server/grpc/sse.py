"""Server-sent events: split a relayed byte stream back into ``data:`` payloads.

The HTTP front end relays a backend's SSE bytes untouched (checked event by
event in ``router/backend/client.py``'s ``EventFilter``, which reads an event's data
as this decoder does); the gRPC front end needs the events themselves to turn
them into protobuf chunks.

Decoding is linear in the stream's size: each byte is searched for a line end
once, however the stream is cut into chunks (a partial line is kept, never
scanned again). And it is bounded: a backend that sends an event (or a line)
over ``max_event_bytes`` gets BadBackendReply, not the router's memory.
Lines end with LF or CRLF, as vLLM and every OpenAI-compatible server send.
"""

from __future__ import annotations

from tailguard.router.backend import MAX_EVENT_BYTES as MAX_EVENT_BYTES
from tailguard.router.errors import BadBackendReply

DONE = b"[DONE]"


class SseDecoder:
    """Incremental: feed chunks as they arrive, get the complete events' data."""

    __slots__ = ("_pending", "_scanned", "_data", "_size", "_max")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._pending = bytearray()  # the start of a line whose end has not come yet
        self._scanned = 0  # bytes of _pending known to hold no line end
        self._data: list[bytes] = []  # the data lines of the event being read
        self._size = 0  # their total size
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        """The ``data`` of every event completed by ``chunk`` (multi-line data joined by newlines).

        Raises BadBackendReply when an event or a line grows over the cap.
        """
        pending = self._pending
        data: bytes | bytearray
        if pending:
            pending += chunk
            data, position = pending, self._scanned
        else:
            data, position = chunk, 0
        events: list[bytes] = []
        start = 0
        find = data.find
        while (end := find(b"\n", position)) >= 0:
            line = data[start:end]
            start = position = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:  # a blank line ends the event
                if self._data:
                    events.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                    self._data = []
                    self._size = 0
            elif line.startswith(b"data:"):
                value = bytes(line[6:] if line.startswith(b"data: ") else line[5:])
                self._size += len(value)
                if self._size > self._max:
                    raise BadBackendReply(f"the backend sent a stream event over {self._max} bytes")
                self._data.append(value)
            # Other fields (event:, id:, retry:) and comments carry nothing the router needs.
        if data is pending:
            del pending[:start]
        elif start < len(data):
            pending += data[start:]
        self._scanned = len(pending)
        if self._scanned > self._max:
            raise BadBackendReply(f"the backend sent a stream line over {self._max} bytes without an end")
        return events
