"""``tailguard advise``'s class thresholds: proposals from the sizes seen, one rule to judge them, the report and the log converter."""

from __future__ import annotations

import json
import math
import random
import tomllib
from pathlib import Path

import pytest

from tailguard.router.admission import classify
from tailguard.router.config import load_config
from tailguard.server import SHIPPED_CONFIG
from tailguard.server.advise.access_log import read_access_log, write_log
from tailguard.server.advise.cli import main
from tailguard.server.advise.judge import PREDICTED_E2E_MAX, Figures, best, within
from tailguard.server.advise.replay.fleet import Arrival, Record
from tailguard.server.advise.thresholds import (
    MAX_SETS,
    MAX_SHARE,
    MIN_SHARE,
    NO_CLASS,
    Bounds,
    file_bounds,
    nice,
    propose,
    shares,
    with_bounds,
)
from tests.advise.test_planner import SMALL_POOLS

SHIPPED = Bounds("file's", 500, 128)


def _sizes(n: int = 4000, seed: int = 3) -> list[tuple[int, int]]:
    """Chat-like sizes: log-uniform prompts 20..8,000 and outputs 8..1,000, independent."""
    rng = random.Random(seed)
    return [
        (round(math.exp(rng.uniform(math.log(20), math.log(8000)))), round(math.exp(rng.uniform(math.log(8), math.log(1000)))))
        for _ in range(n)
    ]


def test_quantile_proposals_hit_their_short_shares_and_stay_bounded() -> None:
    sizes = _sizes()
    found = propose(sizes, SHIPPED)
    assert found[0] == SHIPPED and found[-1] == NO_CLASS and len(found) <= MAX_SETS
    quantile = found[1:-1]
    got = sorted(shares(sizes, b)[0] for b in quantile)
    assert shares(sizes, SHIPPED)[0] == pytest.approx(0.31, abs=0.01)
    assert got == [pytest.approx(0.2, abs=0.02), pytest.approx(0.5, abs=0.02), pytest.approx(0.8, abs=0.02)]
    # A 30% target would sit within 5 points of the file's 31%: it adds nothing and is not proposed.
    assert propose(sizes, Bounds("file's", 280, 69))[1:-1] == [b for b in quantile if b.label != "~20% short"]
    for b in quantile:
        assert b.prompt is not None and b.output is not None and b.prompt == nice(b.prompt)  # two significant figures
        # Both axes cut at one quantile level: neither bound is left wide open.
        assert max(p for p, _ in sizes) > b.prompt and max(o for _, o in sizes) > b.output


def test_no_proposal_puts_nearly_everything_in_one_class() -> None:
    same = [(300, 64)] * 500  # one size: any bound admits all or none of it
    assert propose(same, SHIPPED) == [SHIPPED, NO_CLASS]
    long_only = [(12_000 + i, 400) for i in range(500)]  # Mooncake-like: the file's admit nothing, the quantiles do
    found = propose(long_only, SHIPPED)
    assert shares(long_only, SHIPPED)[0] == 0 and len(found) == 5
    assert all(MIN_SHARE <= shares(long_only, b)[0] <= MAX_SHARE for b in found[1:-1])
    # Every output the same: the prompt alone is cut, to more figures than two where two would admit them all.
    assert [(b.prompt, b.output) for b in found[1:-1]] == [(12_100, 400), (12_250, 400), (12_400, 400)]
    assert propose([], SHIPPED) == [SHIPPED, NO_CLASS]


def test_shares_count_requests_and_tokens() -> None:
    sizes = [(100, 10), (100, 10), (900, 100), (1000, 900)]
    assert shares(sizes, SHIPPED) == pytest.approx((0.5, 220 / 3120))
    assert shares(sizes, NO_CLASS) == (0.0, 0.0)
    assert (nice(1234), nice(87), nice(0), nice(15_500), nice(12_345, 3)) == (1300, 87, 1, 16_000, 12_400)


def test_the_bounds_are_what_the_router_classifies_by() -> None:
    config = load_config(SHIPPED_CONFIG)
    assert file_bounds(config) == Bounds("file's", 500, 128)
    wider = with_bounds(config, Bounds("~80% short", 2000, 600))
    assert classify(1500, 500, wider.classes).name == "interactive" and classify(2500, 500, wider.classes).name == "batch"
    nothing = with_bounds(config, NO_CLASS)
    assert classify(1, 1, nothing.classes).name == "batch"  # no interactive class: every request the catch-all's


def test_judge_prefers_safe_then_short_e2e_and_ties_to_fewer_settings() -> None:
    fast_but_unfair = Figures(1.5, 0.3, 0.1, 1.0, 0)
    safe_short = Figures(1.05, 0.7, 0.4, 0.99, 0, settings=2)
    safe_same = Figures(1.05, 0.7, 0.4, 0.99, 0, settings=1)
    failing = Figures(0.9, 0.5, 0.2, 1.0, 3)
    assert best([fast_but_unfair, safe_short, safe_same, failing]) == (2, True)
    assert best([fast_but_unfair, failing]) == (0, False)  # none safe: the least miss (failures count one each)
    # advise's own predictions must clear the bound with headroom: 1.08x is safe swept, not predicted.
    edge, room = Figures(1.08, 0.6, 0.2, 1.0, 0), Figures(1.0, 0.7, 0.3, 1.0, 0)
    assert best([edge, room]) == (0, True) and best([edge, room], PREDICTED_E2E_MAX) == (1, True)
    no_shorts = [Figures(1.02, math.nan, math.nan, 1.0, 0), Figures(0.95, math.nan, math.nan, 1.0, 0)]
    assert best(no_shorts) == (1, True)  # no short requests: the long E2E P99 decides
    assert within(Figures(1.1, 0.77, 0.3, 1.0, 0), Figures(1.0, 0.7, 0.5, 1.0, 0))
    assert not within(Figures(1.0, 0.78, 0.3, 1.0, 0), Figures(1.0, 0.7, 0.5, 1.0, 0))


def _arrivals(n: int = 96) -> list[Arrival]:
    """``n`` requests, 8 a second, a third long; the short ones of varied sizes."""
    rng = random.Random(5)
    out = []
    for i in range(n):
        prompt, output = (rng.randint(1500, 4000), rng.randint(300, 800)) if i % 3 == 0 else (rng.randint(50, 480), rng.randint(16, 128))
        out.append(Arrival(i, i / 8, "short" if prompt <= 500 and output <= 128 else "long", True, prompt, output))
    return out


def test_the_converter_round_trips_through_advises_reader(tmp_path: Path) -> None:
    arrivals = _arrivals()
    records = [Record(a.kind, True, "ok" if a.index != 7 else "timeout", 0.05, 0.2 + a.index / 100, at=a.at) for a in arrivals]
    log = tmp_path / "tailguard.log"
    assert write_log(log, arrivals, records, "interactive", "batch") == len(arrivals)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["logger"] == "tailguard.access" and lines[0]["ts"].endswith("Z") and "e2e_ms" in lines[0]
    assert [row["ts"] for row in lines] == sorted(row["ts"] for row in lines)  # in the order requests ended, as a log is
    back, _, usage = read_access_log(log, "interactive", 1e9)
    assert usage.used == len(arrivals) and not usage.skipped
    assert [(a.kind, a.prompt_tokens, a.max_tokens) for a in back] == [(a.kind, a.prompt_tokens, a.max_tokens) for a in arrivals]
    assert all(abs(a.at - b.at) < 0.002 for a, b in zip(arrivals, back))  # ts is to the millisecond
    assert [row["outcome"] for row in lines if row["request_id"] == "r7"] == ["error"]


def test_the_report_and_the_snippet_carry_the_recommended_thresholds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.toml"
    config.write_text(SMALL_POOLS)  # two engines, the batch one of 8 seats
    log = tmp_path / "tailguard.log"
    write_log(log, _arrivals(60), None, "interactive", "batch")  # advise recommends on 50 requests or more
    assert main(["--access-log", str(log), "--config", str(config), "--json", str(tmp_path / "advice.json")]) == 0
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "advice.json").read_text())["thresholds"]
    sets = [row["thresholds"] for row in found["sets"]]
    assert sets[0] == {"label": "file's", "prompt": 500, "output": 128, "none": False} and sets[-1]["none"] and len(sets) <= MAX_SETS
    # At 2 engines: 7 layouts (the shared pool, 1:1 static and under 5 lending rules) and 2 baselines a set,
    # 3 runs for "no interactive class" (the shared pool alone).
    assert found["runs"] == 9 * (len(sets) - 1) + 3 and len(found["judged"]) == 7 * (len(sets) - 1) + 1
    pick = found["recommended"]["thresholds"]
    assert "Class thresholds from this traffic" in out and "**<- recommended**" in out
    assert "| prompt <= 500 and max_tokens <= 128 (the file's)" in out and "| 67% / " in out  # two thirds short, by requests
    text = Bounds(**pick).text()
    assert f"Recommended thresholds: {text}" in out
    if not pick["none"]:
        interactive = tomllib.loads(out.rsplit("```toml\n", 1)[1].split("```", 1)[0])["classes"]["interactive"]
        assert (interactive["max_prompt_tokens"], interactive["max_output_tokens"]) == (pick["prompt"], pick["output"])
        assert "of the requests" in out and "of their tokens short" in out
    assert main(["--access-log", str(log), "--config", str(config), "--keep-thresholds"]) == 0
    assert "Class thresholds" not in capsys.readouterr().out
