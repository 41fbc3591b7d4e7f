"""``python -m bench sweep``: the routing policy in virtual time, loads x set-ups x engine splits.

The router core and the simulated engines share one process per point under
Trio's MockClock (in-process transport, no sockets), so a sweep measures the
policy, not the machine. On the same engines and the same seeded open-loop
Poisson traffic (quick_mixed's mix: 80% short chat, 20% ~2,000-token
documents with max_tokens 512, all streaming), it compares:

- ``shared``: round robin straight to throughput engines (no router);
- ``priority``: a Router with one pool of the same engines, interactive
  (prio 0) queued ahead of batch (prio 1), caps = seats, queue deadlines
  3 s / 30 s (config.toml);
- ``disaggregated i:b``: an interactive pool of i latency engines and a batch
  pool of b throughput engines, caps = seats;
- ``short-only``: shared without the long requests, the ideal.

Load is a fraction of the shared fleet's capacity for the mix. Each point is
an independent simulation (warm-up, then a measured window; traffic goes on
until the window's requests end); points run in parallel processes. An hour
of simulated traffic per point would cost hours of wall time in Python (the
engines and the router cost ~1 ms of CPU per request), so the default is a
60 s window after a 20 s warm-up; ``--seconds`` buys steadier P99s. It also
replays ``bench/quick_mixed.py``'s real-time schedule in virtual time and
prints both side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .sweep_check import (
    QUICK_MIXED_JSON,
    compare,
    comparison_json,
    load_real,
    mix_prompt_tokens,
    model_capacity,
    replay_points,
    saturation_run,
)
from .sweep_report import comparison_table, full_table, pivot, plot_headline, plot_split
from .sweep_sim import PointResult, Setup, disaggregated, priority, run_point, shared
from .sweep_sim import Point as SimPoint

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "sweep"
DEFAULT_LOADS = "0.1,0.3,0.5,0.7,0.8,0.9,1.0,1.1,1.3,1.5"
DEFAULT_SPLITS = "1:3,2:2"


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
            print(f"  {label} {done}/{len(points)}: {result.setup} @ {result.load:g} ({result.wall_s:.1f} s wall)", file=sys.stderr, flush=True)
    return [results[i] for i in range(len(points))]


def _indexed(item: tuple[int, SimPoint]) -> tuple[int, PointResult]:
    index, point = item
    return index, run_point(point)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="simulated measured window per point (default %(default)s)")
    parser.add_argument("--warmup", type=float, default=20.0, help="simulated warm-up per point, not measured (default %(default)s)")
    parser.add_argument("--loads", default=DEFAULT_LOADS, help="offered loads, fractions of the shared fleet's capacity (default %(default)s)")
    parser.add_argument("--engines", type=int, default=4, help="engines (GPUs) in every set-up (default %(default)s)")
    parser.add_argument("--splits", default=DEFAULT_SPLITS, help="interactive:batch engine splits for disaggregated (default %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the arrivals, the same for every set-up (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="processes (default: the CPUs, %(default)s)")
    parser.add_argument("--no-compare", action="store_true", help="skip the virtual-vs-real replay of quick_mixed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where JSON, markdown and plots go (default %(default)s)")
    return parser


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
        splits = parse_splits(args.splits, args.engines)
    except ValueError as error:
        parser.error(str(error))
    if args.seconds <= 0 or args.warmup < 0 or args.jobs < 1 or not loads:
        parser.error("--seconds and --jobs must be positive, --warmup non-negative, --loads non-empty")
    started = time.perf_counter()
    per_engine = model_capacity()
    capacity = per_engine.req_per_s * args.engines
    setups = build_setups(args.engines, splits)
    points = build_points(setups, loads, capacity, args)
    short_tokens, long_tokens = mix_prompt_tokens()
    note = f"{args.engines} engines, {args.seconds:g} s window per point"
    print(
        f"sweep: {len(setups)} set-ups x {len(loads)} loads on {args.engines} engines; shared capacity "
        f"{capacity:.1f} req/s (model: {per_engine.req_per_s:.2f} per throughput engine); window {args.seconds:g} s "
        f"after {args.warmup:g} s warm-up per point, simulated; {args.jobs} processes",
        file=sys.stderr,
        flush=True,
    )

    results = run_parallel(points, args.jobs, "point")
    saturation = saturation_run(per_engine)
    real = load_real() if not args.no_compare and QUICK_MIXED_JSON.exists() else None
    comparison = compare(real, run_parallel(replay_points(real), args.jobs, "replay")) if real else []
    wall = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    paths = [plot_headline(results, args.out / "short_e2e_p99.png", note)]
    paths += [plot_split(results, f"disaggregated {i}:{b}", args.out / f"split_{i}-{b}.png", note) for i, b in splits]

    header = (
        f"Virtual time (Trio MockClock), {args.engines} engines, {len(loads)} loads x {len(setups)} set-ups; per point "
        f"{args.warmup:g} s warm-up + {args.seconds:g} s measured window of simulated traffic (traffic continues until the "
        f"window's requests end), seed {args.seed}. Mix: 80% short ({short_tokens} prompt tokens, max_tokens 64), 20% long "
        f"({long_tokens} prompt tokens, max_tokens 512), all streaming, Poisson. Load 1.0 = {capacity:.1f} req/s = "
        f"{args.engines} x {per_engine.req_per_s:.2f} (cost model); saturation run of one throughput engine in virtual time: "
        f"{saturation.completed_req_per_s:.2f} req/s ({saturation.completed_req_per_s / per_engine.req_per_s:.0%} of the model). "
        f"Caller deadline 120 s everywhere; percentiles over ok answers (nearest rank). Wall time {wall:.0f} s."
    )
    tables = [
        pivot(results, "short", "e2e_p99_ms", "short E2E P99, ms"),
        pivot(results, "short", "ttft_p99_ms", "short TTFT P99, ms"),
        pivot(results, "long", "e2e_p99_ms", "long E2E P99, ms"),
    ]
    print("\n\n".join(tables))
    if comparison:
        print(
            f"\n**virtual vs real: quick_mixed's schedule ({real['rate_req_per_s_real']:.1f} req/s = {real['target_load']:g} "  # type: ignore[index]
            f"x one engine, {real['warmup_s']:g} s warm-up + {real['window_s']:g} s window, seed {real['seed']})**\n"  # type: ignore[index]
        )
        print(comparison_table(comparison))
    print("\n" + header)
    markdown = "\n\n".join(
        ["# python -m bench sweep", header, *tables, "## every point", full_table(results)]
        + (["## virtual vs real (bench/quick_mixed.py)", comparison_table(comparison)] if comparison else [])
    )
    (args.out / "sweep.md").write_text(markdown + "\n")
    payload = {
        "what": "routing policy in virtual time: loads x set-ups x splits",
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "short_prompt_tokens": short_tokens,
        "long_prompt_tokens": long_tokens,
        "capacity": {
            "model_per_engine": asdict(per_engine),
            "shared_req_per_s": capacity,
            "saturation_one_engine": asdict(saturation),
        },
        "setups": [{"name": s.name, "description": s.description} for s in setups],
        "wall_s": wall,
        "points": [asdict(r) for r in results],
        "virtual_vs_real": comparison_json(comparison),
    }
    (args.out / "sweep.json").write_text(json.dumps(_json_safe(payload), indent=2) + "\n")
    print(f"wrote {args.out / 'sweep.json'}, {args.out / 'sweep.md'}, " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
