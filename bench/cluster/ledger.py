"""The cluster benchmark's view of the ledger in Redis, and phase 1: what the ledger adds per request."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import coredis

from bench.cluster.lab import KEYS, Lab, stop_all
from bench.harness.client import CHAT_PATH, http_request
from bench.harness.client import ConnectionPool as OpenPool
from bench.harness.procs import process_cpu_seconds
from bench.harness.traffic import http_open_loop, poisson_offsets
from bench.harness.unique import repeated
from tailguard.server.advise.replay.mix import percentile
from tailguard.server.redis_ledger import RedisLedger


class LedgerView:
    """What Redis holds: grants (``RedisLedger.grants``), leases and wants (their keys)."""

    def __init__(self, ledger: RedisLedger, raw: Any, namespace: str, resources: Sequence[str]) -> None:
        self.ledger, self.raw, self.namespace, self.resources = ledger, raw, namespace, list(resources)

    async def grants(self) -> dict[str, dict[str, int]]:
        return {r: await self.ledger.grants(r) for r in self.resources}

    async def alive(self, replica: str) -> bool:
        return bool(await self.raw.exists([f"{self.namespace}:alive:{replica}"]))

    async def keys(self) -> list[str]:
        return sorted(str(k) for k in await self.raw.keys(f"{self.namespace}:*"))

    async def wants(self) -> dict[str, dict[str, str]]:
        found: dict[str, dict[str, str]] = {}
        for key in await self.keys():
            if ":want:" in key:
                found[key] = {str(k): str(v) for k, v in (await self.raw.hgetall(key)).items()}
        return found


# -- phase 1: what the ledger adds per request ---------------------------------------------------


async def ledger_cost(lab: Lab) -> dict[str, Any]:
    """Open-loop short requests, non-streaming, at one rate: tailguard with [cluster] vs without, rounds alternating."""
    o = lab.options
    plain, ledger = await lab.group(["cost-plain"], None, instant=True) + await lab.group(["cost-ledger"], "bench-cost", instant=True)
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "stream": False}
    latencies: dict[str, list[float]] = {"plain": [], "ledger": []}
    cpu: dict[str, float] = {"plain": 0.0, "ledger": 0.0}
    errors = {"plain": 0, "ledger": 0}
    try:
        for round_ in range(o.overhead_rounds):
            order = [("plain", plain), ("ledger", ledger)]
            for name, replica in order if round_ % 2 == 0 else order[::-1]:
                raw = http_request(replica.port, CHAT_PATH, body)  # the same each time: an instant engine, a prompt under one block
                request = repeated(raw.replace(b"\r\n", f"\r\nAuthorization: Bearer {KEYS[0].secret}\r\n".encode(), 1))
                pool = OpenPool(replica.port)
                before = sum(process_cpu_seconds(replica.process.pid))
                tally = await http_open_loop(pool, request, poisson_offsets(o.overhead_rate, o.overhead_seconds, o.seed + round_))
                cpu[name] += sum(process_cpu_seconds(replica.process.pid)) - before
                await pool.aclose()
                latencies[name] += tally.latencies
                errors[name] += tally.errors + tally.dropped
                print(f"  ledger cost round {round_ + 1} {name}: {len(tally.latencies)} ok, p50 {_q(tally.latencies, 50):.2f} ms", file=sys.stderr)
    finally:
        await stop_all([plain, ledger])
    result: dict[str, Any] = {"rate": o.overhead_rate, "seconds_per_round": o.overhead_seconds, "rounds": o.overhead_rounds}
    for name in latencies:
        values = latencies[name]
        result[name] = {"n": len(values), "errors": errors[name], **{f"p{q}_ms": round(_q(values, q), 3) for q in (50, 90, 99)}}
        result[name]["cpu_us_per_request"] = round(cpu[name] / max(len(values), 1) * 1e6, 1)
    result["added_ms"] = {f"p{q}": round(result["ledger"][f"p{q}_ms"] - result["plain"][f"p{q}_ms"], 3) for q in (50, 90, 99)}
    return result


def _q(values: Sequence[float], q: float) -> float:
    """Percentile of seconds, in ms."""
    return percentile(sorted(values), q) * 1000


@asynccontextmanager
async def ledger_view(lab: Lab, namespace: str) -> AsyncIterator[LedgerView]:
    """The ledger of ``namespace`` as Redis holds it, through clients of its own."""
    url = lab.redis.url
    async with RedisLedger(url, namespace) as ledger:
        raw = coredis.Redis.from_url(url, decode_responses=True, stream_timeout=1.0, connect_timeout=1.0)
        async with raw:
            yield LedgerView(ledger, raw, namespace, list(lab.caps()))
