"""``python -m bench sim_cpu``: how much CPU the simulator burns streaming to many clients.

The target: two engines (latency + throughput) streaming to 128 concurrent
clients each, at time scale 1, under half a core of the simulator process.

The simulator runs as a subprocess (``python -m tailguard.sim``) on two free
ports; this process holds N streaming requests open per engine for the whole
run and reads the simulator's CPU time from ``/proc/PID/stat`` around a
measurement window that follows a warm-up. The load client is deliberately
lean (raw Trio sockets, hand-written HTTP/1.1, SSE events counted with
``bytes.count``) so that it does not starve the simulator of the second core;
its own CPU is reported too, so the reader can check it was not the limit.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import trio

from bench.harness.cli import add_json_arg, add_seconds_arg, add_time_scale_arg, add_warmup_arg, driver_parser, run_trio
from bench.harness.client import HOST, LoadCounters, sse_client
from bench.harness.procs import RESULTS_ROOT, free_ports, process_cpu_seconds, start_simulator, stop, wait_ready
from bench.harness.report import md_table, save_json
from bench.harness.unique import repeated

DEFAULT_JSON = RESULTS_ROOT / "sim_cpu.json"
PROFILES = ("latency", "throughput")
TARGET_CORES = 0.5  # the simulator's CPU budget for this load


@dataclass(frozen=True)
class CpuSample:
    """CPU and wall clocks read at one instant."""

    wall: float  # trio.current_time()
    sim_user: float  # simulator process, utime, seconds
    sim_system: float  # simulator process, stime, seconds (mostly socket sends)
    client_cpu: float  # this process, time.process_time()

    @property
    def sim_cpu(self) -> float:
        return self.sim_user + self.sim_system


@dataclass
class EngineResult:
    profile: str
    port: int
    streams: int
    events: int
    events_per_s: float
    streams_done: int
    errors: int


@dataclass
class Result:
    """The measurement window's totals."""

    streams_per_engine: int
    time_scale: float
    warmup_s: float
    window_s: float
    sim_cpu_s: float
    sim_user_s: float
    sim_system_s: float
    sim_cores: float
    client_cpu_s: float
    client_cores: float
    events: int
    events_per_s: float
    sim_cpu_us_per_event: float
    target_cores: float
    within_target: bool
    engines: list[EngineResult]


# -- the simulator process ---------------------------------------------------


def sample(pid: int) -> CpuSample:
    user, system = process_cpu_seconds(pid)
    return CpuSample(trio.current_time(), user, system, time.process_time())


# -- the load -----------------------------------------------------------------


def completion_request(port: int) -> bytes:
    """One streaming completion, as bytes on the wire (built once, sent many times)."""
    body = json.dumps(
        {
            "prompt": "Summarize the history of the printing press.",
            "max_tokens": 256,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\n"
        f"Host: {HOST}:{port}\r\n"
        "Content-Type: application/json\r\n"
        "Accept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


# -- the run ------------------------------------------------------------------


async def measure(streams: int, warmup: float, seconds: float, time_scale: float) -> Result:
    """Start the simulator, load it, measure its CPU over the window, tear it all down."""
    ports = free_ports(len(PROFILES))
    counters = {profile: LoadCounters() for profile in PROFILES}
    async with trio.open_nursery() as nursery:
        process = await start_simulator(nursery, list(zip(ports, PROFILES, strict=True)), time_scale)
        try:
            for port in ports:
                await wait_ready(port, process, "the simulator")
            deadline = trio.current_time() + warmup + seconds + 1.0
            async with trio.open_nursery() as load:
                for port, profile in zip(ports, PROFILES, strict=True):
                    request = repeated(completion_request(port))  # under one 16-token block: nothing a cache could serve
                    for _ in range(streams):
                        load.start_soon(sse_client, port, request, deadline, counters[profile])
                await trio.sleep(warmup)
                before, events_before = sample(process.pid), _snapshot(counters)
                await trio.sleep(seconds)
                after, events_after = sample(process.pid), _snapshot(counters)
                if process.returncode is not None:
                    raise RuntimeError(f"the simulator exited with {process.returncode} during the run")
                # Stop the simulator before 2N clients hang up at once: it is
                # measured, and a mass hang-up is not what this run is about.
                await stop(process)
                load.cancel_scope.cancel()
        finally:
            nursery.cancel_scope.cancel()  # terminates the simulator if still running (SIGTERM, then SIGKILL)
    return _result(streams, time_scale, warmup, ports, before, after, events_before, events_after)


def _snapshot(counters: dict[str, LoadCounters]) -> dict[str, LoadCounters]:
    return {profile: LoadCounters(**asdict(c)) for profile, c in counters.items()}


def _result(
    streams: int,
    time_scale: float,
    warmup: float,
    ports: Sequence[int],
    before: CpuSample,
    after: CpuSample,
    events_before: dict[str, LoadCounters],
    events_after: dict[str, LoadCounters],
) -> Result:
    wall = after.wall - before.wall
    sim_cpu = after.sim_cpu - before.sim_cpu
    client_cpu = after.client_cpu - before.client_cpu
    engines = []
    for port, profile in zip(ports, PROFILES, strict=True):
        events = events_after[profile].events - events_before[profile].events
        engines.append(
            EngineResult(
                profile=profile,
                port=port,
                streams=streams,
                events=events,
                events_per_s=events / wall,
                streams_done=events_after[profile].streams_done - events_before[profile].streams_done,
                errors=events_after[profile].errors - events_before[profile].errors,
            )
        )
    total = sum(e.events for e in engines)
    return Result(
        streams_per_engine=streams,
        time_scale=time_scale,
        warmup_s=warmup,
        window_s=wall,
        sim_cpu_s=sim_cpu,
        sim_user_s=after.sim_user - before.sim_user,
        sim_system_s=after.sim_system - before.sim_system,
        sim_cores=sim_cpu / wall,
        client_cpu_s=client_cpu,
        client_cores=client_cpu / wall,
        events=total,
        events_per_s=total / wall,
        sim_cpu_us_per_event=sim_cpu / total * 1e6 if total else float("nan"),
        target_cores=TARGET_CORES,
        within_target=sim_cpu / wall < TARGET_CORES,
        engines=engines,
    )


# -- reporting ----------------------------------------------------------------


def render_table(result: Result) -> str:
    engines = md_table(
        ["engine", "streams", "events/s", "streams done", "errors"],
        ((f"{e.profile} :{e.port}", e.streams, f"{e.events_per_s:,.0f}", e.streams_done, e.errors) for e in result.engines),
    )
    r = result
    total = md_table(
        ["window s", "sim CPU s (user + sys)", "sim cores", "events/s", "sim CPU µs/event", "client cores", "target", "verdict"],
        [(
            f"{r.window_s:.1f}", f"{r.sim_cpu_s:.2f} ({r.sim_user_s:.2f} + {r.sim_system_s:.2f})", f"{r.sim_cores:.3f}", f"{r.events_per_s:,.0f}",
            f"{r.sim_cpu_us_per_event:.1f}", f"{r.client_cores:.3f}", f"< {r.target_cores} core", "PASS" if r.within_target else "FAIL",
        )],
    )
    return "\n".join([*engines, "", *total])


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument("--streams", type=int, default=128, help="concurrent streams per engine (default %(default)s)")
    add_seconds_arg(parser, 20.0, "measurement window")
    add_warmup_arg(parser, 5.0, "load before the window opens")
    add_time_scale_arg(parser, 1.0)
    add_json_arg(parser, DEFAULT_JSON)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.streams < 1 or args.seconds <= 0 or args.warmup < 0 or args.time_scale <= 0:
        parser.error("--streams must be >= 1, --seconds and --time-scale > 0, --warmup >= 0")
    result = run_trio(measure, args.streams, args.warmup, args.seconds, args.time_scale, said="the simulator was stopped")
    if result is None:
        return 130
    print(render_table(result))
    print(
        f"\nsimulator: {', '.join(PROFILES)} at time scale {args.time_scale:g}, {args.streams} streams each, "
        f"{args.warmup:g} s warm-up; events are SSE 'data: ' lines (256 tokens + finish + [DONE] per stream)"
    )
    save_json(args.json, asdict(result))
    return 0

