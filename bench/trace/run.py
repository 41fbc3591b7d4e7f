"""``python -m bench trace``: the grid of traces x engines x loads, every set-up on the same arrivals, and its report.

Each point (trace, engines, load, set-up) runs in its own process
(``--jobs``), building its arrivals there (they are deterministic, and a
Mooncake schedule's prompt text is tens of MB to pickle); the report puts
every set-up of a trace x engines x load side by side. Results go to
``bench/results/trace/NAME.md`` and ``NAME.json`` (``--name``, default trace).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.cli import driver_parser
from bench.harness.report import write_json, write_text
from bench.trace.plot import plot_attainment
from tailguard.router.config import Config, LendConfig, load_config
from tailguard.server.advise.replay.mix import MIXES
from tailguard.server.advise.replay.point import Point, PointResult, run_point

from .load import CONTEXT, Workload, mooncake, sharegpt, thresholds
from .report import PointReport, checks, headline, point_section, rebalancing_table
from .samples import MOONCAKE, SHAREGPT, read_mooncake, read_pairs
from .setups import (
    BASELINES,
    COOLDOWN,
    DEFAULT_SETUPS,
    HAND_SPLIT,
    HOLD_TIME,
    ROUND_ROBIN,
    SEAT_STEP,
    SETUPS,
    SHIPPED_CONFIG,
    default_split,
)

# The two real traces, then the synthetic mixes bench tail runs in real time (server/advise/replay/mix.py).
TRACES = ("mooncake", "sharegpt", *MIXES)
DEFAULT_REQUESTS = {"mooncake": 1200, "sharegpt": 10_000, **{mix: 3000 for mix in MIXES}}  # the default grid: ~2.5 min on one core
RESULTS = Path(__file__).resolve().parents[1] / "results" / "trace"


@dataclass(frozen=True)
class Job:
    """One point to run; everything a worker process needs to rebuild its arrivals."""

    trace: str
    path: Path
    requests: int
    engines: int
    load: float
    setup: str
    unique: bool
    seed: int
    config: Path


def workload(job: Job) -> Workload:
    """The job's arrivals (the same for every set-up of its trace x engines x load)."""
    classes = thresholds(load_config(job.config))
    if job.trace == "mooncake":
        return mooncake(read_mooncake(job.path, job.requests), job.engines, job.load, classes, reuse=not job.unique)
    pairs = mix_pairs(job.trace) if job.trace in MIXES else read_pairs(job.path)
    return sharegpt(pairs, job.requests, job.engines, job.load, classes, seed=job.seed)


def mix_pairs(name: str) -> list[tuple[int, int]]:
    """A mix's shapes as (prompt, output) pairs drawn uniformly: each repeated in proportion to its share (per 1,000)."""
    return [(prompt, output) for _, share, prompt, output in MIXES[name]() for _ in range(round(share * 1000))]


def run_job(job: Job) -> tuple[Job, PointResult]:
    """Run one set-up on the job's arrivals, all measured, over the schedule's span."""
    work = workload(job)
    setup = SETUPS[job.setup](job.engines, default_split(job.engines), load_config(job.config))
    window = work.arrivals[-1].at + 1
    return job, run_point(Point(setup, job.load, work.rate, 0.0, window, job.seed, work.arrivals))


def run_all(jobs: Sequence[Job], processes: int) -> dict[Job, PointResult]:
    """Every job in ``processes`` worker processes (or in this one for 1)."""
    results: dict[Job, PointResult] = {}
    if processes == 1:  # no fork: a process that runs threads (a test run's) must not fork
        finished: Iterable[tuple[Job, PointResult]] = map(run_job, jobs)
        _report(finished, len(jobs), results)
        return results
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        _report(pool.imap_unordered(run_job, jobs), len(jobs), results)
    return results


def _report(finished: Iterable[tuple[Job, PointResult]], total: int, into: dict[Job, PointResult]) -> None:
    """Collect each finished job's result, saying so on stderr."""
    for done, (job, result) in enumerate(finished, 1):
        into[job] = result
        print(
            f"  {done}/{total}: {job.trace} {job.engines} engines @ {job.load:g}: {result.setup}"
            f" ({result.requests:,} requests, {result.cpu_s:.1f} s CPU)",
            file=sys.stderr,
            flush=True,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument("--traces", default="mooncake,sharegpt", help=f"comma-separated, of {','.join(TRACES)} (default %(default)s)")
    parser.add_argument("--engines", default="2,4", help="fleet sizes (default %(default)s); the hand split is 1:1 at 2, 1:3 at 4")
    parser.add_argument("--loads", default="0.6,0.8,0.9", help="fractions of the fleet's modelled capacity (default %(default)s)")
    parser.add_argument(
        "--setups", default=",".join(DEFAULT_SETUPS), help=f"of {', '.join(SETUPS)}; {' and '.join(BASELINES)} always run (default %(default)s)"
    )
    parser.add_argument("--requests", type=int, help=f"requests per point (default {DEFAULT_REQUESTS})")
    parser.add_argument("--trace", type=Path, default=MOONCAKE, help="the Mooncake trace file (default: the committed first 1,200 lines)")
    parser.add_argument("--pairs", type=Path, default=SHAREGPT, help="the ShareGPT (prompt, output) CSV (default: the committed one)")
    parser.add_argument("--unique-prompts", action="store_true", help="Mooncake: every prompt unique filler (no prefix reuse)")
    parser.add_argument("--config", type=Path, default=SHIPPED_CONFIG, help="the file whose classes and lend rules tailguard uses (default: the shipped one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="processes (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="trace", help="the results' file name in --out, without .md / .json (default %(default)s)")
    return parser


def parse_jobs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Job]:
    traces = args.traces.split(",")
    setups = [*BASELINES, *(s for s in args.setups.split(",") if s not in BASELINES)]
    unknown = [name for name in (*traces, *setups) if name not in (*TRACES, *SETUPS)]
    if unknown or args.jobs < 1 or (args.requests is not None and args.requests < 2):
        parser.error(f"unknown {', '.join(unknown)}" if unknown else "--jobs must be positive and --requests at least 2")
    paths = {"mooncake": args.trace, "sharegpt": args.pairs, **{mix: args.pairs for mix in MIXES}}  # a mix reads no file
    return [
        Job(trace, paths[trace], args.requests or DEFAULT_REQUESTS[trace], int(engines), float(load), setup, args.unique_prompts, args.seed, args.config)
        for trace in traces
        for engines in args.engines.split(",")
        for load in args.loads.split(",")
        for setup in setups
    ]


def reports(jobs: Sequence[Job], results: dict[Job, PointResult]) -> list[PointReport]:
    """Jobs grouped by trace x engines x load, set-ups in the order given."""
    grouped: dict[tuple[str, int, float], list[Job]] = {}
    for job in jobs:
        grouped.setdefault((job.trace, job.engines, job.load), []).append(job)
    out: list[PointReport] = []
    for (trace, engines, load), group in grouped.items():
        work = workload(group[0])
        out.append(
            PointReport(
                trace,
                engines,
                load,
                work.rate,
                work.capacity_per_engine,
                len(work.arrivals),
                sum(a.kind == "short" for a in work.arrivals),
                work.left_out,
                {job.setup: results[job].setup for job in group},
                {job.setup: results[job].classes for job in group},
                {job.setup: results[job].prefix_hit_rate for job in group},
                {job.setup: moved for job in group if (moved := results[job].rebalancing) is not None},
            )
        )
    return out


def profiles_summary(config: Config) -> str:
    """Each pool's engine tuning, as the simulator models it."""
    return ", ".join(f"{pool.name}: {pool.simulate_profile}" for pool in config.pools)


def lend_summary(config: Config) -> str:
    """Each pool's lend rule, only the keys it sets away from the defaults."""
    default = dataclasses.asdict(LendConfig())
    rules = []
    for pool in config.pools:
        changed = {k: v for k, v in dataclasses.asdict(pool.lend).items() if v != default[k]}
        rules.append(f"{pool.name}: " + (", ".join(f"{k} = {v!r}" for k, v in changed.items()) or "lends nothing"))
    return "; ".join(rules)


def rebalancing_note(config: Config, setups: Sequence[str]) -> list[str]:
    """The header's line on the set-ups that rebalance, when the run has one."""
    if not {"tailguard-moves", "tailguard-shares"} & set(setups):
        return []
    shipped = config.rebalance
    return [
        "- tailguard moves / seat shares: tailguard as above, both pools `rebalance = \"auto\"` and every endpoint movable; the"
        " router's own rebalancing turn (`Router.rebalance_turn`) runs every `interval` s of virtual time, as `Router.run` would."
        f" `[rebalance]` as the file's (interval {shipped.interval:g} s, threshold {shipped.threshold:g}) but hold_time"
        f" {HOLD_TIME:g} s and cooldown {COOLDOWN:g} s (the file's {shipped.hold_time:g} / {shipped.cooldown:g} s would allow a"
        f" move or two in a point's 110 to 560 s); moves: seat_step 1 (whole engines), seat shares: seat_step {SEAT_STEP:g}."
    ]


def header(args: argparse.Namespace, argv: Sequence[str], wall: float) -> list[str]:
    config = load_config(args.config)
    bounds = thresholds(config)
    return [
        "# Real traces in virtual time: tailguard beside round robin and a hand split",
        "",
        f"`{' '.join(['python -m bench trace', *argv])}` ({wall:.0f} s wall, {args.jobs} processes, virtual time).",
        "",
        "- Mooncake: the first lines of the conversation trace (kvcache-ai/Mooncake, FAST25-release/traces, Apache-2.0; FAST '25),"
        f" `{args.trace.name}`, its own arrival times scaled to the load; prompts "
        + ("unique filler." if args.unique_prompts else "built from `hash_ids`, so the engines' prefix cache sees the trace's reuse."),
        "- ShareGPT: first-turn lengths of the V3 unfiltered cleaned split (anon8231489123/ShareGPT_Vicuna_unfiltered; lengths only,"
        " bench/trace/data/README.md), Poisson arrivals at the load, pairs drawn uniformly (seeded), unique prompts.",
        "- origin, chat: `bench tail`'s mixes (server/advise/replay/mix.py: the origin's 80% one-line questions and 20% documents;"
        " chat's 90% 300-token turns and four long shapes), Poisson arrivals at the load, shapes drawn by their shares (seeded), unique prompts.",
        f"- Load: a fraction of the fleet's capacity from the engine model (throughput profile, KV cache bounding the seats) for the"
        f" sample's own lengths. The model prefills every prompt token: it ignores the prefix cache, so with Mooncake's real reuse"
        f" the real load is lower than nominal. Requests over the {CONTEXT:,}-token context are left out of every set-up.",
        f"- Classes from `{args.config.name}`: short = prompt <= {bounds.prompt} and max_tokens <= {bounds.output};"
        " max_tokens = the trace's output length. Every set-up gets the same arrivals; a caller gives up at 120 s (timeout).",
        "- Set-ups: round robin over throughput engines (no router); the hand split, each class straight to its own engines"
        " (latency engines for short, throughput for long; 1:1 at 2 engines, 1:3 at 4); tailguard over that split's engines,"
        f" each pool's tuned as `{args.config.name}` says ({profiles_summary(config)}) and lending as it says"
        f" ({lend_summary(config)}); the same with latency-tuned interactive engines (64 seats, 2,048-token steps);"
        " tailguard shared: one pool of every throughput engine, short requests queued first."
        " Routed set-ups' input cap is raised to the context.",
        *rebalancing_note(config, args.setups.split(",")),
        "- Percentiles over ok answers (nearest rank), ms; completed/s = ok answers over the schedule's span.",
        "- Repeatability: every point repeats exactly for its `--seed` (the arrivals, and the order Trio wakes same-instant"
        " tasks in: `seed_trio_scheduler`). That order is still a draw: unseeded, tailguard shared at Mooncake, 2 engines,"
        " 0.6 moved between 1.02x and 1.26x round robin's long E2E P99 over six runs, so a verdict within ~0.1 of a bound"
        " is one draw; `--seed` gives another.",
        "",
    ]


def point_data(point: PointReport) -> dict[str, Any]:
    """A point as JSON: its stats and each candidate's targets, judged against round robin."""
    rr = point.classes[ROUND_ROBIN]
    targets = {key: [dataclasses.asdict(c) for c in checks(stats, rr)] for key, stats in point.classes.items() if key not in BASELINES}
    return {**dataclasses.asdict(point), "targets": targets}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    jobs = parse_jobs(args, parser)
    print(f"{len(jobs)} points in {args.jobs} processes", file=sys.stderr)
    started = time.perf_counter()
    results = run_all(jobs, args.jobs)
    points = reports(jobs, results)
    wall = time.perf_counter() - started
    lines = [*header(args, argv, wall), "## Against round robin", "", *headline(points, ROUND_ROBIN, HAND_SPLIT), ""]
    moved = rebalancing_table(points)
    if moved:
        lines += ["## Rebalancing", "", *moved, ""]
    lines += ["## Per point", ""]
    for point in points:
        lines += point_section(point, ROUND_ROBIN, HAND_SPLIT)
    text = "\n".join(lines)
    print(text)
    write_text(args.out / f"{args.name}.md", text)
    data = {"argv": argv, "wall_s": wall, "points": [point_data(point) for point in points]}
    write_json(args.out / f"{args.name}.json", data)
    figure = plot_attainment(points, args.out / f"{args.name}-attainment.png", f"virtual time, {args.config.name}, seed {args.seed}")
    if figure is not None:
        print(f"attainment against load: {figure}", file=sys.stderr)
    return 0

