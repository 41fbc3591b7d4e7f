"""bench tenants: its pure pieces (busy fraction, usage, arrivals, ratios, the config) and a tiny real run through tailguard."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import pytest

from bench.harness.report import Target
from bench.harness.short_chat import MAX_TOKENS, PROMPT_TOKENS
from bench.tenants.drive import Played
from bench.tenants.measure import Result, measure
from bench.tenants.model import KEYS, Options, ratio
from bench.tenants.probe import EngineLooks
from bench.tenants.report import p99_ratio, render, targets, weight_error
from bench.tenants.setups import router_config
from bench.tenants.stats import SetupNumbers, TenantNumbers, busy_fraction, summarise, tokens_served, waiting_in_engine
from bench.tenants.traffic import arrivals, bursting
from bench.tenants.usage import Served, TenantRequests, usage_of
from tailguard.router.config import parse_config

LOOKS = [(0.5, 8, 0), (1.0, 8, 2), (1.5, 4, 0), (2.0, 0, 0), (9.0, 8, 5)]


def test_busy_fraction_is_the_mean_share_of_seats_running_inside_the_window() -> None:
    assert busy_fraction(LOOKS, 8, 1.0, 2.5) == pytest.approx((8 + 4 + 0) / 3 / 8)
    assert busy_fraction(LOOKS, 8, 0.0, 1.0) == 1.0  # the end is excluded
    assert math.isnan(busy_fraction(LOOKS, 8, 3.0, 4.0))


def test_waiting_in_engine_is_the_mean_and_the_most_inside_the_window() -> None:
    assert waiting_in_engine(LOOKS, 0.0, 2.5) == (0.5, 2)
    mean, most = waiting_in_engine(LOOKS, 3.0, 4.0)
    assert math.isnan(mean) and most == 0


def test_tokens_served_count_only_usage_that_arrived_in_the_window() -> None:
    served = [Served(100.5, 64, 40), Served(101.5, 64, 33), Served(103.0, 64, 50)]
    assert tokens_served(served, 100.0, 1.0, 3.0) == (1, 64, 33)
    assert tokens_served(served, 100.0, 0.0, 10.0) == (3, 192, 123)


def test_usage_is_read_from_the_usage_event_and_nothing_else() -> None:
    event = {"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 40, "total_tokens": 104}}
    piece = b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\ndata: ' + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
    assert usage_of(piece) == (64, 40)
    assert usage_of(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n') is None
    assert usage_of(b'data: {"usage": broken\n\n') is None


def test_bursting_keeps_the_on_phases_of_each_cycle() -> None:
    assert bursting([0.0, 9.9, 10.0, 14.9, 15.0, 24.0, 26.0], 10.0, 5.0) == [0.0, 9.9, 15.0, 24.0]


def test_arrivals_are_seeded_b_steady_and_a_only_while_bursting() -> None:
    options = Options(seconds=60.0)
    solo, mixed = arrivals(options, with_a=False), arrivals(options, with_a=True)
    assert {a.kind for a in solo} == {"B"} and solo == [a for a in mixed if a.kind == "B"]
    assert mixed == arrivals(options, with_a=True)  # the same seed, the same run
    period = options.burst_on + options.burst_off
    a_times = [a.at for a in mixed if a.kind == "A"]
    assert all(t % period < options.burst_on for t in a_times)
    bursting_s = sum(min(options.burst_on, max(0.0, options.horizon - start)) for start in range(0, int(options.horizon), int(period)))
    assert len(a_times) / bursting_s == pytest.approx(options.a_burst * options.capacity, rel=0.15)
    assert len(solo) / options.horizon == pytest.approx(options.b_load * options.capacity, rel=0.2)
    assert all(MAX_TOKENS[0] <= a.max_tokens <= MAX_TOKENS[1] and a.prompt == PROMPT_TOKENS for a in mixed)
    assert len({a.max_tokens for a in mixed}) > 10  # lengths vary: seats do not free in lockstep
    assert [a.measured for a in mixed] == [a.at >= options.warmup for a in mixed]


def test_the_config_is_tailguards_own_with_both_keys_their_weights_and_the_order() -> None:
    text = router_config(
        18000, 18001, 18002, Options(seats=4, time_scale=4.0), order="arrival", weights={"A": 3.0, "B": 1.0}, queue_timeout=3.0
    )
    config = parse_config(text)
    (pool,) = config.pools
    assert pool.queue_order == "arrival" and pool.max_concurrency == 4
    keys = {key.name: key for key in config.auth.keys}
    assert keys["A"].weight == 3.0 and keys["B"].weight == 1.0
    assert {name: key.sha256 for name, key in keys.items()} == {t: hashlib.sha256(KEYS[t].encode()).hexdigest() for t in ("A", "B")}
    assert "queue_timeout = 12" in text  # 3 GPU s, in real s at time scale 4


def test_tenant_requests_carry_the_key_and_are_unique_bodies() -> None:
    requests = TenantRequests(8000, "B", 1, "fair")
    raw = [requests.request(n, 40 + n % 3) for n in range(6)]
    bodies = []
    for one in raw:
        head, _, body = one.partition(b"\r\n\r\n")
        assert f"Authorization: Bearer {KEYS['B']}".encode() in head and f"Content-Length: {len(body)}".encode() in head
        bodies.append(json.loads(body))
    assert [b["max_tokens"] for b in bodies] == [40, 41, 42, 40, 41, 42]
    assert len({b["messages"][0]["content"] for b in bodies}) == 6
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)


def _tenant(p99_ttft: float, p99_e2e: float, tokens: int = 0) -> TenantNumbers:
    return TenantNumbers(10, {"ok": 10}, {"p50": 1.0, "p99": p99_ttft}, {"p50": 1.0, "p99": p99_e2e}, 10, tokens, 0)


def _setup(name: str, busy: float, **tenants: TenantNumbers) -> SetupNumbers:
    return SetupNumbers(name, name, dict(tenants), busy, 0.0, 0, 10, (0.0, 1.0), 1.0)


def test_ratios_and_weight_error() -> None:
    assert p99_ratio(_tenant(20, 500), _tenant(10, 400), "ttft") == 2.0
    assert p99_ratio(_tenant(20, 500), _tenant(10, 400), "e2e") == 1.25
    assert math.isnan(p99_ratio(None, _tenant(10, 400), "e2e"))
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0))
    assert weight_error(3000, 1000, (3.0, 1.0)) == 0.0
    assert weight_error(2000, 1000, (3.0, 1.0)) == pytest.approx(1 / 3)
    assert math.isnan(weight_error(10, 0, (3.0, 1.0)))


def test_targets_pass_and_miss_on_the_numbers() -> None:
    result = Result(["x"], "code", {})
    result.setups = [
        _setup("solo", 0.4, B=_tenant(10, 400)),
        _setup("fair", 0.96, B=_tenant(11, 600)),
        _setup("fifo", 1.0, B=_tenant(900, 3000)),
    ]
    result.weighted = _setup("weighted", 1.0, A=_tenant(1, 1, tokens=3100), B=_tenant(1, 1, tokens=1000))
    verdicts = {t.name: t.met for t in targets(result, (3.0, 1.0))}
    assert verdicts == {
        "B's TTFT P99, fair / solo": True,  # 1.1x
        "B's E2E P99, fair / solo": False,  # 1.5x
        "busy fraction, fair / fifo": True,  # 0.96
        "tokens served A:B, both backlogged": True,  # 3.1:1
    }
    result.setups = result.setups[:1]  # no fair run: a miss, never a pass on NaN
    assert not any(t.met for t in targets(result, (3.0, 1.0)) if "fair" in t.name)


def test_summarise_counts_the_window_and_the_failures() -> None:
    from bench.harness.open_loop import Sample

    samples = [
        Sample("B", True, 0.0, outcome="ok", ttft=0.03, e2e=0.3),
        Sample("B", False, 0.0, outcome="ok", ttft=9.0, e2e=9.0),  # warm-up: not counted
        Sample("A", True, 0.0, outcome="503", status=503, code="queue_timeout"),
        Sample("A", True, 0.0, outcome="cut"),
    ]
    played = Played(samples, {"A": [], "B": [Served(11.0, 64, 40)]}, EngineLooks(LOOKS), 10.0, 5.0)
    found = summarise("fair", "d", played, 8, 3.0, (0.0, 2.5))
    assert found.tenants["B"].ok == 1 and found.tenants["B"].ttft_ms["p99"] == pytest.approx(10.0)
    assert found.tenants["B"].tokens == 104
    assert (found.tenants["A"].failed, found.tenants["A"].cut) == (1, 1)
    assert found.outcome_codes["A"] == {"503 queue_timeout": 1}


@pytest.mark.trio
async def test_a_tiny_run_through_tailguard_serves_b_and_reports_every_part(tmp_path: Path) -> None:
    options = Options(
        seats=2, time_scale=1.0, a_burst=1.5, burst_on=1.0, burst_off=0.5, warmup=0.3, seconds=1.5, drain=4.0,
        backlog_seconds=1.5, backlog_warmup=0.3, backlog=3, out=tmp_path,
    )  # fmt: skip
    result = await measure(options, Result(["test"], "code", {}), setups=("fair",))
    (fair,) = result.setups
    b, a = fair.tenants["B"], fair.tenants["A"]
    assert b.requests >= 2 and b.ok == b.requests  # B is served, none refused
    assert b.tokens > 0 and b.ttft_ms["p99"] <= b.e2e_ms["p99"]
    assert a.requests > b.requests and a.ok > 0
    assert 0.3 < fair.busy <= 1.0 and fair.looks > 5
    assert fair.engine_waiting_max <= 1  # the pool's seats are the engine's: nothing queues inside it for long
    weighted = result.weighted
    assert weighted is not None and all(weighted.tenants[t].tokens > 0 for t in ("A", "B"))
    result.targets = targets(result, options.weights)
    report = render(dataclasses.replace(result, targets=[*result.targets, Target("x", "y", "z", True)]))
    assert "## Targets" in report and "| fair | B |" in report and "## Scenario 2" in report
