"""Child processes for the benchmarks: free ports, the simulator, tailguard, readiness, stopping, CPU and memory.

Every benchmark that runs a real process uses these: a child is started in
a Trio nursery (``trio.run_process`` terminates it when the nursery's scope
is cancelled, by an error, Ctrl-C or the end of the run), waited for on
``GET /health``, and read for its CPU and memory from ``/proc``.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import trio

from bench.harness.client import HOST, KeepAliveClient, ProtocolError

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS_ROOT = PROJECT_ROOT / "bench" / "results"  # where every benchmark writes by default


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


async def stop(process: trio.Process) -> None:
    """SIGTERM, then SIGKILL if it has not exited within a few seconds."""
    if process.returncode is None:
        process.terminate()
    with trio.move_on_after(5):
        await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()


_READY_TIMEOUT_S = 30.0

_LOG_TAIL_BYTES = 4000


async def start_simulator(
    nursery: trio.Nursery,
    engines: Sequence[tuple[int, str]],
    time_scale: float = 1.0,
    log: IO[bytes] | None = None,
    extra_args: Sequence[str] = (),
) -> trio.Process:
    """``python -m tailguard.sim`` with (port, profile) engines and ``extra_args``; cancelling ``nursery`` terminates it."""
    spec = ",".join(f"{port}:{profile}" for port, profile in engines)
    command = [sys.executable, "-m", "tailguard.sim", "--engines", spec, "--time-scale", f"{time_scale:g}", *extra_args]
    return await start_process(nursery, command, log)


async def start_tailguard(
    nursery: trio.Nursery,
    config: Path,
    log: IO[bytes] | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> trio.Process:
    """``python -m tailguard.server serve --config CONFIG``; cancelling ``nursery`` terminates it.

    ``env`` adds variables to this process's environment (a backend key the config names by ``api_key_env``).
    """
    command = [sys.executable, "-m", "tailguard.server", "serve", "--config", str(config), "--log-level", "WARNING", *extra_args]
    return await start_process(nursery, command, log, env)


async def start_process(
    nursery: trio.Nursery, command: list[str], log: IO[bytes] | None, env: Mapping[str, str] | None = None
) -> trio.Process:
    """``command`` as a child in ``nursery``, its stderr to ``log``, with ``env`` added to this process's environment."""
    # trio.run_process terminates the child (SIGTERM, then SIGKILL) when its
    # scope is cancelled: by an error, by Ctrl-C, or at the end of the run.
    environ = None if env is None else {**os.environ, **env}
    run = partial(
        trio.run_process, command, cwd=str(PROJECT_ROOT), stdout=subprocess.DEVNULL, stderr=log, check=False, env=environ
    )
    process: trio.Process = await nursery.start(run)
    return process


async def wait_ready(port: int, process: trio.Process, name: str) -> None:
    """Poll GET /health until it answers 200 (tailguard: every pool healthy)."""
    client = KeepAliveClient(port)
    request = f"GET /health HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
    try:
        with trio.fail_after(_READY_TIMEOUT_S):
            while True:
                if process.returncode is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} before it was ready")
                try:
                    if (await client.exchange(request)).status == 200:
                        return
                except (OSError, trio.BrokenResourceError, ProtocolError):
                    pass
                await trio.sleep(0.05)
    except trio.TooSlowError:
        raise RuntimeError(f"{name} on port {port} was not ready within {_READY_TIMEOUT_S:g} s") from None
    finally:
        await client.aclose()


async def wait_listening(port: int, process: trio.Process, name: str, timeout: float = _READY_TIMEOUT_S) -> None:
    """Until something accepts on 127.0.0.1:``port``: a child that speaks no HTTP (bounded by ``timeout``)."""
    with trio.fail_after(timeout):
        while True:
            if process.returncode is not None:
                raise RuntimeError(f"{name} exited with {process.returncode} before it listened")
            try:
                stream = await trio.open_tcp_stream(HOST, port)
            except OSError:
                await trio.sleep(0.05)
                continue
            await stream.aclose()
            return


def log_tail(path: Path) -> str:
    """The end of a child's log, to show when it failed."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-_LOG_TAIL_BYTES:].decode("utf-8", "replace")


def add_serve_arg(parser: argparse.ArgumentParser) -> None:
    """``--serve-arg``: what every benchmark that starts tailguard passes on to ``tailguard serve``."""
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `tailguard serve`, repeatable; write it as --serve-arg=--no-grpc",
    )


@dataclass(frozen=True)
class ProcSample:
    """tailguard's footprint at one moment."""

    moment: str
    at_s: float  # since the phase began
    open_streams: int
    rss_mib: float
    peak_rss_mib: float  # VmHWM: the high-water mark so far
    threads: int
    fds: int


def read_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {name: value.strip() for name, _, value in (line.partition(":") for line in f)}


def proc_sample(pid: int, moment: str, since: float, open_streams: int) -> ProcSample:
    status = read_status(pid)
    return ProcSample(
        moment=moment,
        at_s=time.perf_counter() - since,
        open_streams=open_streams,
        rss_mib=int(status["VmRSS"].split()[0]) / 1024,
        peak_rss_mib=int(status["VmHWM"].split()[0]) / 1024,
        threads=int(status["Threads"]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
    )


def raise_nofile(wanted: int) -> int:
    """Raise this process's RLIMIT_NOFILE (children inherit it); return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return soft
    if hard != resource.RLIM_INFINITY and hard < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))  # needs CAP_SYS_RESOURCE
            return wanted
        except (ValueError, OSError):
            wanted = hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
