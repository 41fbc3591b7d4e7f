"""What the budget benchmark's modules share: its options, its one key, the timeline's phases, one request's record."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.procs import RESULTS_ROOT
from bench.harness.report import RunRecord

RESULTS = RESULTS_ROOT / "budgets"

NAMESPACE = "bench-budgets"

KEY_NAME = "shared"

KEY_SECRET = "tg-bench-budgets-shared-0123456789"  # the benchmark's own made-up key

POOL = "chat"

MAX_QUEUE = 256

HEALTH_POLL_S = 0.25

CALL_TIMEOUT_S = 60.0  # one request's client-side bound: a queue_timeout and ~6 s of decoding, with room


@dataclass(frozen=True)
class Options:
    duration: float  # s of arrivals
    kill_at: float | None  # s: kill -9 of the victim (None: no kill)
    outage_at: float | None  # s: redis-server SIGSTOPped (None: no outage)
    outage_s: float  # s it stays stopped
    load: float  # offered tokens over the budget's rate
    budget: int  # the key's tokens_per_minute
    prompt_tokens: int
    max_tokens: int
    spread: tuple[float, ...]  # each replica's share of the arrivals
    victim: int  # index of the replica killed
    static_share: float
    lease_ttl: float
    sync_interval: float
    queue_timeout: float
    seats: int  # the pool's and the engine's max_concurrency: never what binds
    time_scale: float
    drain: float  # s after the last arrival before the run is cut
    seed: int
    out: Path

    @property
    def replicas(self) -> int:
        return len(self.spread)


def replica_name(index: int) -> str:
    return f"r{index}"


@dataclass(frozen=True)
class Phase:
    """A span of the timeline: ``[start, end)`` s from the first arrival's origin."""

    name: str
    start: float
    end: float


def phases(o: Options) -> list[Phase]:
    """The run cut at its events: steady, after the kill, during the outage, after it (those that happen)."""
    cuts: list[tuple[float, str]] = [(0.0, "steady")]
    if o.kill_at is not None:
        cuts.append((o.kill_at, "after kill"))
    if o.outage_at is not None:
        cuts += [(o.outage_at, "Redis stopped"), (o.outage_at + o.outage_s, "after outage")]
    cuts = sorted(c for c in cuts if c[0] < o.duration)
    ends = [at for at, _ in cuts[1:]] + [o.duration]
    return [Phase(name, start, end) for (start, name), end in zip(cuts, ends) if end > start]


@dataclass
class Sent:
    """One request as the client saw it; times in s from the run's origin."""

    number: int
    replica: str
    at: float  # due
    reserve: int  # what admission reserves: the prompt (the simulator's count) and max_tokens
    sent: float = math.nan
    ended: float = math.nan
    status: int = 0  # 0: no answer (the connection failed, or the run's bound cut it)
    code: str = ""  # an error's error.code, or the transport's exception
    tokens: int = 0  # a 200's usage: prompt_tokens + completion_tokens
    retry_after: float | None = None


Trail = list[tuple[float, str, str]]  # (s, /health status, cluster mode) at each change


@dataclass
class Result(RunRecord):
    """A run's numbers (``numbers.summarise``), /health trails and every request: what ``report.render`` writes out."""

    summary: dict[str, Any] = field(default_factory=dict)
    health: dict[str, Trail] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    load_average: dict[str, list[float]] = field(default_factory=dict)
    wall_s: float = 0.0
