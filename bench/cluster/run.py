"""``python -m bench cluster``: one admission budget across tailguard replicas, on a real redis-server (issue 13).

Real time, 127.0.0.1 only, free ports, every loop bounded. One simulator
process serves three capped engines (a latency engine for the interactive
pool, two throughput engines for the batch pool, ``--seats`` each: the
endpoints' ``max_concurrency``, below the engines' own ``max_num_seqs``, so
the engine's running count is what the routers sent it) and two instant
engines; one redis-server (no persistence) holds the ledger. In order:

1. ledger cost: one tailguard with ``[cluster]`` (alone in its namespace) and
   one without, in front of the instant engines; an open loop of short
   non-streaming requests, rounds alternating; the difference is what the
   ledger adds per request.
2. load: the origin's mix (80% short, 20% long, streaming), Poisson and
   bursty, at ``--loads`` of the capped engines' modelled capacity. Each
   schedule is played against one plain tailguard (the single-process
   default), then against ``--replicas`` replicas sharing one namespace
   (``static_share`` 1/replicas), the client round robin over them; Poisson
   at the first load also against one tailguard with ``[cluster]``.
3. kill -9 one replica mid-load: when its lease lapses and its grants leave
   the ledger; every request sent to a survivor must end with one answer.
4. redis-server killed mid-load at the highest load and started again empty
   on the same port after ``--outage`` s; then paused (SIGSTOP/SIGCONT) for
   ``--pause`` s with one more replica killed during the pause. The replicas'
   /health and the ledger are read throughout, the ledger checked afterwards.
5. affinity (issue 22): ``--replicas`` replicas in front of a pool of four
   instant engines, each tenant's requests sharing a system prompt; the
   share that ran on their tenant's engine whichever replica placed them
   (``bench.cluster.affinity``), and Redis commands per request beside a run
   with ``placement = "least_loaded"``.

Watched all the time: every capped engine's own ``vllm:num_requests_running``
and ``vllm:num_requests_waiting`` (its /metrics, every 10 ms), whose sum must
never pass the endpoint's cap; and per API key, the requests the client saw
streaming at once (first to last token of each 200), never above the key's
``max_concurrency``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import trio

from bench.cluster.affinity import AFFINITY_ENGINES, affinity_run
from bench.cluster.checks import checks
from bench.cluster.lab import KEYS, NAMESPACE, PHASES, RESULTS, Engine, Lab, Options
from bench.cluster.ledger import ledger_cost, ledger_view
from bench.cluster.load import capacity
from bench.cluster.report import render
from bench.cluster.runs import kill_run, load_run, outage_run
from bench.harness.cli import (
    add_name_arg,
    add_out_arg,
    add_seed_arg,
    add_time_scale_arg,
    add_warmup_arg,
    driver_parser,
    listed,
    output_name,
    run_trio,
    same_named,
)
from bench.harness.procs import free_ports, start_process, wait_ready
from bench.harness.redis import RedisProcess
from bench.harness.replicas import stop_all
from bench.harness.report import git_commit, write_report

# -- the whole run ------------------------------------------------------------------------------


async def measure(options: Options) -> dict[str, Any]:
    o = options
    started = time.perf_counter()
    result: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()},
        "capacity_per_s": round(capacity(o), 3),
        "keys": [asdict(k) for k in KEYS],
    }
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp_name:
        tmp = Path(tmp_name)
        async with trio.open_nursery() as nursery:
            sim_log = (tmp / "sim.log").open("ab")
            redis_log = (tmp / "redis.log").open("ab")
            ports = free_ports(6 + AFFINITY_ENGINES)
            redis = RedisProcess(nursery, ports[5], redis_log)
            await redis.start()
            engines = [Engine("interactive", ports[0], o.seats), Engine("batch-1", ports[1], o.seats), Engine("batch-2", ports[2], o.seats)]
            instant = [*ports[3:5], *ports[6:]]
            spec = ",".join([f"{ports[0]}:latency", f"{ports[1]}:throughput", f"{ports[2]}:throughput", *(f"{p}:instant" for p in instant)])
            command = [sys.executable, "-m", "tailguard.sim", "--engines", spec, "--time-scale", f"{o.time_scale:g}"]
            sim = await start_process(nursery, command, sim_log)
            lab = Lab(o, tmp, nursery, redis, engines, (ports[3], ports[4]), [sim_log, redis_log], tuple(ports[6:]))
            for port in [*ports[:5], *ports[6:]]:
                await wait_ready(port, sim, "the simulator")
            try:
                await phases(lab, result)
            finally:
                if redis.paused:  # no checkpoint here: runs even when cancelled
                    redis.pause(False)
                nursery.cancel_scope.cancel()
        for log in lab.logs:
            log.close()
        result["fallback_warnings"] = _fallback_warnings(tmp, [*(f"r{i}" for i in range(o.replicas + 1)), *(f"s{i}" for i in range(o.replicas))])
    result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["checks"] = checks(result)
    return result


async def phases(lab: Lab, result: dict[str, Any]) -> None:
    """The phases ``--phases`` names, in order; each writes its part of ``result``."""
    o = lab.options
    share = 1 / o.replicas
    if "cost" in o.phases:
        print("ledger cost", file=sys.stderr)
        result["ledger_cost"] = await ledger_cost(lab)
    group = await lab.group([f"r{i}" for i in range(o.replicas)], NAMESPACE, share)
    if "load" in o.phases:
        print("load", file=sys.stderr)
        single = await lab.group(["single"], None)
        alone = await lab.group(["single-ledger"], "bench-alone")
        runs = []
        for traffic in o.traffics:
            for load in o.loads:
                runs.append(await load_run(lab, "1 replica", single, traffic, load))
                if traffic == o.traffics[0] and load == o.loads[0]:
                    runs.append(await load_run(lab, "1 replica + ledger", alone, traffic, load))
                runs.append(await load_run(lab, f"{o.replicas} replicas", group, traffic, load))
        result["load"] = runs
        await stop_all(single + alone)
    dead: list[str] = []
    if "kill" in o.phases:
        print("kill -9 one replica", file=sys.stderr)
        victim = group[-1]
        async with ledger_view(lab, NAMESPACE) as view:
            result["kill"] = await kill_run(lab, group, victim, view)
        dead.append(victim.name)
        group = [r for r in group if r is not victim] + await lab.group([f"r{o.replicas}"], NAMESPACE, share)
    if "outage" in o.phases:
        print("redis-server stopped, then paused", file=sys.stderr)
        async with ledger_view(lab, NAMESPACE) as view:  # a client per phase: nothing of the old connections is reused
            result["outage_stop"] = await outage_run(lab, group, view, "stop", o.outage, dead, None)
        async with ledger_view(lab, NAMESPACE) as view:
            result["outage_pause"] = await outage_run(lab, group, view, "pause", o.pause, dead, group[0])
    await stop_all([r for r in group if r.alive])
    if "skew" in o.phases:
        print("redis-server stopped, a replica holding most seats, block 0", file=sys.stderr)
        # block 0: the first replica's grants may grow past its static share; keys without max_concurrency,
        # since with block 0 a key's grant never grows past the requests it already holds
        skewed = await lab.group([f"s{i}" for i in range(o.replicas)], "bench-skew", share, block=0, key_caps=False)
        async with ledger_view(lab, "bench-skew") as view:
            result["outage_skew"] = await outage_run(lab, skewed, view, "stop", max(3 * o.lease_ttl, 8.0), [], None, skew=True)
        await stop_all(skewed)
    if "affinity" in o.phases:
        print(f"affinity: one prefix, one engine, from {o.replicas} replicas", file=sys.stderr)
        result["affinity"] = await affinity_run(lab, o.affinity_requests)


def _fallback_warnings(tmp: Path, names: Sequence[str]) -> dict[str, int]:
    """How often each replica logged its fallback (a WARNING; its return is logged at INFO, below the level the replicas run at)."""
    return {name: (tmp / f"{name}.log").read_text(errors="replace").count("the shared ledger is away") for name in names if (tmp / f"{name}.log").exists()}


# -- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__, quick="smoke run (~3 min): one load, Poisson only, short windows, Redis down 8 s and paused 4 s")
    add = parser.add_argument
    add("--replicas", type=int, default=4, help="replicas sharing the caps (default %(default)s)")
    add("--seats", type=int, default=8, help="every capped endpoint's max_concurrency (default %(default)s)")
    add_time_scale_arg(parser, 2.0)
    add("--loads", type=listed(float), default="0.8,1.3", help="fractions of the capped engines' capacity (default %(default)s)")
    add("--traffic", default="poisson,bursty", help="arrival processes, comma-separated (default %(default)s)")
    add("--burst-period", type=float, default=6.0, help="bursty: twice the rate for half of this many s, then silence (default %(default)s)")
    add_warmup_arg(parser, 3.0, "unmeasured arrivals first, s")
    add("--window", type=float, default=15.0, help="measured arrivals, s (default %(default)s)")
    add("--drain", type=float, default=10.0, help="longest wait after the last arrival, s (default %(default)s)")
    add("--lease-ttl", type=float, default=2.0, help="[cluster] lease_ttl, s (default %(default)s)")
    add("--sync-interval", type=float, default=0.1, help="[cluster] sync_interval, s (default %(default)s)")
    add("--block", type=int, default=2, help="[cluster] block (default %(default)s)")
    add("--outage", type=float, default=30.0, help="s redis-server stays killed before it starts again (default %(default)s)")
    add("--pause", type=float, default=10.0, help="s redis-server stays paused (SIGSTOP) (default %(default)s)")
    add("--overhead-rate", type=float, default=100.0, help="ledger cost: req/s of the open loop (default %(default)s)")
    add("--overhead-seconds", type=float, default=5.0, help="ledger cost: s per round (default %(default)s)")
    add("--overhead-rounds", type=int, default=4, help="ledger cost: rounds, alternating (default %(default)s)")
    add_seed_arg(parser, 1, "the arrivals and key choices")
    add("--phases", default=",".join(PHASES), help="phases to run, comma-separated, of: " + ", ".join(PHASES) + " (default: all)")
    add("--no-key-caps", action="store_true", help="API keys without max_concurrency (experiments; the key check then says nothing)")
    add("--affinity-requests", type=int, default=800, help="affinity: requests over all replicas, one at a time per replica (default %(default)s)")
    add_name_arg(parser, "cluster")
    add_out_arg(parser, RESULTS)
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    loads: tuple[float, ...] = args.loads
    traffics = tuple(t.strip() for t in args.traffic.split(",") if t.strip())
    if not loads or min(loads) <= 0 or any(t not in ("poisson", "bursty") for t in traffics) or not traffics:
        parser.error("--loads > 0; --traffic of poisson, bursty")
    phases = tuple(x.strip() for x in args.phases.split(",") if x.strip())
    if not phases or any(x not in PHASES for x in phases):
        parser.error(f"--phases of: {', '.join(PHASES)}")
    if args.replicas < 2 or args.seats < args.replicas:
        parser.error("--replicas >= 2 and --seats >= --replicas (each static share at least one seat)")
    given = {"loads": loads, "traffics": traffics, "sample_interval": 0.01, "phases": phases, "key_caps": not args.no_key_caps}
    if args.quick:
        given |= {"loads": (loads[0],), "traffics": ("poisson",), "warmup": 2.0, "window": 8.0, "drain": 8.0, "outage": 8.0, "pause": 4.0}
        given |= {"overhead_seconds": 3.0, "overhead_rounds": 2, "affinity_requests": max(args.affinity_requests // 4, 1)}
    return same_named(Options, args, **given)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = options_from(args, parser)
    command = " ".join(["python -m bench cluster", *(argv or [])])
    result = run_trio(measure, options, said="redis-server, the simulator and tailguard were stopped")
    if result is None:
        return 130
    text = render(result, command)
    print(text)
    write_report(options.out, output_name(args, "cluster"), result, text)
    return 0
