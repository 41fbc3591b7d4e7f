"""What the overhead run concludes: the latency each router adds over the engine, tailguard beside vllm-router, the issue's targets."""

from __future__ import annotations

from collections.abc import Sequence

from bench.harness.closed_loop import RunResult
from bench.harness.load import StreamRun
from bench.harness.report import Target
from bench.overhead.records import DIRECT, GRPC, HTTP, PEER, SATURATION_CONCURRENCY, TAILGUARD, Added, OpenRun, VersusPeer

# The issue's targets.
TARGET_RATE = 400.0  # req/s at which the added latency is judged
TARGET_ADDED_P50_MS = 1.0
TARGET_ADDED_P99_MS = 3.0
TARGET_SATURATION = 1_500.0  # req/s
TARGET_EVENTS_PER_S = 30_000.0

# An added latency below this is within the clock's noise: no ratio against it
# (a peer that adds 0.002 ms would make any router look hundreds of times slower).
ADDED_MS_FLOOR = 0.05


def added_latency(runs: Sequence[OpenRun]) -> list[Added]:
    """Each router path's P50 and P99 over the engine called directly at the same rate."""
    direct = {r.rate: r for r in runs if r.path == DIRECT}
    return [Added(r.path, r.rate, r.p50_ms - direct[r.rate].p50_ms, r.p99_ms - direct[r.rate].p99_ms) for r in runs if r.path != DIRECT and r.rate in direct]


def issue_targets(added: Sequence[Added], saturation: Sequence[RunResult], streams: Sequence[StreamRun]) -> list[Target]:
    """The issue's targets at TARGET_RATE (else the highest rate run), judged; reported, not tuned for."""
    targets = []
    rates = sorted({a.rate for a in added})
    rate = TARGET_RATE if TARGET_RATE in rates else (rates[-1] if rates else TARGET_RATE)
    for a in added:
        if a.rate == rate:
            met = a.added_p50_ms < TARGET_ADDED_P50_MS and a.added_p99_ms < TARGET_ADDED_P99_MS
            goal = f"P50 < {TARGET_ADDED_P50_MS:g} ms, P99 < {TARGET_ADDED_P99_MS:g} ms"
            targets.append(Target(f"added latency at {rate:g} req/s, {a.path}", goal, f"P50 {a.added_p50_ms:+.2f} ms, P99 {a.added_p99_ms:+.2f} ms", met))
    for r in saturation:
        if r.target in (HTTP, GRPC):
            measured = f"{r.req_per_s:,.0f} req/s (router {r.cores[TAILGUARD]:.2f} cores)"
            targets.append(Target(f"saturation throughput, {r.target}", f">= {TARGET_SATURATION:,.0f} req/s", measured, r.req_per_s >= TARGET_SATURATION))
    relayed = [s for s in streams if s.target == HTTP]
    if relayed:
        best = max(relayed, key=lambda s: s.chunks_per_s)
        measured = f"{best.chunks_per_s:,.0f} events/s ({best.streams} streams, router {best.cores[TAILGUARD]:.2f} cores)"
        targets.append(Target("SSE events/s relayed per router process", f">= {TARGET_EVENTS_PER_S:,.0f}", measured, best.chunks_per_s >= TARGET_EVENTS_PER_S))
    return targets


def versus_peer(
    added: Sequence[Added], saturation: Sequence[RunResult], streams: Sequence[StreamRun], paced: Sequence[StreamRun]
) -> list[VersusPeer]:
    """tailguard's HTTP and gRPC APIs beside vllm-router, measure by measure (empty without the peer)."""
    rows: list[VersusPeer] = []

    def row(measure: str, better: str, values: dict[str, float | None], floor: float = 0.0) -> None:
        peer = values.get(PEER)
        if peer is None:
            return
        http, grpc = values.get(HTTP), values.get(GRPC)
        rows.append(VersusPeer(measure, better, peer, http, grpc, _ratio(http, peer, floor), _ratio(grpc, peer, floor)))

    for rate in sorted({a.rate for a in added}):
        at = {a.path: a for a in added if a.rate == rate}
        row(f"added P50 ms at {rate:g} req/s", "lower", {p: a.added_p50_ms for p, a in at.items()}, ADDED_MS_FLOOR)
        row(f"added P99 ms at {rate:g} req/s", "lower", {p: a.added_p99_ms for p, a in at.items()}, ADDED_MS_FLOOR)
    sat = {r.target: r for r in saturation}
    row(f"saturation req/s (concurrency {SATURATION_CONCURRENCY})", "higher", {p: r.req_per_s for p, r in sat.items()})
    cpu = {p: r.router_cpu_ms_per_request * 1000 for p, r in sat.items() if r.router_cpu_ms_per_request is not None}
    row("router CPU µs/request at saturation", "lower", dict(cpu))
    for count in sorted({s.streams for s in streams}):
        at_count = {s.target: s for s in streams if s.streams == count}
        row(f"SSE events/s, {count} streams", "higher", {p: s.chunks_per_s for p, s in at_count.items()})
        per_event = {p: s.tailguard_cpu_us_per_chunk for p, s in at_count.items() if s.tailguard_cpu_us_per_chunk is not None}
        row(f"router CPU µs/event, {count} streams", "lower", dict(per_event))
    if paced:
        per_event = {s.target: s.tailguard_cpu_us_per_chunk for s in paced if s.tailguard_cpu_us_per_chunk is not None}
        row(f"router CPU µs/event at engine pace, {paced[0].streams} streams", "lower", dict(per_event))
    return rows


def _ratio(value: float | None, peer: float, floor: float = 0.0) -> float | None:
    """tailguard / peer; None when either is missing or the peer's is not above ``floor`` (no meaningful ratio)."""
    return value / peer if value is not None and peer > floor else None
