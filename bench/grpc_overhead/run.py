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
import asyncio
import collections
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

import grpc
import trio

from bench.harness import procs
from bench.harness.cli import add_json_arg, driver_parser, run_trio
from bench.harness.client import CALL_TIMEOUT_S, HOST, KeepAliveClient
from bench.harness.clocks import CpuClock
from bench.harness.closed_loop import MAX_TOKENS, MESSAGE, RunResult, closed_loop, runs_table
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.grpc import WARMUP_CALLS, WARMUP_SECONDS, AsyncioThread, GrpcClient, chat_request, grpc_closed_loop, run_result
from bench.harness.load import StreamRun, sse_streams
from bench.harness.ramp import Ramp, higher, hold_peak, settle
from bench.harness.report import Target, cores_cell, maybe, md_table, save_json, targets_table
from bench.harness.unique import unique_chat
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc

DEFAULT_JSON = procs.RESULTS_ROOT / "grpc_overhead.json"

# The targets.
TARGET_CALLS_PER_S = 2_500
TARGET_CHUNKS_PER_S = 20_000
TARGET_OPEN_STREAMS = 10_000
TARGET_RSS_MIB = 1024

# Phase 1: unary closed loops (seconds bound each run; the call count is a second bound).
UNARY_SECONDS = {1: 4.0, 64: 8.0}
UNARY_MAX_CALLS = 100_000

# Phase 2: streams.
STREAMS = 200
STREAM_MAX_TOKENS = 128  # the interactive class's max_output_tokens: still interactive
STREAM_WARMUP_S = 2.0
STREAM_WINDOW_S = 10.0
DIRECT_STREAM_WARMUP_S = 1.0
DIRECT_STREAM_WINDOW_S = 5.0
STREAMS_PER_WORKER = 10_000  # a count bound on every stream loop besides its deadline

# Phase 3: open streams against a slow engine.
OPEN_MAX_TOKENS = 256  # above 128: the batch class, routed to the slow engine's pool
SLOW_ENGINE_ARGS = ("--max-num-seqs", "20000", "--base-ms", "4000", "--kv-cache-tokens", "100000000")
STREAMS_PER_ENDPOINT = 1_000  # the default --open-endpoints: one slow engine per this many streams
MAX_OPENING = 256  # calls started but not yet routed; paces the ramp so connects do not time out
RAMP_TIMEOUT_S = 75.0
STALL_S = 15.0  # give up the ramp when nothing opened or failed for this long
HOLD_S = 5.0
SETTLE_TIMEOUT_S = 30.0
SETTLE_FD_SLACK = 16
SAMPLE_EVERY_S = 0.5
PROGRESS_EVERY_S = 5.0

INTERACTIVE_CAP = 512
_ERROR_BACKOFF_S = 0.05
_CANCEL_GRACE_S = 30.0
_PY_SPY_SECONDS = 4


# -- the asyncio side: a loop on its own thread, for grpc.aio -----------------------------


@dataclass
class StreamTally:
    """What the stream workers received so far (cumulative; read from the Trio thread)."""

    chunks: int = 0
    streams_done: int = 0
    errors: int = 0


async def _stream_worker(stub: pb_grpc.CompletionsStub, request: pb.ChatRequest, deadline: float, tally: StreamTally) -> None:
    """Read one stream to its end, then start the next, until ``deadline`` (perf_counter)."""
    for _ in range(STREAMS_PER_WORKER):
        if time.perf_counter() >= deadline:
            return
        try:
            async for _chunk in stub.ChatStream(request, timeout=CALL_TIMEOUT_S):
                tally.chunks += 1
        except grpc.aio.AioRpcError:
            tally.errors += 1
            await asyncio.sleep(_ERROR_BACKOFF_S)
            continue
        tally.streams_done += 1


async def grpc_streams(client: GrpcClient, request: pb.ChatRequest, streams: int, seconds: float, tally: StreamTally) -> None:
    deadline = time.perf_counter() + seconds
    workers = [_stream_worker(client.stubs[i % len(client.stubs)], request, deadline, tally) for i in range(streams)]
    try:
        async with asyncio.timeout(seconds + CALL_TIMEOUT_S):
            await asyncio.gather(*workers)
    except TimeoutError:
        pass


@dataclass
class OpenTally:
    """Streams of the open-streams phase, by state (read from the Trio thread)."""

    started: int = 0
    pending: int = 0  # started, neither routed (initial metadata) nor failed yet
    routed: int = 0
    first_chunk: int = 0  # ever received their first chunk
    open: int = 0  # received their first chunk and still open
    chunks: int = 0
    ended: int = 0  # finished on their own while they should have been held
    failed: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)


async def _hold(stub: pb_grpc.CompletionsStub, request: pb.ChatRequest, timeout: float, tally: OpenTally) -> None:
    """One stream, read until it is cancelled; cancelling cancels the RPC."""
    call = stub.ChatStream(request, timeout=timeout)
    tally.started += 1
    tally.pending += 1
    pending, opened = True, False
    try:
        metadata = await call.initial_metadata()
        if any(key == "x-tailguard-pool" for key, _ in metadata or ()):
            tally.routed += 1
            tally.pending -= 1
            pending = False
        async for _chunk in call:
            tally.chunks += 1
            if not opened:
                opened = True
                tally.first_chunk += 1
                tally.open += 1
        tally.ended += 1
    except grpc.aio.AioRpcError as error:
        tally.failed += 1
        tally.codes[error.code().name] += 1
    finally:
        if pending:
            tally.pending -= 1
        if opened:
            tally.open -= 1
        call.cancel()


async def hold_streams(client: GrpcClient, request: pb.ChatRequest, count: int, timeout: float, tally: OpenTally) -> None:
    """Open ``count`` streams, at most MAX_OPENING unrouted at once, and hold them until cancelled."""
    loop = asyncio.get_running_loop()
    ramp_deadline = loop.time() + RAMP_TIMEOUT_S
    holders: list[asyncio.Task[None]] = []
    try:
        for i in range(count):
            while tally.pending >= MAX_OPENING and loop.time() < ramp_deadline:
                await asyncio.sleep(0.005)
            if loop.time() >= ramp_deadline:
                break
            holders.append(loop.create_task(_hold(client.stubs[i % len(client.stubs)], request, timeout, tally)))
            if i % 64 == 63:
                await asyncio.sleep(0)  # let the new calls go out
        await asyncio.gather(*holders)
    finally:
        for holder in holders:
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)


# -- /proc readings -------------------------------------------------------------------------


# -- results --------------------------------------------------------------------------------


@dataclass
class OpenStreams:
    """Phase 3: many gRPC streams held open at once, then cancelled.

    Deliberately parallel to ``bench.hold.run.HoldRun`` (the same
    measurement over HTTP SSE): both are filled field by field from a stream
    tally, CPU clocks and ``harness.ramp``'s samples, so their constructors
    look alike. They stay two records because the committed JSON of each
    (grpc_overhead.json, hold/hold.json) names its fields its own way; the
    ramp, hold and settle rules they share are one copy, in ``harness.ramp``.
    """

    requested: int
    max_tokens: int
    endpoints: int  # slow engines behind the batch pool
    slow_engine_args: list[str]
    started: int
    routed: int
    first_chunk: int
    open_at_hold_end: int
    ended_early: int
    failed: int
    error_codes: dict[str, int]
    ramp_s: float
    ramp_progress: list[tuple[float, int]]  # (seconds, streams open), every PROGRESS_EVERY_S
    tailguard_cpu_ms_per_stream_opened: float
    rss_kib_per_open_stream: float
    hold_s: float
    hold_chunks_per_s: float
    hold_cores: dict[str, float]
    cancel_s: float
    settle_s: float
    threads_back_to_baseline: bool
    fds_back_to_baseline: bool
    fds_left_above_baseline: int
    unary_call_ok_after: bool
    samples: list[procs.ProcSample]  # before, during the ramp (peak), held, after
    stopped_because: str


@dataclass
class Result:
    cpu_count: int
    channels: int
    nofile_limit: int
    unary_message: str
    unary_max_tokens: int
    unary: list[RunResult]
    streaming: list[StreamRun]
    open_streams: OpenStreams | None
    targets: list[Target]
    py_spy_profiles: list[str]
    wall_s: float = 0.0


@dataclass(frozen=True)
class Options:
    streams_open: int
    open_endpoints: int
    channels: int
    py_spy_dir: Path | None


# -- the run ----------------------------------------------------------------------------


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


async def start_slow_simulator(nursery: trio.Nursery, ports: Sequence[int], log: IO[bytes]) -> trio.Process:
    """Engines that step every 4 s with 20,000 seats each: streams stay open for minutes."""
    engines = ",".join(f"{port}:instant" for port in ports)
    command = [sys.executable, "-m", "tailguard.sim", "--engines", engines, *SLOW_ENGINE_ARGS]
    return await procs.start_process(nursery, command, log)


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
        targets=_targets(unary, streaming, held, options.streams_open),
        py_spy_profiles=profiles,
    )


async def direct_unary(port: int, concurrency: int, pids: dict[str, int]) -> RunResult:
    """The baseline: the same chat straight to the engine, on keep-alive HTTP/1.1 connections."""
    request = unique_chat(port, {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS}, "unary", concurrency)
    clients = [KeepAliveClient(port) for _ in range(concurrency)]
    try:
        await closed_loop(clients, request, max(WARMUP_CALLS, concurrency), WARMUP_SECONDS)
        before = CpuClock.read(pids)
        tally, wall = await closed_loop(clients, request, UNARY_MAX_CALLS, UNARY_SECONDS[concurrency])
        after = CpuClock.read(pids)
    finally:
        for client in clients:
            await client.aclose()
    return run_result("http-direct", concurrency, tally, wall, before, after)


async def grpc_unary(
    aio: AsyncioThread, client: GrpcClient, concurrency: int, pids: dict[str, int], tg_pid: int, profile: Path | None
) -> RunResult:
    request = chat_request(MAX_TOKENS)
    await aio.run(partial(grpc_closed_loop, client, request, concurrency, max(WARMUP_CALLS, concurrency), WARMUP_SECONDS))
    seconds = UNARY_SECONDS[concurrency]
    async with trio.open_nursery() as nursery:
        if profile is not None:
            nursery.start_soon(py_spy, tg_pid, profile, min(_PY_SPY_SECONDS, seconds))
        before = CpuClock.read(pids)
        tally, wall = await aio.run(partial(grpc_closed_loop, client, request, concurrency, UNARY_MAX_CALLS, seconds))
        after = CpuClock.read(pids)
    return run_result("grpc", concurrency, tally, wall, before, after)


async def direct_streams(port: int, pids: dict[str, int]) -> StreamRun:
    """The engine's own SSE relay rate to STREAMS direct streams (one connection per stream)."""
    payload = {
        "messages": [{"role": "user", "content": MESSAGE}],
        "max_tokens": STREAM_MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},  # tailguard asks for it too
    }
    request = unique_chat(port, payload, "streams")
    return await sse_streams("http-direct", port, request, STREAMS, DIRECT_STREAM_WARMUP_S, DIRECT_STREAM_WINDOW_S, pids, router=None)


async def grpc_stream_run(aio: AsyncioThread, client: GrpcClient, pids: dict[str, int], tg_pid: int, profile: Path | None) -> StreamRun:
    tally = StreamTally()
    request = chat_request(STREAM_MAX_TOKENS)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(aio.run, partial(grpc_streams, client, request, STREAMS, STREAM_WARMUP_S + STREAM_WINDOW_S, tally))
        await trio.sleep(STREAM_WARMUP_S)
        if profile is not None:
            nursery.start_soon(py_spy, tg_pid, profile, _PY_SPY_SECONDS)
        before, at_start = CpuClock.read(pids), StreamTally(**asdict(tally))
        await trio.sleep(STREAM_WINDOW_S)
        after, at_end = CpuClock.read(pids), StreamTally(**asdict(tally))
    chunks = at_end.chunks - at_start.chunks
    wall = after.wall - before.wall
    cpu = after.seconds_since(before)["tailguard"]
    return StreamRun(
        "grpc",
        STREAMS,
        wall,
        chunks,
        chunks / wall,
        at_end.streams_done - at_start.streams_done,
        at_end.errors - at_start.errors,
        after.cores_since(before),
        cpu / chunks * 1e6 if chunks else None,
    )


async def open_streams(aio: AsyncioThread, client: GrpcClient, count: int, endpoints: int, pids: dict[str, int], tg_pid: int) -> OpenStreams:
    """Open ``count`` streams, hold them, cancel them all; sample tailguard's footprint throughout."""
    tally = OpenTally()
    request = chat_request(OPEN_MAX_TOKENS)
    call_timeout = RAMP_TIMEOUT_S + HOLD_S + 30.0
    start = time.perf_counter()
    before = peak = procs.proc_sample(tg_pid, "before", start, 0)
    cpu_start = CpuClock.read(pids)
    async with trio.open_nursery() as holders:
        holders.start_soon(aio.run, partial(hold_streams, client, request, count, call_timeout, tally))
        ramp = Ramp(count, RAMP_TIMEOUT_S, STALL_S, started=time.perf_counter())
        printed_at = start
        ramp_progress: list[tuple[float, int]] = []
        with trio.move_on_after(RAMP_TIMEOUT_S):
            while True:
                await trio.sleep(SAMPLE_EVERY_S)
                now = time.perf_counter()
                sample = procs.proc_sample(tg_pid, "peak (ramp + hold)", start, tally.open)
                peak = higher(peak, sample)
                if now - printed_at >= PROGRESS_EVERY_S:
                    print(f"  open streams: {tally.open:,} open, {tally.failed} failed, RSS {sample.rss_mib:,.0f} MiB", file=sys.stderr, flush=True)
                    ramp_progress.append((round(now - start, 1), tally.open))
                    printed_at = now
                if ramp.done(tally.first_chunk + tally.failed + tally.ended, now):
                    break
        stopped_because = ramp.stopped_because
        ramp_s = time.perf_counter() - start
        cpu_ramp = CpuClock.read(pids)
        chunks_at = tally.chunks
        peak = await hold_peak(tg_pid, peak, start, lambda: tally.open, HOLD_S, SAMPLE_EVERY_S)
        cpu_held = CpuClock.read(pids)
        hold_chunks = tally.chunks - chunks_at
        held = procs.proc_sample(tg_pid, "held", start, tally.open)
        open_at_hold_end = tally.open
        cancel_at = time.perf_counter()
        holders.cancel_scope.cancel()
    cancel_s = time.perf_counter() - cancel_at
    settle_s, after = await settle(
        tg_pid, before, start, "after cancel", lambda: tally.open, threads=True, timeout=SETTLE_TIMEOUT_S, fd_slack=SETTLE_FD_SLACK, every=SAMPLE_EVERY_S
    )
    unary_ok = await _unary_ok(aio, client)
    return OpenStreams(
        requested=count,
        max_tokens=OPEN_MAX_TOKENS,
        endpoints=endpoints,
        slow_engine_args=list(SLOW_ENGINE_ARGS),
        started=tally.started,
        routed=tally.routed,
        first_chunk=tally.first_chunk,
        open_at_hold_end=open_at_hold_end,
        ended_early=tally.ended,
        failed=tally.failed,
        error_codes=dict(tally.codes),
        ramp_s=ramp_s,
        ramp_progress=ramp_progress,
        tailguard_cpu_ms_per_stream_opened=cpu_ramp.seconds_since(cpu_start)["tailguard"] / max(tally.routed, 1) * 1000,
        rss_kib_per_open_stream=(held.rss_mib - before.rss_mib) * 1024 / max(open_at_hold_end, 1),
        hold_s=cpu_held.wall - cpu_ramp.wall,
        hold_chunks_per_s=hold_chunks / (cpu_held.wall - cpu_ramp.wall),
        hold_cores=cpu_held.cores_since(cpu_ramp),
        cancel_s=cancel_s,
        settle_s=settle_s,
        threads_back_to_baseline=after.threads <= before.threads,
        fds_back_to_baseline=after.fds <= before.fds + SETTLE_FD_SLACK,
        fds_left_above_baseline=max(0, after.fds - before.fds),
        unary_call_ok_after=unary_ok,
        samples=[before, peak, held, after],
        stopped_because=stopped_because,
    )


async def _unary_ok(aio: AsyncioThread, client: GrpcClient) -> bool:
    tally, _ = await aio.run(partial(grpc_closed_loop, client, chat_request(MAX_TOKENS), 1, 1, CALL_TIMEOUT_S))
    return len(tally.latencies) == 1


# -- profiling (optional) ------------------------------------------------------------------


def _profile_path(options: Options, phase: str) -> Path | None:
    return None if options.py_spy_dir is None else options.py_spy_dir / f"tailguard-{phase}.txt"


async def py_spy(pid: int, path: Path, seconds: float) -> None:
    """``py-spy record`` tailguard for a few seconds (collapsed stacks); perturbs the numbers a little."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [exe, "record", "--pid", str(pid), "--duration", f"{max(1, round(seconds))}", "--rate", "100", "--format", "raw", "--output", str(path)]
    with trio.move_on_after(seconds + 15):
        await trio.run_process(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


# -- reporting ---------------------------------------------------------------------------


def _targets(unary: Sequence[RunResult], streaming: Sequence[StreamRun], held: OpenStreams | None, requested: int) -> list[Target]:
    top = max((r for r in unary if r.target == "grpc"), key=lambda r: r.req_per_s)
    stream = next(s for s in streaming if s.target == "grpc")
    targets = [
        Target("unary calls/s (gRPC)", f">= {TARGET_CALLS_PER_S:,}", f"{top.req_per_s:,.0f} (c={top.concurrency})", top.req_per_s >= TARGET_CALLS_PER_S),
        Target("chunks/s relayed (200 streams)", f">= {TARGET_CHUNKS_PER_S:,}", f"{stream.chunks_per_s:,.0f}", stream.chunks_per_s >= TARGET_CHUNKS_PER_S),
    ]
    if held is not None:
        before, during = held.samples[0], held.samples[2]
        peak = max(s.peak_rss_mib for s in held.samples)
        added_threads = during.threads - before.threads
        targets += [
            Target("concurrent open streams", f">= {TARGET_OPEN_STREAMS:,}", f"{held.open_at_hold_end:,} of {requested:,}", held.open_at_hold_end >= TARGET_OPEN_STREAMS),
            Target("tailguard RSS while holding", f"< {TARGET_RSS_MIB:,} MiB", f"{during.rss_mib:,.0f} MiB (peak {peak:,.0f})", peak < TARGET_RSS_MIB),
            Target(
                "no thread per stream",
                "threads added << streams",
                f"{before.threads} -> {during.threads} threads for {during.open_streams:,} streams",
                added_threads < max(1, during.open_streams // 100),
            ),
        ]
    return targets


def render(result: Result) -> str:
    unary = runs_table(
        result.unary, ["path", "concurrency", "calls", "errors", "P50 ms", "P99 ms", "calls/s", "cores: sim / tailguard / client", "tailguard CPU ms/call"], ".2f"
    )
    streaming = md_table(
        ["path", "streams", "window s", "chunks/s", "streams done", "errors", "cores: sim / tailguard / client", "tailguard CPU µs/chunk"],
        (
            (s.target, s.streams, f"{s.window_s:.1f}", f"{s.chunks_per_s:,.0f}", f"{s.streams_done:,}", s.errors, cores_cell(s.cores),
             maybe(s.tailguard_cpu_us_per_chunk, ".1f"))
            for s in result.streaming
        ),
    )
    lines = [
        "Unary `Chat`, max_tokens 16 (interactive), instant engine", "", *unary, "",
        f"Streaming `ChatStream`, {STREAMS} concurrent streams, max_tokens {STREAM_MAX_TOKENS} (interactive), instant engine", "", *streaming,
    ]
    held = result.open_streams
    if held is not None:
        lines += [
            "",
            f"Open streams: {held.requested:,} `ChatStream` calls held at once, max_tokens {held.max_tokens} (batch), "
            f"{held.endpoints} slow engine endpoint(s) ({' '.join(held.slow_engine_args)})",
            "",
            *md_table(
                ["moment", "at s", "open streams", "tailguard RSS MiB", "peak RSS MiB", "threads", "fds"],
                ((p.moment, f"{p.at_s:.1f}", f"{p.open_streams:,}", f"{p.rss_mib:,.0f}", f"{p.peak_rss_mib:,.0f}", p.threads, f"{p.fds:,}") for p in held.samples),
            ),
        ]
        codes = ", ".join(f"{code} {n}" for code, n in sorted(held.error_codes.items())) or "none"
        hold = held.hold_cores
        lines += [
            "",
            "| started | routed | got first chunk | open at end of hold | failed (codes) | ended early | ramp s | tailguard CPU ms/stream opened "
            "| RSS KiB/stream | hold: chunks/s, cores sim / slow sim / tailguard / client | cancel s | settle s | threads / fds back | unary call after |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {held.started:,} | {held.routed:,} | {held.first_chunk:,} | {held.open_at_hold_end:,} | {held.failed} ({codes}) | {held.ended_early} "
            f"| {held.ramp_s:.1f} ({held.stopped_because}) | {held.tailguard_cpu_ms_per_stream_opened:.2f} | {held.rss_kib_per_open_stream:.0f} "
            f"| {held.hold_chunks_per_s:,.0f}, {hold['simulator']:.2f} / {hold['slow simulator']:.2f} / {hold['tailguard']:.2f} / {hold['client']:.2f} "
            f"| {held.cancel_s:.1f} | {held.settle_s:.1f} | {_yes(held.threads_back_to_baseline)} / "
            f"{_yes(held.fds_back_to_baseline) if held.fds_back_to_baseline else f'no, {held.fds_left_above_baseline:,} left'} "
            f"| {_yes(held.unary_call_ok_after)} |",
            "",
            "Ramp (s: open): " + ", ".join(f"{t:g}: {n:,}" for t, n in held.ramp_progress),
        ]
    lines += ["", *targets_table(result.targets)]
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


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

