"""``python -m bench sweep``: the routing policy in virtual time, loads x set-ups x engine splits.

The router core and the simulated engines share one process per point under
Trio's MockClock (in-process, no sockets), so a sweep measures the policy,
not the machine. On the same engines and the same seeded open-loop Poisson
traffic (quick_mixed's mix: 80% short chat, 20% ~2,000-token documents with
max_tokens 512, all streaming), it compares:

- ``shared``: round robin straight to throughput engines (no router);
- ``priority``: a Router with one pool of the same engines, interactive
  (prio 0) queued ahead of batch (prio 1), caps = seats, queue deadlines
  3 s / 30 s (config.toml);
- ``disaggregated i:b``: an interactive pool of i latency engines and a batch
  pool of b throughput engines, caps = seats;
- ``short-only``: shared without the long requests, the ideal.

Load is a fraction of the shared fleet's capacity for the mix. Each point is
an independent simulation (warm-up, then a measured window -- an hour by
default; traffic goes on until the window's requests end); points run in
parallel processes. What makes an hour affordable (tailguard.server.advise.replay.fleet,
tailguard.server.advise.replay.engine and .clock): the engine model steps in
aggregate and wakes only when a sequence starts or ends, requests carry no
bytes (first-token and finish times are the engine's own), and timers do not
go through Trio cancel scopes. Every routed request still goes through the
router's own ``Router.open`` (limits, classes, pools, caps, wait queue).

Also checked and reported: the sweep's engine against ``bench.sim.Engine`` on
the same seeded traffic (every timestamp), the capacity model against a
saturation run, and ``bench/tail/quick_mixed.py``'s real-time run replayed in
virtual time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness.cli import add_out_arg, add_seed_arg, add_warmup_arg, driver_parser
from bench.harness.procs import RESULTS_ROOT
from bench.harness.report import write_json, write_text
from bench.sweep.check import (
    QUICK_MIXED_JSON,
    Comparison,
    EngineAgreement,
    Saturation,
    compare,
    comparison_json,
    engine_agreements,
    load_real,
    mix_prompt_tokens,
    model_capacity,
    replay_points,
    saturation_run,
)
from bench.sweep.report import comparison_table, cost_summary, engine_table, full_table, pivot, plot_headline, plot_split
from tailguard.server.advise.replay.mix import Capacity
from tailguard.server.advise.replay.point import Point as SimPoint, PointResult, run_point
from tailguard.server.advise.replay.setups import Setup, disaggregated, priority, shared

DEFAULT_OUT = RESULTS_ROOT / "sweep"
DEFAULT_LOADS = "0.1,0.3,0.5,0.7,0.8,0.9,1.0,1.1,1.3,1.5"
DEFAULT_SPLITS = "1:3,2:2"
DEFAULT_SECONDS = 3600.0  # an hour of simulated traffic per point
MAX_SECONDS = 24 * 3600.0  # a day: the bound on one point's window
MAX_LOADS = 40
MAX_LOAD = 5.0


def parse_loads(text: str) -> list[float]:
    """Comma-separated loads, each in (0, MAX_LOAD], at most MAX_LOADS of them."""
    loads = [float(x) for x in text.split(",") if x.strip()]
    if not 1 <= len(loads) <= MAX_LOADS or not all(0 < load <= MAX_LOAD for load in loads):
        raise ValueError(f"--loads needs 1 to {MAX_LOADS} loads, each above 0 and at most {MAX_LOAD:g}")
    return loads


def parse_splits(text: str, engines: int) -> list[tuple[int, int]]:
    splits = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        left, _, right = item.partition(":")
        interactive, batch = int(left), int(right)
        if interactive < 1 or batch < 1 or interactive + batch != engines:
            raise ValueError(f"split {item!r} must be two positive counts adding up to {engines} engines")
        splits.append((interactive, batch))
    return splits


def build_setups(engines: int, splits: Sequence[tuple[int, int]]) -> list[Setup]:
    """The set-ups in the order the tables show them."""
    return [
        shared(engines),
        priority(engines),
        *(disaggregated(i, b) for i, b in splits),
        shared(engines, name="short-only", kinds=("short",)),
    ]


def build_points(setups: Sequence[Setup], loads: Sequence[float], capacity: float, args: argparse.Namespace) -> list[SimPoint]:
    return [SimPoint(setup, load, load * capacity, args.warmup, args.seconds, args.seed) for setup in setups for load in loads]


def run_parallel(points: Sequence[SimPoint], jobs: int, label: str) -> list[PointResult]:
    """Run points in ``jobs`` processes, busiest first; return them in the given order."""
    order = sorted(range(len(points)), key=lambda i: -points[i].rate * (len(points[i].setup.kinds) + 1))
    results: dict[int, PointResult] = {}
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        for done, (index, result) in enumerate(pool.imap_unordered(_indexed, [(i, points[i]) for i in order]), 1):
            results[index] = result
            print(
                f"  {label} {done}/{len(points)}: {result.setup} @ {result.load:g} "
                f"({result.requests:,} requests, {result.wall_s:.1f} s wall, {result.cpu_s:.1f} s CPU)",
                file=sys.stderr,
                flush=True,
            )
    return [results[i] for i in range(len(points))]


def _indexed(item: tuple[int, SimPoint]) -> tuple[int, PointResult]:
    index, point = item
    return index, run_point(point)


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument(
        "--seconds",
        type=float,
        default=DEFAULT_SECONDS,
        help=f"simulated measured window per point, at most {MAX_SECONDS:g} (default %(default)s: an hour)",
    )
    add_warmup_arg(parser, 20.0, "simulated warm-up per point, not measured")
    parser.add_argument("--loads", default=DEFAULT_LOADS, help="offered loads, fractions of the shared fleet's capacity (default %(default)s)")
    parser.add_argument("--engines", type=int, default=4, help="engines (GPUs) in every set-up (default %(default)s)")
    parser.add_argument("--splits", default=DEFAULT_SPLITS, help="interactive:batch engine splits for disaggregated (default %(default)s)")
    add_seed_arg(parser, 1, "the arrivals, the same for every set-up")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="processes (default: the CPUs, %(default)s)")
    parser.add_argument("--no-compare", action="store_true", help="skip the virtual-vs-real replay of quick_mixed")
    add_out_arg(parser, DEFAULT_OUT, "where JSON, markdown and plots go")
    return parser


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[float], list[tuple[int, int]]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        loads = parse_loads(args.loads)
        splits = parse_splits(args.splits, args.engines)
    except ValueError as error:
        parser.error(str(error))
    if not 0 < args.seconds <= MAX_SECONDS or not 0 <= args.warmup <= MAX_SECONDS or args.jobs < 1:
        parser.error(f"--seconds must be in (0, {MAX_SECONDS:g}], --warmup in [0, {MAX_SECONDS:g}], --jobs positive")
    return args, loads, splits


# -- the run ----------------------------------------------------------------------


@dataclass
class Checks:
    """What the sweep checks besides its points."""

    engines: list[EngineAgreement]
    saturation: Saturation
    real: dict[str, Any] | None
    comparison: list[Comparison]


def run_checks(args: argparse.Namespace, per_engine: Capacity) -> Checks:
    engines = engine_agreements(per_engine)
    for check in engines:
        print(
            f"  engine check, {check.profile} ({check.documents or 'no'} shared documents, {check.prefix_hits_reference:,} hit tokens): "
            f"{check.requests} requests, {check.differing} ended differently, "
            f"largest timestamp difference {check.max_difference_s:.3g} s",
            file=sys.stderr,
            flush=True,
        )
    saturation = saturation_run(per_engine)
    real = load_real() if not args.no_compare and QUICK_MIXED_JSON.exists() else None
    comparison = compare(real, run_parallel(replay_points(real), args.jobs, "replay")) if real else []
    return Checks(engines, saturation, real, comparison)


# -- the report ----------------------------------------------------------------------


def header(args: argparse.Namespace, setups: int, loads: int, per_engine: Capacity, checks: Checks, wall: float) -> str:
    short_tokens, long_tokens = mix_prompt_tokens()
    capacity = per_engine.req_per_s * args.engines
    saturated = checks.saturation.completed_req_per_s
    checked = sum(c.requests for c in checks.engines)
    engine = (
        f"The sweep's engine gave the same first-token and finish times as bench.sim.Engine for all {checked:,} requests "
        "of its check (hang-ups and preemptions included)."
        if all(c.agrees for c in checks.engines)
        else "WARNING: the sweep's engine and bench.sim.Engine disagree (see the engine table below); "
        "tailguard.server.advise.replay.engine no longer follows bench/sim/engine.py."
    )
    return (
        f"Virtual time (Trio MockClock), {args.engines} engines, {loads} loads x {setups} set-ups; per point "
        f"{args.warmup:g} s warm-up + {args.seconds:g} s measured window of simulated traffic (traffic continues until the "
        f"window's requests end), seed {args.seed}. Mix: 80% short ({short_tokens} prompt tokens, max_tokens 64), 20% long "
        f"({long_tokens} prompt tokens, max_tokens 512), all streaming, Poisson. Load 1.0 = {capacity:.1f} req/s = "
        f"{args.engines} x {per_engine.req_per_s:.2f} (cost model); saturation run of one throughput engine in virtual time: "
        f"{saturated:.2f} req/s ({saturated / per_engine.req_per_s:.0%} of the model). Caller deadline 120 s everywhere; "
        f"percentiles over ok answers (nearest rank). Wall time {wall:.0f} s with {args.jobs} processes. {engine}"
    )


def markdown(head: str, results: Sequence[PointResult], checks: Checks) -> tuple[list[str], str]:
    """The headline tables (also printed) and the whole sweep.md."""
    tables = [
        pivot(results, "short", "e2e_p99_ms", "short E2E P99, ms"),
        pivot(results, "short", "ttft_p99_ms", "short TTFT P99, ms"),
        pivot(results, "long", "e2e_p99_ms", "long E2E P99, ms"),
    ]
    sections = ["# python -m bench sweep", head, cost_summary(results), *tables, "## every point", full_table(results)]
    sections += ["## the sweep's engine against bench.sim.Engine", engine_table(checks.engines)]
    if checks.comparison and checks.real is not None:
        sections += ["## virtual vs real (bench/tail/quick_mixed.py)", replay_title(checks.real), comparison_table(checks.comparison)]
    return tables, "\n\n".join(sections) + "\n"


def replay_title(real: dict[str, Any]) -> str:
    return (
        f"quick_mixed's schedule ({real['rate_req_per_s_real']:.1f} req/s = {real['target_load']:g} x one engine, "
        f"{real['warmup_s']:g} s warm-up + {real['window_s']:g} s window, seed {real['seed']}), real time against virtual time:"
    )


def payload(args: argparse.Namespace, setups: Sequence[Setup], per_engine: Capacity, results: Sequence[PointResult], checks: Checks, wall: float) -> dict[str, Any]:
    short_tokens, long_tokens = mix_prompt_tokens()
    return {
        "what": "routing policy in virtual time: loads x set-ups x splits",
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "short_prompt_tokens": short_tokens,
        "long_prompt_tokens": long_tokens,
        "capacity": {
            "model_per_engine": asdict(per_engine),
            "shared_req_per_s": per_engine.req_per_s * args.engines,
            "saturation_one_engine": asdict(checks.saturation),
        },
        "engine_checks": [asdict(check) for check in checks.engines],
        "setups": [{"name": s.name, "description": s.description} for s in setups],
        "wall_s": wall,
        "cpu_s": sum(r.cpu_s for r in results),
        "points": [asdict(r) for r in results],
        "virtual_vs_real": comparison_json(checks.comparison),
    }


def write_outputs(args: argparse.Namespace, splits: Sequence[tuple[int, int]], results: Sequence[PointResult], text: str, data: dict[str, Any]) -> list[Path]:
    args.out.mkdir(parents=True, exist_ok=True)
    note = f"{args.engines} engines, {args.seconds:g} s window per point"
    paths = [plot_headline(results, args.out / "short_e2e_p99.png", note)]
    paths += [plot_split(results, f"disaggregated {i}:{b}", args.out / f"split_{i}-{b}.png", note) for i, b in splits]
    write_text(args.out / "sweep.md", text)
    write_json(args.out / "sweep.json", data)
    return [args.out / "sweep.json", args.out / "sweep.md", *paths]


def main(argv: Sequence[str] | None = None) -> int:
    args, loads, splits = parse_args(argv)
    started = time.perf_counter()
    per_engine = model_capacity()
    setups = build_setups(args.engines, splits)
    points = build_points(setups, loads, per_engine.req_per_s * args.engines, args)
    print(
        f"sweep: {len(setups)} set-ups x {len(loads)} loads on {args.engines} engines; shared capacity "
        f"{per_engine.req_per_s * args.engines:.1f} req/s (model: {per_engine.req_per_s:.2f} per throughput engine); "
        f"window {args.seconds:g} s after {args.warmup:g} s warm-up per point, simulated; {args.jobs} processes",
        file=sys.stderr,
        flush=True,
    )
    checks = run_checks(args, per_engine)
    results = run_parallel(points, args.jobs, "point")
    wall = time.perf_counter() - started
    head = header(args, len(setups), len(loads), per_engine, checks, wall)
    tables, text = markdown(head, results, checks)
    print("\n\n".join(tables))
    if checks.comparison and checks.real is not None:
        print(f"\n**virtual vs real: {replay_title(checks.real)}**\n")
        print(comparison_table(checks.comparison))
    print("\n" + head + "\n" + cost_summary(results))
    paths = write_outputs(args, splits, results, text, payload(args, setups, per_engine, results, checks, wall))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
