"""``python -m bench grpc_overhead``: what tailguard's gRPC path costs, beside calling the engine over HTTP.

One run, one machine, side by side (the issue's targets: >= 2,500 unary
calls/s, >= 20,000 relayed chunks/s, 10,000 concurrent open streams in one
process with RSS under 1 GiB and no thread per stream):

1. Unary: a closed loop of ``Chat`` calls (max_tokens 16, interactive class)
   at concurrency 1 and 64, straight to an ``instant`` engine over HTTP (the
   lean keep-alive client of ``bench.router_overhead.run``), then through
   tailguard over gRPC (a grpc.aio client). P50/P99, calls/s, and
   tailguard's CPU per call from ``/proc/PID/stat``.
2. Streaming: 200 concurrent ``ChatStream`` calls (max_tokens 128, so still
   interactive), restarted as they finish, for a fixed window; chunks/s
   received and tailguard's CPU per chunk. Beside it, the engine's own SSE
   rate to 200 direct streams (``bench.sim_cpu.run``'s lean streaming client).
3. Open streams: N ``ChatStream`` calls held open at once against slow
   engines (a second simulator process: one step every 4 s), as the batch
   class (max_tokens 256) so the instant engine of phases 1-2 stays in the
   interactive pool. By default the batch pool has one slow engine per
   1,000 streams, as a real fleet would (a vLLM engine seats ~256-1,024
   sequences); ``--open-endpoints 1`` puts them all behind one endpoint,
   which costs tailguard CPU per stream in proportion to the streams open
   (httpcore scans every connection of an endpoint's pool on each request
   and each close). A stream counts as open once its first chunk arrived
   (the simulator sends the role chunk at once, so this means routed,
   backend connected, and relayed end to end). tailguard's VmRSS, Threads
   and open fds (``/proc/PID``) before, while held, and after all are
   cancelled.

Why the gRPC client runs on its own thread: grpc.aio is asyncio-only, while
the helpers reused here (child processes that ``trio.run_process`` kills on
every exit path, the lean HTTP clients) are Trio. The orchestrator is Trio;
the gRPC client is an asyncio loop on one thread that Trio hands coroutines
to, and a cancelled Trio caller cancels its asyncio task. Its CPU is counted
as the client's (``time.process_time`` covers every thread).

Child processes inherit this process's RLIMIT_NOFILE, raised at start-up so
that tailguard and the slow simulator can each hold one socket per stream.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import trio

from bench.grpc_overhead.open_streams import open_streams, start_slow_simulator
from bench.grpc_overhead.phases import UNARY_SECONDS, direct_streams, direct_unary, grpc_stream_run, grpc_unary
from bench.grpc_overhead.records import Options, Result
from bench.grpc_overhead.report import TARGET_OPEN_STREAMS, issue_targets, render
from bench.harness import procs
from bench.harness.cli import add_json_arg, driver_parser, run_trio
from bench.harness.client import HOST
from bench.harness.closed_loop import MAX_TOKENS, MESSAGE, RunResult
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.grpc import AsyncioThread, GrpcClient
from bench.harness.load import StreamRun
from bench.harness.report import save_json

DEFAULT_JSON = procs.RESULTS_ROOT / "grpc_overhead.json"
STREAMS_PER_ENDPOINT = 1_000  # the default --open-endpoints: one slow engine per this many streams
INTERACTIVE_CAP = 512
_CANCEL_GRACE_S = 30.0


@dataclass(frozen=True)
class Ports:
    fast: int  # the instant engine: the interactive pool
    http: int
    grpc: int
    slow: tuple[int, ...]  # the slow engines: the batch pool


def write_config(path: Path, ports: Ports, streams_open: int) -> None:
    """Interactive pool on the instant engine; batch pool sized to hold every open stream."""
    hold = max(streams_open, 1) + 64
    per_endpoint = math.ceil(hold / len(ports.slow)) + 16
    interactive = PoolSpec("interactive", [(ports.fast, INTERACTIVE_CAP)], max_concurrency=INTERACTIVE_CAP, max_queue=2 * INTERACTIVE_CAP)
    batch = PoolSpec("batch", [(port, per_endpoint) for port in ports.slow], max_concurrency=hold, max_queue=hold)
    path.write_text(tailguard_config(ports.http, ports.grpc, interactive, batch))


async def measure(options: Options, aio: AsyncioThread, nofile: int) -> Result:
    """Start both simulators and tailguard, run the three phases, tear everything down."""
    fast, http, grpc_port, *slow_ports = procs.free_ports(3 + options.open_endpoints)
    ports = Ports(fast, http, grpc_port, tuple(slow_ports))
    with tempfile.TemporaryDirectory(prefix="tailguard-grpc-bench-") as tmp:
        config = Path(tmp) / "config.toml"
        write_config(config, ports, options.streams_open)
        logs = {name: Path(tmp) / f"{name}.log" for name in ("sim", "slow-sim", "tailguard")}
        with logs["sim"].open("wb") as sim_out, logs["slow-sim"].open("wb") as slow_out, logs["tailguard"].open("wb") as tg_out:
            try:
                async with trio.open_nursery() as nursery:
                    sim = await procs.start_simulator(nursery, [(ports.fast, "instant")], log=sim_out)
                    slow = await start_slow_simulator(nursery, ports.slow, slow_out)
                    await procs.wait_ready(ports.fast, sim, "the simulator")
                    for port in ports.slow:
                        await procs.wait_ready(port, slow, "the slow simulator")
                    tg = await procs.start_tailguard(nursery, config, log=tg_out)
                    await procs.wait_ready(ports.http, tg, "tailguard")
                    client = await aio.run(partial(GrpcClient.open, f"{HOST}:{ports.grpc}", options.channels))
                    try:
                        result = await _phases(options, aio, client, ports, sim, slow, tg, nofile)
                    finally:
                        with trio.CancelScope(shield=True), trio.move_on_after(_CANCEL_GRACE_S):
                            await aio.run(client.close)
                    for process, name in ((tg, "tailguard"), (sim, "the simulator"), (slow, "the slow simulator")):
                        if process.returncode is not None:
                            raise RuntimeError(f"{name} exited with {process.returncode} during the run")
                    await procs.stop(tg)  # tailguard first: it must not see its backends vanish
                    nursery.cancel_scope.cancel()
            except Exception:
                for name, path in logs.items():
                    print(f"--- {name} log ---\n{procs.log_tail(path)}", file=sys.stderr)
                raise
    return result


def _progress(run: RunResult) -> str:
    return f"  {run.target:>11} c={run.concurrency:<3} n={run.requests} P50 {run.p50_ms:.2f} ms P99 {run.p99_ms:.2f} ms {run.req_per_s:,.0f} calls/s"


def _stream_progress(run: StreamRun) -> str:
    return f"  {run.target:>11} {run.streams} streams: {run.chunks_per_s:,.0f} chunks/s, {run.errors} errors"


async def _phases(
    options: Options, aio: AsyncioThread, client: GrpcClient, ports: Ports, sim: trio.Process, slow: trio.Process, tg: trio.Process, nofile: int
) -> Result:
    pids = {"simulator": sim.pid, "tailguard": tg.pid}
    profiles: list[str] = []
    unary: list[RunResult] = []
    for concurrency in sorted(UNARY_SECONDS):
        unary.append(await direct_unary(ports.fast, concurrency, pids))
        print(_progress(unary[-1]), file=sys.stderr, flush=True)
        profile = _profile_path(options, f"unary-c{concurrency}") if concurrency == max(UNARY_SECONDS) else None
        unary.append(await grpc_unary(aio, client, concurrency, pids, tg.pid, profile))
        print(_progress(unary[-1]), file=sys.stderr, flush=True)
        profiles += [str(profile)] if profile else []
    streaming = [await direct_streams(ports.fast, pids)]
    print(_stream_progress(streaming[-1]), file=sys.stderr, flush=True)
    profile = _profile_path(options, "streaming")
    streaming.append(await grpc_stream_run(aio, client, pids, tg.pid, profile))
    print(_stream_progress(streaming[-1]), file=sys.stderr, flush=True)
    profiles += [str(profile)] if profile else []
    held = None
    if options.streams_open:
        held = await open_streams(aio, client, options.streams_open, len(ports.slow), {**pids, "slow simulator": slow.pid}, tg.pid)
    return Result(
        cpu_count=len(os.sched_getaffinity(0)),
        channels=options.channels,
        nofile_limit=nofile,
        unary_message=MESSAGE,
        unary_max_tokens=MAX_TOKENS,
        unary=unary,
        streaming=streaming,
        open_streams=held,
        targets=issue_targets(unary, streaming, held, options.streams_open),
        py_spy_profiles=profiles,
    )


def _profile_path(options: Options, phase: str) -> Path | None:
    return None if options.py_spy_dir is None else options.py_spy_dir / f"tailguard-{phase}.txt"


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    add_json_arg(parser, DEFAULT_JSON)
    parser.add_argument(
        "--streams-open", type=int, default=TARGET_OPEN_STREAMS, help="streams held open at once in phase 3; 0 skips it (default %(default)s)"
    )
    parser.add_argument(
        "--open-endpoints",
        type=int,
        default=None,
        metavar="K",
        help=f"slow engines behind the batch pool in phase 3 (default: one per {STREAMS_PER_ENDPOINT:,} streams)",
    )
    parser.add_argument("--channels", type=int, default=1, help="gRPC channels (HTTP/2 connections) the client spreads calls over (default %(default)s)")
    parser.add_argument("--py-spy", type=Path, default=None, metavar="DIR", help="record tailguard with py-spy during unary c=64 and streaming into DIR")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.open_endpoints is None:
        args.open_endpoints = max(1, math.ceil(args.streams_open / STREAMS_PER_ENDPOINT))
    if args.streams_open < 0 or args.channels < 1 or args.open_endpoints < 1:
        parser.error("--streams-open must be >= 0, --channels and --open-endpoints >= 1")
    nofile = procs.raise_nofile(4 * args.streams_open + 4096)
    if nofile < args.streams_open + 1024:  # tailguard and the slow simulator each hold one socket per stream
        print(f"warning: RLIMIT_NOFILE is {nofile}; {args.streams_open:,} streams may run out of sockets", file=sys.stderr)
    options = Options(args.streams_open, args.open_endpoints, args.channels, args.py_spy)
    started = time.perf_counter()
    with AsyncioThread() as aio:
        result = run_trio(measure, options, aio, nofile, said="the simulators and tailguard were stopped")
    if result is None:
        return 130
    result.wall_s = time.perf_counter() - started
    print(render(result))
    print(
        f"\n'{MESSAGE}'; engines in the 'instant' profile (phases 1-2); one gRPC client process, grpc.aio on "
        f"{args.channels} channel(s); {result.cpu_count} CPUs shared by the simulators, tailguard and this client; "
        f"RLIMIT_NOFILE {nofile:,} (inherited by the children). Wall time {result.wall_s:.0f} s."
    )
    save_json(args.json, asdict(result))
    return 0
