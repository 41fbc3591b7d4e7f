"""Load pieces of ``python -m bench overhead``: open-loop arrivals, SSE streams, py-spy profiles.

Open loop, because added latency measured in a closed loop at saturation is
the router's queue, not the router: requests are sent at pre-drawn Poisson
arrival times whatever the server does, and each latency runs from the
*scheduled* send time, so a late sender or a slow server both show up. The
HTTP side takes an idle keep-alive connection for each request or opens a new
one (up to a cap), so the client never queues; the gRPC side starts one call
per arrival on one HTTP/2 channel (gRPC multiplexes, so it never queues
either). The lean HTTP client is ``bench.router_overhead.run``'s, the gRPC
client and its asyncio thread are ``bench.grpc_overhead.run``'s, and the SSE
client is ``bench.sim_cpu.run``'s.
"""

from __future__ import annotations

import asyncio
import collections
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import trio

from bench.harness.client import CALL_TIMEOUT_S, LoadCounters, Source, sse_client
from bench.harness.clocks import CpuClock
from bench.harness.traffic import START_DELAY_S, OpenTally
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc

_PY_SPY_GRACE_S = 30.0  # py-spy's own start-up and writing of the file


# -- the machine's CPU --------------------------------------------------------------------


# -- arrivals -------------------------------------------------------------------------


# -- HTTP: Trio, keep-alive pool ---------------------------------------------------------


# -- gRPC: grpc.aio on bench.grpc_overhead.run's asyncio thread ---------------------------------


async def grpc_open_loop(stub: pb_grpc.CompletionsStub, request: pb.ChatRequest, offsets: Sequence[float]) -> OpenTally:
    """The same schedule as ``http_open_loop``, one unary ``Chat`` call per arrival (runs on the asyncio thread)."""
    tally = OpenTally(connections=1)
    start = time.perf_counter() + START_DELAY_S
    pending: set[asyncio.Task[None]] = set()

    async def call(due: float) -> None:
        tally.lags.append(time.perf_counter() - due)
        try:
            await stub.Chat(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            tally.errors += 1
        else:
            tally.latencies.append(time.perf_counter() - due)

    try:
        for offset in offsets:
            due = start + offset
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(call(due))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(set(pending), timeout=CALL_TIMEOUT_S + 1)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    return tally


# -- SSE relay ---------------------------------------------------------------------------


async def sse_streams(
    target: str,
    port: int,
    request: Source,
    streams: int,
    warmup_s: float,
    window_s: float,
    pids: dict[str, int],
    profile: Path | None = None,
    profile_s: float = 0.0,
    router: str | None = "tailguard",
) -> StreamRun:
    """``streams`` concurrent streams, each restarted when it ends (a connection each); events/s over the window.

    ``router`` names the pid whose CPU per event is reported (None: no router, the engine's own stream).

    With ``profile``, the load goes on after the window while py-spy records
    tailguard, so the profile does not perturb the measured numbers.
    """
    counters = LoadCounters()
    extra = profile_s + _PY_SPY_GRACE_S if profile is not None else 0.0
    deadline = trio.current_time() + warmup_s + window_s + extra + 1.0
    async with trio.open_nursery() as load:
        for _ in range(streams):
            load.start_soon(sse_client, port, request, deadline, counters)
        await trio.sleep(warmup_s)
        before, at_start = CpuClock.read(pids), LoadCounters(**asdict(counters))
        await trio.sleep(window_s)
        after, at_end = CpuClock.read(pids), LoadCounters(**asdict(counters))
        if profile is not None:
            await py_spy_speedscope(pids["tailguard"], profile, profile_s)
        load.cancel_scope.cancel()
    done = at_end.streams_done - at_start.streams_done
    events = at_end.events - at_start.events - done  # a finished stream's [DONE] is not a relayed chunk
    wall = after.wall - before.wall
    per_event = after.seconds_since(before)[router] / events * 1e6 if router is not None and events else None
    return StreamRun(target, streams, wall, events, events / wall, done, at_end.errors - at_start.errors, after.cores_since(before), per_event)


# -- profiles ----------------------------------------------------------------------------


async def py_spy_speedscope(pid: int, path: Path, seconds: float) -> bool:
    """``py-spy record --format speedscope`` of ``pid`` for ``seconds``; whether the file was written."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():  # the run's figures stand without it; say why there is no profile
        print("warning: py-spy is not installed (pip install -e '.[bench]'): no router profile", file=sys.stderr)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    command = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", "100", "--format", "speedscope", "--output", str(path)]
    with trio.move_on_after(seconds + _PY_SPY_GRACE_S):
        await trio.run_process(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return path.exists()


@dataclass
class ProfileSummary:
    """Where the sampled CPU went, as shares of the main thread's samples.

    The other threads (Trio's thread cache, the guest-mode I/O poller) are
    almost always blocked in a wait py-spy cannot tell from work; their
    sample counts are kept apart so a reader can check.
    """

    path: str
    samples: int  # main thread
    other_thread_samples: dict[str, int]
    top_self: list[tuple[str, float]]  # leaf frames
    top_inclusive: list[tuple[str, float]]  # frames anywhere on the stack
    self_by_component: list[tuple[str, float]]  # the leaf frame's package or project module
    inclusive_by_component: list[tuple[str, float]]  # packages anywhere on the stack


def summarize_speedscope(path: Path, top: int = 25) -> ProfileSummary:
    """Self and inclusive shares per frame and per component, from a py-spy speedscope file."""
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    names = [f"{f['name']} ({_short_file(f.get('file', '?'))}:{f.get('line', 0)})" for f in frames]
    components = [_component(f.get("file", "")) for f in frames]
    profiles = data["profiles"]
    main = [p for p in profiles if "MainThread" in p.get("name", "")] or profiles
    others = {p.get("name", "?"): len(p.get("samples", [])) for p in profiles if p not in main}
    self_w: collections.Counter[str] = collections.Counter()
    incl_w: collections.Counter[str] = collections.Counter()
    comp_self: collections.Counter[str] = collections.Counter()
    comp_incl: collections.Counter[str] = collections.Counter()
    total = 0
    for profile in main:
        for stack in profile.get("samples", []):
            if not stack:
                continue
            total += 1
            self_w[names[stack[-1]]] += 1
            comp_self[components[stack[-1]]] += 1
            incl_w.update({names[i] for i in stack})
            comp_incl.update({components[i] for i in stack})

    def shares(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(name, n / total) for name, n in counter.most_common(top)] if total else []

    return ProfileSummary(str(path), total, others, shares(self_w), shares(incl_w), shares(comp_self), shares(comp_incl))


def _short_file(file: str) -> str:
    for marker in ("site-packages/", "/lib/python3"):
        if marker in file:
            return file.split(marker, 1)[1].lstrip("/").removeprefix(".11/").removeprefix("1/")
    return file.rsplit("/work/main/", 1)[-1]


def _component(file: str) -> str:
    """The package a frame's file belongs to: a third-party package, a project package, or the stdlib module."""
    if "site-packages/" in file:
        return file.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    for project in ("router", "server", "bench"):
        if f"/{project}/" in file:
            return f"tailguard {project}/"
    if "/lib/python3" in file:
        rest = file.split("/lib/python3", 1)[1].split("/", 1)[-1]
        return "stdlib " + rest.split("/", 1)[0].removesuffix(".py")
    return file or "?"



@dataclass
class StreamRun:
    target: str  # "http-direct" (SSE events from the engine) or "grpc" (chunks through tailguard)
    streams: int
    window_s: float
    chunks: int  # gRPC messages; for http-direct, SSE events without [DONE]
    chunks_per_s: float
    streams_done: int
    errors: int
    cores: dict[str, float]
    tailguard_cpu_us_per_chunk: float | None
