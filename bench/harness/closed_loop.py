"""Closed loops: a fixed number of keep-alive clients, each sending its next request as the last one ends; latency and CPU per run.

A closed loop slows down with the server, so it measures what a request
costs (latency, CPU per request) rather than queueing; ``router_overhead``,
``overhead``, ``grpc_overhead`` and ``workers`` run it (gRPC's twin is
``bench.harness.grpc``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from bench.harness.client import KeepAliveClient, ProtocolError, Source
from bench.harness.clocks import CpuClock
from bench.harness.report import cores_cell, latency_ms, maybe, md_table

_ERROR_BACKOFF_S = 0.05


@dataclass
class Budget:
    """How many requests a phase may still start, and until when (perf_counter)."""

    remaining: int
    deadline: float

    def take(self) -> bool:
        if self.remaining <= 0 or time.perf_counter() >= self.deadline:
            return False
        self.remaining -= 1
        return True


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)  # seconds
    errors: int = 0


async def closed_loop_worker(client: KeepAliveClient, request: Source, budget: Budget, tally: Tally) -> None:
    """Send requests back to back on one connection while the budget lasts, each ``request()``'s bytes."""
    while budget.take():
        start = time.perf_counter()
        try:
            reply = await client.exchange(request())
        except (OSError, trio.BrokenResourceError, ProtocolError):
            tally.errors += 1
            await trio.sleep(_ERROR_BACKOFF_S)
            continue
        if reply.status == 200:
            tally.latencies.append(time.perf_counter() - start)
        else:
            tally.errors += 1


async def closed_loop(clients: Sequence[KeepAliveClient], request: Source, count: int, seconds: float) -> tuple[Tally, float]:
    """Run ``count`` requests (or ``seconds``, whichever ends first) over ``clients``; (tally, wall s)."""
    tally = Tally()
    start = time.perf_counter()
    budget = Budget(count, start + seconds)
    with trio.move_on_after(seconds + 10):  # a hung response must not hang the run
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(closed_loop_worker, client, request, budget, tally)
    return tally, time.perf_counter() - start


@dataclass
class RunResult:
    target: str  # "direct" or "tailguard"
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    req_per_s: float
    cores: dict[str, float]  # CPU cores used during the run: simulator, tailguard, client
    router_cpu_ms_per_request: float | None

    @classmethod
    def from_tally(
        cls,
        target: str,
        concurrency: int,
        tally: Tally,
        wall: float,
        before: CpuClock,
        after: CpuClock,
        *,
        through_router: bool,
        router: str = "tailguard",
    ) -> RunResult:
        """Percentiles and CPU of one measured loop (the CPU of ``router``, a key of the pids, only when it was in the path)."""
        latencies = sorted(tally.latencies)
        n = len(latencies)
        return cls(
            target=target,
            concurrency=concurrency,
            requests=n,
            errors=tally.errors,
            wall_s=wall,
            **latency_ms(latencies),
            req_per_s=n / wall,
            cores=after.cores_since(before),
            router_cpu_ms_per_request=after.seconds_since(before)[router] / n * 1000 if through_router and n else None,
        )


@dataclass(frozen=True)
class Plan:
    concurrencies: Sequence[int]
    requests: Callable[[int], int]  # requests for one run at this concurrency
    seconds: float
    warmup: int
    serve_args: Sequence[str] = ()
    tracing: float | None = None  # [tracing]'s sample_ratio, spans exported to a receiver run here; None: off
MESSAGE = "What is the capital of France?"
MAX_TOKENS = 16


async def measure_closed_loop(
    target: str, port: int, request: Source, concurrency: int, plan: Plan, pids: dict[str, int], router: str | None = None
) -> RunResult:
    """Warm the connections up, then measure one closed loop on them.

    ``router`` names the pid whose CPU is the router's (default: tailguard's,
    when ``target`` is "tailguard"); None and another target: no router.
    """
    clients = [KeepAliveClient(port) for _ in range(concurrency)]
    try:
        await closed_loop(clients, request, max(plan.warmup, concurrency), plan.seconds)
        before = CpuClock.read(pids)
        tally, wall = await closed_loop(clients, request, plan.requests(concurrency), plan.seconds)
        after = CpuClock.read(pids)
    finally:
        for client in clients:
            await client.aclose()
    if router is None and target == "tailguard":
        router = "tailguard"
    return RunResult.from_tally(target, concurrency, tally, wall, before, after, through_router=router is not None, router=router or "tailguard")


def runs_table(runs: Sequence[RunResult], header: Sequence[str], ms: str) -> list[str]:
    """Closed-loop runs, a row each: HTTP requests here, gRPC calls in ``grpc_overhead`` (its own header, latency digits ``ms``)."""
    return md_table(header, (
        (r.target, r.concurrency, f"{r.requests:,}", r.errors, format(r.p50_ms, ms), format(r.p99_ms, ms), f"{r.req_per_s:,.0f}", cores_cell(r.cores),
         maybe(r.router_cpu_ms_per_request, ".3f"))
        for r in runs
    ))
