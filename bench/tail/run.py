"""``python -m bench tail``: short requests' P99 under mixed load, five set-ups on the same engines and traffic.

Real time, open loop, on 127.0.0.1: one simulator process serves N
throughput-profile engines plus I latency-profile ones; tailguard runs in
its own process, started afresh for each set-up that uses it. The same
seeded arrivals are played against, one after another:

- ``shared``: all N throughput engines, client round robin, one FIFO per engine, no caps (no router);
- ``priority``: tailguard, ONE pool of the N throughput engines (cap 256 each), both classes routed to it,
  interactive priority 0 before batch priority 1, queue timeouts and deadlines (the origin's fix);
- ``disaggregated``: tailguard's default, ``--split I:B`` (I + B = N): an interactive pool of I
  latency engines (cap 64 each), a batch pool of B throughput engines (cap 256 each);
- ``split-direct``: ``disaggregated``'s exact split fed by the client with no router: each short request
  round robin to the I latency engines, each long one to the B throughput engines, each body the one
  tailguard would forward (its model, max_tokens after the output cap), so the difference from
  ``disaggregated`` is the router's own added latency;
- ``short-only``: ``shared`` with the long requests removed: the ideal short P99.

Work-conserving set-ups (issue 12), on ``disaggregated``'s split unless said:

- ``lend``: the interactive pool lends idle seats to batch requests under a rule
  (``--lend-rule``: prefill budget, reserve, seats at most; one set-up per rule),
  and the batch pool lends its idle seats to interactive requests (``--no-lend-back`` turns that off);
- ``rebalance``: every endpoint ``movable = true`` and a ``[rebalance]`` section (hold time,
  cooldown, threshold in GPU s, ``--hold``/``--cooldown``/``--threshold``);
- ``lend-rebalance``: both, with the first ``--lend-rule``;
- ``shared-limit``: ``priority``'s one pool with ``class_max_concurrency`` for batch (``--batch-seats``, one set-up each);
- ``vllm-priority``: ``priority``'s one pool with ``vllm_priority = true``, its engines run with the
  simulator's ``--scheduling-policy priority``.

Every set-up gets engines of its own, so ``--max-engines`` can run several set-ups at once
(each still alone on its engines; only the CPU is shared, and the report says how busy it was).
``--mix`` picks the traffic: the origin's, ``chat`` (short requests take most of the GPU time),
or ``shift`` (``chat`` then the origin's, ``--phase-seconds`` each).

The load is a fraction of the ``shared`` set-up's capacity for the traffic's
mix, computed from the engine model (``tailguard.server.advise.replay.mix.engine_capacity``);
every set-up's own modelled capacity is reported beside it. Latencies are
GPU time (real divided by ``--time-scale``); tailguard's timeouts are scaled
by the same factor so its deadlines mean what they say in GPU time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from bench.harness.cli import add_name_arg, add_out_arg, add_seed_arg, add_time_scale_arg, driver_parser, output_name, run_trio, same_named
from bench.tail.measure import measure
from bench.tail.model import DEFAULT_LEND, DEFAULT_SETUPS, RESULTS, SETUP_NAMES, SPLIT_KINDS, LendRule, Options, RebalanceSpec
from bench.tail.report import render, write_outputs
from tailguard.server.advise.replay.mix import MIXES


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__, quick="smoke check under 2 minutes: load 0.8, warm-up 4 s, window 8 s, drain 12 s")
    add = parser.add_argument
    add("--engines", type=int, default=4, help="simulated GPUs per set-up (default %(default)s)")
    add(
        "--split",
        default="1:3",
        help="disaggregated I:B, interactive latency engines : batch throughput engines, I+B = --engines; "
        "comma-separated for several (each split set-up runs on each) (default %(default)s)",
    )
    add("--loads", default=None, help="comma-separated loads, fractions of the shared capacity (default 0.5,0.8,1.0,1.3)")
    add("--traffic", choices=("poisson", "bursty"), default="poisson", help="arrival process (default %(default)s)")
    add("--burst-period", type=float, default=10.0, help="bursty: on half, off half of this many real s (default %(default)s)")
    add("--trace", type=Path, help="replay a JSONL trace (at GPU s, prompt_tokens, max_tokens, class) instead; --loads is ignored")
    add("--record-trace", type=Path, help="write the first load's generated schedule as a JSONL trace")
    add("--warmup", type=float, default=None, help="unmeasured arrivals before the window, real s (default 20)")
    add("--seconds", type=float, default=None, help="measured arrival window, real s (default 30)")
    add("--drain", type=float, default=None, help="longest wait after the last arrival, real s (default 30)")
    add_time_scale_arg(parser, 4.0, "the simulator's --time-scale; keeps its CPU and the router's low")
    add_seed_arg(parser, 1, "the arrivals")
    add("--setup", action="append", choices=SETUP_NAMES, help=f"run this set-up, repeatable (default: {', '.join(DEFAULT_SETUPS)})")
    add("--mix", choices=(*MIXES, "shift"), default="origin", help="traffic: the origin's, chat (short requests take most GPU time), "
        "or shift (chat, then the origin's, --phase-seconds each) (default %(default)s)")
    add("--phase-seconds", type=float, default=None, help="--mix shift: real s of each phase (default 120)")
    add("--interactive-profile", choices=("latency", "throughput"), default="latency",
        help="the split's interactive engines' profile: tuned for latency, or as the batch pool's (default %(default)s)")
    add("--seats", type=int, default=None, help="every engine's max_num_seqs (and its endpoint cap); default: the profiles' (64 latency, 256 throughput)")
    add("--lend-rule", action="append", default=None, metavar="RULE",
        help="the interactive pool's lending rule, e.g. prompt=512,reserve=8,seats=32,output=512; repeatable: one lend set-up "
        f"each, lend-rebalance takes the first (default {DEFAULT_LEND.label()})")
    add("--no-lend-back", action="store_true", help="in the lend set-ups, the batch pool lends nothing to interactive requests")
    add("--batch-relay-interval", type=float, default=0.0, metavar="S",
        help="the batch class's relay_interval in GPU seconds: its streams are read at most once per S (default 0: as events come)")
    add("--hold", type=float, default=RebalanceSpec.hold, help="[rebalance] hold_time, GPU s (default %(default)s)")
    add("--cooldown", type=float, default=RebalanceSpec.cooldown, help="[rebalance] cooldown, GPU s (default %(default)s)")
    add("--threshold", type=float, default=RebalanceSpec.threshold, help="[rebalance] threshold (default %(default)s)")
    add("--batch-seats", default="16", help="shared-limit: batch's class_max_concurrency per engine, comma-separated, one set-up each (default %(default)s)")
    add("--max-engines", type=int, default=0, help="run set-ups (and loads) at once while their engines add up to at most this "
        "(each on engines of its own); 0: one at a time (default %(default)s)")
    add("--baselines-each-round", action="store_true", help="with --max-engines: every round runs its own shared and short-only, "
        "and each set-up is compared with those (a busy machine's load changes between rounds)")
    add("--bins", type=float, default=0.0, help="GPU s per bin of the per-class series over time (default: 2 with --mix shift, else none)")
    add("--prefix-caching", choices=("true", "false"), default="true",
        help="the simulated engines' prefix cache; every prompt is unique either way, so it has nothing to hit (default %(default)s)")
    add_out_arg(parser, RESULTS)
    add_name_arg(parser, "tail")
    add("--samples", type=Path, default=None, help="also write every request's fate (JSONL, one file per set-up and load) to this folder")
    add(
        "--fail-fast-fraction",
        type=float,
        default=None,
        help="every pool's fail_fast_fraction in tailguard's config: 0 = requests wait and time out (the old behaviour); "
        "default: the router's own default",
    )
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    try:
        splits = [tuple(int(x) for x in item.split(":")) for item in args.split.split(",") if item.strip()]
        loads = [float(x) for x in (args.loads or ("0.8" if args.quick else "0.5,0.8,1.0,1.3")).split(",") if x.strip()]
        rules = [LendRule.parse(text) for text in args.lend_rule] if args.lend_rule else [DEFAULT_LEND]
        batch_seats = [int(x) for x in args.batch_seats.split(",") if x.strip()]
    except ValueError as error:
        parser.error(f"--split is I:B (integers), --loads comma-separated numbers, --batch-seats integers: {error}")
    setups = args.setup or DEFAULT_SETUPS
    needs_split = any(kind in SPLIT_KINDS for kind in setups)
    for split in splits:
        if len(split) != 2 or (needs_split and (split[0] < 1 or split[1] < 1 or sum(split) != args.engines)):
            parser.error(f"--split {args.split}: each I:B both >= 1 and summing to --engines {args.engines}")
    interactive, batch = splits[0]
    if not loads or min(loads) <= 0 or args.time_scale <= 0:
        parser.error("--loads and --time-scale must be > 0")
    quick = (4.0, 8.0, 12.0) if args.quick else (20.0, 30.0, 30.0)
    warmup, seconds, drain = (given if given is not None else default for given, default in zip((args.warmup, args.seconds, args.drain), quick))
    phase = args.phase_seconds if args.phase_seconds is not None else 120.0
    if args.mix == "shift":
        seconds = 2 * phase - warmup  # the window: from the warm-up's end to the last arrival
    if seconds <= 0 or warmup < 0 or drain < 0:
        parser.error("--seconds must be > 0, --warmup and --drain >= 0")
    if args.fail_fast_fraction is not None and not 0 <= args.fail_fast_fraction <= 1:
        parser.error("--fail-fast-fraction is between 0 and 1")
    return same_named(
        Options,
        args,
        split=(interactive, batch),
        loads=loads,
        warmup=warmup,
        seconds=seconds,
        drain=drain,
        setups=setups,
        name=output_name(args, "tail"),
        samples_dir=args.samples,
        splits=[(i, b) for i, b in splits],
        lend_rules=rules,
        lend_back=not args.no_lend_back,
        rebalance=RebalanceSpec(hold=args.hold, threshold=args.threshold, cooldown=args.cooldown),
        batch_seats=batch_seats,
        phase_seconds=phase if args.mix == "shift" else 0.0,
        bin_seconds=args.bins,
        prefix_caching=args.prefix_caching == "true",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = options_from(args, parser)
    started = time.perf_counter()
    result = run_trio(measure, options, ["python", "-m", "bench", "tail", *(argv or [])], said="the simulator and tailguard were stopped")
    if result is None:
        return 130
    table = render(result)
    print(table)
    for path in write_outputs(result, options, table):
        print(f"wrote {path}")
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0
