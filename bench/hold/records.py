"""The hold benchmark's records: its options, and each phase's numbers as ``hold.json`` names them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import procs
from bench.hold.gc_pauses import GcPauses
from bench.hold.streams import Latencies

SLOW_SIM = "slow sim"  # the slow simulators' names in the pids and the cores start with this


@dataclass(frozen=True)
class Options:
    """The command line's choices, as the report's parameters quote them."""

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


@dataclass
class HoldRun:
    """Phase 1: many HTTP SSE streams held open at once, then closed.

    Deliberately parallel to ``bench.grpc_overhead.records.OpenStreams`` (the
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


@dataclass
class RelayRun:
    """Phase 2: the SSE relay load under one GC threshold, over a window after its warm-up."""

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


@dataclass
class Result:
    """The run: what it ran on, its parameters, and both phases."""

    code: str
    cpu_count: int
    load_average_start: tuple[float, float, float]
    load_average_end: tuple[float, float, float]
    nofile_soft_hard: tuple[int, int]
    parameters: dict[str, object]
    hold: HoldRun | None
    relay: list[RelayRun]
    wall_s: float = 0.0
