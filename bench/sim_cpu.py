"""``python -m bench.sim_cpu``: how much CPU the simulator burns streaming to many clients.

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
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import trio

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "sim_cpu.json"
PROFILES = ("latency", "throughput")
HOST = "127.0.0.1"
TARGET_CORES = 0.5  # the simulator's CPU budget for this load

EVENT = b"data: "
DONE = b"data: [DONE]"
_TAIL = len(DONE) - 1  # bytes kept between reads so no marker is split unseen
_READ_SIZE = 64 * 1024
_HEALTH_TIMEOUT_S = 15.0
_ERROR_BACKOFF_S = 0.1
_MAX_REQUESTS_PER_CLIENT = 10_000  # a bound on every client loop besides the deadline


@dataclass
class LoadCounters:
    """What the clients of one engine have received so far (cumulative)."""

    events: int = 0  # SSE events ("data: " lines), including the finish event and [DONE]
    streams_started: int = 0
    streams_done: int = 0
    errors: int = 0


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


def free_ports(count: int) -> list[int]:
    """Ports the kernel hands out now; all held open together so they differ."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def process_cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()  # comm may hold spaces; it ends at the last ')'
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    ticks = os.sysconf("SC_CLK_TCK")
    return utime / ticks, stime / ticks


def sample(pid: int) -> CpuSample:
    user, system = process_cpu_seconds(pid)
    return CpuSample(trio.current_time(), user, system, time.process_time())


async def start_simulator(
    nursery: trio.Nursery, ports: Sequence[int], time_scale: float
) -> trio.Process:
    """Run ``python -m tailguard.sim`` in ``nursery``; cancelling the nursery terminates it."""
    engines = ",".join(f"{port}:{profile}" for port, profile in zip(ports, PROFILES, strict=True))
    command = [sys.executable, "-m", "tailguard.sim", "--engines", engines, "--time-scale", str(time_scale)]
    process: trio.Process = await nursery.start(
        partial(trio.run_process, command, cwd=str(PROJECT_ROOT), stdout=subprocess.DEVNULL, check=False)
    )
    return process


async def wait_healthy(port: int, process: trio.Process) -> None:
    """Poll GET /health until it answers 200; fail if the simulator exits first."""
    request = f"GET /health HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n\r\n".encode()
    with trio.fail_after(_HEALTH_TIMEOUT_S):
        while True:
            if process.returncode is not None:
                raise RuntimeError(f"the simulator exited with {process.returncode} before it was healthy")
            try:
                stream = await trio.open_tcp_stream(HOST, port)
                async with stream:
                    await stream.send_all(request)
                    reply = await stream.receive_some(_READ_SIZE)
                if reply.startswith(b"HTTP/1.1 200"):
                    return
            except OSError:
                pass
            await trio.sleep(0.05)


async def stop(process: trio.Process) -> None:
    """SIGTERM, then SIGKILL if it has not exited within a few seconds."""
    if process.returncode is None:
        process.terminate()
    with trio.move_on_after(5):
        await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()


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


async def read_stream(stream: trio.SocketStream, counters: LoadCounters) -> bool:
    """Count SSE events until [DONE]; False if the response is not a 200 or ends early."""
    tail = b""
    first = True
    while True:
        data = await stream.receive_some(_READ_SIZE)
        if not data:
            return False
        if first:
            if not data.startswith(b"HTTP/1.1 200"):
                return False
            first = False
        window = tail + data
        # Markers wholly inside the tail were counted on the previous read.
        counters.events += window.count(EVENT) - tail.count(EVENT)
        if DONE in window:
            return True
        tail = window[-_TAIL:]


async def client(port: int, request: bytes, deadline: float, counters: LoadCounters) -> None:
    """One connection at a time: stream a completion to its end, then start the next."""
    with trio.move_on_at(deadline):
        for _ in range(_MAX_REQUESTS_PER_CLIENT):
            ok = False
            try:
                stream = await trio.open_tcp_stream(HOST, port)
                async with stream:
                    await stream.send_all(request)
                    counters.streams_started += 1
                    ok = await read_stream(stream, counters)
            except (OSError, trio.BrokenResourceError):
                ok = False
            if ok:
                counters.streams_done += 1
            else:
                counters.errors += 1
                await trio.sleep(_ERROR_BACKOFF_S)


# -- the run ------------------------------------------------------------------


async def measure(streams: int, warmup: float, seconds: float, time_scale: float) -> Result:
    """Start the simulator, load it, measure its CPU over the window, tear it all down."""
    ports = free_ports(len(PROFILES))
    counters = {profile: LoadCounters() for profile in PROFILES}
    async with trio.open_nursery() as nursery:
        process = await start_simulator(nursery, ports, time_scale)
        try:
            for port in ports:
                await wait_healthy(port, process)
            deadline = trio.current_time() + warmup + seconds + 1.0
            async with trio.open_nursery() as load:
                for port, profile in zip(ports, PROFILES, strict=True):
                    request = completion_request(port)
                    for _ in range(streams):
                        load.start_soon(client, port, request, deadline, counters[profile])
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
    lines = [
        "| engine | streams | events/s | streams done | errors |",
        "|---|---|---|---|---|",
    ]
    for e in result.engines:
        lines.append(f"| {e.profile} :{e.port} | {e.streams} | {e.events_per_s:,.0f} | {e.streams_done} | {e.errors} |")
    lines += [
        "",
        "| window s | sim CPU s (user + sys) | sim cores | events/s | sim CPU µs/event | client cores | target | verdict |",
        "|---|---|---|---|---|---|---|---|",
        f"| {result.window_s:.1f} | {result.sim_cpu_s:.2f} ({result.sim_user_s:.2f} + {result.sim_system_s:.2f}) "
        f"| {result.sim_cores:.3f} | {result.events_per_s:,.0f} "
        f"| {result.sim_cpu_us_per_event:.1f} | {result.client_cores:.3f} | < {result.target_cores} core "
        f"| {'PASS' if result.within_target else 'FAIL'} |",
    ]
    return "\n".join(lines)


def write_json(path: Path, result: Result) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(result), indent=2) + "\n")


def interrupted(error: BaseException) -> bool:
    """Whether ``error`` is Ctrl-C, possibly wrapped in Trio's exception groups."""
    if isinstance(error, BaseExceptionGroup):
        _, rest = error.split(KeyboardInterrupt)
        return rest is None
    return isinstance(error, KeyboardInterrupt)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=128, help="concurrent streams per engine (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window (default %(default)s)")
    parser.add_argument("--warmup", type=float, default=5.0, help="load before the window opens (default %(default)s)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the simulator's --time-scale (default %(default)s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results (default %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.streams < 1 or args.seconds <= 0 or args.warmup < 0 or args.time_scale <= 0:
        parser.error("--streams must be >= 1, --seconds and --time-scale > 0, --warmup >= 0")
    try:
        result = trio.run(measure, args.streams, args.warmup, args.seconds, args.time_scale)
    except BaseException as error:
        if not interrupted(error):
            raise
        print("interrupted; the simulator was stopped", file=sys.stderr)
        return 130
    print(render_table(result))
    print(
        f"\nsimulator: {', '.join(PROFILES)} at time scale {args.time_scale:g}, {args.streams} streams each, "
        f"{args.warmup:g} s warm-up; events are SSE 'data: ' lines (256 tokens + finish + [DONE] per stream)"
    )
    write_json(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
