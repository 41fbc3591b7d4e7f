"""``python -m bench.tail.advise_check``: ``tailguard advise``'s pick on a trace, checked in real time by ``bench tail``.

advise predicts in virtual time; this prints the ``python -m bench tail``
command that runs its recommended candidate (or ``--candidate``) on the
same trace in real time, beside the ``shared`` and ``short-only``
baselines, with ``--samples``. Given that folder back (``--samples DIR``
after the run), it puts the measured figures beside the predicted ones
(``bench/results/advise/advise.md`` has such runs). The planner ships in
the wheel; this check, like ``bench tail``, runs from a checkout only.

    python -m bench.tail.advise_check --trace bench/results/tail/example-trace.jsonl --engines 4
    python -m bench tail ...   # the command it printed
    python -m bench.tail.advise_check --trace bench/results/tail/example-trace.jsonl --engines 4 --samples samples
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tailguard.router.config import ConfigError, LendConfig, load_config
from tailguard.server.advise.candidates import Candidate
from tailguard.server.advise.cli import default_config
from tailguard.server.advise.fleet import fleet_from
from tailguard.server.advise.report import report
from tailguard.server.advise.simulate import Fate, Stats, stats_of
from tailguard.server.advise.traffic import arrivals_from_trace, seen_in_trace
from tailguard.server.advise.verdict import Advice, advise

TAIL_TIME_SCALE = 4.0  # bench tail's default --time-scale
# Of the trace replayed: the printed bench tail run lasts that x its --time-scale in real time, so
# this check keeps a short default where tailguard advise replays the whole trace.
DEFAULT_SECONDS, MAX_SECONDS = 120.0, 3600.0
TAIL_DRAIN_GPU_S = 120.0  # the caller's deadline: no request outlasts it, so bench tail's drain never cuts one


def tail_setup(candidate: Candidate) -> str:
    """The ``bench tail`` set-up that runs ``candidate``: ``priority`` for the shared pool, ``disaggregated`` when static, ``lend`` when lending."""
    if candidate.shared:
        return "priority"
    return "lend" if candidate.lends else "disaggregated"


def _lend_rule(lend: LendConfig) -> str:
    rule = [f"reserve={lend.reserve}"]
    rule += [f"seats={lend.max_seats}"] if lend.max_seats is not None else []
    rule += [f"prompt={lend.max_prompt_tokens}"] if lend.max_prompt_tokens is not None else []
    rule += [f"output={lend.max_output_tokens}"] if lend.max_output_tokens is not None else []
    rule += [f"prefills={lend.prefills}"] if lend.prefills is not None else []
    rule += [f"when={lend.when}"] if lend.when != "full" else []
    rule += [f"ttft={round(lend.ttft_budget * 1000)}"] if lend.ttft_budget is not None else []  # GPU ms, as advise's times are
    rule += [f"imbalance={lend.max_imbalance:g}"] if lend.max_imbalance is not None else []
    return ",".join(rule)


def tail_command(advice: Advice, candidate: Candidate, trace: Path, samples: Path, time_scale: float = TAIL_TIME_SCALE) -> str | None:
    """The real-time ``bench tail`` run of ``candidate`` on ``trace`` (None: bench tail cannot express it).

    bench tail's lending set-up lends interactive -> batch under one rule,
    the batch pool lending back any idle seat unless ``--no-lend-back``.
    """
    back = candidate.lend_back
    if back.to and (back != LendConfig(back.to) or not candidate.lend.to):
        return None
    window = math.ceil(advice.seconds * time_scale) + 1
    split = "" if candidate.shared else f" --split {candidate.interactive}:{candidate.batch}"
    words = [
        "python -m bench tail",
        f"--engines {advice.fleet.engines}{split}",
        f"--trace {trace} --time-scale {time_scale:g} --warmup 0 --seconds {window} --drain {TAIL_DRAIN_GPU_S * time_scale:g}",
        f"--setup shared --setup short-only --setup {tail_setup(candidate)}",
    ]
    if candidate.lend.to:
        words.append(f"--lend-rule {_lend_rule(candidate.lend)}" + ("" if back.to else " --no-lend-back"))
    words.append(f"--samples {samples}")
    return " ".join(words)


@dataclass(frozen=True)
class Check:
    """Predicted against measured for one candidate, from ``bench tail --samples`` files."""

    candidate: Candidate
    predicted: Stats
    measured: Stats
    measured_ideal: Stats
    measured_shared: Stats


def fates_from_samples(path: Path, time_scale: float) -> list[Fate]:
    """``bench tail --samples`` JSONL (real seconds) as fates in GPU seconds."""
    fates = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)

        def gpu(key: str) -> float | None:
            value = row.get(key)
            return None if value is None else float(value) / time_scale

        fates.append(Fate(str(row["kind"]), float(row["at"]) / time_scale, row["outcome"] == "ok", gpu("ttft"), gpu("e2e")))
    return fates


def _one(directory: Path, setup: str) -> Path:
    found = sorted(directory.glob(f"*-{setup}-load*.jsonl"))
    if len(found) != 1:
        raise ValueError(f"{directory}: expected one *-{setup}-load*.jsonl (bench tail --samples), found {len(found)}")
    return found[0]


def compare(advice: Advice, name: str | None, directory: Path, time_scale: float) -> Check:
    """A candidate's prediction (default: the recommended one) beside bench tail's samples of it, shared and short-only."""
    chosen = advice.recommended if name is None else next((p for p in advice.predictions if p.candidate.name == name), None)
    if chosen is None:
        raise ValueError(f"no candidate is named {name!r}; the names are the table's split and lending columns, e.g. '1:3 static'")

    def measured(setup: str) -> Stats:
        return stats_of(fates_from_samples(_one(directory, setup), time_scale))

    return Check(chosen.candidate, chosen.stats, measured(tail_setup(chosen.candidate)), measured("short-only"), measured("shared"))


def check_table(check: Check, advice: Advice) -> str:
    def row(name: str, predicted: float, measured: float, fmt: str = "{:.3f}") -> str:
        off = (predicted - measured) / measured if measured and math.isfinite(measured) and math.isfinite(predicted) else math.nan
        return f"| {name} | {fmt.format(predicted)} | {fmt.format(measured)} | {off:+.1%} |"

    p, m = check.predicted, check.measured
    return "\n".join([
        f"| {check.candidate.name}, GPU s | predicted (virtual time) | measured (bench tail, real time) | predicted vs measured |",
        "|---|---|---|---|",
        row("short E2E P99", p.short_e2e_p99, m.short_e2e_p99),
        row("short TTFT P99", p.short_ttft_p99, m.short_ttft_p99),
        row("long finished/s", p.long_goodput, m.long_goodput, "{:.2f}"),
        row("short-only ideal: short E2E P99", advice.ideal.short_e2e_p99, check.measured_ideal.short_e2e_p99),
        row("short-only ideal: short TTFT P99", advice.ideal.short_ttft_p99, check.measured_ideal.short_ttft_p99),
        row("shared round robin: long finished/s", advice.shared.long_goodput, check.measured_shared.long_goodput, "{:.2f}"),
        row("shared round robin: short E2E P99", advice.shared.short_e2e_p99, check.measured_shared.short_e2e_p99),
    ])


def advice_on_trace(config: Path, trace: Path, engines: int | None, seconds: float, jobs: int, prefix_cache: bool) -> Advice:
    """What ``tailguard advise --trace`` predicts for ``trace`` (its report is ``report`` of this).

    Raises ValueError (or OSError) on a config or trace advise refuses.
    """
    try:
        fleet = fleet_from(load_config(config), engines)
    except ConfigError as error:
        raise ValueError(f"{config}: invalid config\n{error}") from None
    arrivals = arrivals_from_trace(trace, seconds)
    if len(arrivals) < 2:
        raise ValueError(f"{trace}: fewer than two requests to replay")
    seen = seen_in_trace(trace, seconds) if prefix_cache else None
    return advise(fleet, arrivals, seen=seen, jobs=jobs, seconds=seconds, source=str(trace))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.tail.advise_check", description=(__doc__ or "").splitlines()[0])
    add = parser.add_argument
    add("--trace", type=Path, required=True, help="a bench tail --record-trace JSONL, as tailguard advise --trace reads it")
    add("--config", type=Path, default=None, help="the pools, endpoints and caps (default: ./config.toml, else the shipped one)")
    add("--engines", type=int, default=None, help="engines to split (default: the endpoints of the config's two pools)")
    add("--seconds", type=float, default=DEFAULT_SECONDS, help=f"replay at most this many seconds of arrivals (default %(default)g, at most {MAX_SECONDS:g})")
    add("--jobs", type=int, default=1, help="processes to simulate candidates in (default %(default)s)")
    add("--no-prefix-cache", action="store_true", help="replay every prompt unique, as tailguard advise --no-prefix-cache")
    add("--samples", type=Path, default=None, help="a bench tail --samples folder of a run of the printed command: measured beside predicted")
    add("--candidate", default=None, help="which candidate that run was, e.g. '1:3 static' (default: the recommended one)")
    add("--time-scale", type=float, default=TAIL_TIME_SCALE, help="that run's --time-scale (default %(default)g)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= MAX_SECONDS or args.jobs < 1 or args.time_scale <= 0:
        parser.error(f"--seconds must be in (0, {MAX_SECONDS:g}], --jobs and --time-scale positive")
    try:
        result = advice_on_trace(args.config or default_config(), args.trace, args.engines, args.seconds, args.jobs, not args.no_prefix_cache)
    except (OSError, ValueError) as error:
        print(f"advise_check: {error}", file=sys.stderr)
        return 2
    print(report(result), end="")
    command = tail_command(result, result.recommended.candidate, args.trace, Path("samples"))
    note = command and f"Check it in real time (bench tail; then --samples samples here): `{command}`"
    print("\n" + (note or "bench tail has no set-up for this lending rule: check it by hand."))
    if args.samples is not None:
        try:
            check = compare(result, args.candidate, args.samples, args.time_scale)
        except (OSError, ValueError) as error:
            print(f"advise_check: {error}", file=sys.stderr)
            return 2
        print("\n" + check_table(check, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
