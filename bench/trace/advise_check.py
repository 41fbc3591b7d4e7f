"""``python -m bench.trace.advise_check``: advise on an access log of each real trace, its pick run beside ``bench trace``'s set-ups.

For each trace x engines at a load, as ``python -m bench trace`` builds
them (same arrivals, the shipped config's classes, input caps at the
context):

1. the first requests are replayed through the sweep's ``tailguard`` set-up
   and written as the access log tailguard would have written
   (``access_log``), the log advise is meant for;
2. advise reads that log back (``access_log.read_access_log``) and searches
   layouts and class thresholds (``joint``), its pick and predicted figures;
3. the sweep's set-ups and advise's pick each run on the trace's full
   arrivals in the trace bench's harness (``run_point``), judged by the
   trace bench's own ratios to round robin;
4. the best swept set-up by ``judge``'s rule, and whether the pick is
   within 10% of it (``judge.within``: its long and its short E2E P99 each
   at most 1.1x the best's).

Results: ``bench/results/trace/advise-check.md`` and ``.json`` (points
already there for other traces x engines are kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.report import write_json, write_text
from tailguard.router.config import Config, LimitsConfig, load_config
from tailguard.server.advise.access_log import read_access_log, write_log
from tailguard.server.advise.candidates import candidate_setup
from tailguard.server.advise.cli import MAX_SECONDS
from tailguard.server.advise.fleet import fleet_from
from tailguard.server.advise.joint import Judged, Search, search
from tailguard.server.advise.judge import PREDICTED_E2E_MAX, Figures, best, within
from tailguard.server.advise.replay.point import ClassStats, Point, run_point
from tailguard.server.advise.replay.setups import Setup
from tailguard.server.advise.simulate import simulate
from tailguard.server.advise.verdict import advise

from .load import CONTEXT, Workload
from .report import completed, failed, ratio
from .run import DEFAULT_REQUESTS, RESULTS, Job, run_job, workload
from .samples import MOONCAKE, SHAREGPT
from .setups import ROUND_ROBIN, SETUPS, SHIPPED_CONFIG, default_split

ADVISED = {"mooncake": 600, "sharegpt": 1500}  # requests of the log advise reads: ~1 min of CPU a point on one core
PATHS = {"mooncake": MOONCAKE, "sharegpt": SHAREGPT}


def routed_config(path: Path) -> Config:
    """The file with its input and output caps at the context, as ``bench trace``'s routed set-ups have them."""
    return dataclasses.replace(load_config(path), limits=LimitsConfig(input_cap_tokens=CONTEXT - 1, output_cap_tokens=CONTEXT - 1))


def swept_figures(classes: Sequence[ClassStats], rr: Sequence[ClassStats]) -> Figures:
    """A swept set-up against round robin by ``bench trace``'s ratios (percentiles over ok answers)."""
    base = {c.kind: c for c in rr}
    mine = {c.kind: c for c in classes}

    def x(kind: str, key: str) -> float:
        if kind not in mine or not mine[kind].n:
            return math.nan
        return ratio(getattr(mine[kind], key), getattr(base[kind], key))

    beyond = sum(max(0, failed(c) - failed(base[c.kind])) for c in classes)
    return Figures(
        x("long", "e2e_p99_ms"), x("short", "e2e_p99_ms"), x("short", "ttft_p99_ms"), ratio(completed(classes), completed(rr)), beyond
    )


def _run_setup(item: tuple[Setup, Workload, float, int]) -> list[ClassStats]:
    setup, work, load, seed = item
    return run_point(Point(setup, load, work.rate, 0.0, work.arrivals[-1].at + 1, seed, work.arrivals)).classes


def _run_sweep(job: Job) -> list[ClassStats]:
    return run_job(job)[1].classes


@dataclass(frozen=True)
class PointCheck:
    """One trace x engines x load: advise's pick, predicted and swept, beside the sweep's set-ups."""

    trace: str
    engines: int
    load: float
    advised_requests: int
    advise_runs: int
    advise_wall_s: float
    pick: str  # thresholds and layout
    predicted: Figures
    measured: Figures
    swept: dict[str, Figures]
    best: str
    within: bool
    command: str = ""  # the run that measured it
    wall_s: float = 0.0  # the point's, all of it


def _log_of(work: Workload, requests: int, engines: int, config: Config, directory: Path) -> Path:
    """The first ``requests`` arrivals through the sweep's tailguard set-up, as its access log."""
    arrivals = work.arrivals[:requests]
    setup = SETUPS["tailguard"](engines, default_split(engines), config)
    records = simulate(setup, arrivals).records
    path = directory / "tailguard.log"
    short, batch = config.classes[0].name, config.classes[-1].name
    write_log(path, arrivals, records, short, batch)
    return path


def _advise(log: Path, engines: int, config: Config, jobs: int, e2e_max: float) -> Search:
    fleet = fleet_from(config, engines)
    arrivals, _, _ = read_access_log(log, fleet.short_class, MAX_SECONDS)
    own = advise(fleet, arrivals, jobs=jobs)
    return search(fleet, arrivals, jobs=jobs, file_advice=own, e2e_max=e2e_max)


def _pick_name(pick: Judged) -> str:
    return f"{pick.bounds.text()}; {pick.prediction.candidate.name}"


def check_point(
    trace: str, engines: int, load: float, jobs: int, config_path: Path = SHIPPED_CONFIG, e2e_max: float = PREDICTED_E2E_MAX
) -> PointCheck:
    """Advise on the trace's log, then the sweep and the pick on the full trace."""
    config = routed_config(config_path)
    job = Job(trace, PATHS[trace], DEFAULT_REQUESTS[trace], engines, load, ROUND_ROBIN, False, 0, config_path)
    work = workload(job)
    requests = min(ADVISED[trace], len(work.arrivals))
    with tempfile.TemporaryDirectory() as folder:
        found = _advise(_log_of(work, requests, engines, config, Path(folder)), engines, config, jobs, e2e_max)
    pick = found.pick
    setup = dataclasses.replace(candidate_setup(found.fleet_of(pick.bounds), pick.prediction.candidate), name="advise's pick")
    names = list(SETUPS)
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        swept = pool.map(_run_sweep, [dataclasses.replace(job, setup=name) for name in names], chunksize=1)
        [mine] = pool.map(_run_setup, [(setup, work, load, job.seed)], chunksize=1)
    rr = swept[names.index(ROUND_ROBIN)]
    figures = {name: swept_figures(classes, rr) for name, classes in zip(names, swept) if name != ROUND_ROBIN}
    names = list(figures)  # every swept set-up but round robin, the baseline
    top = names[best([figures[name] for name in names])[0]]
    measured = swept_figures(mine, rr)
    return PointCheck(
        trace,
        engines,
        load,
        requests,
        found.runs,
        found.wall_s,
        _pick_name(pick),
        pick.figures,
        measured,
        figures,
        top,
        within(measured, figures[top]),
    )


def _x(value: float) -> str:
    return "-" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:.2f}"


def _fig(f: Figures) -> str:
    return f"{_x(f.long_e2e)} / {_x(f.short_e2e)} / {_x(f.short_ttft)} / {_x(f.completed)} / {f.failures_beyond}"


def markdown(points: Sequence[PointCheck]) -> str:
    commands: dict[str, list[PointCheck]] = {}
    for p in points:
        commands.setdefault(p.command, []).append(p)
    runs = [
        f"`{command}`: {', '.join(f'{p.trace} {p.engines} engines' for p in mine)}, {sum(p.wall_s for p in mine):.0f} s wall"
        for command, mine in commands.items()
    ]
    rows = [
        "# advise on each trace's access log, against the trace sweep",
        "",
        "Made by " + "; ".join(runs) + " (virtual time).",
        "",
        "- The log: each trace's first requests (Mooncake 600, ShareGPT 1,500) of `python -m bench trace`'s arrivals at"
        " the point, replayed through its `tailguard` set-up and written as tailguard's JSON access lines"
        " (`server/advise/access_log.py`; no prefix groups, so advise replays Mooncake's prompts unique). advise reads it"
        " back with `read_access_log`, the shipped config's caps raised to the context as the sweep's are.",
        "- advise searches the layouts x class thresholds (`server/advise/joint.py`, `thresholds.py`); its pick then runs"
        " on the trace's full arrivals in the sweep's harness beside the sweep's set-ups, every one judged on the"
        " shipped thresholds' classes against round robin (`server/advise/judge.py`).",
        "- Figures: long E2E P99 / short E2E P99 / short TTFT P99 / completed/s, each x round robin, / failures beyond"
        " round robin's. Predicted: advise's, on the log's window; measured: the pick on the full trace.",
        "- Best swept: the sweep's set-up (hand split, tailguard, its latency-tuned variant, tailguard shared) that"
        " `judge` ranks first: no worse than round robin (each class's E2E P99 <= 1.1x, completed/s >= 0.97x, no"
        " failure beyond), then the lowest short E2E P99 (no short requests: long). Within 10%: the pick's measured"
        " long and short E2E P99 each <= 1.1x the best's.",
        "",
        "| trace | engines | load | advise's pick (thresholds; layout) | predicted | measured | best swept | its figures "
        "| pick / best: long, short E2E P99 | within 10% | advise runs, wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        top = p.swept[p.best]
        rows.append(
            f"| {p.trace} | {p.engines} | {p.load:g} | {p.pick} | {_fig(p.predicted)} | {_fig(p.measured)} | {p.best} "
            f"| {_fig(top)} | {_x(ratio(p.measured.long_e2e, top.long_e2e))}, {_x(ratio(p.measured.short_e2e, top.short_e2e))} "
            f"| {'yes' if p.within else 'no'} | {p.advise_runs}, {p.advise_wall_s:.0f} s |"
        )
    rows += [
        "",
        "Every swept set-up at each point:",
        "",
        "| trace | engines | load | set-up | figures | safe |",
        "|---|---|---|---|---|---|",
    ]
    for p in points:
        rows += [
            f"| {p.trace} | {p.engines} | {p.load:g} | {name} | {_fig(f)} | {'yes' if f.safe else 'no'} |" for name, f in p.swept.items()
        ]
    return "\n".join(rows) + "\n"


def _as_json(point: PointCheck) -> dict[str, Any]:
    def safe(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return {k: safe(v) for k, v in value.items()} if isinstance(value, dict) else value

    return safe(dataclasses.asdict(point))  # type: ignore[no-any-return]


def _from_json(row: dict[str, Any]) -> PointCheck:
    def fig(d: dict[str, Any]) -> Figures:
        values: dict[str, Any] = {k: math.nan if v is None else v for k, v in d.items()}  # a NaN ratio was written as null
        return Figures(**values)

    fields = {**row, "predicted": fig(row["predicted"]), "measured": fig(row["measured"])}
    return PointCheck(**{**fields, "swept": {k: fig(v) for k, v in row["swept"].items()}})


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m bench.trace.advise_check", *argv])
    parser = argparse.ArgumentParser(prog="python -m bench.trace.advise_check", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--traces", default="mooncake,sharegpt")
    parser.add_argument("--engines", default="2,4")
    parser.add_argument("--loads", default="0.8")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--predicted-max",
        type=float,
        default=PREDICTED_E2E_MAX,
        help="the E2E P99 ratio advise holds its predictions to (default %(default)g)",
    )
    args = parser.parse_args(argv)
    done = []
    for trace in args.traces.split(","):
        for engines in map(int, args.engines.split(",")):
            for load in map(float, args.loads.split(",")):
                began = time.perf_counter()
                point = check_point(trace, engines, load, args.jobs, e2e_max=args.predicted_max)
                point = dataclasses.replace(point, command=command, wall_s=time.perf_counter() - began)
                print(f"  {trace} {engines} engines @ {load:g}: {point.pick}; within 10%: {point.within}", file=sys.stderr, flush=True)
                done.append(point)
    path = args.out / "advise-check.json"
    kept = [_from_json(row) for row in json.loads(path.read_text())["points"]] if path.exists() else []
    fresh = {(p.trace, p.engines, p.load) for p in done}
    points = sorted([p for p in kept if (p.trace, p.engines, p.load) not in fresh] + done, key=lambda p: (p.trace, p.engines, p.load))
    text = markdown(points)
    write_text(args.out / "advise-check.md", text)
    write_json(path, {"points": [_as_json(p) for p in points]})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
