"""``python -m bench budgets``: 4 replicas on one Redis sharing one key's 100k tokens/minute; kill -9 and a 30 s outage mid-run.

Real time, 127.0.0.1 only, free ports, every loop bounded in count and
time. One simulated engine (the latency profile) with seats that never
bind, so the budget is what limits; one redis-server without persistence;
``--spread``'s replicas, each ``tailguard serve`` with ``[cluster]`` on
that Redis in one namespace, and one API key with ``tokens_per_minute``.
An open loop of non-streaming chats (unique prompts, ``ignore_eos``) offers
``--load`` times the budget's tokens, spread unevenly over the replicas.
At ``--kill-at`` the replica of ``--victim`` is killed with SIGKILL (its
clients move to the others); at ``--outage-at`` redis-server is SIGSTOPped
for ``--outage-s``, then resumed. The target (issue 24): the tokens
admitted fleet-wide in any 60 s stay within the budget and one largest
request, whatever the kill and the outage do. Reported beside it: tokens
admitted per 10 s and per replica, utilisation per phase against what
static shares alone would admit, every replica's cluster mode, the 429s'
Retry-After.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench.budgets.drive import arrival_rate, drive, reserve_of
from bench.budgets.model import RESULTS, Options, Result
from bench.budgets.numbers import summarise
from bench.budgets.report import render
from bench.budgets.setup import fleet
from bench.harness.cli import (
    add_name_arg,
    add_out_arg,
    add_seats_arg,
    add_seed_arg,
    add_time_scale_arg,
    driver_parser,
    listed,
    output_name,
    run_and_report,
    same_named,
)
from bench.harness.report import code_version


async def measure(o: Options, command: list[str]) -> Result:
    parameters = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()}
    parameters |= {"replicas": o.replicas, "reserve": reserve_of(o), "rate_per_s": arrival_rate(o), "cpus": os.cpu_count()}
    result = Result(command, code_version(), parameters, load_average={"start": list(os.getloadavg())})
    with tempfile.TemporaryDirectory(prefix="bench-budgets-") as tmp:
        async with fleet(o, Path(tmp)) as running:
            print(f"{o.replicas} replicas ready; {o.duration:g} s of arrivals", file=sys.stderr)
            driven = await drive(o, running)
            exited = [r.name for i, r in enumerate(running.replicas) if i != o.victim and not r.alive]
            if exited:
                raise RuntimeError(f"{', '.join(exited)} exited during the run; see its log under {tmp}")
    parameters["arrivals"] = len(driven.sent)
    result.summary = summarise(o, driven)
    result.health = driven.health
    result.requests = [asdict(s) for s in driven.sent]
    result.load_average["end"] = list(os.getloadavg())
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__, quick="smoke run (~65 s): 60 s of arrivals, kill at 20 s, Redis stopped at 30 s for 15 s")
    add = parser.add_argument
    add("--duration", type=float, default=240.0, help="s of arrivals (default %(default)s)")
    add("--kill-at", type=float, default=70.0, help="s: kill -9 the --victim replica (default %(default)s)")
    add("--outage-at", type=float, default=120.0, help="s: SIGSTOP redis-server (default %(default)s)")
    add("--outage-s", type=float, default=30.0, help="s redis-server stays stopped (default %(default)s)")
    add("--no-kill", action="store_true", help="no replica killed")
    add("--no-outage", action="store_true", help="Redis never stopped")
    add("--load", type=float, default=2.0, help="offered tokens over the budget's rate (default %(default)s)")
    add("--budget", type=int, default=100_000, help="the key's tokens_per_minute (default %(default)s)")
    add("--prompt-tokens", type=int, default=200, help="each request's prompt (default %(default)s)")
    add("--max-tokens", type=int, default=800, help="each request's max_tokens, all generated (ignore_eos) (default %(default)s)")
    add("--spread", type=listed(float), default="0.55,0.25,0.15,0.05", help="each replica's share of the arrivals, comma-separated (default %(default)s)")
    add("--victim", type=int, default=1, help="index in --spread of the replica killed (default %(default)s)")
    add("--static-share", type=float, default=0.25, help="[cluster] static_share (default %(default)s)")
    add("--lease-ttl", type=float, default=2.0, help="[cluster] lease_ttl, s (default %(default)s)")
    add("--sync-interval", type=float, default=0.05, help="[cluster] sync_interval, s (default %(default)s)")
    add("--queue-timeout", type=float, default=5.0, help="the one class's queue_timeout, s (default %(default)s)")
    add_seats_arg(parser, 64)
    add_time_scale_arg(parser, 1.0)
    add("--drain", type=float, default=15.0, help="s after the last arrival before the run is cut (default %(default)s)")
    add_seed_arg(parser, 1, "the arrivals and their replicas")
    add_name_arg(parser, "budgets")
    add_out_arg(parser, RESULTS)
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    spread: tuple[float, ...] = args.spread
    duration, kill_at, outage_at, outage_s = (60.0, 20.0, 30.0, 15.0) if args.quick else (args.duration, args.kill_at, args.outage_at, args.outage_s)
    o = same_named(
        Options,
        args,
        duration=duration,
        kill_at=None if args.no_kill else kill_at,
        outage_at=None if args.no_outage else outage_at,
        outage_s=outage_s,
        drain=10.0 if args.quick else args.drain,
    )
    if len(spread) < 2 or min(spread) <= 0 or not 0 <= o.victim < len(spread):
        parser.error("--spread: two or more positive shares; --victim an index into it")
    if o.load <= 0 or o.budget < o.prompt_tokens + o.max_tokens or o.duration <= 0:
        parser.error("--load > 0, --duration > 0, --budget at least one request")
    if (o.kill_at is not None and not 0 < o.kill_at < o.duration) or (o.outage_at is not None and not 0 < o.outage_at < o.outage_at + o.outage_s <= o.duration):
        parser.error("the kill and the whole outage fall within --duration")
    return o


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = options_from(args, parser)
    command = ["python -m bench budgets", *(argv or [])]
    said = "redis-server, the simulator and the replicas were stopped"
    return run_and_report(measure, options, command, said=said, render=render, out=options.out, stem=output_name(args, "budgets"))
