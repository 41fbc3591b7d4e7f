"""``python -m bench quick_mixed``: short requests' P99 through tailguard vs one shared engine, under a mixed load.

Real time, open loop, the origin's mix: Poisson arrivals, 80% short chat
questions (max_tokens 64) and 20% ~2,000-token documents (max_tokens 512),
all streaming. The same arrival sequence (seeded) is played against four
set-ups on one simulator process, one after another:

- ``shared x1``: every request straight to one throughput-profile engine;
- ``shared x2 rr``: two throughput engines, the client alternating (the same
  GPU count as tailguard's set-up, so the comparison is fair on hardware);
- ``tailguard``: tailguard in front of a latency-profile engine (interactive
  pool, cap 64) and a throughput-profile engine (batch pool, cap 256);
- ``split direct``: the same two engines without the router, the client
  sending each class to its engine: what tailguard's routing would give for
  free, so the difference from ``tailguard`` is the router's own cost.

The rate is 0.8 of the single shared engine's capacity, computed from the
simulator's cost model (see :func:`shared_capacity`). Requests that arrive
during the warm-up load the engines but are not counted; the window's
requests are then waited for, up to a bound, and any still running are
cancelled and reported as unfinished.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import trio

from bench.harness.cli import add_json_arg, add_seconds_arg, add_seed_arg, add_time_scale_arg, add_warmup_arg, driver_parser, run_trio
from bench.harness.client import CHAT_PATH, TOKEN_MARKER, ConnectionPool, ProtocolError
from bench.harness.clocks import CpuClock
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.procs import RESULTS_ROOT, add_serve_arg, free_ports, log_tail, start_simulator, start_tailguard, stop, wait_ready
from bench.harness.report import cores_cell, md_table, save_json
from bench.harness.traffic import Arrival, schedule
from bench.harness.unique import UniqueRequests, run_seed
from tailguard.server.advise.replay.mix import (
    CLASSES,
    LONG_MAX_TOKENS,
    SHORT_MAX_TOKENS,
    SHORT_SHARE,
    Capacity,
    payloads,
    percentile,
    prompt_tokens,
    shared_capacity,
    unique_payload,
)
from tailguard.sim.params import PROFILES

DEFAULT_JSON = RESULTS_ROOT / "quick_mixed.json"
TARGET_LOAD = 0.8  # of the single shared engine's capacity
SETUP_NAMES = ("shared x1", "shared x2 rr", "tailguard", "split direct")


# -- the open loop -------------------------------------------------------------------


@dataclass
class Sample:
    """One request's fate; times in seconds, real (unscaled by the caller)."""

    kind: str
    measured: bool
    lag: float  # how late the client sent it against the schedule
    ttft: float | None = None
    e2e: float | None = None
    status: int | None = None
    outcome: str = "unfinished"  # ok | http_error | incomplete | connection_error | unfinished


async def send_one(pool: ConnectionPool, request: bytes, sample: Sample) -> None:
    """One streaming request on a pooled connection; fills ``sample``."""
    client = pool.take()
    start = time.perf_counter()
    try:
        reply = await client.exchange(request, TOKEN_MARKER)
    except (OSError, trio.BrokenResourceError, ProtocolError):
        sample.outcome = "connection_error"
        return
    finally:
        pool.give_back(client)  # a failed one reconnects on its next use
    sample.e2e = time.perf_counter() - start
    sample.status = reply.status
    if reply.marker_at is not None:
        sample.ttft = reply.marker_at - start
    if reply.status != 200:
        sample.outcome = "http_error"
    elif not reply.done_seen or sample.ttft is None:
        sample.outcome = "incomplete"
    else:
        sample.outcome = "ok"


async def open_loop(
    pools: Mapping[str, Sequence[ConnectionPool]],
    requests: Mapping[tuple[int, str], UniqueRequests],
    arrivals: Sequence[Arrival],
    drain: float,
) -> tuple[list[Sample], float]:
    """Send each arrival on time (round robin over its class's ``pools``), each its own body; wait ``drain`` s at most after the last.

    Returns the samples and the wall time from the start of the schedule to the end.
    """
    samples: list[Sample] = []
    origin = time.perf_counter()
    end = trio.current_time() + (arrivals[-1].at if arrivals else 0.0) + drain
    with trio.move_on_at(end):
        async with trio.open_nursery() as nursery:
            base = trio.current_time()
            for index, arrival in enumerate(arrivals):
                await trio.sleep_until(base + arrival.at)
                choices = pools[arrival.kind]
                pool = choices[index % len(choices)]
                sample = Sample(arrival.kind, arrival.measured, lag=time.perf_counter() - origin - arrival.at)
                samples.append(sample)
                nursery.start_soon(send_one, pool, requests[(pool.port, arrival.kind)].request(index), sample)
    return samples, time.perf_counter() - origin


# -- set-ups and the run ---------------------------------------------------------------


@dataclass
class ClassStats:
    setup: str
    kind: str
    n: int
    ok: int
    errors: int
    unfinished: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    outcomes: dict[str, int]


@dataclass
class SetupResult:
    name: str
    description: str
    wall_s: float
    arrivals: int
    client_lag_p99_ms: float
    client_lag_max_ms: float
    cores: dict[str, float]
    classes: list[ClassStats]


@dataclass
class Result:
    time_scale: float
    times_are: str
    rate_req_per_s_gpu_time: float
    rate_req_per_s_real: float
    capacity: Capacity
    target_load: float
    short_prompt_tokens: int
    long_prompt_tokens: int
    warmup_s: float
    window_s: float
    drain_s: float
    seed: int
    serve_args: list[str]
    cpu_count: int
    setups: list[SetupResult] = field(default_factory=list)


@dataclass(frozen=True)
class Setup:
    name: str
    description: str
    ports: Mapping[str, Sequence[int]]  # by class: where its requests go, round robin


@dataclass(frozen=True)
class Options:
    seconds: float
    warmup: float
    drain: float
    time_scale: float
    load: float
    seed: int
    serve_args: Sequence[str] = ()
    only: Sequence[str] = ()  # set-up names to run; empty = all


async def measure(options: Options) -> Result:
    """Start the simulator (4 engines) and tailguard; play the schedule against each set-up."""
    bodies = payloads()
    short_tokens, long_tokens = prompt_tokens(bodies["short"]), prompt_tokens(bodies["long"])
    capacity = shared_capacity(PROFILES["throughput"], short_tokens, long_tokens)
    gpu_rate = options.load * capacity.req_per_s
    real_rate = gpu_rate / options.time_scale
    arrivals = schedule(real_rate, options.warmup, options.seconds, options.seed)
    ports = Ports(*free_ports(6))
    setups = [s for s in _setups(ports) if not options.only or s.name in options.only]
    result = Result(
        time_scale=options.time_scale,
        times_are="GPU time: real ms divided by time_scale" if options.time_scale != 1 else "real time (time_scale 1)",
        rate_req_per_s_gpu_time=gpu_rate,
        rate_req_per_s_real=real_rate,
        capacity=capacity,
        target_load=options.load,
        short_prompt_tokens=short_tokens,
        long_prompt_tokens=long_tokens,
        warmup_s=options.warmup,
        window_s=options.seconds,
        drain_s=options.drain,
        seed=options.seed,
        serve_args=list(options.serve_args),
        cpu_count=len(os.sched_getaffinity(0)),
    )
    print(
        f"capacity of one shared engine for this mix: {capacity.req_per_s:.1f} req/s (GPU time); "
        f"rate {gpu_rate:.1f} req/s GPU time = {real_rate:.2f} req/s real at time scale {options.time_scale:g}; "
        f"{len(arrivals)} arrivals per set-up",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="tailguard-bench-") as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(
            tailguard_config(
                ports.tailguard,
                ports.grpc,
                PoolSpec("interactive", [(ports.tg_latency, 64)], max_concurrency=64, max_queue=256),
                PoolSpec("batch", [(ports.tg_throughput, 256)], max_concurrency=256, max_queue=512),
            )
        )
        sim_log, tg_log = Path(tmp) / "sim.log", Path(tmp) / "tailguard.log"
        with sim_log.open("wb") as sim_out, tg_log.open("wb") as tg_out:
            try:
                async with trio.open_nursery() as nursery:
                    sim = await start_simulator(nursery, ports.engines(), options.time_scale, log=sim_out)
                    for port, _ in ports.engines():
                        await wait_ready(port, sim, "the simulator")
                    tg = await start_tailguard(nursery, config, log=tg_out, extra_args=options.serve_args)
                    await wait_ready(ports.tailguard, tg, "tailguard")
                    pids = {"simulator": sim.pid, "tailguard": tg.pid}
                    for setup in setups:
                        requests = _unique_requests(setup, options.seed)
                        result.setups.append(await _run_setup(setup, requests, arrivals, options, pids))
                        print(f"  {setup.name}: done in {result.setups[-1].wall_s:.0f} s", file=sys.stderr, flush=True)
                        for process, name in ((tg, "tailguard"), (sim, "the simulator")):
                            if process.returncode is not None:
                                raise RuntimeError(f"{name} exited with {process.returncode} during the run")
                    await stop(tg)
                    nursery.cancel_scope.cancel()
            except Exception:
                print(f"--- simulator log ---\n{log_tail(sim_log)}\n--- tailguard log ---\n{log_tail(tg_log)}", file=sys.stderr)
                raise
    return result


@dataclass(frozen=True)
class Ports:
    """Where everything listens: four engines in one simulator, and tailguard."""

    shared_a: int
    shared_b: int
    tg_latency: int
    tg_throughput: int
    tailguard: int
    grpc: int

    def engines(self) -> list[tuple[int, str]]:
        return [
            (self.shared_a, "throughput"),
            (self.shared_b, "throughput"),
            (self.tg_latency, "latency"),
            (self.tg_throughput, "throughput"),
        ]


def _unique_requests(setup: Setup, seed: int) -> dict[tuple[int, str], UniqueRequests]:
    """Per target and class, every request its own prompt; a seed per set-up, as set-ups share engines (and their caches)."""
    nonce_seed = run_seed(seed, setup.name)
    return {
        (port, kind): UniqueRequests(port, CHAT_PATH, partial(unique_payload, kind, seed=nonce_seed), seed=nonce_seed)
        for kind, ports in setup.ports.items()
        for port in ports
    }


def _both(*targets: int) -> dict[str, Sequence[int]]:
    """Both classes to the same targets."""
    return {kind: targets for kind in CLASSES}


def _setups(ports: Ports) -> list[Setup]:
    return [
        Setup("shared x1", "direct, one shared throughput engine", _both(ports.shared_a)),
        Setup("shared x2 rr", "direct, two throughput engines, client round robin", _both(ports.shared_a, ports.shared_b)),
        Setup(
            "tailguard",
            "tailguard: interactive -> latency engine (cap 64), batch -> throughput engine (cap 256)",
            _both(ports.tailguard),
        ),
        Setup(
            "split direct",
            "no router: the client sends short requests to tailguard's latency engine, long ones to its throughput engine",
            {"short": [ports.tg_latency], "long": [ports.tg_throughput]},
        ),
    ]


async def _run_setup(
    setup: Setup, requests: dict[tuple[int, str], UniqueRequests], arrivals: Sequence[Arrival], options: Options, pids: dict[str, int]
) -> SetupResult:
    by_port = {port: ConnectionPool(port) for ports in setup.ports.values() for port in ports}
    pools = {kind: [by_port[port] for port in ports] for kind, ports in setup.ports.items()}
    try:
        before = CpuClock.read(pids)
        samples, wall = await open_loop(pools, requests, arrivals, options.drain)
        cores = CpuClock.read(pids).cores_since(before)
    finally:
        for pool in by_port.values():
            await pool.aclose()
        await trio.sleep(1.0)  # let aborted sequences leave the engines before the next set-up
    lags = sorted(s.lag for s in samples)
    return SetupResult(
        name=setup.name,
        description=setup.description,
        wall_s=wall,
        arrivals=len(samples),
        client_lag_p99_ms=percentile(lags, 99) * 1000,
        client_lag_max_ms=(lags[-1] if lags else math.nan) * 1000,
        cores=cores,
        classes=[_class_stats(setup.name, kind, samples, options.time_scale) for kind in CLASSES],
    )


def _class_stats(setup: str, kind: str, samples: Sequence[Sample], scale: float) -> ClassStats:
    mine = [s for s in samples if s.kind == kind and s.measured]
    ok = [s for s in mine if s.outcome == "ok"]
    ttft = sorted(s.ttft / scale for s in ok if s.ttft is not None)
    e2e = sorted(s.e2e / scale for s in ok if s.e2e is not None)
    outcomes: dict[str, int] = {}
    for s in mine:
        outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
    unfinished = outcomes.get("unfinished", 0)
    return ClassStats(
        setup=setup,
        kind=kind,
        n=len(mine),
        ok=len(ok),
        errors=len(mine) - len(ok) - unfinished,
        unfinished=unfinished,
        ttft_p50_ms=percentile(ttft, 50) * 1000,
        ttft_p99_ms=percentile(ttft, 99) * 1000,
        e2e_p50_ms=percentile(e2e, 50) * 1000,
        e2e_p99_ms=percentile(e2e, 99) * 1000,
        outcomes=outcomes,
    )


# -- reporting -----------------------------------------------------------------------


def render_table(result: Result) -> str:
    classes = md_table(
        ["set-up", "class", "n", "TTFT P50 ms", "TTFT P99 ms", "E2E P50 ms", "E2E P99 ms", "errors", "unfinished"],
        (
            (s.name, c.kind, c.n, f"{c.ttft_p50_ms:,.1f}", f"{c.ttft_p99_ms:,.1f}", f"{c.e2e_p50_ms:,.0f}", f"{c.e2e_p99_ms:,.0f}", c.errors, c.unfinished)
            for s in result.setups
            for c in s.classes
        ),
    )
    setups = md_table(
        ["set-up", "wall s", "arrivals", "cores: sim / tailguard / client", "client lag P99 / max ms"],
        (
            (s.name, f"{s.wall_s:.0f}", s.arrivals, cores_cell(s.cores), f"{s.client_lag_p99_ms:.1f} / {s.client_lag_max_ms:.1f}")
            for s in result.setups
        ),
    )
    return "\n".join([*classes, "", *setups])


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    add_seconds_arg(parser, 30.0, "measured arrival window per set-up, real s")
    add_warmup_arg(parser, 12.0, "unmeasured arrivals before the window, real s")
    parser.add_argument("--drain", type=float, default=20.0, help="longest wait for stragglers after the last arrival, real s (default %(default)s)")
    add_time_scale_arg(parser, 1.0, "the simulator's --time-scale; arrival rate is divided by it")
    parser.add_argument("--load", type=float, default=TARGET_LOAD, help="offered load, fraction of one shared engine's capacity (default %(default)s)")
    add_seed_arg(parser, 1, "the arrival schedule")
    parser.add_argument(
        "--setup", action="append", default=[], choices=SETUP_NAMES, help="run only this set-up, repeatable (default: all)"
    )
    add_serve_arg(parser)
    add_json_arg(parser, DEFAULT_JSON)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.warmup < 0 or args.drain < 0 or args.time_scale <= 0 or args.load <= 0:
        parser.error("--seconds, --time-scale and --load must be > 0; --warmup and --drain >= 0")
    options = Options(args.seconds, args.warmup, args.drain, args.time_scale, args.load, args.seed, args.serve_arg, args.setup)
    started = time.perf_counter()
    result = run_trio(measure, options, said="the simulator and tailguard were stopped")
    if result is None:
        return 130
    print(render_table(result))
    print(
        f"\nMix: {SHORT_SHARE:.0%} short ({result.short_prompt_tokens} prompt tokens, max_tokens {SHORT_MAX_TOKENS}), "
        f"{1 - SHORT_SHARE:.0%} long ({result.long_prompt_tokens} prompt tokens, max_tokens {LONG_MAX_TOKENS}), all streaming; "
        f"Poisson at {result.rate_req_per_s_gpu_time:.1f} req/s = {result.target_load:g} x one throughput engine's "
        f"modelled capacity ({result.capacity.req_per_s:.1f} req/s). Time scale {result.time_scale:g}: "
        f"{result.times_are}. Warm-up {result.warmup_s:g} s, window {result.window_s:g} s, drain <= {result.drain_s:g} s "
        f"per set-up; TTFT = first token event (not the role event). Wall time {time.perf_counter() - started:.0f} s."
    )
    save_json(args.json, asdict(result))
    return 0

