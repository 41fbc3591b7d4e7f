"""``python -m bench prefix``: shared-prefix workloads against cache-blind, cache-aware and hand-pinned placement, side by side.

Workloads (``bench/prefix/workloads.py``, ``bench/prefix/mooncake.py``):
``tenants`` (24 tenants' system prompts, Zipf popularity, unique questions,
10% unique long documents beside), ``multi-turn`` (conversations resending
their history and the answers received, with think time), ``rag`` (many
questions about each of a set of documents), ``mooncake`` (the committed
sample of the Mooncake trace, text built block by block from its
``hash_ids``) and ``unique`` (the tenants' shapes with nothing shared).

Set-ups (``bench/prefix/setups.py``): vllm-router round_robin, cache_aware
(its defaults, and balancing thresholds sized to these engines) and
consistent_hash on a session header (hand affinity), tailguard least loaded
and tailguard's default placement. Each gets four fresh simulated
engines (32 seats, the prefix cache on, a KV cache holding about a third of
the tenants' system prompts) per workload; the set-ups of a workload run
at the same time unless ``--serial``. Latencies are GPU time: real divided
by ``--time-scale``. Writes ``bench/results/prefix/NAME.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench.harness.cli import add_name_arg, add_out_arg, add_seed_arg, add_time_scale_arg, driver_parser, output_name, run_trio
from bench.harness.mooncake import read_rows
from bench.harness.procs import RESULTS_ROOT
from bench.harness.report import code_version, write_report
from bench.prefix.engines import kv_sizing
from bench.prefix.measure import RunSpec, measure_workload
from bench.prefix.model import ENGINES, SEATS, Workload
from bench.prefix.mooncake import SAMPLE, replay
from bench.prefix.report import Result, render, targets
from bench.prefix.setups import ALL_SETUPS, SETUPS, describe, placement_supported
from bench.prefix.workloads import Spec, conversations, rag, system_prompts, tenants, unique_prompts

WORKLOADS = ("tenants", "multi-turn", "rag", "mooncake", "unique")
RESULTS = RESULTS_ROOT / "prefix"


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__, quick="smoke run of ~2 minutes: warm-up 1.5 GPU s, window 3.5 GPU s, 120 trace rows, drain 5 s")
    add = parser.add_argument
    add("--workload", action="append", choices=WORKLOADS, help="run this workload, repeatable (default: all)")
    add("--setup", action="append", choices=ALL_SETUPS, help=f"run this set-up, repeatable (default: {', '.join(SETUPS)})")
    add("--load", type=float, default=0.8, help="fraction of each workload's modelled capacity (default %(default)s)")
    add("--warmup", type=float, default=None, help="unmeasured GPU s at the start of each schedule (default 5)")
    add("--seconds", type=float, default=None, help="measured GPU s after the warm-up (default 16)")
    add("--drain", type=float, default=None, help="real s each run waits after its schedule's end at most (default 10)")
    add("--trace", type=Path, default=SAMPLE, help="the Mooncake trace (JSONL) to replay (default: the committed sample)")
    add("--trace-rows", type=int, default=None, help="replay the trace's first N rows (default 400)")
    add("--serial", action="store_true", help="run a workload's set-ups one after another instead of side by side")
    add_time_scale_arg(parser, 3.0, "the simulator's --time-scale (GPU time runs this many times slower)")
    add_seed_arg(parser, 1, "every workload")
    add_out_arg(parser, RESULTS)
    add_name_arg(parser, "prefix")
    return parser


def build_workloads(names: Sequence[str], spec: Spec, trace: Path, rows: int) -> list[Workload]:
    """The chosen workloads, generated from ``spec``."""
    makers = {
        "tenants": lambda: tenants(spec),
        "multi-turn": lambda: conversations(spec),
        "rag": lambda: rag(spec),
        "mooncake": lambda: replay(spec, read_rows(trace, rows)),
        "unique": lambda: unique_prompts(spec),
    }
    return [makers[name]() for name in names]


async def measure(workloads: Sequence[Workload], result: Result, setup_names: Sequence[str], spec: RunSpec) -> Result:
    """Every workload against every set-up, in order; the targets checked at the end."""
    setups = [describe(name, spec.placement_ok) for name in setup_names]
    for workload in workloads:
        print(f"{workload.name}: {workload.description}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        result.runs += await measure_workload(workload, setups, spec)
        print(f"  {workload.name} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    result.targets = targets(result)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quick = args.quick
    warmup = args.warmup if args.warmup is not None else (1.5 if quick else 5.0)
    seconds = args.seconds if args.seconds is not None else (3.5 if quick else 16.0)
    drain = args.drain if args.drain is not None else (5.0 if quick else 10.0)
    rows = args.trace_rows if args.trace_rows is not None else (120 if quick else 400)
    if args.load <= 0 or args.time_scale <= 0 or seconds <= 0 or warmup < 0 or drain < 0 or rows < 2:
        parser.error("--load, --time-scale and --seconds must be > 0, --warmup and --drain >= 0, --trace-rows >= 2")
    spec = Spec(seed=args.seed, load=args.load, warmup_s=warmup, seconds=seconds)
    sizing = kv_sizing(sum(len(p) // 4 for p in system_prompts(spec)), spec.unique_share)
    spec = dataclasses.replace(spec, kv_cache_tokens=sizing.kv_cache_tokens)
    print(sizing.line(), file=sys.stderr)
    placement_ok = placement_supported()
    run_spec = RunSpec(args.time_scale, drain, sizing.kv_cache_tokens, args.seed, placement_ok, parallel=not args.serial)
    workloads = build_workloads(args.workload or WORKLOADS, spec, args.trace, rows)
    result = Result(
        command=["python", "-m", "bench", "prefix", *(argv if argv is not None else sys.argv[1:])],
        code=code_version(),
        time_scale=args.time_scale,
        times_are="GPU time: real divided by the time scale",
        engines=f"{ENGINES} simulated engines a set-up, latency profile, max_num_seqs {SEATS}, prefix caching on",
        kv_sizing=sizing.line(),
        placement='placement = "least_loaded" | default (prefix affinity)'
        if placement_ok
        else "this tailguard has no placement key: both tailguard set-ups place least loaded",
        load=args.load,
        workloads={
            w.name: {
                "description": w.description,
                "rate_req_s": w.rate_req_s,
                "capacity_req_s": w.capacity_req_s,
                "requests": len(w.requests) + sum(len(c.turns) for c in w.conversations),
                "warmup_s": w.warmup_s,
                "end_s": w.end_s,
            }
            for w in workloads
        },  # fmt: skip
        cpu_count=len(os.sched_getaffinity(0)),
        load_average={"start": list(os.getloadavg())},
    )
    started = time.perf_counter()
    done = run_trio(measure, workloads, result, args.setup or SETUPS, run_spec, said="the simulators and routers were stopped")
    if done is None:
        return 130
    done.wall_s = time.perf_counter() - started
    done.load_average["end"] = list(os.getloadavg())
    report = render(done)
    print(report)
    write_report(args.out, output_name(args, "prefix"), asdict(done), report)
    return 0
