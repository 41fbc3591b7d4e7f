"""One error table, two shapes: OpenAI's everywhere, Anthropic's on its routes; and the other APIs' streams read right."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from tailguard.router import error_spec, errors
from tailguard.router.backend.events import first_error_event, stream_ended
from tailguard.router.observe import RequestRecord
from tailguard.server.errors_map import http_error


@pytest.mark.parametrize(
    ("error", "status", "error_type"),
    [
        (errors.QueueFull("full", retry_after=2.0), 429, "rate_limit_error"),
        (errors.QueueTimeout("waited", retry_after=2.0), 529, "overloaded_error"),
        (errors.Draining("draining", retry_after=1.0), 529, "overloaded_error"),
        (errors.InvalidRequest("bad", param="max_tokens"), 400, "invalid_request_error"),
        (errors.ModelNotFound("no such model"), 404, "not_found_error"),
        (errors.Unauthenticated("no key"), 401, "authentication_error"),
        (errors.BodyTooLarge("big"), 413, "request_too_large"),
        (errors.DeadlineExceeded("late"), 504, "timeout_error"),
        (errors.InternalError("bug"), 500, "api_error"),
    ],
)
def test_anthropic_routes_answer_in_anthropics_shape_with_its_statuses(error: errors.TailguardError, status: int, error_type: str) -> None:
    rendered = http_error(error, "anthropic")
    assert rendered.status == status
    assert rendered.body == {"type": "error", "error": {"type": error_type, "message": error.message}}
    headers = dict(rendered.headers())
    assert (b"retry-after" in headers) == (error_spec.retry_after(error) is not None)
    # The same error on an OpenAI route keeps OpenAI's shape and status.
    openai_shape = http_error(error)
    assert set(openai_shape.body) == {"error"} and openai_shape.status == error_spec.http_status(error)


def test_a_retryable_anthropic_error_is_not_marked_final_and_a_late_one_is() -> None:
    assert (b"x-should-retry", b"false") not in http_error(errors.QueueTimeout("w", retry_after=1.0), "anthropic").headers()
    assert (b"x-should-retry", b"false") in http_error(errors.DeadlineExceeded("late"), "anthropic").headers()


def test_a_backends_anthropic_refusal_keeps_its_status_and_type() -> None:
    refused = errors.BackendRejected("max_tokens: field required", status=400, error_type="invalid_request_error")
    assert http_error(refused, "anthropic").body == {"type": "error", "error": {"type": "invalid_request_error", "message": refused.message}}


def test_an_anthropic_stream_ends_with_an_error_event_of_its_shape() -> None:
    event = http_error(errors.DeadlineExceeded("late"), "anthropic").sse_event()
    name, data = event.decode().strip().split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: "))["error"]["type"] == "timeout_error"


MESSAGE_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":12,"output_tokens":0}}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":12,"output_tokens":7}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)
RESPONSES_STREAM = (
    b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1","max_output_tokens":64,"usage":null}}\n\n'
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":9,"output_tokens":5}}}\n\n'
)


def test_the_other_apis_streams_end_with_their_own_last_event() -> None:
    assert stream_ended(MESSAGE_STREAM) and stream_ended(RESPONSES_STREAM)
    cut = MESSAGE_STREAM[: MESSAGE_STREAM.index(b"event: message_stop")]
    assert not stream_ended(cut)
    assert not stream_ended(RESPONSES_STREAM[: RESPONSES_STREAM.index(b"event: response.completed")])


def test_the_other_apis_error_events_are_the_backends_word() -> None:
    anthropic = b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"boom"}}\n\n'
    assert first_error_event(anthropic) == b'{"type":"error","error":{"type":"internal_error","message":"boom"}}'
    failed = b'event: response.failed\ndata: {"type":"response.failed","response":{"error":{"message":"x"}}}\n\n'
    assert first_error_event(failed) is not None
    assert first_error_event(MESSAGE_STREAM) is None and first_error_event(RESPONSES_STREAM) is None


@pytest.mark.parametrize(("stream", "prompt", "output"), [(MESSAGE_STREAM, 12, 7), (RESPONSES_STREAM, 9, 5)])
async def test_usage_is_read_from_the_last_count_in_a_read(stream: bytes, prompt: int, output: int) -> None:
    """Anthropic's stream opens with 0 output tokens and ends with the count: one read holding both counts the end."""
    record = RequestRecord("r", "http", 0.0)
    record.saw_chunk(stream)
    assert (record.input_tokens, record.completion_tokens) == (prompt, output)


async def test_a_responses_streams_first_token_is_its_first_output_event_not_its_opening(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM sends response.created and response.in_progress before the prefill: they are no first token."""
    record = RequestRecord("r", "http", trio.current_time())
    record.kind = "responses"
    record.saw_chunk(RESPONSES_STREAM[: RESPONSES_STREAM.index(b"event: response.output_text.delta")])
    assert record.first_token_at is None and record.response_id == "resp_1"
    await trio.sleep(0.5)
    record.saw_chunk(RESPONSES_STREAM[RESPONSES_STREAM.index(b"event: response.output_text.delta") :])
    assert record.first_token_at == record.arrival + 0.5


async def test_an_anthropic_prompts_cached_part_counts_and_a_cut_stream_counts_its_events() -> None:
    """vLLM's Anthropic input_tokens is the prompt's uncached part: the prompt is it plus the cache reads and writes.
    message_start's output count is 0: a stream cut before message_delta counts its token events instead."""
    cached = MESSAGE_STREAM.replace(
        b'"usage":{"input_tokens":12,"output_tokens":7}',
        b'"usage":{"input_tokens":12,"output_tokens":7,"cache_read_input_tokens":400,"cache_creation_input_tokens":16}',
    )
    record = RequestRecord("r", "http", trio.current_time())
    record.kind, record.stream = "messages", True
    record.saw_chunk(cached)
    assert (record.input_tokens, record.cached_tokens, record.completion_tokens) == (428, 400, 7)
    delta = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}\n\n'
    cut = RequestRecord("c", "http", trio.current_time())
    cut.kind, cut.stream = "messages", True
    opening = MESSAGE_STREAM[: MESSAGE_STREAM.index(b"event: content_block_delta")]
    cut.saw_chunk(opening + b'event: content_block_start\ndata: {"type":"content_block_start","index":0}\n\n' + delta * 3)
    cut.finish_tokens()
    assert cut.completion_tokens == 3 and cut.input_tokens == 12
