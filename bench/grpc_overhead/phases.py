"""Phases 1 and 2: unary calls in closed loops and streams restarted as they end, straight to the engine over HTTP and through tailguard over gRPC."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import trio

from bench.grpc_overhead.aio_streams import StreamTally, grpc_streams
from bench.harness.client import KeepAliveClient
from bench.harness.clocks import CpuClock
from bench.harness.closed_loop import MAX_TOKENS, MESSAGE, RunResult, closed_loop
from bench.harness.grpc import WARMUP_CALLS, WARMUP_SECONDS, AsyncioThread, GrpcClient, chat_request, grpc_closed_loop, run_result
from bench.harness.load import StreamRun, sse_streams
from bench.harness.unique import unique_chat

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

_PY_SPY_SECONDS = 4


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
    """The same chat through tailguard's gRPC API, py-spy recording it when ``profile`` names a file."""
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
    """STREAMS ``ChatStream`` calls restarted as they end; chunks and tailguard's CPU over the window after the warm-up."""
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


async def py_spy(pid: int, path: Path, seconds: float) -> None:
    """``py-spy record`` tailguard for a few seconds (collapsed stacks); perturbs the numbers a little."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [exe, "record", "--pid", str(pid), "--duration", f"{max(1, round(seconds))}", "--rate", "100", "--format", "raw", "--output", str(path)]
    with trio.move_on_after(seconds + 15):
        await trio.run_process(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
