"""The overhead benchmark's phases: open-loop added latency, closed-loop saturation, SSE relay, and relay at engine pace."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import trio

from bench.harness.client import ConnectionPool, KeepAliveClient, Source
from bench.harness.clocks import CpuClock, MachineClock
from bench.harness.closed_loop import MAX_TOKENS, MESSAGE, Plan, RunResult, closed_loop, measure_closed_loop
from bench.harness.grpc import WARMUP_CALLS, WARMUP_SECONDS, AsyncioThread, GrpcClient, chat_request, grpc_closed_loop, run_result
from bench.harness.load import ProfileSummary, StreamRun, grpc_open_loop, py_spy_speedscope, sse_streams, summarize_speedscope
from bench.harness.report import latency_ms, maybe
from bench.harness.stats import percentile
from bench.harness.traffic import OpenTally, http_open_loop, poisson_offsets
from bench.harness.unique import unique_chat
from bench.overhead.records import (
    DIRECT,
    GRPC,
    HTTP,
    PACED_MAX_TOKENS,
    PACED_ROUTER_OF,
    PEER,
    ROUTER_OF,
    SATURATION_CONCURRENCY,
    STREAM_MAX_TOKENS,
    TAILGUARD,
    OpenRun,
    Options,
    router_cores,
)

SATURATION_WARMUP = 500  # requests


def _open_progress(r: OpenRun) -> str:
    return f"  open {r.path:>14} {r.rate:g}/s: n={r.completed} P50 {r.p50_ms:.2f} P99 {r.p99_ms:.2f} ms, lag P99 {r.lag_p99_ms:.2f} ms, router {router_cores(r.cores, r.path):.2f} cores"


def _sat_progress(r: RunResult) -> str:
    return f"  saturation {r.target:>14}: {r.req_per_s:,.0f} req/s, router {router_cores(r.cores, r.target):.2f} cores, client {r.cores['client']:.2f}"


def _sse_progress(s: StreamRun, routers: dict[str, str] = ROUTER_OF) -> str:
    return (
        f"  sse {s.target:>14} {s.streams} streams: {s.chunks_per_s:,.0f} events/s, router {router_cores(s.cores, s.target, routers):.2f} cores, "
        f"{maybe(s.tailguard_cpu_us_per_chunk, '.1f')} µs an event, {s.errors} errors"
    )


async def open_loop_phase(options: Options, aio: AsyncioThread, client: GrpcClient, ports: dict[str, int], pids: dict[str, int]) -> list[OpenRun]:
    """Every rate, every path, the same Poisson arrivals; unmeasured warm-up at the same rate before each run."""
    payload = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS}
    requests = {path: unique_chat(port, payload, options.seed, "open", path) for path, port in ports.items()}
    pools = {path: ConnectionPool(port) for path, port in ports.items()}
    stub, grpc_request = client.stubs[0], chat_request(MAX_TOKENS)
    runs: list[OpenRun] = []

    async def send(path: str, offsets: Sequence[float]) -> OpenTally:
        if path == GRPC:
            return await aio.run(partial(grpc_open_loop, stub, grpc_request, offsets))
        return await http_open_loop(pools[path], requests[path], offsets)

    try:
        for rate in options.rates:
            offsets = poisson_offsets(rate, options.seconds, options.seed + int(rate))
            warm = poisson_offsets(rate, options.warmup_s, options.seed + int(rate) + 1)
            for path in _paths(ports, (DIRECT, PEER, HTTP, GRPC)):
                if warm:
                    await send(path, warm)
                before, machine = CpuClock.read(pids), MachineClock.read()
                tally = await send(path, offsets)
                after = CpuClock.read(pids)
                runs.append(_open_run(path, rate, len(offsets), tally, before, after, MachineClock.read().cores_since(machine)))
                print(_open_progress(runs[-1]), file=sys.stderr, flush=True)
    finally:
        with trio.CancelScope(shield=True):
            for pool in pools.values():
                await pool.aclose()
    return runs


async def saturation_phase(
    options: Options, aio: AsyncioThread, client: GrpcClient, ports: dict[str, int], pids: dict[str, int], busy: dict[str, float]
) -> tuple[list[RunResult], dict[str, ProfileSummary]]:
    """Closed loops at concurrency 64: direct, vllm-router, tailguard HTTP (then profiled), tailguard gRPC."""
    payload = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS}
    plan = Plan(concurrencies=[SATURATION_CONCURRENCY], requests=lambda _: 10**7, seconds=options.sat_seconds, warmup=SATURATION_WARMUP)
    runs: list[RunResult] = []
    for path in _paths(ports, (DIRECT, PEER, HTTP)):
        request = unique_chat(ports[path], payload, options.seed, "saturation", path)
        machine = MachineClock.read()
        run = await measure_closed_loop(path, ports[path], request, SATURATION_CONCURRENCY, plan, pids, ROUTER_OF.get(path))
        busy[path] = MachineClock.read().cores_since(machine)
        runs.append(replace(run, target=path))
        print(_sat_progress(runs[-1]), file=sys.stderr, flush=True)
    profiles: dict[str, ProfileSummary] = {}
    if options.profile_s > 0:
        request = unique_chat(ports[HTTP], payload, options.seed, "profile", HTTP)
        summary = await _profile_http(ports[HTTP], request, pids[TAILGUARD], options.out_dir / "profile_http.json", options.profile_s)
        if summary is not None:
            profiles["http_saturation"] = summary
    grpc_request = chat_request(MAX_TOKENS)
    machine = MachineClock.read()
    await aio.run(partial(grpc_closed_loop, client, grpc_request, SATURATION_CONCURRENCY, max(WARMUP_CALLS, SATURATION_CONCURRENCY), WARMUP_SECONDS))
    before = CpuClock.read(pids)
    tally, wall = await aio.run(partial(grpc_closed_loop, client, grpc_request, SATURATION_CONCURRENCY, 10**7, options.sat_seconds))
    after = CpuClock.read(pids)
    busy[GRPC] = MachineClock.read().cores_since(machine)
    runs.append(replace(run_result("grpc", SATURATION_CONCURRENCY, tally, wall, before, after), target=GRPC))
    print(_sat_progress(runs[-1]), file=sys.stderr, flush=True)
    return runs, profiles


async def _profile_http(port: int, request: Source, tg_pid: int, path: Path, seconds: float) -> ProfileSummary | None:
    """The HTTP saturation loop again, unmeasured, while py-spy records tailguard."""
    clients = [KeepAliveClient(port) for _ in range(SATURATION_CONCURRENCY)]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(closed_loop, clients, request, 10**7, seconds + 60)
            await trio.sleep(0.5)
            written = await py_spy_speedscope(tg_pid, path, seconds)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            for c in clients:
                await c.aclose()
    return summarize_speedscope(path) if written else _no_profile(path)


async def sse_phase(options: Options, ports: dict[str, int], pids: dict[str, int], busy: dict[str, float]) -> tuple[list[StreamRun], dict[str, ProfileSummary]]:
    """Streaming chats (max_tokens 128): direct, through vllm-router and through tailguard HTTP, at each stream count."""
    payload = {
        "messages": [{"role": "user", "content": MESSAGE}],
        "max_tokens": STREAM_MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},  # tailguard asks the engine for it too
    }
    runs: list[StreamRun] = []
    profiles: dict[str, ProfileSummary] = {}
    top = max(options.streams)
    for streams in options.streams:
        for path in _paths(ports, (DIRECT, PEER, HTTP)):
            profile = options.out_dir / "profile_sse.json" if path == HTTP and streams == top and options.profile_s > 0 else None
            request = unique_chat(ports[path], payload, options.seed, "sse", streams, path)
            machine = MachineClock.read()
            target = "direct" if path == DIRECT else path
            run = await sse_streams(
                target, ports[path], request, streams, options.sse_warmup_s, options.sse_seconds, pids, profile, options.profile_s, ROUTER_OF.get(path)
            )
            busy[f"{path} {streams}"] = MachineClock.read().cores_since(machine)
            runs.append(replace(run, target=path))
            print(_sse_progress(runs[-1]), file=sys.stderr, flush=True)
            if profile is not None:
                summary = summarize_speedscope(profile) if profile.exists() else _no_profile(profile)
                if summary is not None:
                    profiles[f"sse_{streams}_streams"] = summary
    return runs, profiles


async def paced_phase(options: Options, ports: dict[str, int], pids: dict[str, int], busy: dict[str, float]) -> list[StreamRun]:
    """Streaming chats from the engine at real pace: directly, through its own vllm-router, through tailguard."""
    payload = {
        "messages": [{"role": "user", "content": MESSAGE}],
        "max_tokens": PACED_MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    runs: list[StreamRun] = []
    for path in _paths(ports, (DIRECT, PEER, HTTP)):
        request = unique_chat(ports[path], payload, options.seed, "paced", path)
        machine = MachineClock.read()
        run = await sse_streams(
            "direct" if path == DIRECT else path, ports[path], request, options.paced_streams, options.sse_warmup_s, options.sse_seconds,
            pids, router=PACED_ROUTER_OF.get(path),
        )
        busy[f"{path} paced"] = MachineClock.read().cores_since(machine)
        runs.append(replace(run, target=path))
        print(_sse_progress(runs[-1], PACED_ROUTER_OF), file=sys.stderr, flush=True)
    return runs


def _paths(ports: dict[str, int], order: Sequence[str]) -> list[str]:
    """The paths of ``order`` this run has (the peer may be left out), in that order."""
    return [path for path in order if path in ports or path == GRPC]


def _no_profile(path: Path) -> ProfileSummary | None:
    """None, after saying so: a missing profile must not sink the run's numbers."""
    print(f"warning: py-spy wrote no profile to {path}", file=sys.stderr)
    return None


def _open_run(path: str, rate: float, arrivals: int, tally: OpenTally, before: CpuClock, after: CpuClock, machine_cores: float) -> OpenRun:
    latencies, lags = sorted(tally.latencies), sorted(tally.lags)
    n = len(latencies)
    wall = after.wall - before.wall
    cpu = after.seconds_since(before)[ROUTER_OF[path]] if path in ROUTER_OF else 0.0
    return OpenRun(
        path=path,
        rate=rate,
        arrivals=arrivals,
        completed=n,
        errors=tally.errors,
        dropped=tally.dropped,
        unfinished=arrivals - n - tally.errors - tally.dropped,
        connections=tally.connections,
        wall_s=wall,
        **latency_ms(latencies),
        lag_p50_ms=percentile(lags, 50) * 1000,
        lag_p99_ms=percentile(lags, 99) * 1000,
        cores=after.cores_since(before),
        machine_busy_cores=machine_cores,
        router_cpu_us_per_request=cpu / n * 1e6 if path != DIRECT and n else None,
    )
