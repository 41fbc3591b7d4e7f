"""bench retry: its pure pieces (histogram, synchronization, the summary, ratios, verdicts, the config), the SDK's attempts as the hooks see them, and a tiny real run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import httpx2
import openai
import pytest
import trio

from bench.retry.measure import Result, measure
from bench.retry.model import Options
from bench.retry.report import comparisons, render, targets
from bench.retry.sdk import Attempt, Attempts, Logical, send
from bench.retry.setups import router_config
from bench.retry.stats import autocorrelation, detrended, histogram, ratio, summarise, synchrony
from tailguard.router.config import parse_config


def test_histogram_counts_each_time_in_its_bin_and_drops_those_outside() -> None:
    assert histogram([0.0, 0.1, 0.25, 0.49, 0.5, 0.9, 1.0, -0.1], 0.0, 1.0, 0.25) == [2, 2, 1, 1]
    assert histogram([5.3, 5.4, 6.0], 5.0, 5.6, 0.25) == [0, 2, 0]  # a partial last bin counts as a bin
    assert histogram([1.0], 2.0, 2.0, 0.25) == []


def test_synchrony_tells_a_wave_every_second_from_an_even_stream() -> None:
    even = synchrony([2] * 40, 0.25, 1.0)
    assert (even.peak_to_mean, even.cv, even.dispersion) == (1.0, 0.0, 0.0) and math.isnan(even.autocorrelation)
    waves = synchrony([8, 0, 0, 0] * 10, 0.25, 1.0)  # the same 80 retries, all in one bin a second
    assert waves.mean == 2.0 and waves.peak_to_mean == 4.0 and waves.dispersion == pytest.approx(6.0)
    assert waves.autocorrelation > 0.8 and waves.echo > 0.8 and waves.echo_lag_s == 1.0  # each wave echoes one second later
    assert waves.allan == pytest.approx(19 * 64 / 39 / 4)
    assert even.allan == 0.0


def test_the_allan_factor_ignores_a_rate_that_grows_where_the_dispersion_does_not() -> None:
    ramp = synchrony([i // 4 for i in range(80)], 0.25, 1.0)  # one more retry a bin each second: no wave
    assert ramp.dispersion > 3 and ramp.allan < 0.1
    assert detrended([1, 2, 3, 4, 5], 1)[1:4] == [0.0, 0.0, 0.0]  # a straight line has nothing left inside its ends
    assert math.isnan(synchrony([], 0.25, 1.0).mean) and math.isnan(synchrony([0, 0], 0.25, 1.0).dispersion)


def test_autocorrelation_is_negative_for_alternation_and_nan_past_the_series() -> None:
    assert autocorrelation([1, 0] * 10, 1) < -0.8
    assert math.isnan(autocorrelation([1, 2, 3], 3)) and math.isnan(autocorrelation([1, 2], 0))


def test_ratio_is_nan_without_a_denominator() -> None:
    assert ratio(1.0, 4.0) == 0.25
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0))


def _logicals() -> list[Logical]:
    served_after_two = Logical(0, 1.0, [Attempt(1.0, 0, 429, "3"), Attempt(4.0, 1, 503, "4"), Attempt(8.1, 2, 200)], "ok", 9.0)
    served_at_once = Logical(1, 2.0, [Attempt(2.0, 0, 200)], "ok", 3.0)
    refused_throughout = Logical(2, 3.0, [Attempt(3.0, 0, 429, "1"), Attempt(4.0, 1, 429, "1")], "gave_up", 5.0)
    warming_up = Logical(3, 0.5, [Attempt(0.5, 0, 200)], "ok", 1.5)  # arrived before the window: not counted
    cut = Logical(4, 3.5, [Attempt(3.5, 0, 0)])
    return [served_after_two, served_at_once, refused_throughout, warming_up, cut]


def test_summarise_counts_fates_second_rejections_and_time_to_success_in_the_window() -> None:
    numbers = summarise("computed", _logicals(), (1.0, 5.0), 1.0, 1.0)
    assert (numbers.logical, numbers.succeeded, numbers.gave_up, numbers.cut) == (4, 2, 1, 1)
    assert (numbers.attempts, numbers.admitted, numbers.first_rejections, numbers.second_rejections) == (7, 2, 2, 2)
    assert numbers.second_rejections_per_admitted == 1.0 and numbers.attempts_per_logical == 7 / 4
    assert (numbers.success_p50_s, numbers.success_p99_s) == (1.0, 8.0)
    assert numbers.hints == {"1": 2, "3": 1, "4": 1} and numbers.refusals == {429: 3, 503: 1}
    # the histogram is of every attempt sent in the window, whoever sent it: 8.1 is past it
    assert numbers.first_bins == [1, 1, 2, 0] and numbers.retry_bins == [0, 0, 0, 2]


def test_targets_and_ratios_compare_computed_with_fixed() -> None:
    base = summarise("computed", _logicals(), (1.0, 5.0), 0.5, 1.0)
    computed = dataclasses.replace(base, retry_synchrony=synchrony([2] * 40, 0.25, 1.0))
    fixed = dataclasses.replace(
        base, name="fixed", second_rejections_per_admitted=1.5, success_p99_s=4.0, retry_synchrony=synchrony([8, 0, 0, 0] * 10, 0.25, 1.0)
    )
    verdicts = {t.name: t.met for t in targets([computed, fixed])}
    assert verdicts == {"second rejections per admitted request": True, "P99 time to success": False, "no synchronized retry waves": True}
    assert comparisons([computed, fixed])["second rejections per admitted"] == pytest.approx(1.0 / 1.5)
    assert comparisons([computed, fixed])["time to success P99"] == 2.0
    assert targets([computed]) == [] and comparisons([fixed]) == {}


def test_the_config_of_each_set_up_parses_with_its_hint() -> None:
    options = Options(seats=4, max_queue=6, queue_timeout_gpu=2.0, time_scale=3.0)
    for hint in ("computed", "fixed"):
        config = parse_config(router_config(18000, 18001, 18002, options, hint=hint))
        assert config.timeouts.retry_after_hint == hint and config.timeouts.retry_after == 1.0
        ((pool,), (klass,)) = config.pools, config.classes
        assert (pool.max_concurrency, pool.max_queue) == (4, 6)
        assert klass.queue_timeout == 6.0


async def test_the_hooks_see_each_attempt_the_sdk_sends_after_the_retry_after_it_was_given(autojump_clock: trio.testing.MockClock) -> None:
    answers = iter([(429, "3"), (503, "2"), (200, None)])

    def handler(request: httpx2.Request) -> httpx2.Response:
        status, retry_after = next(answers)
        if status != 200:
            return httpx2.Response(status, headers={"retry-after": retry_after or ""}, json={"error": {"message": "full"}})
        choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
        return httpx2.Response(200, json={"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]})

    attempts = Attempts(trio.current_time())
    http = httpx2.AsyncClient(
        transport=httpx2.MockTransport(handler), event_hooks={"request": [attempts.on_request], "response": [attempts.on_response]}
    )
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", max_retries=2, http_client=http)
    logical = attempts.by_id["r-7"] = Logical(7, 0.0)
    await send(client, logical, "r", 1, 8)
    assert logical.outcome == "ok"
    assert [(a.retry, a.status, a.retry_after) for a in logical.attempts] == [(0, 429, "3"), (1, 503, "2"), (2, 200, None)]
    sent = [a.sent for a in logical.attempts]
    assert sent[1] - sent[0] == pytest.approx(3.0, abs=0.01) and sent[2] - sent[1] == pytest.approx(2.0, abs=0.01)  # as told, no jitter
    await client.close()


@pytest.mark.trio
async def test_a_tiny_run_refuses_some_and_the_sdk_retries_them(tmp_path: Path) -> None:
    options = Options(
        seats=2,
        max_queue=2,
        queue_timeout_gpu=2.0,
        time_scale=1.0,
        load=2.0,
        warmup=0.3,
        seconds=1.5,
        drain=3.0,
        max_retries=1,
        out=tmp_path,
    )
    result = await measure(options, Result(["test"], "code", {}))
    computed, fixed = result.setups
    for numbers in (computed, fixed):
        assert numbers.logical >= 8 and numbers.succeeded > 0 and numbers.errors == 0
        assert numbers.first_rejections > 0 and numbers.attempts > numbers.logical  # refused, and retried
        assert numbers.succeeded + numbers.gave_up + numbers.cut == numbers.logical
    assert set(fixed.hints) == {"1"}  # every fixed hint is retry_after
    result.targets = targets(result.setups)
    report = render(result)
    assert "## Targets" in report and "| computed |" in report and "## Arrival histogram" in report
