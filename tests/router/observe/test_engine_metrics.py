"""The engine's own per-request timings (vLLM's --enable-per-request-metrics), kept where it sends them (virtual time)."""

from __future__ import annotations

import trio
import trio.testing

from tailguard.router.observe import RequestRecord
from tests.helpers.router import chat, router_over_engines, two_pool_config


async def engine_timings(*, sent: bool, stream: bool, usage: bool = False) -> tuple[float | None, float | None, float | None]:
    """One request through a router over engines that send their per-request metrics (``sent``) or not: what its record kept."""
    async with router_over_engines(two_pool_config(), per_request_metrics=sent) as fleet:
        record = RequestRecord("r", "http", trio.current_time())
        params = {"stream_options": {"include_usage": True}} if usage else {}
        request = chat("hello", max_tokens=16, stream=stream, params=params)
        async with fleet.router.open(request, record=record) as completion:
            if stream:
                async for _ in completion.chunks():
                    pass
            else:
                await completion.read()
    return record.engine_queue, record.engine_ttft, record.engine_itl


async def test_the_engines_own_timings_are_kept_from_a_whole_answer_and_a_stream(autojump_clock: trio.testing.MockClock) -> None:
    for stream, usage in ((False, False), (True, True), (True, False)):  # a caller without usage: tailguard asks for it anyway
        queue, ttft, itl = await engine_timings(sent=True, stream=stream, usage=usage)
        assert queue is not None and queue >= 0, (stream, usage)
        assert ttft is not None and ttft > 0 and itl is not None and itl > 0, (stream, usage)


async def test_an_engine_that_sends_none_leaves_them_unknown(autojump_clock: trio.testing.MockClock) -> None:
    assert await engine_timings(sent=False, stream=False) == (None, None, None)
    assert await engine_timings(sent=False, stream=True, usage=True) == (None, None, None)

