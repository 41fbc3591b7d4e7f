"""Attacks on per-tenant state (issue 32): many API keys rotated by reloads, and budgets across an empty Redis restart.

Each records in ``phase.extra`` the figures that say whether the defect is
there, and in ``phase.extra["check_failures"]`` what the row failed.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import coredis
import trio

from bench.chaos.attacks import CHAT_PATH, Phase, chat_body, open_loop
from bench.chaos.client import JSON_CONTENT, HttpPool, Reply, RequestSpec, send
from bench.chaos.figures import p50_p99_max_ms, queue_seconds, refusal_spells, retry_after, usage_tokens
from bench.chaos.lab import Key, Lab, Setup, proc_stats
from bench.harness.procs import free_ports, process_cpu_seconds, stop, wait_ready
from bench.harness.windows import sliding_max
from tailguard.router.quotas import WINDOW

# -- tenant cardinality ------------------------------------------------------------------------------

ROTATIONS = 2  # three sets of keys: the first, and two that replace it in turn
TENANT_WORKERS = 32  # requests in flight while every key of a set sends its one request
TENANT_SET_BOUND_S = 120.0  # a set's requests stop being sent after this long (its row says how many were)
PROBE = Key("probe", tokens_per_minute=100_000)  # a key with its budget left, sent after the idle time
PROBE_REQUESTS = 20
# The most RSS may grow with a set of keys sent after the idle time, over the most it reached before: the sets
# are alike and the earlier ones' state is gone by then, so growth is state kept (the allocator: a few MiB).
ROTATION_RSS_SLACK_MIB = 15.0
TENANTS = Setup(keys=(PROBE,))
TENANTS_CLUSTER = Setup(keys=(PROBE,), cluster="chaos-tenants")
_HEALTH_EVERY_S = 0.5


def tenant_keys(rotation: int, count: int) -> tuple[Key, ...]:
    """The ``rotation``-th set of tenants' keys, each with a budget (so per-key budget state exists)."""
    return tuple(Key(f"t{rotation}-{i:05d}", tokens_per_minute=1_000_000) for i in range(count))


async def tenant_cardinality(lab: Lab, phase: Phase) -> None:
    """Three sets of ``tenant_keys`` keys in turn, by reloads, each key sending one request; then idle, then a look, then a fourth set.

    What per-caller state costs: /metrics (bytes, lines, time to scrape,
    lines naming keys a reload removed), RSS and CPU after the idle time,
    the event loop's worst lag; under [cluster] also what the ledger syncs
    (keys in Redis, the sync script's calls and cost, Redis's CPU), whether
    the ledger fell back to static shares (/health "degraded"), and whether
    a key with its budget left (``probe``) is refused.
    """
    steady = lab.setup
    count = lab.options.tenant_keys
    health: Counter[str] = Counter()
    phase.fault_on()
    async with trio.open_nursery() as watch:
        watch.start_soon(_watch_health, lab, health)
        sets, rss_after_sets = [], []
        for rotation in range(ROTATIONS + 1):
            keys = tenant_keys(rotation, count)
            await lab.reload(replace(steady, keys=(PROBE, *keys)))
            began, answered = time.perf_counter(), len(phase.answers)
            await _one_request_each(lab, phase, keys)
            sets.append(f"{len(phase.answers) - answered:,} requests in {time.perf_counter() - began:.1f} s")
            rss_after_sets.append(proc_stats(lab.tailguard.pid, ()).rss_mib)
        phase.fault_off()
        rss_busy = proc_stats(lab.tailguard.pid, ()).rss_mib
        idle = await _idle_costs(lab)
        probe = await open_loop(lab, phase, [_tenant_spec(PROBE, 90_000 + i) for i in range(PROBE_REQUESTS)], 10.0, group="probe")
        watch.cancel_scope.cancel()
    page = await _metrics_page(lab, removed=[f"t{r}-" for r in range(ROTATIONS)])
    # One more set once the idle time is over: the removed keys' state is gone by then (a key under
    # [cluster] lives its minute in the ledger first), so RSS must not grow past what the sets before reached.
    await lab.reload(replace(steady, keys=(PROBE, *tenant_keys(ROTATIONS + 1, count))))
    await _one_request_each(lab, phase, tenant_keys(ROTATIONS + 1, count))
    rss_after_sets.append(proc_stats(lab.tailguard.pid, ()).rss_mib)
    await lab.reload(steady)
    refused = [r for r in probe if r.status == 429]
    tenants_refused = Counter(a.outcome for a in phase.answers if a.group == "attack" and not a.ok)
    phase.extra |= {
        "keys": f"{ROTATIONS + 1} sets of {count:,} keys: {'; '.join(sets)}",
        "metrics": page,
        "rss_mib_after_traffic_after_idle": [rss_busy, proc_stats(lab.tailguard.pid, ()).rss_mib],
        # Judged here, not by the run's RSS check: the keys in force (a set of them) cost memory of their own.
        "rss_mib_after_each_set": rss_after_sets,
        "idle": idle,
        "tenant_requests_failed": dict(tenants_refused),
        "probe_key_429": len(refused),
        "probe_ms_p50_p99_max": p50_p99_max_ms([a.elapsed for a in phase.answers if a.group == "probe"]),
    }
    failures = []
    if page.get("lines_naming_removed_keys"):
        failures.append(f"/metrics still names keys a reload removed: {page['lines_naming_removed_keys']:,} lines")
    if steady.cluster is not None:
        phase.extra["health_seen"] = dict(health)
        if health["degraded"]:
            failures.append(f"the ledger fell back to static shares ({health['degraded']} looks at /health said degraded)")
    grown = rss_after_sets[-1] - max(rss_after_sets[:-1])
    if grown > ROTATION_RSS_SLACK_MIB:
        failures.append(f"RSS grew {grown:.0f} MiB with a set of keys sent after the idle time: removed keys' state kept")
    if tenants_refused:
        failures.append(f"keys with their budgets left (one request each) were refused: {dict(tenants_refused)}")
    if refused:
        failures.append(f"a key with its budget left got {len(refused)} of {PROBE_REQUESTS} requests refused 429")
    if failures:
        phase.extra["check_failures"] = failures


def _tenant_spec(key: Key, i: int) -> RequestSpec:
    return RequestSpec(CHAT_PATH, chat_body(i, stream=False, max_tokens=4), headers=(*JSON_CONTENT, key.header))


async def _one_request_each(lab: Lab, phase: Phase, keys: tuple[Key, ...]) -> None:
    """Each key sends one short request, ``TENANT_WORKERS`` at a time (closed loop), bounded in time."""
    pending = iter(enumerate(keys))
    deadline = time.perf_counter() + TENANT_SET_BOUND_S

    async def worker() -> None:
        for i, key in pending:
            if time.perf_counter() > deadline:
                return
            await send(lab.pool, _tenant_spec(key, 60_000 + i), "attack", lab.client_timeout, phase.answers)

    async with trio.open_nursery() as nursery:
        for _ in range(TENANT_WORKERS):
            nursery.start_soon(worker)


async def _idle_costs(lab: Lab) -> dict[str, Any]:
    """tailguard's CPU (and under [cluster] Redis's, and the ledger's syncs) over ``tenant_idle_s`` of no traffic."""
    await lab.pool.aclose()
    seconds = lab.options.tenant_idle_s
    cpu = sum(process_cpu_seconds(lab.tailguard.pid))
    redis = lab.redis if lab.setup.cluster is not None else None
    before = await _redis_costs(redis.url) if redis is not None else None
    await trio.sleep(seconds)
    costs: dict[str, Any] = {"seconds": seconds, "tailguard_cpu_pct": round(100 * (sum(process_cpu_seconds(lab.tailguard.pid)) - cpu) / seconds, 1)}
    if redis is not None and before is not None:
        after = await _redis_costs(redis.url)
        calls = after["calls"] - before["calls"]
        costs["redis"] = {
            "keys": after["keys"],
            "syncs_per_s": round(calls / seconds, 1),
            "ms_per_sync": round((after["usec"] - before["usec"]) / max(calls, 1) / 1000, 2),
            "cpu_pct": round(100 * (after["cpu"] - before["cpu"]) / seconds, 1),
        }
    return costs


async def _redis_costs(url: str) -> dict[str, float]:
    """Keys, the sync script's calls and microseconds so far, CPU seconds so far, as redis-server reports them."""
    client = coredis.Redis.from_url(url, decode_responses=True, stream_timeout=5.0, connect_timeout=1.0)
    async with client:
        commands = await client.info("commandstats")
        cpu = await client.info("cpu")
        keys = await client.dbsize()
    scripts = [v for k, v in commands.items() if k in ("cmdstat_evalsha", "cmdstat_eval") and isinstance(v, dict)]
    return {
        "keys": float(keys),
        "calls": float(sum(s["calls"] for s in scripts)),
        "usec": float(sum(s["usec"] for s in scripts)),
        "cpu": float(str(cpu["used_cpu_sys"])) + float(str(cpu["used_cpu_user"])),
    }


async def _metrics_page(lab: Lab, removed: list[str]) -> dict[str, Any]:
    """tailguard's whole /metrics page once: its size, lines, time to scrape, lines naming removed keys' callers, the loop's worst lag.

    Scraped once: rendering a page of every caller's series holds tailguard's event loop.
    """
    started = time.perf_counter()
    reply = await HttpPool(lab.tg_port).request(RequestSpec("/metrics", b"", method="GET", headers=()), 60.0, keep=False)
    took = time.perf_counter() - started
    if reply.status != 200:
        return {"failure": f"{reply.status} {reply.failure}"}
    lines = reply.body.splitlines()
    names = tuple(f'caller="{prefix}'.encode() for prefix in removed)
    lag = [float(line.split()[-1]) for line in lines if line.startswith(b"tailguard_event_loop_lag_max_seconds ")]
    return {
        "bytes": reply.size,
        "lines": len(lines),
        "scrape_s": round(took, 2),
        "lines_naming_removed_keys": sum(1 for line in lines if any(name in line for name in names)),
        "loop_lag_max_s": round(lag[0], 3) if lag else None,
    }


async def _watch_health(lab: Lab, seen: Counter[str]) -> None:
    """tailguard's /health "status" every half second (under [cluster] "degraded" while the ledger is away)."""
    pool = HttpPool(lab.tg_port)
    try:
        while True:
            seen[await _health_status(pool)] += 1
            await trio.sleep(_HEALTH_EVERY_S)
    finally:
        with trio.CancelScope(shield=True):
            await pool.aclose()


async def _health_status(pool: HttpPool) -> str:
    reply = await pool.request(RequestSpec("/health", b"", method="GET", headers=()), 5.0, keep=True)
    try:
        return str(json.loads(reply.body)["status"])
    except (ValueError, KeyError, TypeError):
        return f"no answer ({reply.status} {reply.failure})"


# -- budgets across an empty Redis restart ----------------------------------------------------------

BUSY = Key("busy", tokens_per_minute=4000)  # sends about twice its budget
QUIET = Key("quiet", tokens_per_minute=20_000)  # uses about a third of its budget at most
BUDGETS = Setup(keys=(BUSY, QUIET), cluster="chaos-budgets")
BUSY_RATE, QUIET_RATE = 6.0, 1.0  # requests a second, over both replicas
BUDGET_MAX_TOKENS = 100
REDIS_AWAY_S = 2.0
_AWAY_EVERY_S = 0.25
OVER_BY = 0.10  # a 60 s window by send time over the budget by more than this: the ledger forgot what it admitted


async def budgets_redis_restart(lab: Lab, phase: Phase) -> None:
    """Two replicas share two budgeted keys through Redis; a third of the way in Redis is killed and started empty.

    The quiet key (a third of its budget) must not be refused; the busy key
    (twice its budget) must not be admitted more than its budget in any 60 s
    window across the replicas. Reported beside: the Retry-After of each run
    of refusals against how long it lasted, and how long each replica's
    ledger stayed away (/health "degraded"). ``--quick`` runs under a
    minute, so its one window is the whole run.
    """
    http2, grpc2 = free_ports(2)
    config2 = lab.workdir / "replica-2.toml"
    config2.write_text(lab.config_text(replace(lab.setup, replica="chaos-2"), http2, grpc2))
    second = await lab.start(config2)
    pools = (lab.pool, HttpPool(http2))
    try:
        await wait_ready(http2, second, "the second replica")
        await _budget_run(lab, phase, pools, (lab.tg_port, http2))
    finally:
        with trio.CancelScope(shield=True):
            await pools[1].aclose()
            await stop(second)


async def _budget_run(lab: Lab, phase: Phase, pools: tuple[HttpPool, HttpPool], ports: tuple[int, int]) -> None:
    assert lab.redis is not None
    length = lab.options.budget_s
    sent: dict[str, list[tuple[RequestSpec, float, Reply]]] = {BUSY.name: [], QUIET.name: []}
    away: dict[int, list[float]] = {port: [] for port in ports}
    restarted = 0.0

    planned = {
        key.name: [
            RequestSpec(CHAT_PATH, chat_body(70_000 + i, stream=False, max_tokens=BUDGET_MAX_TOKENS), headers=(*JSON_CONTENT, key.header))
            for i in range(int(rate * length))
        ]
        for key, rate in ((BUSY, BUSY_RATE), (QUIET, QUIET_RATE))
    }

    async def key_traffic(key: Key, rate: float) -> None:
        specs = planned[key.name]
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i, spec in enumerate(specs):
                await trio.sleep_until(trio.current_time() + max(0.0, start + i / rate - time.perf_counter()))
                nursery.start_soon(one, key, spec, pools[i % 2])

    async def one(key: Key, spec: RequestSpec, pool: HttpPool) -> None:
        at = time.perf_counter()
        sent[key.name].append((spec, at, await send(pool, spec, key.name, lab.client_timeout, phase.answers)))

    async with trio.open_nursery() as nursery:
        for port in ports:
            nursery.start_soon(_watch_away, port, away[port])
        async with trio.open_nursery() as traffic:
            traffic.start_soon(key_traffic, BUSY, BUSY_RATE)
            traffic.start_soon(key_traffic, QUIET, QUIET_RATE)
            await trio.sleep(length / 3)
            phase.fault_on()
            await lab.redis.kill()
            await trio.sleep(REDIS_AWAY_S)
            await lab.redis.start()  # empty: no persistence
            restarted = time.perf_counter()
            phase.fault_off()
        nursery.cancel_scope.cancel()
    budget = BUSY.tokens_per_minute or 0
    busy = sent[BUSY.name]
    by_send = sliding_max([(at, usage_tokens(r, False)) for _, at, r in busy], WINDOW).tokens
    by_seat = sliding_max([(at + queue_seconds(r), usage_tokens(r, False)) for _, at, r in busy], WINDOW).tokens
    quiet_refused = sum(1 for _, _, r in sent[QUIET.name] if r.status == 429)
    phase.extra |= {
        "busy": {
            "tokens_per_minute": budget,
            "outcomes": dict(Counter(_label(r) for _, _, r in busy)),
            "max_60s_tokens_by_send_time": by_send,
            "max_60s_tokens_by_seat_time": by_seat,
        },
        "quiet": {
            "tokens_per_minute": QUIET.tokens_per_minute,
            "outcomes": dict(Counter(_label(r) for _, _, r in sent[QUIET.name])),
            "tokens_served": sum(usage_tokens(r, False) for _, _, r in sent[QUIET.name]),
        },
        "refusal_spells_from_restart_retry_after_lasted_s": {name: _spells(requests, restarted) for name, requests in sent.items()},
        "ledger_seen_away_s_total_and_after_restart": {f"replica {i + 1}": _away(away[port], restarted) for i, port in enumerate(ports)},
        "requests_to_replica_2": sum(len(specs) // 2 for specs in planned.values()),  # not in the counter beside
    }
    failures = []
    if quiet_refused > max(1, len(sent[QUIET.name]) // 100):
        failures.append(f"the quiet key (a third of its budget) got {quiet_refused} of {len(sent[QUIET.name])} requests refused 429")
    if by_send > budget * (1 + OVER_BY):
        failures.append(f"the busy key was admitted {by_send:,} tokens in a 60 s window (by send time), its budget {budget:,}")
    if failures:
        phase.extra["check_failures"] = failures


def _label(reply: Reply) -> str:
    return str(reply.status) if reply.status is not None else str(reply.failure)


def _spells(requests: list[tuple[RequestSpec, float, Reply]], restarted: float) -> list[list[float | None]]:
    """Each run of refusals (at most 8): [when it began after Redis came back (< 0: before), its first Retry-After, how long it lasted], s."""
    spells = refusal_spells([(at, r.status == 429, retry_after(r)) for _, at, r in requests])
    return [[round(s.start - restarted, 1), s.hint_s, None if s.lasted_s is None else round(s.lasted_s, 1)] for s in spells[:8]]


async def _watch_away(port: int, times: list[float]) -> None:
    """When a replica's /health said its ledger was away ("degraded"), four looks a second."""
    pool = HttpPool(port)
    try:
        while True:
            if await _health_status(pool) == "degraded":
                times.append(time.perf_counter())
            await trio.sleep(_AWAY_EVERY_S)
    finally:
        with trio.CancelScope(shield=True):
            await pool.aclose()


def _away(times: list[float], restarted: float) -> list[float]:
    """[how long the replica's /health said degraded in all, how long after Redis came back it last did (0: never after)]."""
    return [len(times) * _AWAY_EVERY_S, round(max((t - restarted for t in times if t >= restarted), default=0.0), 2)]
