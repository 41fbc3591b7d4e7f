"""``python -m bench overhead``: what tailguard adds per request and per relayed event, HTTP and gRPC, beside vllm-router, in one run.

Engines in the ``instant`` profile (no GPU time: every millisecond is HTTP,
gRPC, JSON and scheduling); tailguard in front of them from a temporary
config; the peer, vllm-router (Rust, from PyPI, ``--policy round_robin``),
in front of the same engine; the engine called directly beside both. Five
phases, side by side:

1. Added latency, open loop: Poisson arrivals at fixed rates (default 100
   and 400 req/s, the same arrivals for every path), each latency from its
   *scheduled* send time, to the engine directly (HTTP), through vllm-router
   (HTTP), through tailguard's HTTP API and through its gRPC API. A closed
   loop at saturation would measure the router's queue, not the router.
2. Saturation: a closed loop at concurrency 64 through each router and API,
   req/s with the router's cores beside it (and the engine direct for
   scale); then, unmeasured, the HTTP loop goes on while py-spy profiles
   tailguard.
3. SSE relay: 64 and 256 concurrent streaming chats (max_tokens 128)
   directly, through vllm-router and through tailguard's HTTP API; events/s
   and router CPU per event, then a py-spy profile of tailguard's 256-stream
   relay (unmeasured). The instant engine writes events as fast as they are
   read, so several ride on one read and one send.
4. SSE relay at engine pace: 64 streams from an engine in the ``latency``
   profile, in real time (one event per stream per ~10 ms step, as vLLM
   sends them), directly, through a vllm-router of its own and through
   tailguard (the batch pool's engine); router CPU per event. Each event is
   a read and a send of its own here: what relaying costs in production.
5. tailguard beside vllm-router (ratios), and the issue's targets, reported
   (not tuned for).

The peer serves no gRPC, so tailguard's gRPC rows are set beside its HTTP.
``--no-peer`` leaves it out (when it is not installed).

Load generators (none of them the bottleneck; their CPU is in every row):
``bench.router_overhead.run``'s lean keep-alive HTTP/1.1 client on raw Trio
sockets, grpc.aio on its own asyncio thread (``bench.grpc_overhead.run``), and
``bench.sim_cpu.run``'s lean SSE client. Router CPU comes from /proc/PID/stat.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path

import trio

from bench.harness.cli import add_out_arg, add_seconds_arg, add_seed_arg, add_warmup_arg, comma_separated, driver_parser, run_and_report
from bench.harness.client import HOST
from bench.harness.closed_loop import MAX_TOKENS, MESSAGE
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.grpc import AsyncioThread, GrpcClient
from bench.harness.peer import find_peer, peer_command, peer_version
from bench.harness.procs import (
    RESULTS_ROOT,
    free_ports,
    log_tail,
    raise_nofile,
    start_process,
    start_simulator,
    start_tailguard,
    stop,
    wait_ready,
)
from bench.harness.report import code_version
from bench.overhead.compare import added_latency, issue_targets, versus_peer
from bench.overhead.phases import open_loop_phase, paced_phase, saturation_phase, sse_phase
from bench.overhead.records import DIRECT, HTTP, PACED_PEER, PACED_PROFILE, PEER, STREAM_MAX_TOKENS, TAILGUARD, VLLM_ROUTER, Options, Result
from bench.overhead.report import render

RESULTS_DIR = RESULTS_ROOT / "overhead"
POOL_CAP = 1024
_CANCEL_GRACE_S = 30.0


async def measure(options: Options, aio: AsyncioThread) -> Result:
    """Start the simulator, tailguard and the peer, run every phase, tear it all down on every path."""
    sim_port, paced_port, http_port, grpc_port, peer_port, peer_metrics_port, paced_peer_port, paced_metrics_port = free_ports(8)
    with tempfile.TemporaryDirectory(prefix="tailguard-overhead-") as tmp:
        config = Path(tmp) / "config.toml"
        pool = partial(PoolSpec, max_concurrency=POOL_CAP, max_queue=4 * POOL_CAP)
        config.write_text(
            tailguard_config(http_port, grpc_port, pool("interactive", [(sim_port, POOL_CAP)]), pool("batch", [(paced_port, POOL_CAP)]))
        )
        logs = {name: Path(tmp) / f"{name}.log" for name in ("simulator", TAILGUARD, VLLM_ROUTER, PACED_PEER)}
        with (
            logs["simulator"].open("wb") as sim_out,
            logs[TAILGUARD].open("wb") as tg_out,
            logs[VLLM_ROUTER].open("wb") as peer_out,
            logs[PACED_PEER].open("wb") as paced_peer_out,
        ):
            try:
                async with trio.open_nursery() as nursery:
                    sim = await start_simulator(nursery, [(sim_port, "instant"), (paced_port, PACED_PROFILE)], log=sim_out)
                    await wait_ready(sim_port, sim, "the simulator")
                    await wait_ready(paced_port, sim, "the simulator")
                    tg = await start_tailguard(nursery, config, log=tg_out)
                    await wait_ready(http_port, tg, "tailguard")
                    routers = [(tg, "tailguard")]
                    pids = {"simulator": sim.pid, TAILGUARD: tg.pid}
                    ports = {DIRECT: sim_port, HTTP: http_port}
                    paced_ports = {DIRECT: paced_port, HTTP: http_port}
                    if options.peer is not None:
                        command = peer_command(options.peer, peer_port, peer_metrics_port, sim_port)
                        peer = await start_process(nursery, command, peer_out)
                        await wait_ready(peer_port, peer, "vllm-router")
                        routers.append((peer, "vllm-router"))
                        pids[VLLM_ROUTER], ports[PEER] = peer.pid, peer_port
                        if options.paced_streams:
                            command = peer_command(options.peer, paced_peer_port, paced_metrics_port, paced_port)
                            paced_peer = await start_process(nursery, command, paced_peer_out)
                            await wait_ready(paced_peer_port, paced_peer, "vllm-router (paced engine)")
                            routers.append((paced_peer, "vllm-router (paced engine)"))
                            pids[PACED_PEER], paced_ports[PEER] = paced_peer.pid, paced_peer_port
                    client = await aio.run(partial(GrpcClient.open, f"{HOST}:{grpc_port}", 1))
                    try:
                        result = await _phases(options, aio, client, ports, paced_ports, pids)
                    finally:
                        with trio.CancelScope(shield=True), trio.move_on_after(_CANCEL_GRACE_S):
                            await aio.run(client.close)
                    for process, name in [*routers, (sim, "the simulator")]:
                        if process.returncode is not None:
                            raise RuntimeError(f"{name} exited with {process.returncode} during the run")
                    for process, _ in routers:
                        await stop(process)  # the routers first: they must not see their backends vanish
                    nursery.cancel_scope.cancel()
            except Exception:
                for name, path in logs.items():
                    print(f"--- {name} log ---\n{log_tail(path)}", file=sys.stderr)
                raise
    result.peer = peer_version(options.peer)
    return result


async def _phases(
    options: Options, aio: AsyncioThread, client: GrpcClient, ports: dict[str, int], paced_ports: dict[str, int], pids: dict[str, int]
) -> Result:
    open_runs = await open_loop_phase(options, aio, client, ports, pids)
    busy: dict[str, float] = {}
    saturation, profiles = await saturation_phase(options, aio, client, ports, pids, busy)
    streams, sse_profile = await sse_phase(options, ports, pids, busy)
    profiles.update(sse_profile)
    paced = await paced_phase(options, paced_ports, pids, busy) if options.paced_streams else []
    added = added_latency(open_runs)
    return Result(
        code=code_version(),
        cpu_count=len(os.sched_getaffinity(0)),
        peer=None,
        engine_profile="instant",
        message=MESSAGE,
        max_tokens=MAX_TOKENS,
        stream_max_tokens=STREAM_MAX_TOKENS,
        arrivals=f"Poisson (exponential gaps, seed {options.seed} + rate), the same arrivals for every path at a rate",
        load_generators=[
            "HTTP: bench.harness.client.KeepAliveClient (raw Trio sockets, keep-alive HTTP/1.1, hand-parsed), "
            "a pool of idle connections: each arrival takes one or opens one, never waits",
            "gRPC: grpc.aio on its own asyncio thread (bench.harness.grpc.AsyncioThread), one channel, one call per arrival",
            "SSE: bench.harness.client.sse_client (raw Trio sockets, one connection per stream, events counted with bytes.count)",
        ],
        parameters={k: (list(v) if isinstance(v, Sequence) else str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()},
        open_loop=open_runs,
        added=added,
        versus_peer=versus_peer(added, saturation, streams, paced),
        saturation=saturation,
        streams=streams,
        paced=paced,
        profiles=profiles,
        targets=issue_targets(added, saturation, streams),
        machine_busy_cores=busy,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument("--rates", type=comma_separated(float), default="100,400", help="comma-separated open-loop rates, req/s (default %(default)s)")
    add_seconds_arg(parser, 10.0, "each open-loop run")
    add_warmup_arg(parser, 1.0, "unmeasured open loop before each run")
    parser.add_argument("--sat-seconds", type=float, default=8.0, help="each saturation run (default %(default)s)")
    parser.add_argument("--streams", type=comma_separated(int), default="64,256", help="comma-separated concurrent SSE streams (default %(default)s)")
    parser.add_argument("--sse-warmup", type=float, default=2.0, help="SSE load before each window (default %(default)s)")
    parser.add_argument("--sse-seconds", type=float, default=6.0, help="each SSE window (default %(default)s)")
    parser.add_argument(
        "--paced-streams", type=int, default=64, help="streams of the relay at engine pace (a latency engine in real time); 0 skips it (default %(default)s)"
    )
    parser.add_argument("--profile-seconds", type=float, default=8.0, help="py-spy recording of the router; 0 skips it (default %(default)s)")
    add_seed_arg(parser, 1, "the Poisson arrivals")
    parser.add_argument("--peer", type=Path, default=None, help="the vllm-router executable (default: beside this Python, else on PATH)")
    parser.add_argument("--no-peer", action="store_true", help="leave vllm-router out (when it is not installed)")
    add_out_arg(parser, RESULTS_DIR, "directory of overhead.json, overhead.md, profiles")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rates: list[float] = args.rates
    streams: list[int] = args.streams
    if not rates or min(rates) <= 0 or not streams or min(streams) < 1:
        parser.error("--rates must be > 0 and --streams >= 1")
    if min(args.seconds, args.sat_seconds, args.sse_seconds) <= 0 or min(args.warmup, args.sse_warmup, args.profile_seconds, args.paced_streams) < 0:
        parser.error("durations must be > 0 (warm-ups and --profile-seconds >= 0)")
    peer = None if args.no_peer else (args.peer or find_peer())
    if not args.no_peer and (peer is None or not peer.exists()):
        parser.error("vllm-router not found: pip install -e '.[bench]', pass --peer PATH, or --no-peer")
    options = Options(
        rates, args.seconds, args.warmup, args.sat_seconds, streams, args.sse_warmup, args.sse_seconds, args.paced_streams, args.profile_seconds,
        args.seed, args.out, peer,
    )
    raise_nofile(8192)  # children inherit it: 256 streams are 512 sockets in tailguard
    with AsyncioThread() as aio:
        return run_and_report(measure, options, aio, said="the simulator and the routers were stopped", render=render, out=args.out, stem="overhead")
