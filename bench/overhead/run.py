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
``bench.overhead.closed_loop``'s lean keep-alive HTTP/1.1 client on raw Trio
sockets, grpc.aio on its own asyncio thread (``bench.overhead.grpc_streams``), and
``bench.simcheck.cpu``'s lean SSE client. Router CPU comes from /proc/PID/stat.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import trio

from bench.harness.cli import add_out_arg, add_seconds_arg, add_seed_arg, add_warmup_arg, comma_separated, driver_parser, run_and_report
from bench.harness.client import HOST, ConnectionPool, KeepAliveClient, Source
from bench.harness.clocks import CpuClock, MachineClock
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.grpc import AsyncioThread
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
from bench.harness.report import Target, code_version, cores_cell, latency_ms, maybe, md_table, targets_table
from bench.harness.traffic import OpenTally, http_open_loop, poisson_offsets
from bench.harness.unique import unique_chat
from bench.overhead.closed_loop import MAX_TOKENS, MESSAGE, Plan, RunResult, closed_loop, measure_closed_loop
from bench.overhead.grpc_streams import WARMUP_CALLS, WARMUP_SECONDS, GrpcClient, chat_request, grpc_closed_loop, run_result
from bench.overhead.load import ProfileSummary, StreamRun, grpc_open_loop, py_spy_speedscope, sse_streams, summarize_speedscope
from tailguard.server.advise.replay.mix import percentile

RESULTS_DIR = RESULTS_ROOT / "overhead"

# The issue's targets.
TARGET_RATE = 400.0  # req/s at which the added latency is judged
TARGET_ADDED_P50_MS = 1.0
TARGET_ADDED_P99_MS = 3.0
TARGET_SATURATION = 1_500.0  # req/s
TARGET_EVENTS_PER_S = 30_000.0

SATURATION_CONCURRENCY = 64
SATURATION_WARMUP = 500  # requests
STREAM_MAX_TOKENS = 128  # the interactive class's max_output_tokens: still interactive
POOL_CAP = 1024
_CANCEL_GRACE_S = 30.0

DIRECT, PEER, HTTP, GRPC = "direct HTTP", "vllm-router HTTP", "tailguard HTTP", "tailguard gRPC"
TAILGUARD, VLLM_ROUTER = "tailguard", "vllm-router"  # the routers' keys in the pids and the cores
ROUTER_OF = {PEER: VLLM_ROUTER, HTTP: TAILGUARD, GRPC: TAILGUARD}  # the router in each path (direct: none)
# The cheapest of the peer's policies, so its cost is a floor; its default,
# cache_aware, also walks a prefix tree per request.
PEER_POLICY = "round_robin"
# The paced relay's engine: real time, a step per ~10 ms. The batch pool's
# endpoint (the other phases send interactive requests only); the peer gets
# a second process in front of it.
PACED_PROFILE = "latency"
PACED_PEER = "vllm-router, paced engine"  # the second peer's key in the pids and the cores
PACED_ROUTER_OF = {PEER: PACED_PEER, HTTP: TAILGUARD}
PACED_MAX_TOKENS = 256  # over the interactive class's 128: tailguard classes them batch, to the paced engine


@dataclass(frozen=True)
class Options:
    rates: Sequence[float]
    seconds: float  # each open-loop run
    warmup_s: float  # unmeasured open loop before each run, same rate
    sat_seconds: float
    streams: Sequence[int]
    sse_warmup_s: float
    sse_seconds: float
    paced_streams: int  # 0: no paced relay
    profile_s: float  # 0: no py-spy
    seed: int
    out_dir: Path
    peer: Path | None  # the vllm-router executable; None: no peer


@dataclass
class OpenRun:
    path: str
    rate: float  # scheduled req/s
    arrivals: int
    completed: int
    errors: int
    dropped: int  # the client's connection cap was reached: never sent
    unfinished: int  # still running when the run's time bound cut it off
    connections: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    lag_p50_ms: float  # how late the client started sending, from the schedule
    lag_p99_ms: float
    cores: dict[str, float]
    machine_busy_cores: float  # every process on the machine, ours included
    router_cpu_us_per_request: float | None


@dataclass
class Added:
    path: str
    rate: float
    added_p50_ms: float
    added_p99_ms: float


@dataclass
class VersusPeer:
    """One measure for the peer and for tailguard's two APIs, and tailguard / peer."""

    measure: str
    better: str  # "lower" or "higher"
    peer: float
    http: float | None
    grpc: float | None
    http_ratio: float | None  # tailguard / peer; None when the peer's value is not > 0
    grpc_ratio: float | None


@dataclass
class Result:
    code: str  # the commit measured, and whether router/ and server/ differed from it
    cpu_count: int
    peer: str | None  # "vllm-router VERSION, flags"
    engine_profile: str
    message: str
    max_tokens: int
    stream_max_tokens: int
    arrivals: str
    load_generators: list[str]
    parameters: dict[str, object]
    open_loop: list[OpenRun]
    added: list[Added]
    versus_peer: list[VersusPeer]
    saturation: list[RunResult]
    streams: list[StreamRun]
    paced: list[StreamRun]  # the relay at engine pace ('tailguard_cpu_us_per_chunk': the path's router's)
    profiles: dict[str, ProfileSummary]
    targets: list[Target]
    machine_busy_cores: dict[str, float]  # saturation and SSE runs (warm-up included), keyed "PATH" / "PATH STREAMS"
    wall_s: float = 0.0


# -- the run -----------------------------------------------------------------------------


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


def peer_command(exe: Path, port: int, metrics_port: int, engine_port: int) -> list[str]:
    """vllm-router in front of one engine, on 127.0.0.1 only (its metrics too), its defaults otherwise."""
    return [
        str(exe),
        "--host", HOST,
        "--port", str(port),
        "--worker-urls", f"http://{HOST}:{engine_port}",
        "--policy", PEER_POLICY,
        "--prometheus-host", HOST,
        "--prometheus-port", str(metrics_port),
        "--log-level", "warning",
    ]  # fmt: skip


def find_peer() -> Path | None:
    """The vllm-router beside this Python (the venv's), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.exists():
        return beside
    found = shutil.which("vllm-router")
    return Path(found) if found else None


def peer_version(peer: Path | None) -> str | None:
    if peer is None:
        return None
    try:
        version = importlib.metadata.version("vllm-router")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    return f"vllm-router {version} ({peer}), --policy {PEER_POLICY}, its defaults otherwise"


async def _phases(
    options: Options, aio: AsyncioThread, client: GrpcClient, ports: dict[str, int], paced_ports: dict[str, int], pids: dict[str, int]
) -> Result:
    open_runs = await open_loop_phase(options, aio, client, ports, pids)
    busy: dict[str, float] = {}
    saturation, profiles = await saturation_phase(options, aio, client, ports, pids, busy)
    streams, sse_profile = await sse_phase(options, ports, pids, busy)
    profiles.update(sse_profile)
    paced = await paced_phase(options, paced_ports, pids, busy) if options.paced_streams else []
    added = _added(open_runs)
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
        versus_peer=_versus_peer(added, saturation, streams, paced),
        saturation=saturation,
        streams=streams,
        paced=paced,
        profiles=profiles,
        targets=_targets(added, saturation, streams),
        machine_busy_cores=busy,
    )


def _open_progress(r: OpenRun) -> str:
    return f"  open {r.path:>14} {r.rate:g}/s: n={r.completed} P50 {r.p50_ms:.2f} P99 {r.p99_ms:.2f} ms, lag P99 {r.lag_p99_ms:.2f} ms, router {_router_cores(r.cores, r.path):.2f} cores"


def _sat_progress(r: RunResult) -> str:
    return f"  saturation {r.target:>14}: {r.req_per_s:,.0f} req/s, router {_router_cores(r.cores, r.target):.2f} cores, client {r.cores['client']:.2f}"


def _sse_progress(s: StreamRun, routers: dict[str, str] = ROUTER_OF) -> str:
    return (
        f"  sse {s.target:>14} {s.streams} streams: {s.chunks_per_s:,.0f} events/s, router {_router_cores(s.cores, s.target, routers):.2f} cores, "
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


def _added(runs: Sequence[OpenRun]) -> list[Added]:
    direct = {r.rate: r for r in runs if r.path == DIRECT}
    return [Added(r.path, r.rate, r.p50_ms - direct[r.rate].p50_ms, r.p99_ms - direct[r.rate].p99_ms) for r in runs if r.path != DIRECT and r.rate in direct]


def _targets(added: Sequence[Added], saturation: Sequence[RunResult], streams: Sequence[StreamRun]) -> list[Target]:
    targets = []
    rates = sorted({a.rate for a in added})
    rate = TARGET_RATE if TARGET_RATE in rates else (rates[-1] if rates else TARGET_RATE)
    for a in added:
        if a.rate == rate:
            met = a.added_p50_ms < TARGET_ADDED_P50_MS and a.added_p99_ms < TARGET_ADDED_P99_MS
            goal = f"P50 < {TARGET_ADDED_P50_MS:g} ms, P99 < {TARGET_ADDED_P99_MS:g} ms"
            targets.append(Target(f"added latency at {rate:g} req/s, {a.path}", goal, f"P50 {a.added_p50_ms:+.2f} ms, P99 {a.added_p99_ms:+.2f} ms", met))
    for r in saturation:
        if r.target in (HTTP, GRPC):
            measured = f"{r.req_per_s:,.0f} req/s (router {r.cores[TAILGUARD]:.2f} cores)"
            targets.append(Target(f"saturation throughput, {r.target}", f">= {TARGET_SATURATION:,.0f} req/s", measured, r.req_per_s >= TARGET_SATURATION))
    relayed = [s for s in streams if s.target == HTTP]
    if relayed:
        best = max(relayed, key=lambda s: s.chunks_per_s)
        measured = f"{best.chunks_per_s:,.0f} events/s ({best.streams} streams, router {best.cores[TAILGUARD]:.2f} cores)"
        targets.append(Target("SSE events/s relayed per router process", f">= {TARGET_EVENTS_PER_S:,.0f}", measured, best.chunks_per_s >= TARGET_EVENTS_PER_S))
    return targets


# -- reporting ---------------------------------------------------------------------------


def _versus_peer(
    added: Sequence[Added], saturation: Sequence[RunResult], streams: Sequence[StreamRun], paced: Sequence[StreamRun]
) -> list[VersusPeer]:
    """tailguard's HTTP and gRPC APIs beside vllm-router, measure by measure (empty without the peer)."""
    rows: list[VersusPeer] = []

    def row(measure: str, better: str, values: dict[str, float | None], floor: float = 0.0) -> None:
        peer = values.get(PEER)
        if peer is None:
            return
        http, grpc = values.get(HTTP), values.get(GRPC)
        rows.append(VersusPeer(measure, better, peer, http, grpc, _ratio(http, peer, floor), _ratio(grpc, peer, floor)))

    for rate in sorted({a.rate for a in added}):
        at = {a.path: a for a in added if a.rate == rate}
        row(f"added P50 ms at {rate:g} req/s", "lower", {p: a.added_p50_ms for p, a in at.items()}, _ADDED_MS_FLOOR)
        row(f"added P99 ms at {rate:g} req/s", "lower", {p: a.added_p99_ms for p, a in at.items()}, _ADDED_MS_FLOOR)
    sat = {r.target: r for r in saturation}
    row(f"saturation req/s (concurrency {SATURATION_CONCURRENCY})", "higher", {p: r.req_per_s for p, r in sat.items()})
    cpu = {p: r.router_cpu_ms_per_request * 1000 for p, r in sat.items() if r.router_cpu_ms_per_request is not None}
    row("router CPU µs/request at saturation", "lower", dict(cpu))
    for count in sorted({s.streams for s in streams}):
        at_count = {s.target: s for s in streams if s.streams == count}
        row(f"SSE events/s, {count} streams", "higher", {p: s.chunks_per_s for p, s in at_count.items()})
        per_event = {p: s.tailguard_cpu_us_per_chunk for p, s in at_count.items() if s.tailguard_cpu_us_per_chunk is not None}
        row(f"router CPU µs/event, {count} streams", "lower", dict(per_event))
    if paced:
        per_event = {s.target: s.tailguard_cpu_us_per_chunk for s in paced if s.tailguard_cpu_us_per_chunk is not None}
        row(f"router CPU µs/event at engine pace, {paced[0].streams} streams", "lower", dict(per_event))
    return rows


# An added latency below this is within the clock's noise: no ratio against it
# (a peer that adds 0.002 ms would make any router look hundreds of times slower).
_ADDED_MS_FLOOR = 0.05


def _ratio(value: float | None, peer: float, floor: float = 0.0) -> float | None:
    """tailguard / peer; None when either is missing or the peer's is not above ``floor`` (no meaningful ratio)."""
    return value / peer if value is not None and peer > floor else None


def _cores(cores: dict[str, float], path: str, routers: dict[str, str] = ROUTER_OF) -> str:
    """Simulator / the path's router / client cores (no router on the direct path)."""
    return cores_cell(cores, routers.get(path))


def _router_cores(cores: dict[str, float], path: str, routers: dict[str, str] = ROUTER_OF) -> float:
    router = routers.get(path)
    return cores[router] if router is not None else 0.0



def render(result: Result) -> str:
    """The markdown report: tables, targets, profile summaries, how it was measured."""
    added = {(a.path, a.rate): a for a in result.added}
    lines = [f"Measured tailguard code: commit {result.code}.", ""] + _render_versus_peer(result) + [
        f"## Added latency, open loop (non-streaming chat, max_tokens {result.max_tokens}; {result.arrivals})",
        "",
        "| path | rate req/s | arrivals | done | errors / dropped / cut off | conns | P50 ms | P99 ms | added P50 / P99 ms | send lag P50 / P99 ms "
        "| cores: sim / router / client | machine busy cores | router CPU µs/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.open_loop:
        a = added.get((r.path, r.rate))
        plus = f"{a.added_p50_ms:+.2f} / {a.added_p99_ms:+.2f}" if a else "-"
        lines.append(
            f"| {r.path} | {r.rate:g} | {r.arrivals:,} | {r.completed:,} | {r.errors} / {r.dropped} / {r.unfinished} | {r.connections} | {r.p50_ms:.2f} "
            f"| {r.p99_ms:.2f} | {plus} | {r.lag_p50_ms:.2f} / {r.lag_p99_ms:.2f} | {_cores(r.cores, r.path)} | {r.machine_busy_cores:.2f} "
            f"| {maybe(r.router_cpu_us_per_request, ',.0f')} |"
        )
    lines += [
        "",
        f"## Saturation, closed loop at concurrency {SATURATION_CONCURRENCY}",
        "",
        "| path | requests | errors | req/s | P50 ms | P99 ms | router cores | req/s per router core | router CPU µs/req "
        "| cores: sim / router / client | machine busy cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result.saturation:
        tg = _router_cores(c.cores, c.target)
        per_core = f"{c.req_per_s / tg:,.0f}" if c.target != DIRECT and tg > 0 else "-"
        cpu = maybe(c.router_cpu_ms_per_request * 1000 if c.router_cpu_ms_per_request is not None else None, ",.0f")
        lines.append(
            f"| {c.target} | {c.requests:,} | {c.errors} | {c.req_per_s:,.0f} | {c.p50_ms:.2f} | {c.p99_ms:.2f} | {tg:.2f} | {per_core} | {cpu} | {_cores(c.cores, c.target)} "
            f"| {maybe(result.machine_busy_cores.get(c.target), '.2f')} |"
        )
    lines += [
        "",
        f"## SSE relay, streaming chat (max_tokens {result.stream_max_tokens}), streams restarted as they end",
        "",
        "| path | streams | window s | events/s | streams done | errors | cores: sim / router / client | machine busy cores | router CPU µs/event |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result.streams:
        lines.append(
            f"| {s.target} | {s.streams} | {s.window_s:.1f} | {s.chunks_per_s:,.0f} | {s.streams_done:,} | {s.errors} | {_cores(s.cores, s.target)} "
            f"| {maybe(result.machine_busy_cores.get(f'{s.target} {s.streams}'), '.2f')} | {maybe(s.tailguard_cpu_us_per_chunk, '.1f')} |"
        )
    if result.paced:
        lines += [
            "",
            f"## SSE relay at engine pace: the '{PACED_PROFILE}' engine in real time, {result.paced[0].streams} streams (max_tokens "
            f"{PACED_MAX_TOKENS}: the batch class), a vllm-router of its own",
            "",
            "| path | window s | events/s | streams done | errors | cores: sim / router / client | machine busy cores | router CPU µs/event |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s in result.paced:
            lines.append(
                f"| {s.target} | {s.window_s:.1f} | {s.chunks_per_s:,.0f} | {s.streams_done:,} | {s.errors} | {_cores(s.cores, s.target, PACED_ROUTER_OF)} "
                f"| {maybe(result.machine_busy_cores.get(f'{s.target} paced'), '.2f')} | {maybe(s.tailguard_cpu_us_per_chunk, '.1f')} |"
            )
        lines += ["", "The engine sets the pace, so events/s are the same on every path; what differs is what each event costs the router."]
    lines += ["", "## Targets (reported, not tuned for)", "", *targets_table(result.targets)]
    for name, p in result.profiles.items():
        others = ", ".join(f"{thread} {n}" for thread, n in p.other_thread_samples.items()) or "none"
        inclusive = [(f, s) for f, s in p.top_inclusive if s < 0.9][:12]
        lines += [
            "",
            f"## Router profile: {name} (py-spy, `{_rel(p.path)}`)",
            "",
            f"{p.samples:,} samples of the main thread (other threads, mostly blocked waits: {others}).",
            "Self time by component (the leaf frame's package): " + ", ".join(f"{c} {s:.0%}" for c, s in p.self_by_component[:8]) + ".",
            "Inclusive by component (anywhere on the stack): " + ", ".join(f"{c} {s:.0%}" for c, s in p.inclusive_by_component[:10]) + ".",
            "",
            *md_table(["top self frames", "share"], ((f"`{f}`", f"{s:.1%}") for f, s in p.top_self[:10])),
            "",
            *md_table(["top inclusive frames (below 90%)", "share"], ((f"`{f}`", f"{s:.1%}") for f, s in inclusive)),
        ]
    lines += ["", "Load generators: " + "; ".join(result.load_generators) + "."]
    lines.append(
        f"Engines in the '{result.engine_profile}' profile; {result.cpu_count} CPUs shared by the simulator, tailguard and the load "
        f"generators (and whatever else runs: 'machine busy cores' counts every process; the saturation and SSE rows' include their warm-ups). "
        f"'send lag' is how late the client started a request after its scheduled time (in every latency); percentiles are over the "
        f"requests done (dropped and cut-off ones are counted beside them). "
        f"Wall time {result.wall_s:.0f} s."
    )
    return "\n".join(lines)


def _render_versus_peer(result: Result) -> list[str]:
    """The headline: tailguard's two APIs beside vllm-router, with ratios (tailguard / vllm-router)."""
    if not result.versus_peer:
        return []
    lines = [
        f"## tailguard beside vllm-router (same run, same engine, same load; peer: {result.peer})",
        "",
        "| measure | better | vllm-router | tailguard HTTP | tailguard gRPC | HTTP / vllm-router | gRPC / vllm-router |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in result.versus_peer:
        fmt = ",.0f" if abs(v.peer) >= 100 else ".2f"
        lines.append(
            f"| {v.measure} | {v.better} | {format(v.peer, fmt)} | {maybe(v.http, fmt)} | {maybe(v.grpc, fmt)} "
            f"| {maybe(v.http_ratio, '.2f')}{'x' if v.http_ratio is not None else ''} | {maybe(v.grpc_ratio, '.2f')}{'x' if v.grpc_ratio is not None else ''} |"
        )
    lines += [
        "",
        "Added latency is over the engine called directly at the same arrivals; a ratio is left out ('-') when the peer's value is not "
        f"above {_ADDED_MS_FLOOR:g} ms. The peer serves HTTP only: the gRPC column is tailguard's gRPC API beside the peer's HTTP.",
        "",
    ]
    return lines


def _rel(path: str) -> str:
    return path.rsplit("/work/main/", 1)[-1]


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser("overhead", __doc__)
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

