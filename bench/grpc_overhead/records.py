"""The gRPC overhead benchmark's records: its options, and each phase's numbers as ``grpc_overhead.json`` names them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.harness import procs
from bench.harness.closed_loop import RunResult
from bench.harness.load import StreamRun
from bench.harness.report import Target


@dataclass
class OpenStreams:
    """Phase 3: many gRPC streams held open at once, then cancelled.

    Deliberately parallel to ``bench.hold.records.HoldRun`` (the same
    measurement over HTTP SSE): both are filled field by field from a stream
    tally, CPU clocks and ``harness.ramp``'s samples, so their constructors
    look alike. They stay two records because the committed JSON of each
    (grpc_overhead.json, hold/hold.json) names its fields its own way; the
    ramp, hold and settle rules they share are one copy, in ``harness.ramp``.
    """

    requested: int
    max_tokens: int
    endpoints: int  # slow engines behind the batch pool
    slow_engine_args: list[str]
    started: int
    routed: int
    first_chunk: int
    open_at_hold_end: int
    ended_early: int
    failed: int
    error_codes: dict[str, int]
    ramp_s: float
    ramp_progress: list[tuple[float, int]]  # (seconds, streams open), every PROGRESS_EVERY_S
    tailguard_cpu_ms_per_stream_opened: float
    rss_kib_per_open_stream: float
    hold_s: float
    hold_chunks_per_s: float
    hold_cores: dict[str, float]
    cancel_s: float
    settle_s: float
    threads_back_to_baseline: bool
    fds_back_to_baseline: bool
    fds_left_above_baseline: int
    unary_call_ok_after: bool
    samples: list[procs.ProcSample]  # before, during the ramp (peak), held, after
    stopped_because: str


@dataclass
class Result:
    """The run: the machine, the client, and the three phases."""

    cpu_count: int
    channels: int
    nofile_limit: int
    unary_message: str
    unary_max_tokens: int
    unary: list[RunResult]
    streaming: list[StreamRun]
    open_streams: OpenStreams | None
    targets: list[Target]
    py_spy_profiles: list[str]
    wall_s: float = 0.0


@dataclass(frozen=True)
class Options:
    """The command line's choices."""

    streams_open: int
    open_endpoints: int
    channels: int
    py_spy_dir: Path | None
