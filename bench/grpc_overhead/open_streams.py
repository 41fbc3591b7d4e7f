"""Phase 3: N ``ChatStream`` calls held open at once against slow engines, then cancelled; tailguard's footprint sampled throughout.

A stream counts as open once its first chunk arrived (the simulator sends
the role chunk at once, so this means routed, backend connected, and
relayed end to end).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import IO

import trio

from bench.grpc_overhead.aio_streams import RAMP_TIMEOUT_S, OpenTally, hold_streams
from bench.grpc_overhead.records import OpenStreams
from bench.harness import procs
from bench.harness.client import CALL_TIMEOUT_S
from bench.harness.clocks import CpuClock
from bench.harness.closed_loop import MAX_TOKENS
from bench.harness.grpc import AsyncioThread, GrpcClient, chat_request, grpc_closed_loop
from bench.harness.ramp import Ramp, higher, hold_peak, settle

OPEN_MAX_TOKENS = 256  # above 128: the batch class, routed to the slow engine's pool
SLOW_ENGINE_ARGS = ("--max-num-seqs", "20000", "--base-ms", "4000", "--kv-cache-tokens", "100000000")
STALL_S = 15.0  # give up the ramp when nothing opened or failed for this long
HOLD_S = 5.0
SETTLE_TIMEOUT_S = 30.0
SETTLE_FD_SLACK = 16
SAMPLE_EVERY_S = 0.5
PROGRESS_EVERY_S = 5.0


async def start_slow_simulator(nursery: trio.Nursery, ports: Sequence[int], log: IO[bytes]) -> trio.Process:
    """Engines that step every 4 s with 20,000 seats each: streams stay open for minutes."""
    engines = ",".join(f"{port}:instant" for port in ports)
    command = [sys.executable, "-m", "tailguard.sim", "--engines", engines, *SLOW_ENGINE_ARGS]
    return await procs.start_process(nursery, command, log)


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
