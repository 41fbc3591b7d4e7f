"""``python -m bench retry``: the openai SDK's retries under 1.5x overload, tailguard's computed Retry-After beside a fixed 1 s.

Real time on 127.0.0.1: one simulated engine (latency profile,
``--seats`` seats) behind one tailguard pool of as many seats and a wait
queue of ``--max-queue``, one class. Seeded Poisson arrivals at ``--load``
times the pool's capacity for ``--warmup`` + ``--seconds`` s, each a
logical request: one ``chat.completions.create`` of the openai SDK
(``max_retries`` ``--max-retries``), which honours each refusal's
``Retry-After`` and sends again. Two set-ups, the same arrivals, tailguard
afresh for each: ``computed`` (``[timeouts] retry_after_hint = "computed"``,
the default: the queue ahead over the measured drain rate, spread) and
``fixed`` (every hint ``retry_after`` = 1 s, as before). Counted: the
logical requests arriving after the warm-up; times are real seconds (the
SDK sleeps real seconds). Writes ``bench/results/retry/NAME.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import openai

from bench.harness import cli
from bench.harness.report import code_version
from bench.harness.short_chat import MAX_TOKENS, PROMPT_TOKENS
from bench.retry.measure import Result, measure
from bench.retry.model import RESULTS, RETRY_AFTER_S, Options
from bench.retry.report import render, targets

DEFAULTS = Options()


def build_parser() -> argparse.ArgumentParser:
    parser = cli.driver_parser(__name__, __doc__, quick="smoke run of ~40 s: warm-up 2 s, 8 s counted, drain 10 s")
    add = parser.add_argument
    cli.add_seats_arg(parser, DEFAULTS.seats)
    add("--max-queue", type=int, default=DEFAULTS.max_queue, help="the pool's max_queue (default %(default)s)")
    add("--queue-timeout", type=float, default=DEFAULTS.queue_timeout_gpu, help="the class's queue_timeout, GPU s (default %(default)s)")
    add("--load", type=float, default=DEFAULTS.load, help="the arrival rate, times the pool's capacity (default %(default)s)")
    cli.add_full_run_arg(parser, "--warmup", DEFAULTS.warmup, "uncounted real s of arrivals first")
    cli.add_full_run_arg(parser, "--seconds", DEFAULTS.seconds, "counted real s of arrivals")
    cli.add_full_run_arg(parser, "--drain", DEFAULTS.drain, "longest real s after the last arrival")
    add("--max-retries", type=int, default=DEFAULTS.max_retries, help="the SDK's max_retries (default %(default)s)")
    cli.add_time_scale_arg(parser, DEFAULTS.time_scale, "the simulator's --time-scale (GPU time runs this many times slower)")
    cli.add_seed_arg(parser, DEFAULTS.seed, "the arrivals, the lengths and the prompts' nonces")
    cli.add_out_arg(parser, RESULTS)
    cli.add_name_arg(parser, "retry")
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    base = dataclasses.replace(DEFAULTS, warmup=2.0, seconds=8.0, drain=10.0) if args.quick else DEFAULTS
    options = dataclasses.replace(
        base, seats=args.seats, max_queue=args.max_queue, queue_timeout_gpu=args.queue_timeout, time_scale=args.time_scale,
        load=args.load, max_retries=args.max_retries, seed=args.seed, out=args.out,
        warmup=base.warmup if args.warmup is None else args.warmup,
        seconds=base.seconds if args.seconds is None else args.seconds,
        drain=base.drain if args.drain is None else args.drain,
        name=cli.output_name(args, "retry"),
    )  # fmt: skip
    if min(options.seats, options.max_queue, options.time_scale, options.load, options.seconds, options.queue_timeout_gpu) <= 0:
        parser.error("--seats, --max-queue, --time-scale, --load, --seconds and --queue-timeout must be > 0")
    if options.max_retries < 0 or options.warmup < 0 or options.drain < 0:
        parser.error("--max-retries, --warmup and --drain must be >= 0")
    return options


def parameters(options: Options) -> dict[str, object]:
    """What the report's parameters table says: the shape, the rates, the SDK, the windows."""
    return {
        "engine": f"1 simulated engine, latency profile, max_num_seqs {options.seats}, --time-scale {options.time_scale:g}",
        "pool": f"max_concurrency {options.seats}, max_queue {options.max_queue}; one class, queue_timeout {options.queue_timeout_gpu:g} GPU s "
        f"({options.queue_timeout_gpu * options.time_scale:g} real s)",
        "request": f"chat, {PROMPT_TOKENS} prompt tokens, max_tokens uniform in {MAX_TOKENS[0]}..{MAX_TOKENS[1]} (seeded), ignore_eos, "
        "not streamed, unique prompts",
        "capacity": f"{options.capacity:.2f} req/s real (engine model, every seat busy)",
        "arrivals": f"Poisson {options.load:g} x capacity = {options.rate:.2f} req/s real, {options.horizon:g} s",
        "window": f"warm-up {options.warmup:g} s, counted {options.seconds:g} s, drain <= {options.drain:g} s (real)",
        "clients": f"one openai.AsyncOpenAI (openai {openai.__version__}), max_retries {options.max_retries}, "
        f"timeout {options.attempt_timeout:g} s an attempt; on a 429 / 5xx it sleeps exactly the Retry-After "
        "(retry-after-ms first, then retry-after; used when 0 < it <= 120 s, no jitter added), else 0.5 s x 2^n less up to 25%",
        "set-ups": f'computed: retry_after_hint = "computed", retry_after = {RETRY_AFTER_S:g} (the floor); '
        f'fixed: retry_after_hint = "fixed", retry_after = {RETRY_AFTER_S:g}',
        "seed": options.seed,
    }


def judged(result: Result) -> str:
    """The report, the targets judged first from the numbers measured."""
    result.targets = targets(result.setups)
    return render(result)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    options = options_from(parser.parse_args(argv), parser)
    result = Result(["python", "-m", "bench", "retry", *(argv or [])], code_version(), parameters(options))
    result.window_start, result.bin_s = options.warmup, options.bin_s
    said = "the simulator and tailguard were stopped"
    return cli.run_and_report(measure, options, result, said=said, render=judged, out=options.out, stem=options.name)
