"""The overhead benchmark's paths and records: what each phase sends through, and what ``overhead.json`` holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness.closed_loop import RunResult
from bench.harness.load import ProfileSummary, StreamRun
from bench.harness.report import Target

SATURATION_CONCURRENCY = 64
STREAM_MAX_TOKENS = 128  # the interactive class's max_output_tokens: still interactive

DIRECT, PEER, HTTP, GRPC = "direct HTTP", "vllm-router HTTP", "tailguard HTTP", "tailguard gRPC"
TAILGUARD, VLLM_ROUTER = "tailguard", "vllm-router"  # the routers' keys in the pids and the cores
ROUTER_OF = {PEER: VLLM_ROUTER, HTTP: TAILGUARD, GRPC: TAILGUARD}  # the router in each path (direct: none)
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


def router_cores(cores: dict[str, float], path: str, routers: dict[str, str] = ROUTER_OF) -> float:
    """The cores of the path's router (none on the direct path: 0)."""
    router = routers.get(path)
    return cores[router] if router is not None else 0.0
