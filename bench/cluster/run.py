"""``python -m bench cluster``: one admission budget across tailguard replicas, on a real redis-server (issue 13).

Real time, 127.0.0.1 only, free ports, every loop bounded. One simulator
process serves three capped engines (a latency engine for the interactive
pool, two throughput engines for the batch pool, ``--seats`` each: the
endpoints' ``max_concurrency``, below the engines' own ``max_num_seqs``, so
the engine's running count is what the routers sent it) and two instant
engines; one redis-server (no persistence) holds the ledger. In order:

1. ledger cost: one tailguard with ``[cluster]`` (alone in its namespace) and
   one without, in front of the instant engines; an open loop of short
   non-streaming requests, rounds alternating; the difference is what the
   ledger adds per request.
2. load: the origin's mix (80% short, 20% long, streaming), Poisson and
   bursty, at ``--loads`` of the capped engines' modelled capacity. Each
   schedule is played against one plain tailguard (the single-process
   default), then against ``--replicas`` replicas sharing one namespace
   (``static_share`` 1/replicas), the client round robin over them; Poisson
   at the first load also against one tailguard with ``[cluster]``.
3. kill -9 one replica mid-load: when its lease lapses and its grants leave
   the ledger; every request sent to a survivor must end with one answer.
4. redis-server killed mid-load at the highest load and started again empty
   on the same port after ``--outage`` s; then paused (SIGSTOP/SIGCONT) for
   ``--pause`` s with one more replica killed during the pause. The replicas'
   /health and the ledger are read throughout, the ledger checked afterwards.

Watched all the time: every capped engine's own ``vllm:num_requests_running``
and ``vllm:num_requests_waiting`` (its /metrics, every 10 ms), whose sum must
never pass the endpoint's cap; and per API key, the requests the client saw
streaming at once (first to last token of each 200), never above the key's
``max_concurrency``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import coredis
import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.cli import add_out_arg, add_seed_arg, add_time_scale_arg, add_warmup_arg, driver_parser, run_trio
from bench.harness.client import CHAT_PATH, HOST, ProtocolError, engine_counts, http_request
from bench.harness.client import ConnectionPool as OpenPool
from bench.harness.clocks import MachineClock
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.open_loop import Sample, TokenClient, TokenPool, class_stats, play, token_times
from bench.harness.procs import RESULTS_ROOT, free_ports, process_cpu_seconds, start_process, start_tailguard, stop, wait_ready
from bench.harness.report import git_commit, write_json
from bench.harness.traffic import http_open_loop, poisson_offsets
from tailguard.router.auth import hash_key
from tailguard.server.redis_ledger import RedisLedger
from tailguard.sim.params import PROFILES
from tailguard.sim.virtual.mix import body_for, origin_mix, percentile, pooled_capacity, shapes_by_class
from tailguard.sim.virtual.trace import Arrival, generated

RESULTS = RESULTS_ROOT / "cluster"
PHASES = ("cost", "load", "kill", "outage", "skew")
OUTAGES = ("outage_stop", "outage_pause", "outage_skew")
NAMESPACE = "bench-cluster"
BATCH_QUEUE_TIMEOUT = 10.0  # real s (interactive: tailguard_config's 3 s)
MAX_QUEUE = 64
ANSWERED = ("ok", "429", "503", "timeout")  # one complete answer each (a 504 is "timeout")
PHASE_DRAIN = BATCH_QUEUE_TIMEOUT + 15.0  # kill and outage runs: every request ends (a long one runs ~9 s at time scale 2)
_LEDGER_POLL_S = 0.02
_HEALTH_POLL_S = 0.25


@dataclass(frozen=True)
class KeySpec:
    """One ``[[auth.keys]]`` entry and its share of the arrivals."""

    name: str
    share: float
    max_concurrency: int

    @property
    def secret(self) -> str:
        return f"tg-bench-{self.name}-0123456789"  # a benchmark's own made-up key


KEYS = (KeySpec("web", 0.5, 16), KeySpec("jobs", 0.3, 8), KeySpec("trial", 0.2, 4))


@dataclass(frozen=True)
class Options:
    time_scale: float
    seats: int
    replicas: int
    loads: tuple[float, ...]
    traffics: tuple[str, ...]
    burst_period: float
    warmup: float
    window: float
    drain: float
    lease_ttl: float
    sync_interval: float
    block: int
    outage: float
    pause: float
    overhead_rate: float
    overhead_seconds: float
    overhead_rounds: int
    sample_interval: float
    seed: int
    out: Path
    phases: tuple[str, ...] = PHASES
    key_caps: bool = True  # the keys' max_concurrency in every config (--no-key-caps: none, for experiments)


# -- processes -------------------------------------------------------------------------


class RedisProcess:
    """redis-server on one port, without persistence: killed and started again, or paused, by the benchmark."""

    def __init__(self, nursery: trio.Nursery, port: int, log: IO[bytes]) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.exe, self.nursery, self.port, self.log = exe, nursery, port, log
        self.process: trio.Process | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    async def start(self) -> None:
        command = [self.exe, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no"]
        self.process = await start_process(self.nursery, command, self.log)
        with trio.fail_after(10):
            while True:
                try:
                    stream = await trio.open_tcp_stream(HOST, self.port)
                except OSError:
                    await trio.sleep(0.02)
                    continue
                await stream.aclose()
                return

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        await self.process.wait()
        self.process = None

    def pause(self, paused: bool) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
        self.paused = paused


@dataclass
class Replica:
    name: str
    port: int
    process: trio.Process
    log: Path

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


@dataclass
class Engine:
    role: str  # interactive | batch-1 | batch-2
    port: int
    cap: int

    @property
    def resource(self) -> str:
        return f"endpoint:http://{HOST}:{self.port}"


@dataclass
class Lab:
    """Everything the phases share: the options, the processes, the ports."""

    options: Options
    tmp: Path
    nursery: trio.Nursery
    redis: RedisProcess
    engines: list[Engine]  # the capped ones
    instant: tuple[int, int]  # interactive, batch instant engines
    logs: list[IO[bytes]] = field(default_factory=list)

    def pools(self, instant: bool = False) -> tuple[PoolSpec, PoolSpec]:
        if instant:
            return (PoolSpec("interactive", [(self.instant[0], 256)], 256, MAX_QUEUE), PoolSpec("batch", [(self.instant[1], 256)], 256, MAX_QUEUE))
        by_role = {e.role: e for e in self.engines}
        inter = by_role["interactive"]
        batch = [by_role["batch-1"], by_role["batch-2"]]
        return (
            PoolSpec("interactive", [(inter.port, inter.cap)], inter.cap, MAX_QUEUE),
            PoolSpec("batch", [(e.port, e.cap) for e in batch], sum(e.cap for e in batch), MAX_QUEUE),
        )

    def caps(self) -> dict[str, int]:
        """Every cluster-wide cap the ledger holds: pools, endpoints, keys."""
        inter, batch = self.pools()
        caps = {"pool:interactive": inter.max_concurrency, "pool:batch": batch.max_concurrency}
        caps |= {e.resource: e.cap for e in self.engines}
        return caps | {f"key:{k.name}": k.max_concurrency for k in KEYS}

    async def replica(
        self, name: str, namespace: str | None, static_share: float = 1.0, instant: bool = False, block: int | None = None, key_caps: bool = True
    ) -> Replica:
        """A tailguard process (HTTP only), with ``[cluster]`` in ``namespace`` unless None; ``wait_ready`` before use."""
        http_port, grpc_port = free_ports(2)
        sections: list[str] = []
        if namespace is not None:
            o = self.options
            sections += [
                "[cluster]",
                f'redis_url = "{self.redis.url}"',
                f'namespace = "{namespace}"',
                f'replica_id = "{name}"',
                f"lease_ttl = {o.lease_ttl:g}",
                f"sync_interval = {o.sync_interval:g}",
                f"static_share = {static_share:g}",
                f"block = {o.block if block is None else block}",
                "",
            ]
        for key in KEYS:
            sections += ["[[auth.keys]]", f'name = "{key.name}"', f'key_sha256 = "{hash_key(key.secret)}"']
            sections += [f"max_concurrency = {key.max_concurrency}", ""] if key_caps and self.options.key_caps else [""]
        text = tailguard_config(http_port, grpc_port, *self.pools(instant), batch_queue_timeout=BATCH_QUEUE_TIMEOUT, sections=sections)
        config = self.tmp / f"{name}.toml"
        config.write_text(text)
        log_path = self.tmp / f"{name}.log"
        log = log_path.open("ab")
        self.logs.append(log)
        process = await start_tailguard(self.nursery, config, log=log, extra_args=["--no-grpc"])
        return Replica(name, http_port, process, log_path)

    async def group(
        self, names: Sequence[str], namespace: str | None, static_share: float = 1.0, instant: bool = False, block: int | None = None,
        key_caps: bool = True,
    ) -> list[Replica]:
        """Several replicas started at once; returns when every one answers /health 200."""
        replicas = [await self.replica(name, namespace, static_share, instant, block, key_caps) for name in names]
        async with trio.open_nursery() as ready:
            for r in replicas:
                ready.start_soon(wait_ready, r.port, r.process, r.name)
        return replicas


async def stop_all(replicas: Sequence[Replica]) -> None:
    async with trio.open_nursery() as nursery:
        for r in replicas:
            nursery.start_soon(stop, r.process)


# -- watching the engines ---------------------------------------------------------------


@dataclass
class CapWatch:
    """One capped engine as its own /metrics tells it, looked at every ``interval``."""

    role: str
    port: int
    cap: int
    looks: int = 0
    failed_looks: int = 0
    max_running: int = 0
    max_in_engine: int = 0  # running + waiting: every request the routers have sent it
    over_cap_looks: int = 0
    first_over_s: float | None = None
    longest_gap_ms: float = 0.0  # between two successful looks
    seconds: float = 0.0


async def watch_engine(watch: CapWatch, interval: float, origin: float) -> None:
    """Scrape the engine every ``interval`` s until cancelled (a look slower than that starts the next at once)."""
    client = TokenClient(watch.port)
    scrape = f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{watch.port}\r\n\r\n".encode()
    start = last = trio.current_time()
    try:
        while True:
            with trio.move_on_after(1.0):
                try:
                    reply = await client.exchange(scrape)
                except (OSError, trio.BrokenResourceError, ProtocolError):
                    reply = None
            now = trio.current_time()
            if reply is None or reply.status != 200:
                watch.failed_looks += 1
            else:
                running, waiting = engine_counts(client.last_piece)
                watch.looks += 1
                watch.max_running = max(watch.max_running, running)
                watch.max_in_engine = max(watch.max_in_engine, running + waiting)
                if running + waiting > watch.cap:
                    watch.over_cap_looks += 1
                    if watch.first_over_s is None:
                        watch.first_over_s = round(time.perf_counter() - origin, 3)
                watch.longest_gap_ms = max(watch.longest_gap_ms, (now - last) * 1000)
                last = now
            watch.seconds = now - start
            await trio.sleep_until(max(now, start + (watch.looks + watch.failed_looks) * interval))
    finally:
        await client.aclose()


def watch_summary(watches: Sequence[CapWatch]) -> dict[str, Any]:
    return {w.role: asdict(w) | {"mean_interval_ms": round(w.seconds / max(w.looks, 1) * 1000, 2)} for w in watches}


# -- the load ---------------------------------------------------------------------------


def capacity(options: Options) -> float:
    """Requests/s (real) at which the capped engines are full for the origin's mix (the lesser pool's figure)."""
    mix = shapes_by_class(origin_mix())
    latency = PROFILES["latency"].replace(max_num_seqs=options.seats)
    throughput = PROFILES["throughput"].replace(max_num_seqs=options.seats)
    gpu = min(pooled_capacity(1, latency, mix["short"]), pooled_capacity(2, throughput, mix["long"]))
    return gpu / options.time_scale


def key_of_each(arrivals: Sequence[Arrival], seed: int) -> list[KeySpec]:
    rng = random.Random(seed)
    return rng.choices(KEYS, weights=[k.share for k in KEYS], k=len(arrivals))


@dataclass
class Played:
    samples: list[Sample]
    sent_to: list[int]  # the replica port each arrival went to
    keys: list[KeySpec]
    wall: float
    cores: float  # the machine's busy cores over the run
    load_average: list[float]


async def play_against(
    ports: list[int], arrivals: list[Arrival], keys: list[KeySpec], drain: float, label: str, during: Callable[[list[TokenPool]], Any] | None = None
) -> Played:
    """Play the schedule round robin over ``ports``; ``during(targets)`` runs alongside and may remove a target."""
    pools = [TokenPool(p) for p in ports]
    targets = list(pools)  # one list: one round robin over both classes; ``during`` may shrink it (a killed replica)
    sent_to: dict[int, int] = {}
    key_at = {id(a): k for a, k in zip(arrivals, keys)}
    cache: dict[tuple[int, int, int, str], bytes] = {}

    def request_of(port: int, arrival: Arrival) -> bytes:
        key = key_at[id(arrival)]
        sent_to[id(arrival)] = port
        wanted = (port, arrival.prompt, arrival.max_tokens, key.name)
        if wanted not in cache:
            raw = http_request(port, CHAT_PATH, body_for(arrival.prompt, arrival.max_tokens))
            cache[wanted] = raw.replace(b"\r\n", f"\r\nAuthorization: Bearer {key.secret}\r\n".encode(), 1)
        return cache[wanted]

    load_average = [round(x, 2) for x in os.getloadavg()]
    before = MachineClock.read()
    try:
        async with trio.open_nursery() as nursery:
            if during is not None:
                nursery.start_soon(during, targets)
            samples, wall = await play({"short": targets, "long": targets}, request_of, arrivals, drain, label)
            nursery.cancel_scope.cancel()
    finally:
        for pool in pools:
            await pool.aclose()
    cores = MachineClock.read().cores_since(before)
    return Played(samples, [sent_to.get(id(a), 0) for a in arrivals[: len(samples)]], keys, wall, cores, load_average)


def overlap(intervals: Sequence[tuple[float, float]], cap: int) -> tuple[int, float, float]:
    """(most at once, seconds above ``cap`` in all, longest stretch above ``cap`` in s) of [start, end) intervals."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])  # an end sorts before a start at the same time
    now = most = 0
    above = longest = 0.0
    since: float | None = None
    for at, step in events:
        now += step
        most = max(most, now)
        if now > cap and since is None:
            since = at
        elif now <= cap and since is not None:
            above += at - since
            longest = max(longest, at - since)
            since = None
    return most, above, longest


def key_results(played: Played) -> dict[str, dict[str, Any]]:
    """Per key: outcomes, and how many of its requests the client saw at once (two ways), against its cap."""
    found: dict[str, dict[str, Any]] = {}
    for key in KEYS:
        mine = [s for s, k in zip(played.samples, played.keys) if k is key]
        outcomes: dict[str, int] = {}
        for s in mine:
            outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
        answered = [(s.sent, s.sent + s.e2e) for s in mine if s.status == 200 and s.e2e is not None]
        streaming = [(t[0], t[-1]) for s in mine if s.outcome == "ok" and (t := token_times(s))]
        most_sent, _, _ = overlap(answered, key.max_concurrency)
        most, above, longest = overlap(streaming, key.max_concurrency)
        found[key.name] = {
            "cap": key.max_concurrency,
            "sent": len(mine),
            "outcomes": outcomes,
            "max_streaming": most,  # first to last token of each 200: inside the router's hold, but for the client's own lag
            "streaming_above_cap_ms": round(above * 1000, 2),
            "longest_above_cap_ms": round(longest * 1000, 2),
            "max_sent_to_end": most_sent,  # send to last byte of each 200: an upper bound (network and client lag on both ends)
        }
    return found


def class_summary(played: Played, kind: str, window: float, only: Callable[[int], bool] | None = None) -> dict[str, Any]:
    samples = [s for s, port in zip(played.samples, played.sent_to) if only is None or only(port)]
    stats = class_stats(kind, samples, 1.0, window, None)
    return {"n": stats.n, "outcomes": stats.outcomes, "e2e_ms": stats.e2e_ms, "ttft_ms": stats.ttft_ms}


# -- the ledger ---------------------------------------------------------------------------


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
                raw = http_request(replica.port, CHAT_PATH, body)
                request = raw.replace(b"\r\n", f"\r\nAuthorization: Bearer {KEYS[0].secret}\r\n".encode(), 1)
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


# -- phase 2: load ---------------------------------------------------------------------------


async def load_run(lab: Lab, setup: str, replicas: Sequence[Replica], traffic: str, load: float) -> dict[str, Any]:
    o = lab.options
    rate = load * capacity(o)
    seed = o.seed + int(load * 100) + (1000 if traffic == "bursty" else 0)
    arrivals = generated(rate, o.warmup, o.window, seed, o.burst_period if traffic == "bursty" else None)
    keys = key_of_each(arrivals, seed)
    watches = [CapWatch(e.role, e.port, e.cap) for e in lab.engines]
    origin = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for w in watches:
            nursery.start_soon(watch_engine, w, o.sample_interval, origin)
        played = await play_against([r.port for r in replicas], arrivals, keys, o.drain, f"{setup} {traffic} {load:g}")
        nursery.cancel_scope.cancel()
    for r in replicas:
        if not r.alive:
            raise RuntimeError(f"{r.name} exited with {r.process.returncode} during the run; see {r.log}")
    return {
        "setup": setup,
        "traffic": traffic,
        "load": load,
        "rate_per_s": round(rate, 3),
        "arrivals": len(arrivals),
        "wall_s": round(played.wall, 1),
        "machine_cores": round(played.cores, 2),
        "load_average": played.load_average,
        "short": class_summary(played, "short", o.window),
        "long": class_summary(played, "long", o.window),
        "keys": key_results(played),
        "engines": watch_summary(watches),
    }


# -- phase 3: kill -9 one replica ----------------------------------------------------------------


async def kill_run(lab: Lab, replicas: list[Replica], victim: Replica, view: LedgerView) -> dict[str, Any]:
    """Poisson at the first load; ``victim`` killed with SIGKILL a third into the window, taken out of the client's round robin."""
    o = lab.options
    rate = o.loads[0] * capacity(o)
    arrivals = generated(rate, o.warmup, o.window, o.seed + 7, None)
    keys = key_of_each(arrivals, o.seed + 7)
    kill_at = o.warmup + o.window / 3
    watches = [CapWatch(e.role, e.port, e.cap) for e in lab.engines]
    found: dict[str, Any] = {"victim": victim.name, "kill_at_s": kill_at, "lease_ttl": o.lease_ttl}
    origin = time.perf_counter()

    async def killer(targets: list[TokenPool]) -> None:
        await trio.sleep_until(trio.current_time() + kill_at - (time.perf_counter() - origin))
        held = {r: g.get(victim.name, 0) for r, g in (await view.grants()).items()}
        found["victim_grants_at_kill"] = {r: n for r, n in held.items() if n}
        victim.process.kill()  # SIGKILL
        killed = time.perf_counter()
        targets[:] = [t for t in targets if t.port != victim.port]  # the client's balancer drops it at once
        lapsed = cleared = None
        deadline = killed + 4 * o.lease_ttl
        while time.perf_counter() < deadline and (lapsed is None or cleared is None):
            if lapsed is None and not await view.alive(victim.name):
                lapsed = time.perf_counter() - killed
            grants = await view.grants()
            if cleared is None and not any(victim.name in g for g in grants.values()):
                cleared = time.perf_counter() - killed
            await trio.sleep(_LEDGER_POLL_S)
        found["lease_gone_after_s"] = None if lapsed is None else round(lapsed, 3)
        found["grants_gone_after_s"] = None if cleared is None else round(cleared, 3)
        found["grants_after"] = await view.grants()

    async with trio.open_nursery() as nursery:
        for w in watches:
            nursery.start_soon(watch_engine, w, o.sample_interval, origin)
        played = await play_against([r.port for r in replicas], arrivals, keys, max(o.drain, PHASE_DRAIN), f"kill -9 {victim.name}", killer)
        nursery.cancel_scope.cancel()
    survivors = {r.port for r in replicas if r is not victim}
    on_survivors = [s for s, port in zip(played.samples, played.sent_to) if port in survivors]
    on_victim = [s for s, port in zip(played.samples, played.sent_to) if port == victim.port]
    found |= {
        "arrivals": len(arrivals),
        "survivor_outcomes": _outcomes(on_survivors),
        "survivor_unanswered": sum(1 for s in on_survivors if s.outcome not in ANSWERED),
        "victim_outcomes": _outcomes(on_victim),
        "survivor_short": class_summary(played, "short", o.window, lambda port: port in survivors),
        "keys": key_results(played),
        "engines": watch_summary(watches),
        "load_average": played.load_average,
        "machine_cores": round(played.cores, 2),
    }
    return found


def _outcomes(samples: Sequence[Sample]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.outcome] = counts.get(s.outcome, 0) + 1
    return counts


# -- phase 4: Redis gone --------------------------------------------------------------------------


async def health_of(client: TokenClient, port: int) -> tuple[str, str]:
    """(status, cluster mode) from a replica's /health; ("down", "?") when it does not answer."""
    request = f"GET /health HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
    with trio.move_on_after(1.0):
        try:
            await client.exchange(request)
            body = json.loads(client.last_piece)
            return str(body.get("status")), str(body.get("cluster", {}).get("mode", "-"))
        except (OSError, trio.BrokenResourceError, ProtocolError, ValueError):
            pass
    return "down", "?"


async def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """A replica's /metrics, parsed by prometheus_client: family -> labels -> value."""
    client = TokenClient(port)
    try:
        await client.exchange(f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode())
        text = client.last_piece.decode()
    finally:
        await client.aclose()
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


async def outage_run(
    lab: Lab, replicas: list[Replica], view: LedgerView, mode: str, hold: float, dead: Sequence[str], victim: Replica | None, skew: bool = False
) -> dict[str, Any]:
    """Load at the highest load; Redis killed (``mode`` "stop", started again empty) or paused ("pause") for ``hold`` s.

    ``victim`` is killed with SIGKILL halfway through the outage. ``dead`` are
    the replicas killed before, whose names must not come back in the ledger.
    With ``skew``, the client sends everything to the first replica until
    Redis goes (a balancer out of step), round robin from then on: the first
    replica holds most seats when the ledger fails.
    """
    o = lab.options
    pre, post = 5.0, 10.0
    rate = max(o.loads) * capacity(o)
    arrivals = generated(rate, 0.0, pre + hold + post, o.seed + (11 if mode == "stop" else 13), None)
    keys = key_of_each(arrivals, o.seed + 11)
    watches = [CapWatch(e.role, e.port, e.cap) for e in lab.engines]
    caps = lab.caps()
    health: dict[str, list[tuple[float, str, str]]] = {r.name: [] for r in replicas}
    ledger_max: dict[str, int] = {}
    ledger_reads = {"ok": 0, "failed": 0}
    found: dict[str, Any] = {
        "mode": mode, "hold_s": hold, "pre_s": pre, "post_s": post, "load": max(o.loads), "victim": victim.name if victim else None, "skew": skew,
        "replicas": [r.name for r in replicas],
    }
    origin = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - origin

    async def watch_health(replica: Replica) -> None:
        client = TokenClient(replica.port)
        try:
            while replica.alive:
                status, cluster_mode = await health_of(client, replica.port)
                trail = health[replica.name]
                if not trail or trail[-1][1:] != (status, cluster_mode):
                    trail.append((round(now(), 2), status, cluster_mode))
                await trio.sleep(_HEALTH_POLL_S)
        finally:
            await client.aclose()

    async def watch_ledger() -> None:
        while True:
            if not lab.redis.paused and lab.redis.process is not None:
                try:
                    with trio.fail_after(1.0):
                        grants = await view.grants()
                except Exception:  # Redis down or restarting: counted, not fatal
                    ledger_reads["failed"] += 1
                else:
                    ledger_reads["ok"] += 1
                    for resource, held in grants.items():
                        ledger_max[resource] = max(ledger_max.get(resource, 0), sum(held.values()))
            await trio.sleep(0.1)

    async def outage(targets: list[TokenPool]) -> None:
        everyone = list(targets)
        if skew:
            targets[:] = [t for t in targets if t.port == replicas[0].port]
        await trio.sleep_until(trio.current_time() + pre - now())
        found["held_at_outage"] = {r.name: await _in_flight_by_endpoint(r, lab.engines) for r in replicas}
        targets[:] = everyone
        found["redis_down_at_s"] = round(now(), 2)
        if mode == "stop":
            await lab.redis.kill()
        else:
            lab.redis.pause(True)
        await trio.sleep_until(trio.current_time() + pre + hold / 2 - now())
        if victim is not None:
            victim.process.kill()
            targets[:] = [t for t in targets if t.port != victim.port]
            found["victim_killed_at_s"] = round(now(), 2)
        await trio.sleep_until(trio.current_time() + pre + hold - 1.0 - now())
        found["grants_in_fallback"] = {r.name: await _cluster_grants(r) for r in replicas if r.alive}
        await trio.sleep_until(trio.current_time() + pre + hold - now())
        if mode == "stop":
            await lab.redis.start()
        else:
            lab.redis.pause(False)
        found["redis_back_at_s"] = round(now(), 2)

    try:
        async with trio.open_nursery() as nursery:
            for w in watches:
                nursery.start_soon(watch_engine, w, o.sample_interval, origin)
            for r in replicas:
                nursery.start_soon(watch_health, r)
            nursery.start_soon(watch_ledger)
            played = await play_against([r.port for r in replicas], arrivals, keys, max(o.drain, PHASE_DRAIN), f"redis {mode} {hold:g} s", outage)
            await trio.sleep(2 * o.lease_ttl + 1.0)  # idle: every replica back on the ledger, past the recovery window
            nursery.cancel_scope.cancel()
    finally:
        if lab.redis.paused:
            lab.redis.pause(False)
        if lab.redis.process is None:
            await lab.redis.start()
    down, back = found["redis_down_at_s"], found["redis_back_at_s"]
    live = [r for r in replicas if r.alive]
    served = {r.name: 0 for r in replicas}
    for s, port, a in zip(played.samples, played.sent_to, arrivals):
        if s.outcome == "ok" and down + 1.0 <= a.at < back:
            served[next(r.name for r in replicas if r.port == port)] += 1
    grants = await view.grants()
    in_flight = {r.name: sum((await scrape(r.port)).get("tailguard_pool_in_flight", {}).values()) for r in live}
    everyone = {r.name for r in live}
    found |= {
        "arrivals": len(arrivals),
        "outcomes": _outcomes(played.samples),
        "unanswered_on_survivors": sum(
            1 for s, port in zip(played.samples, played.sent_to) if s.outcome not in ANSWERED and (victim is None or port != victim.port)
        ),
        "ok_during_outage": served,
        "health": health,
        "fallback_within_s": _first_mode(health, "fallback", down, victim),
        "ledger_again_within_s": _first_mode(health, "ledger", back, victim),
        "degraded_everywhere": all(any(st == "degraded" for _, st, _ in health[r.name]) for r in replicas if r is not victim),
        "ledger_reads": ledger_reads,
        "ledger_max_sum": ledger_max,
        "ledger_over_cap": {r: n for r, n in ledger_max.items() if n > caps[r]},
        "grants_after": grants,
        "grant_sum_after": {r: sum(g.values()) for r, g in grants.items()},
        "strangers_after": sorted({name for g in grants.values() for name in g} - everyone),
        "idle_grant_above_block": {r: {n: s for n, s in g.items() if s > o.block} for r, g in grants.items() if any(s > o.block for s in g.values())},
        "dead_in_ledger": [k for k in await view.keys() if any(k.endswith(f":alive:{d}") for d in dead)]
        + [f"{r}:{d}" for r, g in grants.items() for d in dead if d in g]
        + [f"{k}:{d}" for k, w in (await view.wants()).items() for d in dead if d in w],
        "in_flight_after": in_flight,
        "engines": watch_summary(watches),
        "keys": {} if skew else key_results(played),  # skewed: the keys have no max_concurrency
        "load_average": played.load_average,
        "machine_cores": round(played.cores, 2),
    }
    return found


async def _in_flight_by_endpoint(replica: Replica, engines: Sequence[Engine]) -> dict[str, float]:
    """The replica's requests running on each capped engine (its tailguard_endpoint_in_flight), by engine role."""
    try:
        with trio.fail_after(2.0):
            metrics = await scrape(replica.port)
    except (OSError, trio.BrokenResourceError, ProtocolError, trio.TooSlowError):
        return {}
    urls = {f"http://{HOST}:{e.port}": e.role for e in engines}
    return {urls[url]: value for labels, value in metrics.get("tailguard_endpoint_in_flight", {}).items() if (url := dict(labels).get("endpoint")) in urls}


async def _cluster_grants(replica: Replica) -> dict[str, float]:
    try:
        with trio.fail_after(2.0):
            metrics = await scrape(replica.port)
    except (OSError, trio.BrokenResourceError, ProtocolError, trio.TooSlowError):
        return {}
    return {dict(labels)["resource"]: value for labels, value in metrics.get("tailguard_cluster_grant_seats", {}).items()}


def _first_mode(health: dict[str, list[tuple[float, str, str]]], mode: str, since: float, killed: Replica | None) -> float | None:
    """Seconds after ``since`` by which every replica but ``killed`` had reported ``mode`` (None if one never did)."""
    worst = 0.0
    for name, trail in health.items():
        if killed is not None and name == killed.name:
            continue
        seen = [t for t, _, m in trail if m == mode and t >= since]
        if not seen:
            return None
        worst = max(worst, seen[0] - since)
    return round(worst, 2)


# -- the whole run ------------------------------------------------------------------------------


async def measure(options: Options) -> dict[str, Any]:
    o = options
    started = time.perf_counter()
    result: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "cpus": os.cpu_count(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()},
        "capacity_per_s": round(capacity(o), 3),
        "keys": [asdict(k) for k in KEYS],
    }
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp_name:
        tmp = Path(tmp_name)
        async with trio.open_nursery() as nursery:
            sim_log = (tmp / "sim.log").open("ab")
            redis_log = (tmp / "redis.log").open("ab")
            ports = free_ports(6)
            redis = RedisProcess(nursery, ports[5], redis_log)
            await redis.start()
            engines = [Engine("interactive", ports[0], o.seats), Engine("batch-1", ports[1], o.seats), Engine("batch-2", ports[2], o.seats)]
            spec = ",".join([f"{ports[0]}:latency", f"{ports[1]}:throughput", f"{ports[2]}:throughput", f"{ports[3]}:instant", f"{ports[4]}:instant"])
            command = [sys.executable, "-m", "tailguard.sim", "--engines", spec, "--time-scale", f"{o.time_scale:g}"]
            sim = await start_process(nursery, command, sim_log)
            lab = Lab(o, tmp, nursery, redis, engines, (ports[3], ports[4]), [sim_log, redis_log])
            for port in ports[:5]:
                await wait_ready(port, sim, "the simulator")
            try:
                await phases(lab, result)
            finally:
                if redis.paused:  # no checkpoint here: runs even when cancelled
                    redis.pause(False)
                nursery.cancel_scope.cancel()
        for log in lab.logs:
            log.close()
        result["fallback_warnings"] = _fallback_warnings(tmp, [*(f"r{i}" for i in range(o.replicas + 1)), *(f"s{i}" for i in range(o.replicas))])
    result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["checks"] = checks(result)
    return result


async def phases(lab: Lab, result: dict[str, Any]) -> None:
    """The phases ``--phases`` names, in order; each writes its part of ``result``."""
    o = lab.options
    share = 1 / o.replicas
    if "cost" in o.phases:
        print("ledger cost", file=sys.stderr)
        result["ledger_cost"] = await ledger_cost(lab)
    group = await lab.group([f"r{i}" for i in range(o.replicas)], NAMESPACE, share)
    if "load" in o.phases:
        print("load", file=sys.stderr)
        single = await lab.group(["single"], None)
        alone = await lab.group(["single-ledger"], "bench-alone")
        runs = []
        for traffic in o.traffics:
            for load in o.loads:
                runs.append(await load_run(lab, "1 replica", single, traffic, load))
                if traffic == o.traffics[0] and load == o.loads[0]:
                    runs.append(await load_run(lab, "1 replica + ledger", alone, traffic, load))
                runs.append(await load_run(lab, f"{o.replicas} replicas", group, traffic, load))
        result["load"] = runs
        await stop_all(single + alone)
    dead: list[str] = []
    if "kill" in o.phases:
        print("kill -9 one replica", file=sys.stderr)
        victim = group[-1]
        async with ledger_view(lab, NAMESPACE) as view:
            result["kill"] = await kill_run(lab, group, victim, view)
        dead.append(victim.name)
        group = [r for r in group if r is not victim] + await lab.group([f"r{o.replicas}"], NAMESPACE, share)
    if "outage" in o.phases:
        print("redis-server stopped, then paused", file=sys.stderr)
        async with ledger_view(lab, NAMESPACE) as view:  # a client per phase: nothing of the old connections is reused
            result["outage_stop"] = await outage_run(lab, group, view, "stop", o.outage, dead, None)
        async with ledger_view(lab, NAMESPACE) as view:
            result["outage_pause"] = await outage_run(lab, group, view, "pause", o.pause, dead, group[0])
    await stop_all([r for r in group if r.alive])
    if "skew" in o.phases:
        print("redis-server stopped, a replica holding most seats, block 0", file=sys.stderr)
        # block 0: the first replica's grants may grow past its static share; keys without max_concurrency,
        # since with block 0 a key's grant never grows past the requests it already holds
        skewed = await lab.group([f"s{i}" for i in range(o.replicas)], "bench-skew", share, block=0, key_caps=False)
        async with ledger_view(lab, "bench-skew") as view:
            result["outage_skew"] = await outage_run(lab, skewed, view, "stop", max(3 * o.lease_ttl, 8.0), [], None, skew=True)
        await stop_all(skewed)


@asynccontextmanager
async def ledger_view(lab: Lab, namespace: str) -> AsyncIterator[LedgerView]:
    """The ledger of ``namespace`` as Redis holds it, through clients of its own."""
    url = lab.redis.url
    async with RedisLedger(url, namespace) as ledger:
        raw = coredis.Redis.from_url(url, decode_responses=True, stream_timeout=1.0, connect_timeout=1.0)
        async with raw:
            yield LedgerView(ledger, raw, namespace, list(lab.caps()))


def _fallback_warnings(tmp: Path, names: Sequence[str]) -> dict[str, int]:
    """How often each replica logged its fallback (a WARNING; its return is logged at INFO, below the level the replicas run at)."""
    return {name: (tmp / f"{name}.log").read_text(errors="replace").count("the shared ledger is away") for name in names if (tmp / f"{name}.log").exists()}


# -- checks and report ------------------------------------------------------------------------------


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """PASS/MISS per target of the issue this run can judge."""
    found: list[dict[str, Any]] = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        found.append({"check": name, "verdict": "info" if ok is None else ("PASS" if ok else "MISS"), "detail": detail})

    o = result["options"]
    runs = result.get("load", [])
    phases = [("load " + f"{r['setup']} {r['traffic']} {r['load']:g}", r) for r in runs]
    phases += [(name, result[name]) for name in ("kill", *OUTAGES) if name in result]
    over = [
        f"{label}: {role} {w['max_in_engine']}/{w['cap']} (first at {w['first_over_s']} s, {w['over_cap_looks']} looks)"
        for label, r in phases for role, w in r["engines"].items() if w["max_in_engine"] > w["cap"]
    ]
    watched = [w for _, r in phases for w in r["engines"].values()]
    if watched:  # the cost phase alone watches no engine: nothing to judge
        intervals = [w["mean_interval_ms"] for w in watched]
        add("no engine ever above its cap (running + waiting, engines' /metrics)", not over,
            f"{sum(w['looks'] for w in watched)} looks, mean interval {min(intervals):.1f}-{max(intervals):.1f} ms, "
            f"longest gap {max(w['longest_gap_ms'] for w in watched):.0f} ms; " + ("; ".join(over) if over else "max seen = cap at most"))
    key_over = [
        f"{label}: {k} {v['max_streaming']}/{v['cap']} for {v['longest_above_cap_ms']} ms"
        for label, r in phases for k, v in r["keys"].items() if v["max_streaming"] > v["cap"]
    ]
    if o.get("key_caps", True) and phases:
        add("no API key above its max_concurrency (client: first to last token of each 200)", not key_over, "; ".join(key_over) or "none")
    cost = result.get("ledger_cost")
    if cost:
        add("added latency per request from the ledger (instant engine, 1 replica, [cluster] vs none)", None,
            f"p50 {cost['added_ms']['p50']:+.3f} ms, p99 {cost['added_ms']['p99']:+.3f} ms at {cost['rate']:g} req/s")
    by = {(r["setup"], r["traffic"], r["load"]): r for r in runs}
    many = f"{o['replicas']} replicas"
    for (setup, traffic, load), run in by.items():
        if setup != many or ("1 replica", traffic, load) not in by:
            continue
        one = by[("1 replica", traffic, load)]["short"]["e2e_ms"]["p99"]
        mine = run["short"]["e2e_ms"]["p99"]
        ratio = mine / one if one and not math.isnan(one) else math.nan
        add(f"short E2E P99 {many} <= 1.1x 1 replica ({traffic} {load:g})", ratio <= 1.1, f"{mine:.0f} ms vs {one:.0f} ms: {ratio:.2f}x")
    if ("1 replica + ledger", o["traffics"][0], o["loads"][0]) in by:
        with_ledger = by[("1 replica + ledger", o["traffics"][0], o["loads"][0])]["short"]["e2e_ms"]
        plain = by[("1 replica", o["traffics"][0], o["loads"][0])]["short"]["e2e_ms"]
        add(f"short E2E, 1 replica with [cluster] vs without ({o['traffics'][0]} {o['loads'][0]:g})", None,
            f"p50 {with_ledger['p50'] - plain['p50']:+.0f} ms, p99 {with_ledger['p99'] - plain['p99']:+.0f} ms (real)")
    kill = result.get("kill")
    if kill:
        gone, cleared = kill["lease_gone_after_s"], kill["grants_gone_after_s"]
        add("kill -9: the dead replica's seats return within lease_ttl", gone is not None and gone <= o["lease_ttl"] + _LEDGER_POLL_S,
            f"lease gone {gone} s, grants out of the ledger {cleared} s after the kill (lease_ttl {o['lease_ttl']:g} s, sync {o['sync_interval']:g} s); "
            f"it held {kill.get('victim_grants_at_kill')}")
        add("kill -9: every request on the survivors ends with one answer", kill["survivor_unanswered"] == 0,
            f"survivors {kill['survivor_outcomes']}; on the victim {kill['victim_outcomes']}")
    for name in OUTAGES:
        out = result.get(name)
        if not out:
            continue
        label = f"Redis {out['mode']} {out['hold_s']:g} s" + (", skewed, block 0" if out["skew"] else "")
        over_engine = [
            f"{role} {w['max_in_engine']}/{w['cap']} from {w['first_over_s']} s ({w['over_cap_looks']} looks; Redis down {out['redis_down_at_s']} s, "
            f"back {out['redis_back_at_s']} s)"
            for role, w in out["engines"].items() if w["max_in_engine"] > w["cap"]
        ]
        add(f"{label}: caps never exceeded (engines)", not over_engine, "; ".join(over_engine) or "max in engine <= cap on every engine")
        served = out["ok_during_outage"]
        victim = out["victim"]
        continues = out["degraded_everywhere"] and all(n > 0 for name_, n in served.items() if name_ != victim) and out["fallback_within_s"] is not None
        add(f"{label}: service continues, degraded, on static shares", continues,
            f"fallback on every replica within {out['fallback_within_s']} s; ok answers sent during the outage per replica {served}; "
            f"back on the ledger within {out['ledger_again_within_s']} s of Redis's return; unanswered on survivors {out['unanswered_on_survivors']}")
        consistent = not out["ledger_over_cap"] and not out["strangers_after"] and not out["dead_in_ledger"] and not out["idle_grant_above_block"] \
            and not any(out["in_flight_after"].values())
        add(f"{label}: ledger consistent afterwards", consistent,
            f"max sum of grants {out['ledger_max_sum']} (over cap: {out['ledger_over_cap'] or 'none'}); idle grants {out['grant_sum_after']}; "
            f"above block: {out['idle_grant_above_block'] or 'none'}; unknown replicas {out['strangers_after'] or 'none'}; "
            f"dead replicas' keys {out['dead_in_ledger'] or 'none'}; in flight after {out['in_flight_after']}")
    return found


def render(result: dict[str, Any], command: str) -> str:
    o = result["options"]
    lines = [
        "# python -m bench cluster",
        "",
        f"`{command}` on {result['date']}, commit {result['commit']}, {result['cpus']} CPUs, wall time {result['wall_s']:g} s.",
        f"Load average (1, 5, 15 min) at the start {result['load_average_start']}, at the end {result['load_average_end']} "
        "(a shared machine: other work ran beside this one).",
        "",
        f"Engines: one latency engine (interactive pool), two throughput engines (batch pool), endpoint cap {o['seats']} each, "
        f"time scale {o['time_scale']:g} (times below are real); capacity for the origin's mix {result['capacity_per_s']:g} req/s. "
        f"Keys: " + ", ".join(f"{k['name']} {k['share']:.0%} of requests, max_concurrency {k['max_concurrency']}" for k in result["keys"]) + ". "
        f"[cluster]: lease_ttl {o['lease_ttl']:g} s, sync_interval {o['sync_interval']:g} s, block {o['block']}, "
        f"static_share 1/{o['replicas']} for the {o['replicas']} replicas. Warm-up {o['warmup']:g} s, window {o['window']:g} s, "
        f"drain <= {o['drain']:g} s; bursty: twice the rate for half of every {o['burst_period']:g} s, then silence. "
        f"Redis stopped {o['outage']:g} s, paused {o['pause']:g} s.",
        "",
        "## Checks",
        "",
        "| check | verdict | detail |",
        "|---|---|---|",
        *(f"| {c['check']} | {c['verdict']} | {c['detail']} |" for c in result["checks"]),
        "",
    ]
    cost = result.get("ledger_cost")
    if cost:
        lines += [
            "## What the ledger adds per request",
            "",
            f"Open loop, Poisson {cost['rate']:g} req/s, short non-streaming chat (16 tokens) on an instant engine, "
            f"{cost['rounds']} alternating rounds of {cost['seconds_per_round']:g} s each.",
            "",
            "| tailguard | n | errors | p50 ms | p90 ms | p99 ms | CPU µs/request |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in ("plain", "ledger"):
            c = cost[name]
            lines.append(f"| {name} | {c['n']} | {c['errors']} | {c['p50_ms']:.3f} | {c['p90_ms']:.3f} | {c['p99_ms']:.3f} | {c['cpu_us_per_request']:.0f} |")
        added = cost["added_ms"]
        lines += ["", f"Added by the ledger: p50 {added['p50']:+.3f} ms, p90 {added['p90']:+.3f} ms, p99 {added['p99']:+.3f} ms.", ""]
    if result.get("load"):
        lines += [
            "## Load",
            "",
            "| set-up | traffic | load | req/s | short ok / n | short 429 / 503 | short E2E p50 / p99 ms | long ok / n | long E2E p50 ms | "
            "engines max in engine / cap | keys most streaming at once / cap | 429 per key | machine cores | load avg |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["load"]:
            s, lg = r["short"], r["long"]
            engines = " ".join(f"{w['max_in_engine']}/{w['cap']}" for w in r["engines"].values())
            keys = " ".join(f"{v['max_streaming']}/{v['cap'] if o.get('key_caps', True) else '-'}" for v in r["keys"].values())
            rejected = " ".join(f"{k}:{v['outcomes'].get('429', 0)}" for k, v in r["keys"].items())
            lines.append(
                f"| {r['setup']} | {r['traffic']} | {r['load']:g} | {r['rate_per_s']:.1f} | {s['outcomes'].get('ok', 0)}/{s['n']} | "
                f"{s['outcomes'].get('429', 0)} / {s['outcomes'].get('503', 0)} | {s['e2e_ms']['p50']:.0f} / {s['e2e_ms']['p99']:.0f} | "
                f"{lg['outcomes'].get('ok', 0)}/{lg['n']} | {lg['e2e_ms']['p50']:.0f} | {engines} | {keys} | {rejected} | {r['machine_cores']:.2f} | {r['load_average'][0]:g} |"
            )
        lines += ["", "Engines: interactive, batch-1, batch-2. Keys: " + ", ".join(k["name"] for k in result["keys"]) + ".", ""]
    kill = result.get("kill")
    if kill:
        lines += [
            "## kill -9 one replica",
            "",
            f"{kill['victim']} killed {kill['kill_at_s']:g} s into a Poisson run at load {o['loads'][0]:g} ({kill['arrivals']} arrivals), "
            "then dropped from the client's round robin.",
            "",
            f"- its grants at the kill: {kill.get('victim_grants_at_kill')}",
            f"- its lease gone from Redis {kill['lease_gone_after_s']} s after the kill; its grants gone from every hash {kill['grants_gone_after_s']} s after",
            f"- ledger afterwards: {kill.get('grants_after')}",
            f"- survivors' requests: {kill['survivor_outcomes']} (unanswered {kill['survivor_unanswered']}); the victim's: {kill['victim_outcomes']}",
            f"- survivors' short E2E p50 / p99: {kill['survivor_short']['e2e_ms']['p50']:.0f} / {kill['survivor_short']['e2e_ms']['p99']:.0f} ms",
            "- engines, max in engine / cap: " + ", ".join(f"{role} {w['max_in_engine']}/{w['cap']}" for role, w in kill["engines"].items()),
            "",
        ]
    for name in OUTAGES:
        out = result.get(name)
        if not out:
            continue
        what = "killed (SIGKILL), started again empty on the same port" if out["mode"] == "stop" else "paused (SIGSTOP), then resumed (SIGCONT)"
        lines += [
            f"## Redis {out['mode']}: {out['hold_s']:g} s" + (", a replica holding most seats (block 0)" if out["skew"] else ""),
            "",
            f"Poisson at load {out['load']:g}, {out['arrivals']} arrivals, replicas {', '.join(out['replicas'])}; redis-server {what}: "
            f"down at {out['redis_down_at_s']} s, back at {out['redis_back_at_s']} s."
            + (f" {out['victim']} killed (SIGKILL) at {out.get('victim_killed_at_s')} s." if out["victim"] else "")
            + (f" Replicas with block 0 and keys without max_concurrency, in a namespace of their own; until Redis went, the client "
               f"sent every request to {out['replicas'][0]} (a balancer out of step), round robin from then on." if out["skew"] else ""),
            "",
            f"- each replica's requests on each capped engine when Redis went (its tailguard_endpoint_in_flight): {out.get('held_at_outage')}",
            f"- outcomes: {out['outcomes']}; unanswered on survivors {out['unanswered_on_survivors']}",
            f"- ok answers to requests sent during the outage (from 1 s after it began), per replica: {out['ok_during_outage']}",
            f"- every replica in fallback within {out['fallback_within_s']} s; on the ledger again within {out['ledger_again_within_s']} s of Redis's return",
            f"- grants each replica used 1 s before Redis came back (its /metrics): {out['grants_in_fallback']}",
            "- engines, max in engine / cap: " + ", ".join(f"{role} {w['max_in_engine']}/{w['cap']}" for role, w in out["engines"].items()),
            "- keys, most streaming at once / cap: " + ", ".join(f"{k} {v['max_streaming']}/{v['cap']}" for k, v in out["keys"].items()),
            f"- ledger reads during the run: {out['ledger_reads']}; largest sum of grants per resource: {out['ledger_max_sum']}",
            f"- ledger afterwards (idle): {out['grants_after']}",
            f"- dead replicas' keys left: {out['dead_in_ledger'] or 'none'}; tailguard_pool_in_flight afterwards: {out['in_flight_after']}",
            "- /health per replica (time s, status, cluster mode): "
            + "; ".join(f"{n}: " + ", ".join(f"{t:g} {st} {m}" for t, st, m in trail) for n, trail in out["health"].items()),
            "",
        ]
    lines += [
        "## Notes",
        "",
        f"- Fallback warnings each replica logged (one per outage expected): {result.get('fallback_warnings')}",
        "- The engines' own maximum (`EngineStatistics.max_running_seen` in bench/sim/engine.py) is not on the simulator's "
        "HTTP surface; the check above rests on the /metrics gauges sampled every ~10 ms (see the mean interval). "
        "A gauge such as `vllm:num_requests_running_max` (or `sim:max_running_seen`) in bench/sim/metrics.py would make it exact.",
        "- Per-key concurrency is counted at the client from the first to the last token of each 200 answer, which lies "
        "inside the router's hold of the key's seat but for the client's own read lag at the end; "
        "`max_sent_to_end` in the JSON (send to last byte) is an upper bound.",
        "",
    ]
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = driver_parser("cluster", __doc__)
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run (~3 min): one load, Poisson only, short windows, Redis down 8 s and paused 4 s")
    add("--replicas", type=int, default=4, help="replicas sharing the caps (default %(default)s)")
    add("--seats", type=int, default=8, help="every capped endpoint's max_concurrency (default %(default)s)")
    add_time_scale_arg(parser, 2.0)
    add("--loads", default="0.8,1.3", help="fractions of the capped engines' capacity (default %(default)s)")
    add("--traffic", default="poisson,bursty", help="arrival processes, comma-separated (default %(default)s)")
    add("--burst-period", type=float, default=6.0, help="bursty: twice the rate for half of this many s, then silence (default %(default)s)")
    add_warmup_arg(parser, 3.0, "unmeasured arrivals first, s")
    add("--window", type=float, default=15.0, help="measured arrivals, s (default %(default)s)")
    add("--drain", type=float, default=10.0, help="longest wait after the last arrival, s (default %(default)s)")
    add("--lease-ttl", type=float, default=2.0, help="[cluster] lease_ttl, s (default %(default)s)")
    add("--sync-interval", type=float, default=0.1, help="[cluster] sync_interval, s (default %(default)s)")
    add("--block", type=int, default=2, help="[cluster] block (default %(default)s)")
    add("--outage", type=float, default=30.0, help="s redis-server stays killed before it starts again (default %(default)s)")
    add("--pause", type=float, default=10.0, help="s redis-server stays paused (SIGSTOP) (default %(default)s)")
    add("--overhead-rate", type=float, default=100.0, help="ledger cost: req/s of the open loop (default %(default)s)")
    add("--overhead-seconds", type=float, default=5.0, help="ledger cost: s per round (default %(default)s)")
    add("--overhead-rounds", type=int, default=4, help="ledger cost: rounds, alternating (default %(default)s)")
    add_seed_arg(parser, 1, "the arrivals and key choices")
    add("--phases", default=",".join(PHASES), help="phases to run, comma-separated, of: " + ", ".join(PHASES) + " (default: all)")
    add("--no-key-caps", action="store_true", help="API keys without max_concurrency (experiments; the key check then says nothing)")
    add("--name", default=None, help="base name of the outputs (default cluster, or cluster-quick)")
    add_out_arg(parser, RESULTS)
    return parser


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    try:
        loads = tuple(float(x) for x in args.loads.split(",") if x.strip())
    except ValueError:
        parser.error("--loads is comma-separated numbers")
    traffics = tuple(t.strip() for t in args.traffic.split(",") if t.strip())
    if not loads or min(loads) <= 0 or any(t not in ("poisson", "bursty") for t in traffics) or not traffics:
        parser.error("--loads > 0; --traffic of poisson, bursty")
    phases = tuple(x.strip() for x in args.phases.split(",") if x.strip())
    if not phases or any(x not in PHASES for x in phases):
        parser.error(f"--phases of: {', '.join(PHASES)}")
    if args.replicas < 2 or args.seats < args.replicas:
        parser.error("--replicas >= 2 and --seats >= --replicas (each static share at least one seat)")
    quick = args.quick
    return Options(
        time_scale=args.time_scale,
        seats=args.seats,
        replicas=args.replicas,
        loads=(loads[0],) if quick else loads,
        traffics=("poisson",) if quick else traffics,
        burst_period=args.burst_period,
        warmup=2.0 if quick else args.warmup,
        window=8.0 if quick else args.window,
        drain=8.0 if quick else args.drain,
        lease_ttl=args.lease_ttl,
        sync_interval=args.sync_interval,
        block=args.block,
        outage=8.0 if quick else args.outage,
        pause=4.0 if quick else args.pause,
        overhead_rate=args.overhead_rate,
        overhead_seconds=3.0 if quick else args.overhead_seconds,
        overhead_rounds=2 if quick else args.overhead_rounds,
        sample_interval=0.01,
        seed=args.seed,
        out=args.out,
        phases=phases,
        key_caps=not args.no_key_caps,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = options_from(args, parser)
    command = " ".join(["python -m bench cluster", *(argv or [])])
    result = run_trio(measure, options, said="redis-server, the simulator and tailguard were stopped")
    if result is None:
        return 130
    text = render(result, command)
    name = args.name or ("cluster-quick" if args.quick else "cluster")
    options.out.mkdir(parents=True, exist_ok=True)
    write_json(options.out / f"{name}.json", result)
    (options.out / f"{name}.md").write_text(text)
    print(text)
    print(f"wrote {options.out / name}.md and .json")
    return 0

