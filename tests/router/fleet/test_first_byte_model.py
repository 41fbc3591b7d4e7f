"""Each engine's time to a stream's first byte, learnt from its calls, and every prediction checked against what happened."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import trio
import trio.testing

from tailguard.router.fleet.first_byte_model import PRIOR_BASE_S, PRIOR_SECONDS_PER_TOKEN, FirstByteModel
from tailguard.router.observe import RequestRecord
from tests.helpers.router import INTERACTIVE_URL, chat, router_over_engines, two_pool_config


def test_it_fits_an_engines_line_from_calls_of_different_sizes_and_follows_a_change() -> None:
    model = FirstByteModel()
    assert model.predict(1_000) == pytest.approx(PRIOR_BASE_S + 1_000 * PRIOR_SECONDS_PER_TOKEN)
    rng = random.Random(3)
    for _ in range(200):  # 30 ms, then 40 µs a token (25 tokens a ms), with 5 % noise
        tokens = rng.randint(50, 8_000)
        model.learn(tokens, (0.03 + 4e-5 * tokens) * rng.uniform(0.95, 1.05))
    assert model.seconds_per_token == pytest.approx(4e-5, rel=0.1)
    assert model.base == pytest.approx(0.03, abs=0.015)
    assert model.predict(4_000) == pytest.approx(0.19, rel=0.05)
    for _ in range(100):  # the engine slows down twice over (a neighbour, a bigger model): the old calls fade
        tokens = rng.randint(50, 8_000)
        model.learn(tokens, 0.06 + 8e-5 * tokens)
    assert model.predict(4_000) == pytest.approx(0.38, rel=0.05)
    assert model.calls == 300


def test_calls_all_of_one_size_move_the_level_and_keep_a_sane_slope() -> None:
    model = FirstByteModel()
    for _ in range(100):
        model.learn(500, 0.5)
    assert model.predict(500) == pytest.approx(0.5, rel=0.02)
    assert 0 < model.seconds_per_token <= 1e-2 and model.base >= 0


def test_nonsense_is_not_learnt() -> None:
    model = FirstByteModel()
    model.learn(100, -1.0)
    model.learn(-5, 0.1)
    assert model.calls == 0 and model.base == PRIOR_BASE_S


async def test_the_router_predicts_each_streams_first_byte_and_learns_the_engine(autojump_clock: trio.testing.MockClock) -> None:
    """Over a simulated engine (25 prompt tokens a ms, one 2,048-token step at a time): streams of many sizes,
    some at once so that prompts queue. The prior (50 ms, 10,000 tokens a second) overestimates this fast
    engine; learnt, the model's predictions centre on what happens. Calls sent together share one step and
    get their first byte together, which a line in the tokens ahead cannot tell apart: single predictions
    stay rough (0.5-3x here), as tailguard_first_byte_prediction_ratio shows an operator.
    """
    config = two_pool_config(interactive_cap=8)
    records: list[RequestRecord] = []
    rng = random.Random(7)
    async with router_over_engines(config) as fleet:
        router = fleet.router

        sizes = [rng.randint(20, 200) for _ in range(120)]  # words: ~40 to ~450 estimated tokens, all interactive

        async def stream(index: int) -> None:
            request = chat(" ".join(f"w{index}x{n}" for n in range(sizes[index])), max_tokens=4, stream=True, request_id=f"s{index}")
            record = RequestRecord(request.request_id, "http", trio.current_time())
            async with router.open(request, record=record) as completion:
                async for _ in completion.chunks():
                    pass
            records.append(record)

        for wave in range(12):
            async with trio.open_nursery() as nursery:
                for index in range(1 + wave % 4):  # 1 to 4 at once
                    nursery.start_soon(stream, wave * 10 + index)
            await trio.sleep(0.5)
        model = router.endpoint(INTERACTIVE_URL).first_byte_model
    assert model.calls == len(records) == 30
    assert all(r.first_byte_seconds is not None and r.first_byte_predicted is not None for r in records)
    ratios = [r.first_byte_seconds / r.first_byte_predicted for r in records]  # type: ignore[operator]
    first = records[0]
    assert first.first_byte_predicted == pytest.approx(PRIOR_BASE_S + PRIOR_SECONDS_PER_TOKEN * (first.prompt_tokens or 0), rel=0.01)
    off = [abs(math.log(ratio)) for ratio in ratios]
    assert statistics.median(ratios[:5]) < 0.8  # the prior, before any call: too slow for this engine
    assert 0.6 < statistics.median(ratios[-15:]) < 1.6  # learnt: centred
    assert statistics.mean(off[-15:]) < statistics.mean(off[:5])  # and nearer than the prior was
    assert 1e-5 < model.seconds_per_token < 2e-4  # the engine's 4e-5, within what step sharing blurs
