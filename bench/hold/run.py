"""``python -m bench hold``: the router's memory while it holds N HTTP SSE streams, and its GC pauses while it relays.

One tailguard process serves HTTP only (``serve --no-grpc``) from a
temporary config; simulated engines run in other processes, so only the
router's own memory is measured. Two phases:

1. Hold: N streaming chats (default 10,000; max_tokens 256, so the batch
   class) against slow engines (one step every ``--step-ms``, so a stream
   gets a token a step and stays open for minutes), one engine per 1,000
   streams so no engine's seats are the limit, two engines a simulator
   process, pool caps above N. The client is lean: one raw Trio socket per
   stream, the request sent once, read every ``--read-pause`` seconds (a
   slow reader). A stream counts as open once its first SSE event arrived
   (routed, backend connected, relayed end to end). Opening is paced (at
   most 1,024 without a response head). Then the streams are held
   ``--seconds`` while they relay, the client closes them all, and the
   router settles. tailguard's VmRSS, VmHWM, threads and fds
   (``/proc/PID``) at idle, at the peak, held, and after; its CPU; its
   garbage-collector pauses while the streams open and while they relay,
   from ``tailguard_gc_pause_seconds`` on its /metrics (scraped before the
   ramp, after it and after the hold); and the latency of ``/health`` on
   the router and on one engine, polled throughout (a stalled event loop
   shows there). The config's connect and health-check timeouts are wider
   than the defaults (10 s and 5 s), so an engine stalled on a shared
   machine is not ejected mid-ramp; the stalls are reported instead.
2. GC thresholds: for each first-generation threshold in ``--relay-gen0``
   (default 700, 10,000 and 50,000; the older generations' as the server
   sets them, ``--gc-older``), a fresh tailguard relays 256 streaming chats
   (max_tokens 128) from an ``instant`` engine, restarted as they end (the
   SSE relay load of ``bench overhead``); events/s, router CPU per event,
   and the GC pause distribution over the window.

The thresholds are set by this benchmark, not by a server option: the
router runs under a bench-side launcher (:func:`router_child`) whose thread
waits for the server's own ``gc.set_threshold`` at start-up and then sets
the threshold asked for; the child logs the thresholds in force, and the
report quotes that line.

File descriptors: the router needs two per stream (caller and engine), so
N is capped at what its RLIMIT_NOFILE hard limit allows (raised from the
soft limit in this process and in the child); the report says when it did.
Percentiles of GC pauses are bucket bounds (a pause "<= 2 ms"), from the
histogram; the mean is exact.
"""

from __future__ import annotations

import argparse
import collections
import gc
import math
import os
import re
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import httpx
import trio
import trio.lowlevel
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import procs
from bench.harness.cli import add_out_arg, add_seconds_arg, driver_parser, run_and_report
from bench.harness.client import EVENT, HOST, KeepAliveClient, LoadCounters, ProtocolError, sse_client
from bench.harness.clocks import CpuClock, MachineClock
from bench.harness.closed_loop import MESSAGE
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.ramp import Ramp, higher, hold_peak, settle
from bench.harness.report import code_version
from bench.harness.stats import percentile
from bench.harness.toml import TomlTable
from bench.harness.unique import unique_chat

T = TypeVar("T")

RESULTS_DIR = procs.RESULTS_ROOT / "hold"
GC_METRIC = "tailguard_gc_pause_seconds"

HOLD_MAX_TOKENS = 256  # above the interactive class's 128: the batch class, the slow engines' pool
STREAMS_PER_ENGINE = 1_000  # a vLLM engine seats ~256-1,024 sequences
ENGINES_PER_SIMULATOR = 2  # a process each: a simulator holding 10,000 streams stalled for seconds (its own GC)
SLOW_SIM = "slow sim"
MAX_OPENING = 1024  # streams sent but without a response head yet: paces the ramp
FD_MARGIN = 64  # the router's fds besides two per stream: listeners, logs, health checks, the scrape
RAMP_TIMEOUT_S = 60.0
STALL_S = 10.0  # give up the ramp when nothing opened or failed for this long
SETTLE_TIMEOUT_S = 20.0
SETTLE_FD_SLACK = 16
SAMPLE_EVERY_S = 0.5
PROBE_EVERY_S = 0.2
PROBE_TIMEOUT_S = 10.0
SCRAPE_TIMEOUT_S = 30.0
PROBES_MAX = 2_000  # a count bound on each probe loop besides the stop flag
PROGRESS_EVERY_S = 5.0
READ_SIZE = 16 * 1024

RELAY_STREAMS = 256
RELAY_MAX_TOKENS = 128  # the interactive class's max_output_tokens
INTERACTIVE_CAP = 1024
CONNECT_TIMEOUT_S = 10.0  # the router's to the engines (default 2)
HEALTH_CHECK_TIMEOUT_S = 5.0  # (default 1)
THRESHOLD_WAIT_S = 60.0  # the child's wait for the server's own gc.set_threshold
THRESHOLD_LOG = "bench.hold: gc thresholds"
_CHILD_ENTRY = "import sys; from bench.hold.run import router_child; sys.exit(router_child(sys.argv[1:]))"
_ERROR_CODE = re.compile(rb'"code":\s*"([a-z_]+)"')  # the OpenAI error body's code, when it came with the head


@dataclass(frozen=True)
class Options:
    streams: int
    seconds: float  # the hold
    step_ms: float  # the slow engines' step: one token per stream per step
    read_pause: float
    gc_threshold: tuple[int, int, int] | None  # during the hold; None: the server's own
    relay_gen0: Sequence[int]
    gc_older: tuple[int, int]
    relay_warmup: float
    relay_seconds: float
    out: Path


# -- the router under a GC threshold of the benchmark's choosing ----------------------------


def router_child(argv: Sequence[str]) -> int:
    """``tailguard`` CLI in this process, ``argv[0]`` the GC thresholds to impose ("a,b,c", or "server").

    The server sets its thresholds once it listens; a thread here waits for
    that (any change from the interpreter's) and sets ours after it, then
    logs what is in force, for the benchmark to quote. RLIMIT_NOFILE's soft
    limit is raised to the hard one first.
    """
    from tailguard.server.cli import main as tailguard_main

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    procs.raise_nofile(hard)
    wanted = None if argv[0] == "server" else _thresholds(argv[0])
    threading.Thread(target=_impose_threshold, args=(wanted,), name="bench-gc-threshold", daemon=True).start()
    return tailguard_main(list(argv[1:]))


def _impose_threshold(wanted: tuple[int, int, int] | None) -> None:
    initial = gc.get_threshold()
    deadline = time.monotonic() + THRESHOLD_WAIT_S
    while gc.get_threshold() == initial and time.monotonic() < deadline:
        time.sleep(0.01)
    server = gc.get_threshold()
    if wanted is not None:
        gc.set_threshold(*wanted)
    print(f"{THRESHOLD_LOG} {gc.get_threshold()} in force (the server's own: {server}; frozen objects: {gc.get_freeze_count()})", file=sys.stderr, flush=True)


def _thresholds(text: str) -> tuple[int, int, int] | None:
    """``--gc-threshold A,B,C`` (empty: the server's own)."""
    if not text:
        return None
    a, b, c = (int(v) for v in text.split(","))
    return a, b, c


async def start_router(nursery: trio.Nursery, config: Path, thresholds: tuple[int, int, int] | None, log: Path) -> trio.Process:
    """tailguard (HTTP only) under :func:`router_child`; cancelling ``nursery`` terminates it."""
    spec = "server" if thresholds is None else ",".join(map(str, thresholds))
    command = [sys.executable, "-c", _CHILD_ENTRY, spec, "serve", "--config", str(config), "--no-grpc", "--log-level", "WARNING"]
    with log.open("ab") as out:  # the child holds its own descriptor
        return await procs.start_process(nursery, command, out)


async def thresholds_in_force(log: Path, process: trio.Process) -> str:
    """The child's line saying which GC thresholds are in force (bounded wait), e.g. "(700, 20, 100) in force (...)"."""
    with trio.move_on_after(5.0):
        while process.returncode is None:
            for line in procs.log_tail(log).splitlines():
                if line.startswith(THRESHOLD_LOG):
                    return line[len(THRESHOLD_LOG) :].strip()
            await trio.sleep(0.05)
    return "unknown (the router did not say)"


def _in_force(said: str) -> str:
    return said.split(" in force", 1)[0]


# -- GC pauses from /metrics --------------------------------------------------------------


Buckets = dict[str, list[tuple[float, float]]]  # generation -> [(upper bound, cumulative count)], and "sum:G"


Scrape = tuple[Buckets, dict[str, float]] | None  # None: the router did not answer in time


async def scrape_gc(port: int) -> Scrape:
    """``tailguard_gc_pause_seconds`` from the router's /metrics: buckets and sums by generation."""
    began = time.perf_counter()
    try:
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
            page = (await client.get(f"http://{HOST}:{port}/metrics")).text
    except httpx.HTTPError as error:
        print(f"  (no /metrics from the router: {type(error).__name__} after {time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)
        return None
    if time.perf_counter() - began > 1.0:
        print(f"  (scraping /metrics took {time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)
    buckets: Buckets = collections.defaultdict(list)
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        if family.name != GC_METRIC:
            continue
        for sample in family.samples:
            generation = sample.labels["generation"]
            if sample.name.endswith("_bucket"):
                buckets[generation].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                sums[generation] = sample.value
    if not buckets:
        raise RuntimeError(f"the router's /metrics has no {GC_METRIC}: is it older than the GC pause metric?")
    return buckets, sums


@dataclass
class GcPauses:
    """One generation's pauses between two scrapes; percentiles and max are bucket upper bounds."""

    generation: str
    count: int
    per_s: float
    paused_ms_per_s: float  # the time the process stood still, per second of wall time
    mean_ms: float | None
    p50_le_ms: float | None
    p99_le_ms: float | None
    max_le_ms: float | None  # inf: above the largest bucket


def gc_delta(before: Scrape, after: Scrape, wall: float) -> list[GcPauses]:
    """Each generation's pauses between two scrapes (none when either failed)."""
    if before is None or after is None:
        return []
    rows = []
    for generation in sorted(after[0]):
        old = dict(before[0].get(generation, []))
        bounds = [b for b, _ in after[0][generation]]
        cumulative = [c - old.get(b, 0.0) for b, c in after[0][generation]]
        count = int(cumulative[-1]) if cumulative else 0
        total = after[1].get(generation, 0.0) - before[1].get(generation, 0.0)

        def rank(q: float) -> float | None:
            if count == 0:
                return None
            needed = max(1, math.ceil(q * count))
            return next(b for b, c in zip(bounds, cumulative, strict=True) if c >= needed) * 1000

        rows.append(
            GcPauses(generation, count, count / wall, total / wall * 1000, total / count * 1000 if count else None, rank(0.5), rank(0.99), rank(1.0))
        )
    return rows


# -- phase 1: hold N streams ----------------------------------------------------------------


@dataclass
class HoldTally:
    started: int = 0
    waiting: int = 0  # sent, no response head yet
    first_event: int = 0  # ever got their first SSE event
    open: int = 0  # got their first event and still open
    ended: int = 0  # finished on their own while they should have been held
    failed: int = 0
    events: int = 0
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    head_s: list[float] = field(default_factory=list)  # connect + send to the response head
    first_event_s: list[float] = field(default_factory=list)  # connect + send to the first SSE event


async def hold_one(port: int, request: bytes, read_pause: float, tally: HoldTally) -> None:
    """One stream on its own socket, read slowly until cancelled (closing the socket) or it ends."""
    tally.started += 1
    tally.waiting += 1
    waiting, opened = True, False
    began = time.perf_counter()
    try:
        stream = await trio.open_tcp_stream(HOST, port)
        async with stream:
            await stream.send_all(request)
            data = b""
            while waiting:
                more = await stream.receive_some(READ_SIZE)
                if not more:
                    tally.failed += 1
                    tally.failures["closed before the head"] += 1
                    return
                data += more
                if b"\r\n" in data:
                    waiting = False
                    tally.waiting -= 1
                    tally.head_s.append(time.perf_counter() - began)
                    status = data.split(b" ", 2)[1].decode("ascii", "replace")
                    if status != "200":
                        code = _ERROR_CODE.search(data)
                        tally.failed += 1
                        tally.failures[f"HTTP {status} {code.group(1).decode() if code else ''}".strip()] += 1
                        return
            tail = b""
            while True:
                window = tail + data
                fresh = window.count(EVENT) - tail.count(EVENT)
                tally.events += fresh
                if fresh and not opened:
                    opened = True
                    tally.first_event_s.append(time.perf_counter() - began)
                    tally.first_event += 1
                    tally.open += 1
                tail = window[-(len(EVENT) - 1) :]
                await trio.sleep(read_pause)
                data = await stream.receive_some(READ_SIZE)
                if not data:
                    tally.ended += 1
                    return
    except (OSError, trio.BrokenResourceError) as error:
        tally.failed += 1
        tally.failures[type(error).__name__] += 1
    finally:
        if waiting:
            tally.waiting -= 1
        if opened:
            tally.open -= 1


@dataclass
class Latencies:
    """P50 / P99 / max of one kind of wait, ms."""

    what: str
    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    @staticmethod
    def of(what: str, seconds: Sequence[float]) -> Latencies:
        ordered = sorted(seconds)
        if not ordered:
            return Latencies(what, 0, math.nan, math.nan, math.nan)
        return Latencies(what, len(ordered), percentile(ordered, 50) * 1000, percentile(ordered, 99) * 1000, ordered[-1] * 1000)


class HealthProbes:
    """GET /health on each port every PROBE_EVERY_S, each answer's latency: a stalled event loop shows.

    The probes run in a thread with a Trio run of its own, so that the
    client's ten thousand tasks do not delay them: a slow answer is the
    server's (give or take the GIL's 5 ms switch interval).
    """

    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports
        self.latencies: dict[str, list[float]] = {name: [] for name in ports}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), name="bench-health-probes", daemon=True)

    async def __aenter__(self) -> HealthProbes:
        self._thread.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stop.set()
        await trio.to_thread.run_sync(self._thread.join, PROBE_TIMEOUT_S + 5.0)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            for name, port in self.ports.items():
                nursery.start_soon(self._probe, name, port)

    async def _probe(self, name: str, port: int) -> None:
        client = KeepAliveClient(port)
        request = f"GET /health HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
        try:
            for _ in range(PROBES_MAX):
                if self._stop.is_set():
                    return
                began = time.perf_counter()
                with trio.move_on_after(PROBE_TIMEOUT_S):
                    try:
                        await client.exchange(request)
                    except (OSError, trio.BrokenResourceError, ProtocolError):
                        pass
                self.latencies[name].append(time.perf_counter() - began)
                await trio.sleep(PROBE_EVERY_S)
        finally:
            await client.aclose()


@dataclass
class HoldRun:
    """Phase 1: many HTTP SSE streams held open at once, then closed.

    Deliberately parallel to ``bench.grpc_overhead.run.OpenStreams`` (the
    same measurement over gRPC), filled alike; two records because each
    committed JSON names its fields its own way. What they share (ramp, hold,
    settle) is one copy, in ``harness.ramp``.
    """

    requested: int
    target: int  # requested, or fewer when the router's fd limit cannot hold them
    capped_because: str | None
    nofile_hard: int
    engines: int
    step_ms: float
    read_pause_s: float
    gc_thresholds: str
    started: int
    first_event: int
    open_at_hold_end: int
    ended_early: int
    failed: int
    failures: dict[str, int]
    ramp_s: float
    stopped_because: str
    ramp_cores: dict[str, float]
    router_cpu_ms_per_stream_opened: float
    rss_kib_per_open_stream: float
    hold_s: float
    hold_events_per_s: float
    hold_cores: dict[str, float]
    hold_machine_busy_cores: float
    router_cpu_us_per_event: float | None
    gc_ramp: list[GcPauses]
    gc: list[GcPauses]  # while held
    settle_s: float
    fds_left_above_idle: int
    samples: list[procs.ProcSample]  # idle, peak (ramp + hold), held, after
    latencies: list[Latencies]  # the streams' heads and first events; /health of the router and of one engine during ramp + hold
    router_log_tail: str  # its warnings, if any


def write_config(path: Path, http_port: int, grpc_port: int, instant: int, slow: Sequence[int], streams: int) -> None:
    """Interactive pool on the instant engine; batch pool on the slow engines, sized to hold every stream."""
    hold = max(streams, 1) + 64
    per_endpoint = math.ceil(hold / len(slow)) + 16
    interactive = PoolSpec("interactive", [(instant, INTERACTIVE_CAP)], max_concurrency=INTERACTIVE_CAP, max_queue=2 * INTERACTIVE_CAP)
    batch = PoolSpec("batch", [(port, per_endpoint) for port in slow], max_concurrency=hold, max_queue=hold)
    # [server]'s connection cap above the streams. Connect and health-check timeouts wide enough that a
    # simulated engine stalled on this shared machine is not ejected (stalls are reported instead).
    sections: TomlTable = {
        "server": {"max_connections": hold + RELAY_STREAMS + 64},
        "timeouts": {"connect_timeout": CONNECT_TIMEOUT_S, "health_check_timeout": HEALTH_CHECK_TIMEOUT_S},
    }
    path.write_text(tailguard_config(http_port, grpc_port, interactive, batch, sections=sections))


async def hold_phase(
    options: Options, port: int, engine_port: int, tg: trio.Process, pids: dict[str, int], engines: int, thresholds: str, log: Path
) -> HoldRun:
    """Open N streams (paced), hold them while they relay, close them all; sample the router throughout."""
    await trio.sleep(1.0)  # start-up garbage collected, health checks settled
    start = time.perf_counter()
    idle = procs.proc_sample(tg.pid, "idle", start, 0)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fit = (hard - idle.fds - FD_MARGIN) // 2
    target = min(options.streams, fit)
    capped = None if target == options.streams else f"RLIMIT_NOFILE hard limit {hard:,}: {idle.fds} fds at idle + 2 a stream + {FD_MARGIN} spare"
    if capped:
        print(f"  hold: {options.streams:,} streams do not fit; holding {target:,} ({capped})", file=sys.stderr, flush=True)
    payload = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": HOLD_MAX_TOKENS, "stream": True}
    request = unique_chat(port, payload, "hold")
    tally = HoldTally()
    peak = idle
    cpu_start = CpuClock.read(pids)
    gc_start = await scrape_gc(port)
    probes = HealthProbes({"router GET /health": port, "one slow engine GET /health": engine_port})
    async with probes, trio.open_nursery() as holders:
        ramp = Ramp(target, RAMP_TIMEOUT_S, STALL_S, started=start)
        with trio.move_on_after(RAMP_TIMEOUT_S):
            printed_at, sampled_at = start, start
            launched = 0
            while True:
                while launched < target and tally.waiting < MAX_OPENING:
                    holders.start_soon(hold_one, port, request(), options.read_pause, tally)
                    launched += 1
                    if launched % 64 == 0:
                        await trio.lowlevel.checkpoint()  # let the connects go out
                await trio.sleep(0.01)
                now = time.perf_counter()
                if now - sampled_at >= SAMPLE_EVERY_S:
                    peak = higher(peak, procs.proc_sample(tg.pid, "peak (ramp + hold)", start, tally.open))
                    sampled_at = now
                if now - printed_at >= PROGRESS_EVERY_S:
                    print(f"  hold: {tally.open:,} open, {tally.failed} failed, RSS {peak.rss_mib:,.0f} MiB peak", file=sys.stderr, flush=True)
                    printed_at = now
                if ramp.done(tally.first_event + tally.failed + tally.ended, now):
                    break
        stopped_because = ramp.stopped_because
        ramp_s = time.perf_counter() - start
        cpu_ramp, machine = CpuClock.read(pids), MachineClock.read()
        gc_before, events_before = await scrape_gc(port), tally.events
        peak = await hold_peak(tg.pid, peak, start, lambda: tally.open, options.seconds, SAMPLE_EVERY_S)
        gc_after, cpu_held = await scrape_gc(port), CpuClock.read(pids)
        busy = MachineClock.read().cores_since(machine)
        events = tally.events - events_before
        held = procs.proc_sample(tg.pid, "held", start, tally.open)
        peak = higher(peak, held)
        open_at_end = tally.open
        print(f"  hold: {open_at_end:,} open for {options.seconds:g} s, RSS {held.rss_mib:,.0f} MiB; closing them", file=sys.stderr, flush=True)
        holders.cancel_scope.cancel()
    settle_s, after = await settle(
        tg.pid, idle, start, "after", lambda: 0, threads=False, timeout=SETTLE_TIMEOUT_S, fd_slack=SETTLE_FD_SLACK, every=SAMPLE_EVERY_S
    )
    hold_s = cpu_held.wall - cpu_ramp.wall
    router_cpu = cpu_held.seconds_since(cpu_ramp)["tailguard"]
    return HoldRun(
        requested=options.streams,
        target=target,
        capped_because=capped,
        nofile_hard=hard,
        engines=engines,
        step_ms=options.step_ms,
        read_pause_s=options.read_pause,
        gc_thresholds=thresholds,
        started=tally.started,
        first_event=tally.first_event,
        open_at_hold_end=open_at_end,
        ended_early=tally.ended,
        failed=tally.failed,
        failures=dict(tally.failures),
        ramp_s=ramp_s,
        stopped_because=stopped_because,
        ramp_cores=cpu_ramp.cores_since(cpu_start),
        router_cpu_ms_per_stream_opened=cpu_ramp.seconds_since(cpu_start)["tailguard"] / max(tally.first_event, 1) * 1000,
        rss_kib_per_open_stream=(held.rss_mib - idle.rss_mib) * 1024 / max(open_at_end, 1),
        hold_s=hold_s,
        hold_events_per_s=events / hold_s,
        hold_cores=cpu_held.cores_since(cpu_ramp),
        hold_machine_busy_cores=busy,
        router_cpu_us_per_event=router_cpu / events * 1e6 if events else None,
        gc_ramp=gc_delta(gc_start, gc_before, ramp_s),
        gc=gc_delta(gc_before, gc_after, hold_s),
        settle_s=settle_s,
        fds_left_above_idle=max(0, after.fds - idle.fds),
        samples=[idle, replace(peak, moment="peak (ramp + hold)"), held, after],
        router_log_tail=procs.log_tail(log)[-1500:],
        latencies=[
            Latencies.of("stream: connect + send to the response head (as the client saw it)", tally.head_s),
            Latencies.of("stream: connect + send to the first SSE event (as the client saw it)", tally.first_event_s),
            *(Latencies.of(f"{name} (a probe thread)", seconds) for name, seconds in probes.latencies.items()),
        ],
    )


# -- phase 2: SSE relay under each GC threshold ------------------------------------------


@dataclass
class RelayRun:
    gc_thresholds: str  # as the router said it had them
    streams: int
    window_s: float
    events: int
    events_per_s: float
    streams_done: int
    errors: int
    router_cores: float
    router_cpu_us_per_event: float | None
    machine_busy_cores: float
    rss_mib_end: float
    gc: list[GcPauses]


async def relay_window(port: int, pid: int, pids: dict[str, int], warmup: float, seconds: float, thresholds: str) -> RelayRun:
    """RELAY_STREAMS streaming chats restarted as they end; GC pauses and CPU over the window after the warm-up."""
    payload = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": RELAY_MAX_TOKENS, "stream": True}
    request = unique_chat(port, payload, "relay", thresholds)
    counters = LoadCounters()
    deadline = trio.current_time() + warmup + seconds + 30.0  # the clients' own bound; cancelled after the window
    async with trio.open_nursery() as load:
        for _ in range(RELAY_STREAMS):
            load.start_soon(sse_client, port, request, deadline, counters)
        await trio.sleep(warmup)
        gc_before, before, machine = await scrape_gc(port), CpuClock.read(pids), MachineClock.read()
        at_start = LoadCounters(**asdict(counters))
        await trio.sleep(seconds)
        gc_after, after = await scrape_gc(port), CpuClock.read(pids)
        busy = MachineClock.read().cores_since(machine)
        at_end = LoadCounters(**asdict(counters))
        load.cancel_scope.cancel()
    done = at_end.streams_done - at_start.streams_done
    events = at_end.events - at_start.events - done  # a finished stream's [DONE] is not a relayed event
    wall = after.wall - before.wall
    cpu = after.seconds_since(before)["tailguard"]
    return RelayRun(
        gc_thresholds=thresholds,
        streams=RELAY_STREAMS,
        window_s=wall,
        events=events,
        events_per_s=events / wall,
        streams_done=done,
        errors=at_end.errors - at_start.errors,
        router_cores=cpu / wall,
        router_cpu_us_per_event=cpu / events * 1e6 if events else None,
        machine_busy_cores=busy,
        rss_mib_end=procs.proc_sample(pid, "end", 0.0, 0).rss_mib,
        gc=gc_delta(gc_before, gc_after, wall),
    )


# -- the run ------------------------------------------------------------------------------


@dataclass
class Result:
    code: str
    cpu_count: int
    load_average_start: tuple[float, float, float]
    load_average_end: tuple[float, float, float]
    nofile_soft_hard: tuple[int, int]
    parameters: dict[str, object]
    hold: HoldRun | None
    relay: list[RelayRun]
    wall_s: float = 0.0


async def measure(options: Options) -> Result:
    """Start the engines, then a router for the hold and one per GC threshold; tear everything down on every path."""
    engines = max(1, math.ceil(options.streams / STREAMS_PER_ENGINE))
    http_port, grpc_port, instant, *slow = procs.free_ports(3 + engines)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tailguard-hold-") as tmp:
        config = Path(tmp) / "config.toml"
        write_config(config, http_port, grpc_port, instant, slow, options.streams)
        logs = {name: Path(tmp) / f"{name}.log" for name in ("simulator", "slow-simulator", "tailguard")}
        try:
            with logs["simulator"].open("wb") as sim_out, logs["slow-simulator"].open("wb") as slow_out:
                async with trio.open_nursery() as nursery:
                    sim = await procs.start_simulator(nursery, [(instant, "instant")], log=sim_out)
                    slow_args = ["--max-num-seqs", "20000", "--base-ms", f"{options.step_ms:g}", "--kv-cache-tokens", "100000000"]
                    slow_sims: dict[str, trio.Process] = {}
                    for first in range(0, len(slow), ENGINES_PER_SIMULATOR):
                        spec = ",".join(f"{port}:instant" for port in slow[first : first + ENGINES_PER_SIMULATOR])
                        command = [sys.executable, "-m", "tailguard.sim", "--engines", spec, *slow_args]
                        slow_sims[f"{SLOW_SIM} {len(slow_sims) + 1}"] = await procs.start_process(nursery, command, slow_out)
                    await procs.wait_ready(instant, sim, "the simulator")
                    for index, port in enumerate(slow):
                        await procs.wait_ready(port, slow_sims[f"{SLOW_SIM} {index // ENGINES_PER_SIMULATOR + 1}"], "a slow simulator")
                    slow_pids = {name: process.pid for name, process in slow_sims.items()}
                    hold = None
                    if options.streams > 0:
                        hold = await _with_router(
                            config, options.gc_threshold, logs["tailguard"], http_port,
                            lambda tg, pids, said: hold_phase(options, http_port, slow[0], tg, {**pids, **slow_pids}, engines, said, logs["tailguard"]),
                            {"simulator": sim.pid},
                        )  # fmt: skip
                    relay: list[RelayRun] = []
                    for gen0 in options.relay_gen0:
                        thresholds = (gen0, *options.gc_older)
                        relay.append(
                            await _with_router(
                                config, thresholds, logs["tailguard"], http_port,
                                lambda tg, pids, said: relay_window(http_port, tg.pid, pids, options.relay_warmup, options.relay_seconds, said),
                                {"simulator": sim.pid},
                            )
                        )  # fmt: skip
                        r = relay[-1]
                        print(f"  relay gc {_in_force(r.gc_thresholds)}: {r.events_per_s:,.0f} events/s, router {r.router_cores:.2f} cores, "
                              f"{sum(g.count for g in r.gc)} collections", file=sys.stderr, flush=True)  # fmt: skip
                    for name, process in {"the simulator": sim, **slow_sims}.items():
                        if process.returncode is not None:
                            raise RuntimeError(f"{name} exited with {process.returncode} during the run")
                    nursery.cancel_scope.cancel()
        except Exception:
            for name, path in logs.items():
                print(f"--- {name} log ---\n{procs.log_tail(path)}", file=sys.stderr)
            raise
    params: dict[str, object] = {k: (list(v) if isinstance(v, (tuple, list)) else str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()}
    return Result(code_version(), len(os.sched_getaffinity(0)), load_start, os.getloadavg(), resource.getrlimit(resource.RLIMIT_NOFILE), params, hold, relay)


async def _with_router(
    config: Path,
    thresholds: tuple[int, int, int] | None,
    log: Path,
    port: int,
    run: Callable[[trio.Process, dict[str, int], str], Awaitable[T]],
    pids: dict[str, int],
) -> T:
    """Start a router, wait until it listens and says its GC thresholds, ``run(tg, pids, said)``, stop it."""
    async with trio.open_nursery() as nursery:
        tg = await start_router(nursery, config, thresholds, log)
        await procs.wait_ready(port, tg, "tailguard")
        said = await thresholds_in_force(log, tg)
        result = await run(tg, {**pids, "tailguard": tg.pid}, said)
        if tg.returncode is not None:
            raise RuntimeError(f"tailguard exited with {tg.returncode} during the run")
        await procs.stop(tg)
        nursery.cancel_scope.cancel()
    log.write_bytes(b"")  # the next router's lines only
    return result


# -- reporting ----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return "> 200" if math.isinf(value) else f"{value:g}"


def _gc_rows(label: str, rows: Sequence[GcPauses]) -> list[str]:
    return [
        f"| {label} | {g.generation} | {g.count:,} | {g.per_s:.2f} | {_ms(g.mean_ms if g.mean_ms is None else round(g.mean_ms, 2))} "
        f"| {_ms(g.p50_le_ms)} | {_ms(g.p99_le_ms)} | {_ms(g.max_le_ms)} | {g.paused_ms_per_s:.2f} |"
        for g in rows
    ]


def render(result: Result) -> str:
    lines = [f"Measured tailguard code: commit {result.code}.", ""]
    h = result.hold
    if h is not None:
        lines += [
            f"## {h.target:,} concurrent HTTP SSE streams held by one tailguard process (`serve --no-grpc`)",
            "",
        ]
        if h.capped_because:
            lines += [f"Asked for {h.requested:,}; held {h.target:,}: {h.capped_because}.", ""]
        lines += [
            f"Streaming chats (max_tokens {HOLD_MAX_TOKENS}, batch class) to {h.engines} simulated engines in another process, "
            f"a token per stream every {h.step_ms:g} ms; the client reads each socket every {h.read_pause_s:g} s. "
            f"GC thresholds in the router: {h.gc_thresholds}.",
            "",
            "| moment | open streams | RSS MiB | peak RSS (VmHWM) MiB | threads | fds |",
            "|---|---|---|---|---|---|",
        ]
        lines += [f"| {s.moment} | {s.open_streams:,} | {s.rss_mib:,.1f} | {s.peak_rss_mib:,.1f} | {s.threads} | {s.fds:,} |" for s in h.samples]
        lines += [
            "",
            f"Ramp: {h.first_event:,} of {h.target:,} opened in {h.ramp_s:.1f} s ({h.stopped_because}); {h.failed} failed "
            f"{h.failures or ''}, {h.ended_early} ended early; router CPU {h.router_cpu_ms_per_stream_opened:.2f} ms a stream opened; cores while opening: "
            f"{_cores(h.ramp_cores)}. "
            f"RSS {h.rss_kib_per_open_stream:.1f} KiB a held stream over idle. "
            f"Hold: {h.hold_s:.1f} s, {h.hold_events_per_s:,.0f} events/s relayed, cores: {_cores(h.hold_cores)} "
            f"({_ms(None if h.router_cpu_us_per_event is None else round(h.router_cpu_us_per_event, 1))} µs an event), "
            f"machine busy {h.hold_machine_busy_cores:.2f} cores. After closing: settled in {h.settle_s:.1f} s, "
            f"{h.fds_left_above_idle} fds above idle.",
            "",
        ]
        warnings = [line for line in h.router_log_tail.splitlines() if line.strip() and not line.startswith(THRESHOLD_LOG)]
        if warnings:
            lines += ["The router's log, last lines:", "", "```", *warnings[-6:], "```", ""]
        lines += ["| wait (ramp, hold and close) | n | P50 ms | P99 ms | max ms |", "|---|---|---|---|---|"]
        lines += [f"| {w.what} | {w.count:,} | {w.p50_ms:.1f} | {w.p99_ms:.1f} | {w.max_ms:.1f} |" for w in h.latencies]
        lines += ["", "GC pauses while the streams open (ramp) and while they are held and relay (hold):", ""]
        lines += _gc_header() + _gc_rows("ramp", h.gc_ramp) + _gc_rows("hold", h.gc)
        lines.append("")
    if result.relay:
        lines += [
            f"## GC thresholds under the SSE relay load ({RELAY_STREAMS} streaming chats, max_tokens {RELAY_MAX_TOKENS}, instant engine, restarted as they end)",
            "",
            "| thresholds in force | events/s | router cores | router CPU µs/event | errors | machine busy cores | RSS MiB at end |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result.relay:
            per_event = "-" if r.router_cpu_us_per_event is None else f"{r.router_cpu_us_per_event:.1f}"
            lines.append(
                f"| {_in_force(r.gc_thresholds)} | {r.events_per_s:,.0f} | {r.router_cores:.2f} | {per_event} | {r.errors} | {r.machine_busy_cores:.2f} | {r.rss_mib_end:,.0f} |"
            )
        lines += ["", "GC pauses over each window:", ""] + _gc_header()
        for r in result.relay:
            lines += _gc_rows(_in_force(r.gc_thresholds), r.gc)
        lines += ["", f"The router's own words on its thresholds, first relay run: {result.relay[0].gc_thresholds}.", ""]
    soft, hard = result.nofile_soft_hard
    lines.append(
        f"{result.cpu_count} CPUs shared by the simulators, tailguard and this client (and whatever else runs). Load average "
        f"(1/5/15 min) {'/'.join(f'{v:.2f}' for v in result.load_average_start)} at the start, "
        f"{'/'.join(f'{v:.2f}' for v in result.load_average_end)} at the end. RLIMIT_NOFILE soft/hard {soft:,}/{hard:,}. "
        f"GC pause percentiles and max are histogram bucket upper bounds (ms); the mean is exact. Wall time {result.wall_s:.0f} s."
    )
    return "\n".join(lines)


def _cores(cores: dict[str, float]) -> str:
    """Cores by process, the slow simulators summed."""
    summed = {name: value for name, value in cores.items() if not name.startswith(SLOW_SIM)}
    slow = [value for name, value in cores.items() if name.startswith(SLOW_SIM)]
    if slow:
        summed[f"{len(slow)} slow simulators"] = sum(slow)
    return ", ".join(f"{name} {value:.2f}" for name, value in summed.items())


def _gc_header() -> list[str]:
    return [
        "| run | generation | collections | per s | mean ms | P50 <= ms | P99 <= ms | max <= ms | paused ms per s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]


def _ints(text: str) -> list[int]:
    return [int(v.replace("_", "")) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser(__name__, __doc__)
    parser.add_argument("--streams", type=int, default=10_000, help="streams to hold; 0 skips the hold (default %(default)s)")
    add_seconds_arg(parser, 15.0, "how long the streams are held once open")
    parser.add_argument("--step-ms", type=float, default=1000.0, help="the slow engines' step: a token per stream per step (default %(default)s)")
    parser.add_argument("--read-pause", type=float, default=0.5, help="the client's pause between reads of a stream, s (default %(default)s)")
    parser.add_argument("--gc-threshold", type=_thresholds, default=None, help="GC thresholds A,B,C in the router during the hold (default: the server's own)")
    parser.add_argument("--relay-gen0", type=_ints, default="700,10000,50000", help="first-generation GC thresholds to try under SSE relay; empty skips (default %(default)s)")
    parser.add_argument("--gc-older", type=_ints, default="20,100", help="the older generations' thresholds in the relay runs (default %(default)s, the server's)")
    parser.add_argument("--relay-warmup", type=float, default=2.0, help="relay load before each window (default %(default)s)")
    parser.add_argument("--relay-seconds", type=float, default=8.0, help="each relay window (default %(default)s)")
    add_out_arg(parser, RESULTS_DIR, "directory of hold.json and hold.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    gc_threshold: tuple[int, int, int] | None = args.gc_threshold
    relay_gen0: list[int] = args.relay_gen0
    older: list[int] = args.gc_older
    if len(older) != 2 or min([*older, *relay_gen0, 1]) < 1:
        parser.error("--gc-older takes two thresholds; thresholds must be >= 1")
    if args.streams < 0 or min(args.seconds, args.step_ms, args.relay_seconds) <= 0 or min(args.read_pause, args.relay_warmup) < 0:
        parser.error("--streams >= 0; --seconds, --step-ms, --relay-seconds > 0; --read-pause, --relay-warmup >= 0")
    options = Options(
        args.streams, args.seconds, args.step_ms, args.read_pause, gc_threshold, relay_gen0, (older[0], older[1]), args.relay_warmup, args.relay_seconds, args.out
    )
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    procs.raise_nofile(hard)  # children inherit it: the router and the slow engines hold a socket per stream
    # This process holds a socket and a task per stream: its own collections
    # (default thresholds, a big heap) would stall the client and its probes,
    # and show as the router's latency. Its garbage waits for the end.
    gc.freeze()
    gc.disable()
    try:
        return run_and_report(measure, options, said="the simulators and the router were stopped", render=render, out=args.out, stem="hold")
    finally:
        gc.enable()
        gc.unfreeze()

