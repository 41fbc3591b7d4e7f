"""``python -m bench tenants``: two API keys on one small pool: B's latency alone, beside A's bursts under fair shares and FIFO, and 3:1 weights.

Real time on 127.0.0.1: one simulated engine (latency profile,
``--seats`` seats) behind one tailguard pool of as many seats, one class,
two API keys (A, B). Scenario 1, one set-up after another on the same
engine, tailguard started afresh for each:

- ``solo``: B alone, Poisson at ``--b-load`` of the pool's capacity;
- ``fair``: B as in solo, and A in bursts (``--burst-on`` s on, ``--burst-off`` off) at ``--a-burst``
  times the capacity (2.5 = five times its fair half), ``queue_order = "fair"``, weights 1:1;
- ``fifo``: the same arrivals with ``queue_order = "arrival"`` (first come, first served across callers);
- ``b-first``: ``fair`` with B's weight 100: B all but always next, the floor of a pool that never
  preempts (B still waits for a seat to free).

Scenario 2 (``weighted``): weights A:B ``--weights``, each tenant keeping
``--backlog`` streams in flight for ``--backlog-seconds``; the tokens served
to each (prompt + completion, from each stream's usage) against the weights.

The capacity is the engine model's (``tailguard.server.advise.replay.mix.engine_capacity``
for the one request shape at ``--seats`` seats), divided by the time scale.
Latencies are GPU time: real divided by ``--time-scale``. Writes
``bench/results/tenants/NAME.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from functools import partial

from bench.harness import cli
from bench.harness.report import code_version
from bench.harness.short_chat import MAX_TOKENS, PROMPT_TOKENS
from bench.tenants.measure import Result, measure
from bench.tenants.model import BACKLOG_QUEUE_TIMEOUT_GPU_S, QUEUE_TIMEOUT_GPU_S, RESULTS, Options
from bench.tenants.report import render, targets

DEFAULTS = Options()


def build_parser() -> argparse.ArgumentParser:
    parser = cli.driver_parser(__name__, __doc__, quick="smoke run of ~1 minute: window 10 s, backlog 10 s")
    add = parser.add_argument
    cli.add_seats_arg(parser, DEFAULTS.seats)
    add("--b-load", type=float, default=DEFAULTS.b_load, help="B's rate, a fraction of the capacity (default %(default)s)")
    add("--a-burst", type=float, default=DEFAULTS.a_burst, help="A's rate while bursting, times the capacity (default %(default)s)")
    add("--burst-on", type=float, default=DEFAULTS.burst_on, help="real s of each burst (default %(default)s)")
    add("--burst-off", type=float, default=DEFAULTS.burst_off, help="real s between bursts (default %(default)s)")
    cli.add_full_run_arg(parser, "--warmup", DEFAULTS.warmup, "unmeasured real s at the start")
    cli.add_full_run_arg(parser, "--seconds", DEFAULTS.seconds, "scenario 1's measured real s")
    add("--drain", type=float, default=DEFAULTS.drain, help="longest real s a set-up waits after its last arrival (default %(default)s)")
    cli.add_full_run_arg(parser, "--backlog-seconds", DEFAULTS.backlog_seconds, "scenario 2's measured real s")
    add("--backlog", type=int, default=0, help="streams each tenant keeps in flight in scenario 2 (default: twice the seats plus 4)")
    add("--weights", default="3:1", help="A:B weights in scenario 2 (default %(default)s)")
    add("--no-weighted", action="store_true", help="skip scenario 2")
    cli.add_time_scale_arg(parser, DEFAULTS.time_scale, "the simulator's --time-scale (GPU time runs this many times slower)")
    cli.add_seed_arg(parser, DEFAULTS.seed, "the arrivals and the prompts' nonces")
    cli.add_out_arg(parser, RESULTS)
    cli.add_name_arg(parser, "tenants")
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    try:
        a, b = (float(x) for x in args.weights.split(":"))
    except ValueError:
        parser.error(f"--weights is A:B, two numbers, got {args.weights!r}")
    quick = dataclasses.replace(DEFAULTS, warmup=3.0, seconds=10.0, backlog_seconds=10.0, backlog_warmup=2.0, drain=10.0)
    base = quick if args.quick else DEFAULTS
    options = dataclasses.replace(
        base,
        seats=args.seats, time_scale=args.time_scale, b_load=args.b_load, a_burst=args.a_burst,
        burst_on=args.burst_on, burst_off=args.burst_off, drain=args.drain if not args.quick else base.drain,
        warmup=args.warmup if args.warmup is not None else base.warmup,
        seconds=args.seconds if args.seconds is not None else base.seconds,
        backlog_seconds=args.backlog_seconds if args.backlog_seconds is not None else base.backlog_seconds,
        backlog=args.backlog, weights=(a, b), seed=args.seed, out=args.out,
        name=cli.output_name(args, "tenants"),
    )  # fmt: skip
    if min(options.seats, options.time_scale, options.b_load, options.a_burst, options.seconds, a, b) <= 0 or options.burst_on <= 0:
        parser.error("--seats, --time-scale, --b-load, --a-burst, --seconds, --burst-on and --weights must be > 0")
    return options


def parameters(options: Options) -> dict[str, object]:
    """What the report's parameters table says: the shape, the rates in real and GPU time, the windows."""
    cap = options.capacity
    return {
        "engine": f"1 simulated engine, latency profile, max_num_seqs {options.seats}; pool max_concurrency {options.seats}, max_queue {options.max_queue}",
        "request": f"chat, {PROMPT_TOKENS} prompt tokens, max_tokens uniform in {MAX_TOKENS[0]}..{MAX_TOKENS[1]} (seeded), ignore_eos, streamed, unique prompts",
        "time_scale": options.time_scale,
        "capacity": f"{options.capacity_gpu:.2f} req/s GPU time = {cap:.2f} req/s real (engine model, every seat busy)",
        "seat turnover": f"a request holds its seat ~{options.service_gpu_ms:.0f} GPU ms in a full batch: with every seat busy, "
        f"one frees every ~{options.service_gpu_ms / options.seats:.0f} GPU ms on average (the wait a newcomer cannot avoid)",
        "B": f"Poisson {options.b_load:g} x capacity = {options.b_load * cap:.2f} req/s real",
        "A": f"Poisson {options.a_burst:g} x capacity = {options.a_burst * cap:.2f} req/s real, {options.burst_on:g} s on / {options.burst_off:g} s off",
        "class": f"one, queue_timeout {QUEUE_TIMEOUT_GPU_S:g} GPU s ({QUEUE_TIMEOUT_GPU_S * options.time_scale:g} real s), priority 0",
        "scenario 1 window": f"warm-up {options.warmup:g} s, measured {options.seconds:g} s (real), drain <= {options.drain:g} s",
        "scenario 2": f"weights {options.weights[0]:g}:{options.weights[1]:g}, {options.outstanding} streams each, "
        f"queue_timeout {BACKLOG_QUEUE_TIMEOUT_GPU_S:g} GPU s, "
        f"warm-up {options.backlog_warmup:g} s, measured {options.backlog_seconds:g} s (real)",
        "seed": options.seed,
    }


def judged(result: Result, weights: tuple[float, float]) -> str:
    """The report, the targets judged first from the numbers measured."""
    result.targets = targets(result, weights)
    return render(result)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = options_from(args, parser)
    result = Result(["python", "-m", "bench", "tenants", *(argv or [])], code_version(), parameters(options))
    result.seat_turnover_ms = options.service_gpu_ms / options.seats
    measured = partial(measure, weighted=not args.no_weighted)
    report = partial(judged, weights=options.weights)
    said = "the simulator and tailguard were stopped"
    return cli.run_and_report(measured, options, result, said=said, render=report, out=options.out, stem=options.name)
