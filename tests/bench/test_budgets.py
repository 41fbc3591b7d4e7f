"""The budget benchmark's arithmetic on synthetic requests: the most tokens in a sliding minute, its bins, phases and verdict."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.budgets.model import Options, Sent, phases
from bench.budgets.numbers import answer_times, bin_rows, phase_rows, retry_after, verdict
from bench.harness.windows import Event, binned, per_minute, sliding_max, static_share_rate, stepped_sums, within_target


def brute_max(events: list[Event], window: float = 60.0, step: float = 0.01, span: float = 300.0) -> int:
    """The most tokens in ``[t, t + window)`` over a fine grid of t (the slow, obvious way)."""
    return max(sum(n for at, n in events if t <= at < t + window) for t in (k * step - window for k in range(int((span + window) / step))))


def test_sliding_max_finds_the_window_a_grid_finds_and_the_gaps_between() -> None:
    rng = random.Random(7)
    events = [(round(rng.uniform(0, 240), 2), rng.randint(1, 1000)) for _ in range(80)]
    most = sliding_max(events)
    assert most.tokens == brute_max(events, step=0.01, span=240)
    assert most.tokens == sum(n for at, n in events if most.start <= at < most.start + 60)


def test_a_window_is_half_open_so_events_60_s_apart_never_share_one() -> None:
    assert sliding_max([(0.0, 500), (60.0, 700)]).tokens == 700
    assert sliding_max([(0.0, 500), (59.99, 700)]).tokens == 1200
    assert sliding_max([]).tokens == 0


def test_whole_second_windows_can_miss_what_the_exact_max_sees() -> None:
    # 0.5 and 60.4 share a window starting at 0.5 s, but no window [k - 60, k) on whole seconds holds both
    events = [(0.5, 100), (60.4, 100)]
    assert sliding_max(events).tokens == 200
    assert max(total for _, total in stepped_sums(events, until=61)) == 100
    assert stepped_sums([(0.5, 100), (1.5, 10)], until=1, window=2.0) == [(1.0, 100), (2.0, 110), (3.0, 10)]


def test_bins_and_rates() -> None:
    events = [(0.0, 1), (9.99, 2), (10.0, 4), (25.0, 8), (31.0, 16)]
    assert binned(events, 10.0, until=30.0) == [3, 4, 8]
    assert per_minute(events, 0.0, 30.0) == pytest.approx(15 * 2)
    # static shares 0.25 of 100k: the busy replicas are held at 25k each, the quiet one gets what it asks for
    assert static_share_rate([110_000, 50_000, 30_000, 10_000], 0.25, 100_000) == 85_000


def test_the_target_allows_one_largest_request_over_the_budget() -> None:
    assert within_target(101_000, 100_000, 1_000)
    assert not within_target(101_001, 100_000, 1_000)


def options(duration: float = 100.0) -> Options:
    return Options(
        duration=duration, kill_at=30.0, outage_at=50.0, outage_s=20.0, load=2.0, budget=10_000, prompt_tokens=200, max_tokens=800,
        spread=(0.5, 0.5), victim=1, static_share=0.5, lease_ttl=2.0, sync_interval=0.05, queue_timeout=5.0, seats=64, time_scale=1.0,
        drain=5.0, seed=1, out=Path("unused"),
    )


def test_phases_cut_the_run_at_the_kill_and_the_outage() -> None:
    assert [(p.name, p.start, p.end) for p in phases(options())] == [
        ("steady", 0.0, 30.0), ("after kill", 30.0, 50.0), ("Redis stopped", 50.0, 70.0), ("after outage", 70.0, 100.0)
    ]


def sent(number: int, replica: str, at: float, status: int = 200, tokens: int = 1000, code: str = "") -> Sent:
    return Sent(number, replica, at, reserve=1000, sent=at, ended=at + 1, status=status, code=code, tokens=tokens)


def test_verdict_and_tables_on_a_run_at_the_bound_and_one_token_past_it() -> None:
    o = options()
    # 11 admitted of 1,000 tokens within 60 s against a 10,000 budget: exactly the budget and one largest request
    run = [sent(i, "r0" if i % 2 else "r1", i * 5.0) for i in range(11)]
    run += [sent(11, "r0", 56.0, status=429, tokens=0, code="token_budget_exceeded"), sent(12, "r1", 57.0, status=0, tokens=0)]
    v = verdict(run, o.budget, until=o.duration)
    assert (v.most, v.largest, v.bound, v.met) == (11_000, 1_000, 11_000, True)
    assert v.most_with_unanswered == 12_000  # the unanswered one at its reservation
    assert retry_after(run)["refused"] == 1 and answer_times(run) == {"min_s": 1.0, "p50_s": 1.0, "max_s": 1.0}
    run.append(sent(13, "r0", 58.0, tokens=1))
    assert not verdict(run, o.budget, until=o.duration).met
    bins = bin_rows(o, run)
    assert [b["admitted"] for b in bins[:6]] == [2000, 2000, 2000, 2000, 2000, 1001]
    assert bins[5]["budget_429"] == 1 and bins[5]["trailing_minute"] == 11_001
    assert bins[0]["by_replica"] == {"r0": 1000, "r1": 1000}
    steady = phase_rows(o, run)[0]  # 0-30 s: 6 requests of 1,000 tokens, 12,000 a minute
    assert (steady["admitted_per_min"], steady["utilisation"]) == (12_000, 1.2)
    assert steady["offered_by_replica"] == {"r0": 6000, "r1": 6000}
    assert steady["static_share_per_min"] == 10_000  # 0.5 of 10,000 each, both asking more
    # the trailing minute at 1..30 s: 1,000 for 5 s, 2,000 for 5 s, ... 6,000: a mean of 3,500
    assert (steady["window_fullness"], steady["most_trailing_minute"]) == (0.35, 6000)
