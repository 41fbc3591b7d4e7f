"""Running a set-up: tailguard afresh over the one simulated engine, a tenant mix played, the engine watched.

Scenario 1 plays seeded open-loop arrivals (``bench.tenants.traffic``)
through the harness's ``play``; scenario 2 keeps each tenant's
``outstanding`` requests in flight (closed loops, bounded in count and
time), so both are backlogged. Every request streams and asks for its
usage; everything stops at its bound.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import trio

from bench.harness.open_loop import Sample, play, send_one
from bench.harness.procs import free_ports, start_tailguard
from bench.harness.serving import ready_process
from bench.tenants.model import TENANTS, Options
from bench.tenants.probe import EngineLooks, watch_engine
from bench.tenants.setups import router_config
from bench.tenants.traffic import max_tokens
from bench.tenants.usage import Served, TenantRequests, UsagePool
from tailguard.server.advise.replay.trace import Arrival

_MAX_PER_LOOP = 10_000  # a closed loop's bound besides its deadline
_BACKOFF_S = 0.05  # after a refused request, before the loop's next


@dataclass
class Played:
    """What one set-up's run saw: every request's fate, each tenant's usage, the engine's looks; times from one origin."""

    samples: list[Sample]
    served: dict[str, list[Served]]
    looks: EngineLooks
    origin: float
    wall_s: float


@asynccontextmanager
async def tailguard(
    engine_port: int, options: Options, order: str, weights: Mapping[str, float], queue_timeout: float, tmp: Path, log: IO[bytes]
) -> AsyncIterator[int]:
    """tailguard over the engine: ``queue_order = ORDER``, these weights, ``queue_timeout`` GPU s; stopped on every path. Yields its port."""
    http, grpc = free_ports(2)
    path = tmp / f"tailguard-{order}-{'-'.join(f'{w:g}' for w in weights.values())}.toml"
    path.write_text(router_config(http, grpc, engine_port, options, order=order, weights=weights, queue_timeout=queue_timeout))
    async with ready_process(partial(start_tailguard, config=path, log=log), http, "tailguard"):
        yield http


async def open_loop(port: int, engine_port: int, options: Options, arrivals: Sequence[Arrival], label: str) -> Played:
    """``arrivals`` (kind = tenant) to tailguard on ``port``, each on time; the engine watched meanwhile."""
    pools = {tenant: UsagePool(port) for tenant in TENANTS}
    requests = {tenant: TenantRequests(port, tenant, options.seed, label) for tenant in TENANTS}
    looks = EngineLooks()
    origin = time.perf_counter()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_engine, engine_port, origin, looks)
            samples, wall = await play(
                {tenant: [pool] for tenant, pool in pools.items()},
                lambda _, number, arrival: requests[arrival.kind].request(number, arrival.max_tokens),
                arrivals,
                options.drain,
                label,
                progress=False,
            )
            nursery.cancel_scope.cancel()
    finally:
        for pool in pools.values():
            await pool.aclose()
    return Played(samples, {t: p.served for t, p in pools.items()}, looks, origin, wall)


async def backlogged(port: int, engine_port: int, options: Options, label: str) -> Played:
    """Each tenant keeps ``options.outstanding`` streams in flight until the window's end; requests cut there count nothing."""
    pools = {tenant: UsagePool(port) for tenant in TENANTS}
    requests = {tenant: TenantRequests(port, tenant, options.seed, label) for tenant in TENANTS}
    counters = dict.fromkeys(TENANTS, 0)
    samples: list[Sample] = []
    looks = EngineLooks()
    origin = time.perf_counter()
    end = origin + options.backlog_warmup + options.backlog_seconds

    lengths = {tenant: max_tokens(options.seed, tenant) for tenant in TENANTS}

    async def loop(tenant: str) -> None:
        for _ in range(_MAX_PER_LOOP):
            number, counters[tenant] = counters[tenant], counters[tenant] + 1
            now = time.perf_counter() - origin
            sample = Sample(tenant, now >= options.backlog_warmup, 0.0, request_id=f"{label}-{tenant}-{number}", at=now)
            samples.append(sample)
            await send_one(pools[tenant], requests[tenant].request(number, lengths[tenant]()), sample)
            sample.sent -= origin
            if sample.outcome != "ok":
                await trio.sleep(_BACKOFF_S)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_engine, engine_port, origin, looks)
            with trio.move_on_at(trio.current_time() + end - time.perf_counter()):
                async with trio.open_nursery() as loops:
                    for tenant in TENANTS:
                        for _ in range(options.outstanding):
                            loops.start_soon(loop, tenant)
            nursery.cancel_scope.cancel()
    finally:
        for pool in pools.values():
            await pool.aclose()
    return Played(samples, {t: p.served for t, p in pools.items()}, looks, origin, time.perf_counter() - origin)
