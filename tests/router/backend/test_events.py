"""The HTTP relay checks every framed SSE event as the gRPC front end reads it (issue 20, defect 5).

A stream event whose data is not a JSON object (nor ``[DONE]``) ends the
relay with BadBackendReply, the events before it relayed whole; the verdict
is the one ``server/grpc/sse.py`` plus ``json.loads`` (the gRPC path) reach, for
any stream, wherever the backend's reads cut it.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, strategies as st

from tailguard.router.backend import MAX_EVENT_BYTES, BackendClient, EventFilter
from tailguard.router.errors import BadBackendReply
from tailguard.server.grpc.sse import SseDecoder
from tailguard.sim.canned import canned_transport

GOOD = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
DONE = b"data: [DONE]\n\n"
BAD_EVENTS = {
    "unterminated_json": b"data: {not json\n\n",
    "json_words": b"data: {not json}\n\n",
    "binary": b"data: \x00\x01\xfe\xff\x89PNG\n\n",
    "invalid_utf8_in_a_string": b'data: {"choices":[{"delta":{"content":"\xff\xfe"}}]}\n\n',
    "a_json_array": b"data: [1, 2]\n\n",
    "a_json_number": b"data: 42\n\n",
    "empty_data": b"data:\n\n",
    "crlf_framed": b"data: {oops\r\n\r\n",
    "two_data_lines_that_are_not_json": b'data: {"a":\ndata: \n\n',
}


async def relay(body: list[bytes], *, drop_usage: bool = False) -> tuple[bytes, Exception | None]:
    """What ``chunks`` relays of a backend stream sent as ``body``'s reads, and what it raised."""

    async def reads() -> object:
        for read in body:
            yield read

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=reads())  # type: ignore[arg-type]

    backend = BackendClient("http://gpu-0:8000", max_concurrency=1, connect_timeout=1.0, transport=canned_transport(handler))
    response = await backend.open("/v1/chat/completions", {}, {}, stream=True)
    relayed: list[bytes] = []
    raised: Exception | None = None
    try:
        await response.start()
        async for chunk in response.chunks(drop_usage=drop_usage):
            relayed.append(chunk)
    except BadBackendReply as error:
        raised = error
    finally:
        await response.aclose()
        await backend.aclose()
    return b"".join(relayed), raised


@pytest.mark.parametrize("bad", BAD_EVENTS.values(), ids=list(BAD_EVENTS))
@pytest.mark.parametrize("drop_usage", [False, True], ids=["usage_kept", "usage_dropped"])
async def test_an_event_that_is_not_json_ends_the_stream_after_the_events_before_it(bad: bytes, drop_usage: bool) -> None:
    for reads in ([GOOD + bad + GOOD + DONE], [GOOD, bad, GOOD, DONE], [GOOD + bad[:7], bad[7:] + DONE]):
        relayed, raised = await relay(reads, drop_usage=drop_usage)
        assert relayed == GOOD, reads  # whole events before it, nothing of it or after it
        assert isinstance(raised, BadBackendReply) and "stream event" in raised.message, raised


async def test_good_streams_pass_unchanged_in_any_framing() -> None:
    streams = [
        GOOD * 3 + DONE,
        b": a comment\n\nevent: message\n" + GOOD + b"id: 7\n" + DONE,
        GOOD.replace(b"\n\n", b"\r\n\r\n") + b"data: [DONE]\r\n\r\n",
        b'data: {"choices":[{"delta":{"content":"caf\xc3\xa9 \xe2\x9c\x93"},"finish_reason":"stop"}]}\n\n' + DONE,
        b'data:{"a":\ndata: 1}\n\n' + GOOD + DONE,  # data lines joined by a newline: one JSON object
        b'data:  { "choices" : [] }  \n\n' + DONE,  # whitespace json.loads allows
    ]
    for stream in streams:
        relayed, raised = await relay([stream[i : i + 5] for i in range(0, len(stream), 5)])
        assert (relayed, raised) == (stream, None)


def grpc_verdict(stream: bytes) -> int | None:
    """How many events the gRPC path accepts before the first it refuses (None: it refuses none)."""
    decoder = SseDecoder()
    for index, data in enumerate(decoder.feed(stream)):
        if data == b"[DONE]":
            continue
        try:
            if not isinstance(json.loads(data), dict):
                return index
        except (ValueError, RecursionError):
            return index
    return None


PIECES = [GOOD, DONE, b": ping\n\n", b"event: x\n" + GOOD, GOOD.replace(b"\n\n", b"\r\n\r\n"), b'data: {"a":\ndata: 2}\n\n', *BAD_EVENTS.values()]


@given(
    events=st.lists(st.sampled_from(PIECES), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=1, max_value=2000), max_size=8),
)
def test_the_http_relay_reaches_the_grpc_verdict_wherever_the_reads_cut(events: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(events)
    points = sorted({cut for cut in cuts if cut < len(stream)})
    reads = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)])]
    check = EventFilter()
    relayed = b"".join(check.feed(read) for read in reads)
    refused_at = grpc_verdict(stream)
    assert (check.refused is not None) == (refused_at is not None), (stream, check.refused)
    if refused_at is None:
        assert relayed + check.flush() == stream
    else:  # the events before the refused one, whole: as many as gRPC turned into chunks
        assert stream.startswith(relayed) and len(SseDecoder().feed(relayed)) == refused_at


def test_an_event_without_an_end_is_refused_past_the_cap() -> None:
    check = EventFilter()
    assert check.feed(GOOD) == GOOD
    piece = b"x" * 65536
    fed = [check.feed(b"data: " + piece)] + [check.feed(piece) for _ in range(MAX_EVENT_BYTES // len(piece) + 1)]
    assert not any(fed) and check.refused is not None and "without its end" in check.refused
    assert check.feed(GOOD) == b""  # nothing passes after a refusal


FINISH = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"!"},"finish_reason":"length"}]}\n\n'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2},"system_fingerprint":"vllm-0.32.0-x"}\n\n'


@given(cuts=st.lists(st.integers(min_value=1, max_value=len(GOOD + FINISH + USAGE + DONE) - 1), max_size=4, unique=True))
def test_dropped_usage_leaves_its_fingerprint_on_the_last_choice_event(cuts: list[int]) -> None:
    """vLLM puts system_fingerprint on the usage event when usage is asked: a caller who did not ask gets it on
    the finishing event, as vLLM sends it then (issue 33, D1), wherever the reads cut the stream."""
    stream = GOOD + FINISH + USAGE + DONE
    bounds = [0, *sorted(cuts), len(stream)]
    events = EventFilter(drop_usage=True)
    relayed = b"".join(events.feed(stream[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)) + events.flush()
    payloads = [line[6:] for line in relayed.split(b"\n") if line.startswith(b"data: ")]
    assert payloads[-1] == b"[DONE]"
    parsed = [json.loads(payload) for payload in payloads[:-1]]
    assert [event["choices"][0]["finish_reason"] for event in parsed] == [None, "length"]
    assert parsed[-1]["system_fingerprint"] == "vllm-0.32.0-x" and "system_fingerprint" not in parsed[0]
