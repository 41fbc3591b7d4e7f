"""The other APIs' streams cut cleanly at the end-to-end deadline: each ends with an error event of its own API's shape.

A Responses stream ends with ``event: error`` (type, code, message, param,
and OpenAI's error object beside them, which the openai SDK raises while
iterating); a Messages stream with Anthropic's ``event: error``, which the
anthropic SDK raises. The generation is aborted and the seat released.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tailguard.router.config import TimeoutsConfig
from tests.helpers.engines import MODEL
from tests.helpers.sockets import Backends, eventually, tailguard
from tests.server.http.test_api import config_for


def _events(text: str) -> list[tuple[str, dict[str, object]]]:
    """A stream's (event name, data) pairs."""
    pairs = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            pairs.append((lines.get("event", ""), json.loads(lines["data"])))
    return pairs


async def test_responses_and_messages_streams_end_with_their_own_error_event_at_the_deadline(two_engines: Backends) -> None:
    config = config_for(two_engines.urls, timeouts=TimeoutsConfig(end_to_end_timeout=0.5), batch_timeout=0.2, interactive_timeout=0.2)
    batch = two_engines.engines[1]
    assert batch is not None
    async with tailguard(config) as running, httpx.AsyncClient(base_url=running.http_url, timeout=10) as client:
        responses = await client.post("/v1/responses", json={"model": MODEL, "input": "Write at length.", "max_output_tokens": 1000, "stream": True})
        assert responses.status_code == 200
        name, last = _events(responses.text)[-1]
        assert name == "error" and last["type"] == "error" and last["code"] == "deadline_exceeded"
        messages = await client.post(
            "/v1/messages", json={"model": MODEL, "max_tokens": 1000, "stream": True, "messages": [{"role": "user", "content": "Write at length."}]}
        )
        assert messages.status_code == 200
        name, last = _events(messages.text)[-1]
        assert (name, last) == ("error", {"type": "error", "error": {"type": "timeout_error", "message": last["error"]["message"]}})  # type: ignore[index]
        await eventually(lambda: batch.statistics().aborted_total == 2 and not batch.statistics().running)
        await eventually(lambda: running.router.statistics().in_flight == 0)
        # Whole answers: 504 in each API's shape.
        whole = await client.post("/v1/messages", json={"model": MODEL, "max_tokens": 1000, "messages": [{"role": "user", "content": "Long."}]})
        assert whole.status_code == 504 and whole.json()["error"]["type"] == "timeout_error"
        assert whole.headers["x-should-retry"] == "false"


async def test_the_sdks_raise_the_error_event_of_a_cut_stream(two_engines: Backends) -> None:
    config = config_for(two_engines.urls, timeouts=TimeoutsConfig(end_to_end_timeout=0.5), batch_timeout=0.2, interactive_timeout=0.2)
    async with tailguard(config) as running:
        client = openai.AsyncOpenAI(base_url=running.http_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIError, match="deadline"):
            stream = await client.responses.create(model=MODEL, input="Write at length.", max_output_tokens=1000, stream=True)
            async for _ in stream:
                pass
        claude = anthropic.AsyncAnthropic(base_url=running.http_url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as raised:
            async with claude.messages.stream(model=MODEL, max_tokens=1000, messages=[{"role": "user", "content": "Write at length."}]) as events:
                async for _ in events:
                    pass
        assert "timeout_error" in str(raised.value.body)
        await client.close()
        await claude.close()
