"""``python -m bench.tail.advise_check``: advise's pick as a ``bench tail`` command, and measured beside predicted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tail.advise_check import compare, tail_command
from tailguard.router.config import load_config
from tailguard.server import SHIPPED_CONFIG
from tailguard.server.advise.fleet import fleet_from
from tailguard.server.advise.traffic import arrivals_from_trace
from tailguard.server.advise.verdict import Advice, advise

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_TRACE = ROOT / "bench" / "results" / "tail" / "example-trace.jsonl"


@pytest.fixture(scope="module")
def example_advice() -> Advice:
    """advise on the committed example trace with 4 engines."""
    return advise(fleet_from(load_config(SHIPPED_CONFIG), 4), arrivals_from_trace(EXAMPLE_TRACE, 120.0), source="example")


def test_the_real_time_check_command_names_the_candidates_set_up(example_advice: Advice) -> None:
    advice = example_advice
    by_name = {p.candidate.name: p.candidate for p in advice.predictions}
    static = tail_command(advice, by_name["1:3 static"], EXAMPLE_TRACE, Path("s"))
    assert static is not None
    assert "--engines 4 --split 1:3" in static and "--setup disaggregated" in static and "--lend-rule" not in static
    assert "--warmup 0 --seconds 13 " in static  # the trace's 3 GPU s at time scale 4, all of it measured
    lending = tail_command(advice, by_name["2:2 lend 256, keep 128"], EXAMPLE_TRACE, Path("s"))
    assert lending is not None and "--setup lend --lend-rule reserve=128,seats=256 --no-lend-back" in lending
    both = tail_command(advice, by_name["2:2 lend any idle, keep 32; batch lends back"], EXAMPLE_TRACE, Path("s"))
    assert both is not None and "--lend-rule reserve=32 " in both and "--no-lend-back" not in both


def test_compare_reads_bench_tail_samples_in_gpu_time(example_advice: Advice, tmp_path: Path) -> None:
    """Samples are real seconds at the run's time scale; the check divides them back to GPU seconds."""
    advice = example_advice

    def write(setup: str, e2e: float) -> None:
        rows = [{"kind": "short", "at": 4.0 * i, "outcome": "ok", "ttft": 0.08, "e2e": e2e} for i in range(10)]
        rows += [{"kind": "long", "at": 0.0, "outcome": "ok", "ttft": 0.4, "e2e": 40.0}]
        (tmp_path / f"t-{setup}-load0.7.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("disaggregated", 2.4)
    write("shared", 4.0)
    write("short-only", 2.0)
    check = compare(advice, "1:3 static", tmp_path, 4.0)
    assert check.candidate.name == "1:3 static"
    assert check.measured.short_e2e_p99 == pytest.approx(0.6) and check.measured.short_ttft_p99 == pytest.approx(0.02)
    assert check.measured_ideal.short_e2e_p99 == pytest.approx(0.5) and check.measured_shared.short_e2e_p99 == pytest.approx(1.0)
    assert check.measured.long_goodput == pytest.approx(1 / 10.0)
    with pytest.raises(ValueError, match="no candidate"):
        compare(advice, "9:9 static", tmp_path, 4.0)


def test_the_driver_prints_advises_report_and_the_command() -> None:
    """The report ``tailguard advise --trace`` prints, then the ``bench tail`` command that runs its pick."""
    argv = ["--trace", str(EXAMPLE_TRACE), "--engines", "4", "--config", str(SHIPPED_CONFIG)]
    done = subprocess.run([sys.executable, "-m", "bench.tail.advise_check", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Recommended: 1:3 static" in done.stdout
    assert done.stdout.rstrip().endswith(
        f"`python -m bench tail --engines 4 --split 1:3 --trace {EXAMPLE_TRACE} --time-scale 4 --warmup 0 --seconds 13 --drain 480 "
        "--setup shared --setup short-only --setup disaggregated --samples samples`"
    )
