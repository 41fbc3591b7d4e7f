"""The cluster benchmark's affinity phase: does one prefix land on one engine whichever replica placed it (issue 22)?

Prefix-affinity placement is a rendezvous hash of the prompt's leading
blocks over the pool's endpoint URLs: every replica computes it alone, with
no round trip to Redis or to each other, so a tenant's system prompt should
reach the same engine from all of them. Here ``--replicas`` replicas sharing
one ``[cluster]`` namespace front a pool of ``AFFINITY_ENGINES`` instant
engines (no GPU cost: only the choice is measured). A client per replica
sends its share of the requests one at a time (so a replica never has two in
flight and the load bound never spills one: what is left to disagree is the
hash), each a tenant's shared system prompt plus a question unique to the
request. Each replica's access log says which endpoint served each request;
the share is the requests that ran on their tenant's most common engine.

Redis's own command counter, read before and after (less the replicas'
idle syncs, measured for a second with no traffic), gives the ledger's
commands per request: placement adds none if it matches a run without
affinity (``placement = "least_loaded"``, when the config knows the key).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import coredis
import trio

from bench.cluster.lab import KEYS, MAX_QUEUE, Lab
from bench.harness.client import CHAT_PATH, KeepAliveClient, ProtocolError, http_request
from bench.harness.config import PoolSpec
from bench.harness.open_loop import with_request_id
from bench.harness.replicas import Replica, stop_all
from bench.harness.stats import percentile
from tailguard.router.config import PoolConfig
from tailguard.server.advise.replay.mix import long_document, request_nonce

AFFINITY_ENGINES = 4
NAMESPACE = "bench-affinity"
TENANTS = 32
SYSTEM_CHARS = 1_200  # ~300 tokens: past the 16 blocks (1,024 characters) the prefix key reads, and interactive
QUESTION = "Which of the points above matters most, and why?"
TARGET_SHARE = 0.99


def tenant_prompt(tenant: int) -> str:
    """Tenant ``tenant``'s system prompt: the same text for every request of that tenant, another for every other."""
    return f"You are the assistant of tenant {tenant}. " + long_document(SYSTEM_CHARS, seed=1_000 + tenant)


def body(tenant: int, number: int, seed: int) -> dict[str, object]:
    """Request ``number``: its tenant's system prompt, then a question unique to it (a nonce first)."""
    messages = [
        {"role": "system", "content": tenant_prompt(tenant)},
        {"role": "user", "content": request_nonce(number, seed=seed) + QUESTION},
    ]
    return {"messages": messages, "max_tokens": 8, "stream": False, "ignore_eos": True}


def knows_placement() -> bool:
    """Whether this tailguard's pools take ``placement`` (prefix-affinity placement wired in)."""
    return "placement" in {f.name for f in fields(PoolConfig)}


async def affinity_run(lab: Lab, requests: int) -> dict[str, Any]:
    """The default placement, and ``least_loaded`` where the config knows it, in the order ABBA (drift falls on both); fresh replicas each."""
    order: list[str | None] = [None, "least_loaded", "least_loaded", None] if knows_placement() else [None]
    runs = [await _one_run(lab, requests, placement, number) for number, placement in enumerate(order, 1)]
    return {"tenants": TENANTS, "engines": AFFINITY_ENGINES, "requests": requests, "target_share": TARGET_SHARE, "runs": runs}


async def _one_run(lab: Lab, requests: int, placement: str | None, number: int) -> dict[str, Any]:
    o = lab.options
    extra = {} if placement is None else {"placement": placement}
    engines = [(port, 64) for port in lab.affinity]
    pools = (PoolSpec("interactive", engines, 64 * len(engines), MAX_QUEUE, extra), PoolSpec("batch", [(lab.instant[1], 256)], 256, MAX_QUEUE))
    label = placement or "default"
    names = [f"a{i}-{label}-{number}" for i in range(o.replicas)]
    replicas = await lab.group(names, f"{NAMESPACE}-{number}", 1 / o.replicas, pools=pools, access_log=True)
    rng = random.Random(o.seed)
    tally = _Tally([rng.randrange(TENANTS) for _ in range(requests)], o.seed)
    idle_per_s = await _idle_commands_per_s(lab)
    commands_before, started = await _redis_commands(lab), time.perf_counter()
    try:
        with trio.move_on_after(60 + requests * 0.05):  # bounded: a hung replica must not hang the run
            async with trio.open_nursery() as nursery:
                for index, replica in enumerate(replicas):
                    nursery.start_soon(_client, replica, range(index, requests, len(replicas)), tally)
        commands, wall = await _redis_commands(lab) - commands_before, time.perf_counter() - started
    finally:
        await stop_all(replicas)  # the access logs are complete once the replicas have exited
    served = _served(replicas)
    print(f"  affinity ({label}): {len(served)} of {len(tally.sent)} requests found in the access logs", file=sys.stderr)
    per_request = round((commands - idle_per_s * wall) / max(len(tally.sent), 1), 2)
    found = {
        "placement": label, "errors": tally.errors, "wall_s": round(wall, 2), "redis_commands": commands,
        "redis_idle_commands_per_s": round(idle_per_s), "redis_commands_per_request": per_request,
        "latency_ms": {f"p{q}": round(percentile(sorted(tally.latencies), q) * 1000, 2) for q in (50, 99)},
    }
    return found | share(tally.sent, served)


@dataclass
class _Tally:
    """One run's requests as the clients sent them."""

    tenants: Sequence[int]  # request number -> its tenant
    seed: int
    sent: dict[str, tuple[int, str]] = field(default_factory=dict)  # request id -> (tenant, replica)
    latencies: list[float] = field(default_factory=list)  # s, the 200s
    errors: int = 0


async def _client(replica: Replica, numbers: Sequence[int], tally: _Tally) -> None:
    """One request at a time on one connection to ``replica``."""
    client = KeepAliveClient(replica.port)
    auth = f"\r\nAuthorization: Bearer {KEYS[0].secret}\r\n".encode()
    try:
        for number in numbers:
            request_id, tenant = f"affinity-{number}", tally.tenants[number]
            raw = http_request(replica.port, CHAT_PATH, body(tenant, number, tally.seed)).replace(b"\r\n", auth, 1)
            tally.sent[request_id] = (tenant, replica.name)
            start = time.perf_counter()
            try:
                reply = await client.exchange(with_request_id(raw, request_id))
            except (OSError, trio.BrokenResourceError, ProtocolError):
                tally.errors += 1
                continue
            if reply.status == 200:
                tally.latencies.append(time.perf_counter() - start)
            else:
                tally.errors += 1
    finally:
        await client.aclose()


def _served(replicas: Sequence[Replica]) -> dict[str, str]:
    """Request id -> the endpoint that served it, from every replica's access log."""
    served: dict[str, str] = {}
    for replica in replicas:
        for line in replica.log.read_bytes().splitlines():
            if b'"tailguard.access"' not in line:
                continue
            try:
                row = json.loads(line)
                served[str(row["request_id"])] = str(row["endpoint"])
            except (ValueError, KeyError, TypeError):
                continue
    return served


def share(sent: dict[str, tuple[int, str]], served: dict[str, str]) -> dict[str, Any]:
    """How many requests ran on their tenant's most common engine, and how the engines were loaded."""
    by_tenant: dict[int, Counter[str]] = {}
    by_replica: dict[tuple[int, str], Counter[str]] = {}
    for request_id, (tenant, replica) in sent.items():
        endpoint = served.get(request_id)
        if endpoint:
            by_tenant.setdefault(tenant, Counter())[endpoint] += 1
            by_replica.setdefault((tenant, replica), Counter())[endpoint] += 1
    joined = sum(sum(c.values()) for c in by_tenant.values())
    on_home = sum(c.most_common(1)[0][1] for c in by_tenant.values())
    homes = {tenant: c.most_common(1)[0][0] for tenant, c in by_tenant.items()}
    agreeing = sum(1 for (tenant, _), c in by_replica.items() if c.most_common(1)[0][0] == homes[tenant])
    per_engine = Counter(endpoint for c in by_tenant.values() for endpoint in c.elements())
    return {
        "joined": joined,
        "on_tenant_engine": on_home,
        "share": round(on_home / joined, 4) if joined else None,
        "replica_tenant_pairs_agreeing": f"{agreeing}/{len(by_replica)}",
        "requests_per_engine": dict(sorted(per_engine.items())),
    }


IDLE_S = 1.0  # the replicas' own syncs, measured with no traffic, are taken out of the run's commands


async def _idle_commands_per_s(lab: Lab) -> float:
    """redis-server's commands per second with the replicas up and no request in flight (their leases and syncs)."""
    await trio.sleep(IDLE_S / 2)  # past the replicas' first syncs
    before = await _redis_commands(lab)
    await trio.sleep(IDLE_S)
    return (await _redis_commands(lab) - before) / IDLE_S


async def _redis_commands(lab: Lab) -> int:
    """redis-server's ``total_commands_processed`` now."""
    client = coredis.Redis.from_url(lab.redis.url, decode_responses=True, stream_timeout=1.0, connect_timeout=1.0)
    async with client:
        stats = await client.info("stats")
    return int(str(stats["total_commands_processed"]))
