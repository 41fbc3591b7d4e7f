"""``tailguard advise``: candidate splits and lending rules replayed in virtual time, and the recommendation."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tailguard.router.config import load_config
from tailguard.server import SHIPPED_CONFIG
from tailguard.server.advise.access_log import (
    BAD_TIME,
    NO_SIZE,
    NOT_ACCESS,
    NOT_JSON,
    OUTSIDE,
    REJECTED,
    arrivals_from_access_log,
    read_access_log,
)
from tailguard.server.advise.fleet import fleet_from
from tailguard.server.advise.prefixes import Seen, with_prefixes
from tailguard.server.advise.replay.fleet import Arrival
from tailguard.server.advise.report import advice_json, report, snippet
from tailguard.server.advise.simulate import Fate, stats_of
from tailguard.server.advise.traffic import arrivals_from_trace, seen_in_trace
from tailguard.server.advise.verdict import Advice, advise
from tailguard.sim.tokens import count_chat_tokens

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_TRACE = ROOT / "bench" / "results" / "tail" / "example-trace.jsonl"

# Two engines whose batch pool holds at most 8 requests (a pool that fills, as
# 32-seat pools do in the issue): what lending can help with.
SMALL_POOLS = """
[pools.interactive]
max_concurrency = 64
max_queue = 256
max_model_len = 32768
models = ["sim-llama-3.1-8b"]
simulate_profile = "latency"
endpoints = [{ url = "http://127.0.0.1:8001", max_concurrency = 64 }]

[pools.batch]
max_concurrency = 8
max_queue = 512
max_model_len = 32768
models = ["sim-llama-3.1-8b"]
simulate_profile = "throughput"
endpoints = [{ url = "http://127.0.0.1:8002", max_concurrency = 8 }]

[classes.interactive]
pool = "interactive"
max_prompt_tokens = 500
max_output_tokens = 128
queue_timeout = 3.0
priority = 0

[classes.batch]
pool = "batch"
queue_timeout = 30.0
priority = 1
"""


@pytest.fixture(scope="module")
def example_advice() -> tuple[Advice, float]:
    """advise on the committed example trace with 4 engines, and the wall seconds it took."""
    started = time.perf_counter()
    advice = advise(fleet_from(load_config(SHIPPED_CONFIG), 4), arrivals_from_trace(EXAMPLE_TRACE, 120.0), source="example")
    return advice, time.perf_counter() - started


def test_example_trace_recommends_a_split_in_seconds(example_advice: tuple[Advice, float]) -> None:
    advice, wall = example_advice
    assert wall < 30  # ~1 s alone on a laptop core; bounded loosely for a busy CI machine
    assert advice.arrivals == 239 and advice.dropped == 0
    assert advice.ideal.short_failed == advice.shared.short_failed == 0 and advice.ideal.short_n == 196
    splits = {(p.candidate.interactive, p.candidate.batch) for p in advice.predictions}
    assert splits == {(0, 4), (1, 3), (2, 2), (3, 1)}  # (0, 4): every engine in one shared pool
    assert sum(not p.candidate.lends and not p.candidate.shared for p in advice.predictions) == 3  # one static candidate per split
    shared_pool = next(p for p in advice.predictions if p.candidate.shared)
    assert not shared_pool.meets  # one pool for both classes keeps the example's short requests beside its documents
    # Mixing both classes on every engine is what the split is for: round robin inflates short P99.
    assert advice.shared.short_e2e_p99 > 1.5 * advice.ideal.short_e2e_p99
    best = advice.recommended
    assert advice.met and best.meets
    assert best.e2e_ratio <= 1.25 and best.ttft_ratio <= 2.0
    assert best.stats.short_failed == 0 and best.stats.long_ok == best.stats.long_n > 0
    # The best long goodput of those within the bounds.
    assert best.stats.long_goodput == max(p.stats.long_goodput for p in advice.predictions if p.meets)
    # A split that starves the batch pool loses long goodput against round robin.
    three_one = next(p for p in advice.predictions if p.candidate.name == "3:1 static")
    assert three_one.goodput_ratio < best.goodput_ratio


def test_lending_never_loses_long_goodput_on_the_example(example_advice: tuple[Advice, float]) -> None:
    """Work conservation: each lending rule predicts at least its static split's long goodput."""
    advice, _ = example_advice
    static = {(p.candidate.interactive, p.candidate.batch): p.stats.long_goodput for p in advice.predictions if not p.candidate.lends}
    lending = [p for p in advice.predictions if p.candidate.lends]
    assert lending
    for p in lending:
        assert p.stats.long_goodput >= static[(p.candidate.interactive, p.candidate.batch)] - 1e-9, p.candidate.name


def _long_heavy(seconds: float) -> list[Arrival]:
    """One short request a second, three long documents a second (2,021 prompt tokens, 512 out)."""
    arrivals = [Arrival(0, t / 3, "long", True, 2021, 512) for t in range(int(seconds * 3))]
    arrivals += [Arrival(0, t + 0.5, "short", True, 20, 64) for t in range(int(seconds))]
    arrivals.sort(key=lambda a: a.at)
    return [Arrival(i, a.at, a.kind, True, a.prompt_tokens, a.max_tokens) for i, a in enumerate(arrivals)]


def test_lending_seats_waiting_batch_requests_on_idle_interactive_engines(tmp_path: Path) -> None:
    """A batch pool at its cap with the interactive engine idle: lending finishes long work sooner."""
    path = tmp_path / "config.toml"
    path.write_text(SMALL_POOLS)
    advice = advise(fleet_from(load_config(path), None), _long_heavy(20.0))
    static = next(p for p in advice.predictions if p.candidate.name == "1:1 static")
    lenders = [p for p in advice.predictions if p.candidate.lends]
    assert static.stats.long_ok == static.stats.long_n  # no long request failed: only their pace differs
    # Every replayed request ends, the last one too (a finite replay used to cut it off now and then).
    assert advice.ideal.short_failed == advice.shared.short_failed == 0
    assert advice.ideal.short_n == advice.shared.short_n == 20
    for p in lenders:
        assert p.stats.long_goodput >= static.stats.long_goodput, p.candidate.name
    generous = next(p for p in lenders if p.candidate.rule == "lend any idle")
    assert generous.stats.long_goodput > 1.5 * static.stats.long_goodput
    # The price is paid by the short requests that share the lender's steps.
    assert generous.stats.short_ttft_p99 > static.stats.short_ttft_p99
    assert generous.stall_ms == pytest.approx(2048 / 25)


def test_cli_prints_the_table_and_the_snippet() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tailguard.server", "advise", "--trace", str(EXAMPLE_TRACE), "--engines", "4", "--config", str(SHIPPED_CONFIG)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Recommended: " in out and "short-only ideal" in out and "shared round robin" in out
    assert "python -m bench" not in out  # the real-time check is a benchmark's (bench.tail.advise_check), in a checkout only
    toml_text = out.split("```toml\n", 1)[1].split("```", 1)[0]
    pools = tomllib.loads(toml_text)["pools"]
    assert len(pools["interactive"]["endpoints"]) + len(pools["batch"]["endpoints"]) == 4
    assert "lend" in pools["interactive"]


def test_cli_refuses_a_missing_trace(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tailguard.server", "advise", "--trace", str(tmp_path / "none.jsonl"), "--engines", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "none.jsonl" in done.stderr


def test_snippet_for_a_lending_candidate_is_a_config_fragment(example_advice: tuple[Advice, float]) -> None:
    advice, _ = example_advice
    candidate = next(p.candidate for p in advice.predictions if p.candidate.name.startswith("2:2 lend") and p.candidate.lend.max_seats)
    pools = tomllib.loads(snippet(advice.fleet, candidate))["pools"]
    assert [e["max_concurrency"] for e in pools["interactive"]["endpoints"]] == [256, 256]
    assert pools["interactive"]["max_concurrency"] == 512 and pools["batch"]["max_concurrency"] == 512
    assert pools["interactive"]["lend"]["to"] == ["batch"]
    assert pools["interactive"]["lend"]["max_seats"] == candidate.lend.max_seats


def test_access_log_lines_become_arrivals(tmp_path: Path) -> None:
    """Arrival = the line's time less its E2E; class names the short ones; other lines skipped."""

    def line(ts: str, klass: str, prompt: int | None, max_tokens: int, e2e_ms: float) -> str:
        fields = {"prompt_tokens_est": prompt, "max_tokens": max_tokens, "class": klass, "e2e_ms": e2e_ms, "status": 200}
        return json.dumps({"ts": ts, "level": "INFO", "logger": "tailguard.access", "msg": "http chat 200 ok", **fields})

    log = tmp_path / "tailguard.log"
    log.write_text(
        "\n".join([
            line("2025-01-01T00:00:10.500Z", "batch", 2000, 512, 8000.0),  # arrived at 2.5
            json.dumps({"ts": "2025-01-01T00:00:03.000Z", "level": "INFO", "logger": "tailguard.reload", "msg": "reloaded"}),
            line("2025-01-01T00:00:03.000Z", "interactive", 20, 64, 500.0),  # arrived at 2.5 too
            line("2025-01-01T00:00:04.000Z", "interactive", None, 64, 1.0),  # refused before it was read
            "not json",
            line("2025-01-01T00:00:05.250Z", "interactive", 30, 32, 250.0),  # arrived at 5.0
        ])
        + "\n"
    )
    arrivals = arrivals_from_access_log(log, "interactive", 120.0)
    assert [(a.kind, a.prompt_tokens, a.max_tokens) for a in arrivals] == [("long", 2000, 512), ("short", 20, 64), ("short", 30, 32)]
    assert [a.at for a in arrivals] == pytest.approx([0.0, 0.0, 2.5])
    assert [a.index for a in arrivals] == [0, 1, 2]
    assert arrivals_from_access_log(log, "interactive", 1.0)[-1].at == 0.0  # --seconds bounds the replay


def test_an_access_log_says_how_much_of_it_was_used_and_why_not_the_rest(tmp_path: Path) -> None:
    """Every line read is used or skipped for a named reason; a rejected request (the caller's
    mistake) is not replayed even when its size is known, a busy or failed one is (it is demand)."""

    def line(ts: str, prompt: int | None, outcome: str = "ok", reason: str | None = None, **more: object) -> str:
        fields = {"prompt_tokens_est": prompt, "max_tokens": 64, "class": "interactive", "e2e_ms": 100.0, "outcome": outcome, "reason": reason}
        return json.dumps({"ts": ts, "level": "INFO", "logger": "tailguard.access", "msg": "-", **fields, **more})

    log = tmp_path / "tailguard.log"
    log.write_text(
        "\n".join([
            line("2025-01-01T00:00:01.000Z", 20),
            line("2025-01-01T00:00:02.000Z", 30, "overloaded", "queue_full"),  # demand: replayed
            line("2025-01-01T00:00:03.000Z", 40, "backend_error", "backend_timeout"),  # demand: replayed
            line("2025-01-01T00:00:03.500Z", 50, "rejected", "model_not_found"),  # sized, but no split serves it
            line("2025-01-01T00:00:04.000Z", None, "rejected", "unauthenticated"),
            line("2025-01-01T00:00:04.100Z", None, "rejected", "unauthenticated"),
            line("2025-01-01T00:00:04.200Z", None, "overloaded", "server_busy"),  # refused before its body was read
            line("yesterday", 20),
            line("2025-01-01T00:01:00.000Z", 20),  # 59 s after the first: outside a 30 s window
            json.dumps({"ts": "2025-01-01T00:00:03.000Z", "level": "INFO", "logger": "tailguard.reload", "msg": "reloaded"}),
            "Traceback (most recent call last):",
            "",
        ])
        + "\n"
    )
    arrivals, _, usage = read_access_log(log, "interactive", 30.0)
    assert [a.prompt_tokens for a in arrivals] == [20, 30, 40]
    assert (usage.lines, usage.used) == (11, 3)
    assert [(why, n, detail) for why, n, detail in usage.skipped] == [
        (NOT_JSON, 1, ""),
        (NOT_ACCESS, 1, ""),
        (REJECTED, 3, "unauthenticated 2, model_not_found 1"),
        (NO_SIZE, 1, "server_busy 1"),
        (BAD_TIME, 1, ""),
        (OUTSIDE, 1, ""),
    ]
    assert usage.used + sum(n for _, n, _ in usage.skipped) == usage.lines
    summary = usage.summary("tailguard.log")
    # The window cut one line: the seconds used read against the log's, from the first arrival (0.9 s) to the last (59.9 s).
    assert summary.startswith("tailguard.log: used 3 of 11 lines, 2.0 of 59 s of arrivals; 8 skipped: 1 not JSON; 1 not an access line; 3 an error outcome")
    assert "[unauthenticated 2, model_not_found 1]" in summary and "1 after the replayed window" in summary
    assert json.loads(json.dumps(usage.as_json()))["skipped"][2] == {"why": REJECTED, "lines": 3, "detail": "unauthenticated 2, model_not_found 1"}
    clean = tmp_path / "clean.log"
    clean.write_text(line("2025-01-01T00:00:01.000Z", 20) + "\n")
    assert read_access_log(clean, "interactive", 30.0)[2].summary("clean.log") == "clean.log: used 1 of 1 lines, 0.0 s of arrivals, none skipped"


def test_stats_count_failed_short_requests_as_slowest() -> None:
    fates = [Fate("short", 0.0, True, 0.01, 0.5)] * 98 + [Fate("short", 0.0, False, None, None)] * 2
    fates += [Fate("long", 1.0, True, 0.1, 9.0), Fate("long", 2.0, False, None, None)]
    stats = stats_of(fates)
    assert stats.short_failed == 2 and math.isinf(stats.short_e2e_p99) and math.isinf(stats.short_ttft_p99)
    assert stats.long_ok == 1 and stats.long_goodput == pytest.approx(1 / 10.0)
    assert stats_of(fates[:98]).short_e2e_p99 == 0.5


def test_cli_replays_an_access_log(tmp_path: Path) -> None:
    """The example trace written as tailguard's access lines gives the same traffic, and advice."""
    start = 1_735_689_600.0  # 2025-01-01T00:00:00Z
    lines = []
    for row in map(json.loads, EXAMPLE_TRACE.read_text().splitlines()):
        end = start + row["at"] + 0.25
        stamp = datetime.fromtimestamp(end, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        klass = "interactive" if row["class"] == "short" else "batch"
        fields = {"class": klass, "prompt_tokens_est": row["prompt_tokens"], "max_tokens": row["max_tokens"], "e2e_ms": 250.0}
        lines.append(json.dumps({"ts": stamp, "level": "INFO", "logger": "tailguard.access", "msg": "http chat 200 ok", **fields}))
    log = tmp_path / "tailguard.log"
    log.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "tailguard.server", "advise", "--access-log", str(log), "--engines", "4", "--config", str(SHIPPED_CONFIG), "--keep-thresholds"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "239 requests over 3.0 s" in done.stdout and "Recommended: 1:3 static" in done.stdout
    assert done.stdout.startswith(f"{log}: used 239 of 239 lines, 3.0 s of arrivals, none skipped\n")  # how much of the log the advice rests on
    assert "[pools.batch]" in done.stdout


def _grouped_log(path: Path, requests: int = 48) -> Path:
    """An access log of ``requests`` requests, 4 a second, a quarter long: two prefix groups (warm ones found 256
    and 128 tokens cached) and unique ones."""
    start = 1_735_689_600.0  # 2025-01-01T00:00:00Z
    lines = []
    for i in range(requests):
        group, cached = [("aaaa0000aaaa0000", 256), ("bbbb1111bbbb1111", 128), (None, None)][i % 3]
        fields = {
            "class": "interactive" if i % 4 else "batch",
            "prompt_tokens_est": 300 + 4 * i if i % 4 else 1500,
            "max_tokens": 32 if i % 4 else 256,
            "e2e_ms": 100.0,
            "prefix_group": group,
            "cached_tokens": cached if i >= 3 else None,  # the first of each group was cold: vLLM leaves the zero out
        }
        stamp = datetime.fromtimestamp(start + i / 4 + 0.1, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        lines.append(json.dumps({"ts": stamp, "level": "INFO", "logger": "tailguard.access", "msg": "http chat 200 ok", **fields}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_logged_prefix_group_replays_as_one_shared_text_and_no_group_as_unique(tmp_path: Path) -> None:
    arrivals, seen, _ = read_access_log(_grouped_log(tmp_path / "tailguard.log"), "interactive", 120.0)
    assert [s.group for s in seen[:3]] == ["aaaa0000aaaa0000", "bbbb1111bbbb1111", None]
    assert [s.cached for s in seen[:4]] == [None, None, None, 256]
    replayed, sharing = with_prefixes(arrivals, seen)
    assert all(count_chat_tokens([a.text or ""]) == a.prompt_tokens for a in replayed)  # each its own length, by the simulator's rule
    first, second, unique = ([a for a, s in zip(replayed, seen) if s.group == g] for g in ("aaaa0000aaaa0000", "bbbb1111bbbb1111", None))
    # 256 cached tokens are 1,024 characters of shared text, 128 are 512; then each request's own 12-character nonce.
    assert len({a.text[:1024] for a in first if a.text}) == 1 and len({a.text[:1036] for a in first if a.text}) == len(first)
    assert len({a.text[:512] for a in second if a.text}) == 1 and len({a.text[:524] for a in second if a.text}) == len(second)
    assert first[0].text and second[0].text and first[0].text[:16] != second[0].text[:16]
    assert len({a.text[:12] for a in unique if a.text}) == len(unique) and all(a.prefix_hint is None for a in unique)
    assert {a.prefix_hint for a in first} == {"aaaa0000aaaa0000"}  # placed as one key, as the log's key was
    assert (sharing.requests, sharing.grouped, sharing.shared, sharing.groups, sharing.assumed) == (48, 32, 32, 2, 0)
    # No line of a group reported cached_tokens: nothing shared unless assumed (the group still placed as one).
    silent = [Seen(s.group, None) for s in seen]
    assert with_prefixes(arrivals, silent)[1].shared == 0
    assumed, counted = with_prefixes(arrivals, silent, assume=128)
    assert counted.shared == 32 and counted.assumed == 2 and counted.tokens_p50 == 128
    assert len({a.text[:512] for a in assumed if a.prefix_hint == "aaaa0000aaaa0000" and a.text}) == 1
    assert len({a.text[:524] for a in assumed if a.prefix_hint == "aaaa0000aaaa0000" and a.text}) == 16


def test_modelling_the_cache_predicts_prefix_hits_that_unique_prompts_do_not(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(SMALL_POOLS)
    fleet = fleet_from(load_config(config), 4)
    arrivals, seen, _ = read_access_log(_grouped_log(tmp_path / "tailguard.log"), "interactive", 120.0)
    cached = advise(fleet, arrivals, seen=seen)
    unique = advise(fleet, arrivals)
    assert cached.sharing is not None and cached.sharing.shared == 32 and unique.sharing is None
    by_name = {p.candidate.name: p.stats for p in cached.predictions}
    for p in unique.predictions:
        assert p.stats.prefix_queries == by_name[p.candidate.name].prefix_queries > 0  # the same prompt tokens looked up
        assert p.stats.prefix_hits == 0 and by_name[p.candidate.name].prefix_hit_rate > 0.1, p.candidate.name
    # Prefix affinity keeps each group on one home per pool: one cold request per group and pool, every other one hits
    # its group's whole share (the two groups' 12 short and 4 long requests share 256 and 128 tokens).
    assert by_name["2:2 static"].prefix_hits == (11 + 3) * 256 + (11 + 3) * 128
    assert by_name["2:2 static"].prefix_hits > cached.shared.prefix_hits  # round robin over the 4 engines finds them colder
    assert "32 of 48 replayed requests in 2 prefix groups" in report(cached) and "| prefix hit rate |" in report(cached)
    assert "not modelled (--no-prefix-cache)" in report(unique)
    assert advice_json(cached)["candidates"][0]["prefix_hit_rate"] == pytest.approx(cached.predictions[0].stats.prefix_hit_rate)


def test_cli_no_prefix_cache_replays_unique_prompts(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(SMALL_POOLS)
    log = _grouped_log(tmp_path / "tailguard.log", 60)  # advise recommends on 50 requests or more
    args = [sys.executable, "-m", "tailguard.server", "advise", "--access-log", str(log), "--config", str(config), "--keep-thresholds"]
    runs = [subprocess.run([*args, *more], cwd=ROOT, capture_output=True, text=True, timeout=120) for more in ([], ["--no-prefix-cache"])]
    assert all(done.returncode == 0 for done in runs), [done.stderr for done in runs]
    assert "40 of 60 replayed requests in 2 prefix groups" in runs[0].stdout
    assert "Prefix cache: not modelled (--no-prefix-cache)" in runs[1].stdout


def test_a_trace_that_carries_prefix_fields_gives_them_in_its_arrivals_order(tmp_path: Path) -> None:
    rows = [
        {"at": 0.5, "prompt_tokens": 300, "max_tokens": 16, "class": "short", "prefix_group": "aa", "cached_tokens": 64},
        {"at": 0.25, "prompt_tokens": 400, "max_tokens": 16, "class": "short"},  # bench tail's own rows carry none
        {"at": 9.0, "prompt_tokens": 300, "max_tokens": 16, "class": "short", "prefix_group": "aa"},  # past --seconds
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arrivals, seen = arrivals_from_trace(trace, 5.0), seen_in_trace(trace, 5.0)
    assert [a.prompt_tokens for a in arrivals] == [400, 300]
    assert seen == [Seen(), Seen("aa", 64)]


def test_traffic_without_a_short_request_is_advised_by_long_goodput_alone() -> None:
    """All long (the Mooncake trace by the shipped thresholds): nothing to protect, so the most long work wins."""
    fleet = fleet_from(load_config(SHIPPED_CONFIG), 4)
    long_only = [a for a in arrivals_from_trace(EXAMPLE_TRACE, 120.0) if a.kind == "long"]
    advice = advise(fleet, long_only, source="long only")
    assert advice.met and all(p.meets for p in advice.predictions) and math.isnan(advice.ideal.short_e2e_p99)
    best = advice.recommended
    assert best.stats.long_goodput == max(p.stats.long_goodput for p in advice.predictions)
    shared_pool = next(p for p in advice.predictions if p.candidate.shared)
    assert shared_pool.goodput_ratio >= 0.97  # one pool of every engine does round robin's long work
    text = snippet(fleet, shared_pool.candidate)
    parsed = tomllib.loads(text)
    assert list(parsed["pools"]) == ["batch"] and len(parsed["pools"]["batch"]["endpoints"]) == 4
    assert {k: v["pool"] for k, v in parsed["classes"].items()} == {"interactive": "batch", "batch": "batch"}


def test_the_report_says_how_much_of_the_traffic_is_short() -> None:
    fleet = fleet_from(load_config(SHIPPED_CONFIG), 4)
    arrivals = arrivals_from_trace(EXAMPLE_TRACE, 120.0)
    mostly_long = [a for i, a in enumerate(arrivals) if a.kind == "long" or i % 10 == 0]
    advice = advise(fleet, mostly_long, source="mostly long")
    short = sum(a.kind == "short" for a in mostly_long) / len(mostly_long)
    assert advice.short_share == pytest.approx(short) and short < 0.5
    text = report(advice)
    assert f"Short by the file's thresholds: {short:.0%} of the requests" in text and "compare the shared pool's row" in text
    assert "compare the shared pool's row" not in report(advise(fleet, arrivals, source="example"))  # 82% short there
