"""Adaptive shedding (router/quotas/shed.py): who is shed, how much, and when it is forgotten."""

from __future__ import annotations

import random

from hypothesis import given, strategies as st

from tailguard.router.quotas import AdaptiveShed


def test_a_caller_whose_calls_are_accepted_is_never_shed() -> None:
    shed = AdaptiveShed(rng=random.Random(1))
    assert all(shed.admit("a", i * 0.001) for i in range(2000))
    assert shed.chance("a", 2.0) == 0.0


def test_a_burst_of_new_calls_is_not_shed_before_any_is_answered() -> None:
    """A call counts as accepted until it is refused: 500 calls at once from a new caller all get in."""
    shed = AdaptiveShed(rng=random.Random(1))
    assert all(shed.admit("new", 5.0) for _ in range(500))


def test_a_flooding_caller_reaches_the_router_at_about_twice_its_accepted_rate() -> None:
    """1,000 calls a second, the router accepts 50 a second of those that reach it: ~100 a second still reach it."""
    shed = AdaptiveShed(rng=random.Random(7))
    reached_in_last_second = accepted_in_last_second = 0
    room = 5.0  # the router: room for a call each 20 ms, up to 5 at once (its queue)
    for ms in range(5000):  # 5 s, a call each ms
        now = ms / 1000
        room = min(5.0, room + 1 / 20)
        if shed.admit("flood", now):
            if room >= 1:
                room -= 1
                accepted_in_last_second += ms >= 4000
            else:
                shed.refused("flood", now)
            reached_in_last_second += ms >= 4000
    assert 70 <= reached_in_last_second <= 140, reached_in_last_second
    assert accepted_in_last_second >= 45  # the router still gets (nearly) all the calls it has room for
    assert shed.chance("flood", 5.0) > 0.8


def test_one_callers_flood_does_not_shed_another_caller() -> None:
    shed = AdaptiveShed(rng=random.Random(3))
    for i in range(500):
        if shed.admit("flood", i * 0.001):
            shed.refused("flood", i * 0.001)
    assert shed.chance("flood", 0.5) > 0.9
    assert all(shed.admit("quiet", 0.5 + i * 0.001) for i in range(100))


def test_a_flood_is_forgotten_once_it_has_left_the_window() -> None:
    shed = AdaptiveShed(window=1.0, rng=random.Random(3))
    for i in range(500):  # 0-0.5 s, every call refused
        if shed.admit("flood", i * 0.001):
            shed.refused("flood", i * 0.001)
    assert shed.chance("flood", 0.6) > 0.9
    assert shed.chance("flood", 1.35) > 0.9  # its last 0.1 s step is still in the window
    assert shed.chance("flood", 1.45) == 0.0  # a second after it ended: all of it has left


def test_callers_beyond_the_cap_share_one_tally_and_quiet_ones_are_dropped() -> None:
    shed = AdaptiveShed(max_callers=3, rng=random.Random(3))
    for caller in ("a", "b", "c"):
        shed.admit(caller, 0.0)
    shed.admit("d", 0.5)  # over the cap, none quiet: shares the overflow tally
    assert shed.callers == 4  # a, b, c and the overflow
    for _ in range(100):  # "e" and "f" are both overflow: e's refusals shed f
        if shed.admit("e", 0.5):
            shed.refused("e", 0.5)
    assert shed.chance("f", 0.5) > 0.9
    shed.admit("g", 2.0)  # a, b, c have been quiet for a window: dropped, g has its own tally
    assert shed.chance("g", 2.0) == 0.0 and shed.callers <= 3


def test_a_few_calls_are_never_shed_however_many_were_refused() -> None:
    """Three calls, two refused (a full queue, a queue timeout): no flood, the fourth gets in."""
    shed = AdaptiveShed(rng=random.Random(0))
    for _ in range(3):
        shed.admit("few", 0.0)
    shed.refused("few", 0.0)
    shed.refused("few", 0.0)
    assert shed.chance("few", 0.0) == 0.0


@given(calls=st.integers(0, 1000), refused=st.integers(0, 1000))
def test_the_chance_is_a_probability_and_zero_while_at_most_half_were_refused(calls: int, refused: int) -> None:
    refused = min(refused, calls)
    shed = AdaptiveShed(min_calls=0, rng=random.Random(0))
    assert all(shed.admit("x", 0.0) for _ in range(calls))  # nothing refused yet: nothing shed
    for _ in range(refused):
        shed.refused("x", 0.0)
    chance = shed.chance("x", 0.0)
    assert 0.0 <= chance < 1.0
    assert chance == max(0.0, (2 * refused - calls) / (calls + 1))
    assert (chance == 0.0) == (2 * refused <= calls)
