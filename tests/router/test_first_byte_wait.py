"""A stream's first byte is waited for as long as its engine's model predicts for the prompts ahead, at least
``first_byte_timeout`` (router/request_path.py ``FIRST_BYTE_SLACK``), in virtual time."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import trio
import trio.testing

from tailguard.router import errors
from tailguard.router.config import Config, LimitsConfig
from tailguard.router.fleet.first_byte_model import PRIOR_BASE_S, PRIOR_SECONDS_PER_TOKEN
from tailguard.router.request_path import FIRST_BYTE_SLACK
from tests.helpers.router import BATCH_URL, chat, run_to_end, two_pool_config
from tests.router.fleet.test_outlier import Handler, hang, ok, router_over

TIMEOUT = 1.0  # the batch pool's first_byte_timeout here
LONG_PROMPT = "word " * 6000  # ~7,500 estimated tokens: the prior predicts ~0.8 s, so 2x of it is past TIMEOUT


def config() -> Config:
    """The batch pool on one engine, ``TIMEOUT`` to a first byte."""
    base = two_pool_config(batch_urls=[BATCH_URL], limits=LimitsConfig(input_cap_tokens=8192))
    return dataclasses.replace(base, pools=(base.pool("interactive"), dataclasses.replace(base.pool("batch"), first_byte_timeout=TIMEOUT)))


def slow_by(seconds: float) -> Handler:
    async def slow(request: httpx.Request) -> httpx.Response:
        await trio.sleep(seconds)
        return await ok(request)

    return slow


async def test_a_long_prompts_first_byte_is_waited_for_as_its_prediction_says(autojump_clock: trio.testing.MockClock) -> None:
    """An engine that takes 1.3 s to a long prompt's first byte is slow, not hung: the prediction gives it longer."""
    async with router_over({BATCH_URL: slow_by(1.3)}, config()) as (router, calls):
        body, routing = await run_to_end(router, chat(LONG_PROMPT, max_tokens=256, stream=True))
        assert routing.pool == "batch" and body and calls[BATCH_URL] == 1


async def test_a_hung_engine_is_still_found_at_the_predicted_wait(autojump_clock: trio.testing.MockClock) -> None:
    """No first byte at all: the call fails at FIRST_BYTE_SLACK x the prediction, not the request's deadline; a short
    prompt's call at first_byte_timeout as before."""
    async with router_over({BATCH_URL: hang}, config()) as (router, _):
        started = trio.current_time()
        with pytest.raises(errors.BackendTimeout):
            await run_to_end(router, chat(LONG_PROMPT, max_tokens=256, stream=True))
        waited = trio.current_time() - started
        assert TIMEOUT < waited < 3 * TIMEOUT
        assert waited >= FIRST_BYTE_SLACK * PRIOR_BASE_S + FIRST_BYTE_SLACK * PRIOR_SECONDS_PER_TOKEN * 6000
        started = trio.current_time()
        with pytest.raises(errors.BackendTimeout):
            await run_to_end(router, chat("a job", max_tokens=256, stream=True))
        assert trio.current_time() - started == pytest.approx(TIMEOUT)
