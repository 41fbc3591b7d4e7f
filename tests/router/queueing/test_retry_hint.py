"""Retry-After computed from the queue ahead and the pool's drain rate, clamped and spread (router/queueing/retry_hint.py)."""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import trio
import trio.testing

from tailguard.router.config import ConfigError, parse_config, render_config
from tailguard.router.errors import NoBackend, QueueFull, QueueTimeout
from tailguard.router.queueing import CEILING, RetryHints, whole_seconds
from tests.helpers.config_text import BASE
from tests.helpers.router import chat, router_over_engines, run_to_end, two_pool_config
from tests.router.queueing.test_queue import Slots


def test_a_hint_is_the_queues_drain_time_clamped_and_spread_over_half_of_it_again() -> None:
    hints = RetryHints(random.Random(7))
    waits = [hints.for_queue(ahead=9, drain_rate=2.0, floor=1.0) for _ in range(200)]
    assert all(5.0 <= wait < 7.5 for wait in waits)  # 10 seats at 2 a second: 5 s, spread to 7.5
    assert max(waits) - min(waits) > 2.0 and len({whole_seconds(w) for w in waits}) == 3  # 5, 6 and 7 s on HTTP
    assert hints.for_queue(ahead=0, drain_rate=100.0, floor=2.0) >= 2.0  # the configured value is a floor
    assert hints.for_queue(ahead=10_000, drain_rate=1.0, floor=1.0) == CEILING
    unmeasured = [hints.for_queue(ahead=5, drain_rate=None, floor=3.0) for _ in range(50)]
    assert all(3.0 <= wait < 4.5 for wait in unmeasured) and len(set(unmeasured)) > 25  # nothing measured: the floor, spread
    assert hints.spread(math.inf, 1.0) == CEILING
    assert hints.for_queue(ahead=10_000, drain_rate=1.0, floor=90.0) == 90.0  # a floor over 60 s holds, unspread


def test_whole_seconds_round_up_and_never_say_zero() -> None:
    assert [whole_seconds(s) for s in (0.0, 0.4, 1.0, 1.01, 59.9)] == [1, 1, 1, 2, 60]


async def test_refusals_of_a_measured_queue_carry_when_a_seat_is_expected(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(1, max_waiting=4, rate=0.5)  # a seat every 2 s once all are taken
    slots.queue.get_nowait(0, None)
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(partial(slots.queue.get, 0, math.inf, None, retry_after=1.0))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFull) as full:
            await slots.queue.get(0, math.inf, None, retry_after=1.0)
        assert 10.0 <= full.value.retry_after < 15.0  # 4 ahead and itself, 2 s each
        assert f"retry after {whole_seconds(full.value.retry_after)} s" in full.value.message
        with pytest.raises(QueueTimeout) as late:
            await slots.queue.get(0, trio.current_time(), None, retry_after=1.0)
        assert 10.0 <= late.value.retry_after < 15.0
        nursery.cancel_scope.cancel()


async def test_no_backend_says_when_the_soonest_ejection_ends(autojump_clock: trio.testing.MockClock) -> None:
    config = two_pool_config(interactive_cap=2, interactive_timeout=30.0)
    async with router_over_engines(config) as fleet:
        endpoint = fleet.router.pool("interactive").endpoints[0]
        endpoint.ejected_until = trio.current_time() + 7.0  # outlier detection has it out for 7 s more
        with pytest.raises(NoBackend) as caught:
            await run_to_end(fleet.router, chat("anyone?"))
        assert 7.0 <= caught.value.retry_after < 10.5
        endpoint.ejected_until = None
        endpoint.healthy = False  # down by the health check: it is looked at again within one interval (2 s)
        with pytest.raises(NoBackend) as down:
            await run_to_end(fleet.router, chat("anyone?"))
        assert 2.0 <= down.value.retry_after < 3.0


def test_retry_after_hint_fixed_gives_the_configured_value_as_before() -> None:
    hints = RetryHints(random.Random(1))
    hints.computed = False
    assert hints.for_queue(ahead=99, drain_rate=1.0, floor=1.0) == 1.0 and hints.spread(30.0, 2.0) == 2.0
    config = parse_config(BASE.replace("[timeouts]\n", '[timeouts]\nretry_after_hint = "fixed"\n', 1))
    assert config.timeouts.retry_after_hint == "fixed" and "fixed: retry_after" in render_config(config)
    assert parse_config(BASE).timeouts.retry_after_hint == "computed"
    with pytest.raises(ConfigError, match="timeouts.retry_after_hint"):
        parse_config(BASE.replace("[timeouts]\n", '[timeouts]\nretry_after_hint = "random"\n', 1))
