"""server/grpc/sse.py: events however the stream is cut, within a cap (its speed: ``python -m bench sse_decoder``)."""

from __future__ import annotations

import pytest

from tailguard.router.errors import BadBackendReply
from tailguard.server.grpc.sse import DONE, MAX_EVENT_BYTES, SseDecoder

STREAM = (
    b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
    b": a comment\n"
    b"event: message\r\n"
    b'data: {"choices":[{"delta":{"content":"lo"}}]}\r\n\r\n'
    b"data: first line\ndata:second line\n\n"
    b"data: [DONE]\n\n"
)
EVENTS = [b'{"choices":[{"delta":{"content":"Hel"}}]}', b'{"choices":[{"delta":{"content":"lo"}}]}', b"first line\nsecond line", DONE]


def test_events_whole_and_cut_at_every_byte() -> None:
    assert SseDecoder().feed(STREAM) == EVENTS
    for cut in range(len(STREAM) + 1):
        decoder = SseDecoder()
        assert decoder.feed(STREAM[:cut]) + decoder.feed(STREAM[cut:]) == EVENTS, cut
    decoder = SseDecoder()
    assert [event for byte in range(len(STREAM)) for event in decoder.feed(STREAM[byte : byte + 1])] == EVENTS


def test_a_long_line_in_small_pieces_is_one_whole_event() -> None:
    """Whether that stays linear in the line's size is a CPU-speed claim: ``python -m bench sse_decoder`` measures it."""
    piece = bytes(range(32, 127)) * 11  # 1,045 bytes, no line end
    decoder = SseDecoder(max_event_bytes=2 * 1024 * 1024)
    assert decoder.feed(b"data: ") == []
    for _ in range(1000):
        assert decoder.feed(piece) == []
    assert decoder.feed(b"\n\n") == [piece * 1000]


def test_an_event_over_the_cap_is_a_bad_reply() -> None:
    decoder = SseDecoder()
    decoder.feed(b"data: ")
    piece = b"x" * 65536
    with pytest.raises(BadBackendReply, match="without an end"):
        for _ in range(2 * MAX_EVENT_BYTES // len(piece)):
            decoder.feed(piece)
    # Many lines, each small, adding up to too much for one event.
    decoder = SseDecoder(max_event_bytes=1000)
    with pytest.raises(BadBackendReply, match="event over 1000 bytes"):
        for _ in range(100):
            decoder.feed(b"data: " + b"y" * 50 + b"\n")
    # Under the cap, events of any count pass.
    decoder = SseDecoder(max_event_bytes=1000)
    assert len(decoder.feed((b"data: " + b"z" * 900 + b"\n\n") * 50)) == 50
