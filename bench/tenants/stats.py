"""A set-up's numbers from what it played: each tenant's latencies and outcomes, the engine's busy fraction, tokens served."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.harness.open_loop import Sample, class_stats
from bench.tenants.drive import Played
from bench.tenants.model import TENANTS
from bench.tenants.usage import Served


def busy_fraction(looks: Sequence[tuple[float, int, int]], seats: int, start: float, end: float) -> float:
    """Mean share of the engine's seats running a sequence over the looks taken in [start, end); NaN without one."""
    inside = [running for at, running, _ in looks if start <= at < end]
    return sum(inside) / len(inside) / seats if inside else math.nan


def waiting_in_engine(looks: Sequence[tuple[float, int, int]], start: float, end: float) -> tuple[float, int]:
    """(mean, most) requests waiting inside the engine (behind its running batch) in [start, end)."""
    inside = [waiting for at, _, waiting in looks if start <= at < end]
    return (sum(inside) / len(inside) if inside else math.nan), max(inside, default=0)


def tokens_served(served: Sequence[Served], origin: float, start: float, end: float) -> tuple[int, int, int]:
    """(requests, prompt tokens, completion tokens) of the streams whose usage arrived in [start, end), real s after ``origin``."""
    inside = [s for s in served if start <= s.at - origin < end]
    return len(inside), sum(s.prompt for s in inside), sum(s.completion for s in inside)


@dataclass
class TenantNumbers:
    """One tenant in one set-up; latencies in GPU ms (real divided by the time scale), of the requests that finished."""

    requests: int
    outcomes: dict[str, int]
    ttft_ms: dict[str, float]
    e2e_ms: dict[str, float]
    served_requests: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def ok(self) -> int:
        return self.outcomes.get("ok", 0)

    @property
    def cut(self) -> int:
        return self.outcomes.get("cut", 0)

    @property
    def failed(self) -> int:
        """Refused, timed out or broken: neither finished nor still running at the run's end."""
        return self.requests - self.ok - self.cut

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class SetupNumbers:
    """One set-up: its tenants, the engine's busy fraction and queue inside it, over the measured window."""

    name: str
    description: str
    tenants: dict[str, TenantNumbers]
    busy: float
    engine_waiting_mean: float
    engine_waiting_max: int
    looks: int
    window_s: tuple[float, float]
    wall_s: float
    outcome_codes: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> "status code" -> count, of the failures


def summarise(name: str, description: str, played: Played, seats: int, scale: float, window: tuple[float, float]) -> SetupNumbers:
    """The set-up's numbers over ``window`` (real s after the origin): requests that arrived in it, tokens whose usage came in it."""
    start, end = window
    tenants: dict[str, TenantNumbers] = {}
    codes: dict[str, dict[str, int]] = {}
    for tenant in TENANTS:
        mine = [s for s in played.samples if s.kind == tenant and s.measured]
        if not mine:
            continue
        stats = class_stats(tenant, mine, scale, end - start, None)
        count, prompt, completion = tokens_served(played.served[tenant], played.origin, start, end)
        tenants[tenant] = TenantNumbers(stats.n, stats.outcomes, stats.ttft_ms, stats.e2e_ms, count, prompt, completion)
        codes[tenant] = _failure_codes(mine)
    mean_waiting, most_waiting = waiting_in_engine(played.looks.looks, start, end)
    return SetupNumbers(
        name,
        description,
        tenants,
        busy_fraction(played.looks.looks, seats, start, end),
        mean_waiting,
        most_waiting,
        len(played.looks.looks),
        window,
        played.wall_s,
        codes,
    )


def _failure_codes(samples: Sequence[Sample]) -> dict[str, int]:
    found: dict[str, int] = {}
    for s in samples:
        if s.outcome not in ("ok", "cut"):
            key = f"{s.status} {s.code}" if s.status is not None else s.outcome
            found[key] = found.get(key, 0) + 1
    return found
