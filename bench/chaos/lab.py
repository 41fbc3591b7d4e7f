"""What the chaos run, its attacks and its report share: options, the running lab, the result types.

Kept apart from ``bench.chaos.run`` so that ``attacks`` and ``report`` import
these without importing the run that imports them.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.chaos.client import HttpPool, RequestSpec
from bench.harness.config import PoolSpec, classes_tables, pools_table, server_table, tailguard_config as shared_config
from bench.harness.grpc import AsyncioThread
from bench.harness.procs import RESULTS_ROOT, free_ports, start_tailguard, stop, wait_ready
from bench.harness.redis import RedisProcess
from bench.harness.toml import TomlTable, dumps, merged
from tailguard.router.config import ServerConfig, TimeoutsConfig
from tailguard.router.quotas import hash_key

RESULTS = RESULTS_ROOT / "chaos"
HOST = "127.0.0.1"
E2E_TIMEOUT_S = 8.0  # tailguard's end_to_end_timeout here: a hung request ends within it
E2E_SHIPPED_S = TimeoutsConfig.end_to_end_timeout  # as shipped (the black hole phase runs with it)
CLIENT_SLACK_S = 4.0  # the client waits this much longer before it calls a request unanswered
SEATS_PER_ENGINE = 8  # interactive endpoints' max_concurrency
BATCH_SEATS = 16  # the batch engine's max_concurrency
INTERACTIVE_QUEUE = BATCH_QUEUE = 64  # the pools' max_queue
BATCH_QUEUE_TIMEOUT_S = 5.0
ENGINE_SEQUENCES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
SETTLE_MAX_S = 15.0
FD_SLACK = 10  # descriptors a phase may leave behind (besides CLOSE-WAIT client sockets)
MAX_NORMAL_REQUESTS = 5_000  # a count bound on one phase's normal traffic, beside its time bound
_CLOSE_WAIT = "08"  # the state column of /proc/net/tcp
RELOAD_BOUND_S = 30.0  # a reload of thousands of keys takes a while
SCRAPE_TIMEOUT_S = 60.0  # a /metrics page of tens of MB (every caller's series) takes seconds, here up to a minute
# tailguard's key for the engines (the simulator runs with --api-key, as vLLM with one): made up, and no
# answer a client gets, nor tailguard's log, may ever hold it.
ENGINE_KEY_ENV = "TAILGUARD_CHAOS_ENGINE_KEY"
ENGINE_KEY = "chaos-engine-key-5e0f9c2a71"
# The gRPC gate as shipped (server.grpc_max_calls): the flood's rounds are sized from it.
SHIPPED_GRPC_GATE = ServerConfig.grpc_max_calls


@dataclass(frozen=True)
class Options:
    quick: bool
    window: float  # s a fault stays on (engine faults, baseline, overload)
    pre: float  # s of normal traffic before the attack
    post: float  # s of normal traffic after the fault's end (recovery is measured there)
    surrogate_s: float  # one lone-surrogate request a second for this long
    fuzz: int
    fuzz_rate: float
    probe_rounds: int
    cancels: int
    cancel_rate: float
    reloads: int
    reload_interval: float
    grpc_calls: tuple[int, ...]  # the gRPC flood's rounds: concurrent calls in each
    huge_mib: int
    overload_s: float
    tenant_keys: int  # API keys in each set of the tenant cardinality phases (three sets: two rotations)
    tenant_idle_s: float  # idle time before the tenant cardinality phase looks at /metrics and RSS
    budget_s: float  # the Redis-restart budget phase's length (the restart a third of the way in)
    black_hole_wait_s: float  # how long a stream to the black-holed engine is waited for (the shipped deadline is 120 s)
    shed_calls: int  # gRPC calls in each of the shed evasion's two floods
    overload_pool: str = "batch"
    normal_rate: float = 20.0
    seed: int = 0
    attacks: tuple[str, ...] = ()
    serve_args: tuple[str, ...] = ()
    out: Path = RESULTS
    name: str = "chaos"


DEFAULT = Options(
    quick=False, window=4.0, pre=1.0, post=4.0, surrogate_s=10, fuzz=400, fuzz_rate=80.0, probe_rounds=5,
    cancels=300, cancel_rate=100.0, reloads=250, reload_interval=0.02, grpc_calls=(2 * SHIPPED_GRPC_GATE, 5 * SHIPPED_GRPC_GATE),
    huge_mib=32, overload_s=10.0, tenant_keys=5000, tenant_idle_s=65.0, budget_s=90.0, black_hole_wait_s=E2E_SHIPPED_S + CLIENT_SLACK_S,
    shed_calls=2000,
)  # fmt: skip
QUICK = replace(
    DEFAULT, quick=True, window=2.0, pre=0.5, post=2.5, surrogate_s=5, fuzz=150, probe_rounds=2, cancels=120,
    reloads=100, grpc_calls=(5 * SHIPPED_GRPC_GATE,), huge_mib=8, overload_s=5.0, tenant_keys=500, tenant_idle_s=5.0,
    budget_s=24.0, black_hole_wait_s=10.0, shed_calls=1500, name="chaos-quick",
)  # fmt: skip


@dataclass(frozen=True)
class ProcStats:
    """One look at tailguard's process."""

    fds: int
    rss_mib: float
    engine_conns: int  # TCP sockets it holds to the engines' ports
    close_wait: int  # client sockets the client closed and tailguard has not (they hold fds)


@dataclass
class PhaseResult:
    attack: str
    description: str
    wall_s: float
    requests: int
    outcomes: dict[str, int]
    normal: int
    normal_failed: dict[str, int]
    normal_failed_during_fault: int
    no_terminal: int
    seats: float | None
    queued: float | None
    engine_busy: float | None  # running + waiting sequences over the engines
    settle_s: float
    before: ProcStats
    after: ProcStats
    rss_max_mib: float
    recovery_s: float | None
    counted_by_tailguard: int | None  # rise of tailguard_requests_total over the phase
    log_errors: int  # ERROR / Traceback lines tailguard logged during the phase
    tailguard_exit: int | None  # its exit code, when the attack killed it (it is restarted)
    stale_retries: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Key:
    """One ``[[auth.keys]]`` entry of a phase's config; its (made-up) secret follows from its name."""

    name: str
    tokens_per_minute: int | None = None

    @property
    def secret(self) -> str:
        return f"tg-chaos-{self.name}"

    @property
    def header(self) -> tuple[str, str]:
        return ("authorization", f"Bearer {self.secret}")

    def table(self) -> TomlTable:
        """Its entry of ``auth.keys``: the name, the secret's SHA-256, the budget if any."""
        budget: TomlTable = {} if self.tokens_per_minute is None else {"tokens_per_minute": self.tokens_per_minute}
        return {"name": self.name, "key_sha256": hash_key(self.secret), **budget}


NORMAL_KEY = Key("normal")  # the normal traffic's key, in every phase that turns [auth] on


@dataclass(frozen=True)
class Setup:
    """tailguard's config in a phase: the lab's own (the defaults), or another an attack needs.

    A phase whose setup differs from the one in force runs on a tailguard
    restarted with it; an attack may also rewrite it and reload (SIGHUP).
    """

    a_cap: int = SEATS_PER_ENGINE  # engine a's max_concurrency (the reload storm moves it)
    shipped_timeouts: bool = False  # the shipped end_to_end and first-byte timeouts and health checks, not the lab's
    interactive_pool: bool = True  # False: no interactive pool; its class goes to the batch pool
    batch_queue: int = BATCH_QUEUE
    keys: tuple[Key, ...] = ()  # any: [auth] on, NORMAL_KEY added
    cluster: str | None = None  # a namespace: [cluster] on the lab's redis-server
    replica: str = "chaos-1"  # [cluster]'s replica_id

    @property
    def room(self) -> int:
        """Requests the pools seat and queue together (what the gRPC gate is bounded by: docs/grpc.md)."""
        interactive = 2 * SEATS_PER_ENGINE + INTERACTIVE_QUEUE if self.interactive_pool else 0
        return interactive + BATCH_SEATS + self.batch_queue

    @property
    def normal_headers(self) -> tuple[tuple[str, str], ...]:
        """What normal traffic adds to its requests under this setup."""
        return (NORMAL_KEY.header,) if self.keys else ()


@dataclass
class Lab:
    """The running processes, their ports and the client: what every attack acts on."""

    options: Options
    tg_port: int
    grpc_port: int
    admin_port: int
    engines: dict[str, int]
    config_path: Path
    tg_log: Path
    sim: trio.Process
    tailguard: trio.Process
    pool: HttpPool
    aio: AsyncioThread
    nursery: trio.Nursery
    tg_log_file: Any
    workdir: Path
    client_timeout: float = E2E_TIMEOUT_S + CLIENT_SLACK_S
    capacity: dict[str, float] = field(default_factory=dict)  # pool -> requests a second it can finish
    setup: Setup = Setup()  # the config in force
    redis: RedisProcess | None = None  # started by the first phase with [cluster]

    def write_config(self, setup: Setup) -> None:
        """Replace the config file at once (tailguard never reads half a file); it is in force once read."""
        self.setup = setup
        fresh = self.config_path.with_suffix(".new")
        fresh.write_text(self.config_text(setup, self.tg_port, self.grpc_port))
        os.replace(fresh, self.config_path)

    def config_text(self, setup: Setup, tg_port: int, grpc_port: int) -> str:
        redis_url = None if self.redis is None else self.redis.url
        return tailguard_config(tg_port, grpc_port, self.engines, setup, redis_url)

    @property
    def env(self) -> dict[str, str]:
        """tailguard's environment beyond this process's: the engines' key."""
        return {ENGINE_KEY_ENV: ENGINE_KEY}

    async def reload(self, setup: Setup) -> None:
        """Write ``setup``, SIGHUP, and wait until tailguard counts the reload (ok or failed; bounded)."""
        before = sum((await self.reload_counts()).values())
        self.write_config(setup)
        os.kill(self.tailguard.pid, signal.SIGHUP)
        with trio.move_on_after(RELOAD_BOUND_S):
            while sum((await self.reload_counts()).values()) <= before:
                await trio.sleep(0.05)

    async def use(self, setup: Setup) -> None:
        """tailguard restarted with ``setup`` (a redis-server started first if it needs one), ready."""
        await self.pool.aclose()
        await stop(self.tailguard)
        if setup.cluster is not None and self.redis is None:
            self.redis = RedisProcess(self.nursery, free_ports(1)[0], self.tg_log_file)
            await self.redis.start()
        self.write_config(setup)
        self.tailguard = await self.start(self.config_path)
        await wait_ready(self.tg_port, self.tailguard, "tailguard (restarted)")

    async def start(self, config: Path) -> trio.Process:
        """A tailguard process on ``config``, with the lab's log, arguments and environment (not waited for)."""
        return await start_tailguard(self.nursery, config, log=self.tg_log_file, extra_args=self.options.serve_args, env=self.env)

    async def set_fault(self, engine: str, fault: dict[str, Any]) -> None:
        """Switch one engine's fault mode through the simulator's admin port."""
        admin = HttpPool(self.admin_port)
        spec = RequestSpec(f"/_sim/faults/{self.engines[engine]}", json.dumps(fault).encode())
        reply = await admin.request(spec, 5.0, keep=False)
        if reply.status != 200:
            raise RuntimeError(f"the simulator refused fault {fault}: {reply.status} {reply.body[:200]!r}")

    async def scrape(self, port: int, names: tuple[str, ...]) -> dict[tuple[str, str], float] | None:
        """The samples of a /metrics page whose names start with one of ``names``, as {(sample name, sorted labels): value}.

        None when it does not answer. Only those lines are parsed: a page of
        every caller's series can be tens of MB.
        """
        reply = await HttpPool(port).request(RequestSpec("/metrics", b"", method="GET", headers=()), SCRAPE_TIMEOUT_S, keep=False)
        if reply.status != 200:
            return None
        wanted = tuple(name.encode() for name in names)
        text = b"\n".join(line for line in reply.body.splitlines() if line.startswith(wanted)).decode("utf-8", "replace")
        samples: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())))] = sample.value
        return samples

    async def tailguard_sum(self, name: str) -> float | None:
        samples = await self.scrape(self.tg_port, (name,))
        return None if samples is None else sum(v for (n, _), v in samples.items() if n == name)

    async def loop_lag_buckets(self) -> tuple[dict[float, float], float, float] | None:
        """tailguard's event-loop lag histogram now: ({upper bound: cumulative count}, sum, worst); None if it does not answer."""
        samples = await self.scrape(self.tg_port, ("tailguard_event_loop_lag",))
        if samples is None:
            return None
        buckets = {
            float(labels.removeprefix("le=")): value for (name, labels), value in samples.items() if name == "tailguard_event_loop_lag_seconds_bucket"
        }
        total = samples.get(("tailguard_event_loop_lag_seconds_sum", ""), 0.0)
        return buckets, total, samples.get(("tailguard_event_loop_lag_max_seconds", ""), 0.0)

    async def reload_counts(self) -> dict[str, float]:
        samples = await self.scrape(self.tg_port, ("tailguard_config_reloads",)) or {}
        return {
            labels.removeprefix("result="): value for (name, labels), value in samples.items() if name == "tailguard_config_reloads_total"
        }

    async def busy(self) -> tuple[float | None, float | None, float | None]:
        """(seats in use, requests queued) in tailguard; sequences running or waiting in the engines."""
        samples = await self.scrape(self.tg_port, ("tailguard_pool_in_flight", "tailguard_pool_queue_length"))
        seats = queued = None
        if samples is not None:
            seats = sum(v for (n, _), v in samples.items() if n == "tailguard_pool_in_flight")
            queued = sum(v for (n, _), v in samples.items() if n == "tailguard_pool_queue_length")
        engine = 0.0
        for port in self.engines.values():
            page = await self.scrape(port, ENGINE_SEQUENCES)
            if page is None:
                return seats, queued, None
            engine += sum(page.values())
        return seats, queued, engine

    async def ensure_tailguard(self) -> int | None:
        """Restart tailguard if it exited; its exit code then."""
        code = self.tailguard.returncode
        if code is None:
            return None
        self.write_config(self.setup)
        self.tailguard = await self.start(self.config_path)
        await wait_ready(self.tg_port, self.tailguard, "tailguard (restarted)")
        return code


def tailguard_config(tg_port: int, grpc_port: int, engines: dict[str, int], setup: Setup = Setup(), redis_url: str | None = None) -> str:
    """tailguard's config: two pools, the shipped classes, an 8 s end-to-end timeout; or ``setup``'s variation.

    The interactive pool is set up as its docs advise for hung engines: a
    first-byte timeout well inside the end-to-end one, and the completion
    health probe, which sees an engine that answers /health but hangs
    (``setup.shipped_timeouts``: neither, and the shipped 120 s). Every pool
    sends the engines' key (``api_key_env``), as a fleet of engines started
    with vLLM's ``--api-key`` needs.
    """
    key: TomlTable = {"api_key_env": ENGINE_KEY_ENV}
    hardened: TomlTable = {} if setup.shipped_timeouts else {"first_byte_timeout": 2.0, "health_check": "completion"}
    interactive = PoolSpec(
        "interactive", [(engines["a"], setup.a_cap), (engines["b"], SEATS_PER_ENGINE)], 2 * SEATS_PER_ENGINE, INTERACTIVE_QUEUE, extra={**key, **hardened}
    )
    batch = PoolSpec("batch", [(engines["c"], BATCH_SEATS)], BATCH_SEATS, setup.batch_queue, extra=key)
    keys: TomlTable = {"auth": {"keys": [k.table() for k in (NORMAL_KEY, *setup.keys)]}} if setup.keys else {}
    sections = merged(_timeouts(setup), _cluster(setup, redis_url), keys)
    if setup.interactive_pool:
        return shared_config(tg_port, grpc_port, interactive, batch, batch_queue_timeout=BATCH_QUEUE_TIMEOUT_S, sections=sections)
    classes = classes_tables({"interactive": "batch", "batch": "batch"}, {"interactive": 3.0, "batch": BATCH_QUEUE_TIMEOUT_S})
    return dumps(merged(server_table(tg_port, grpc_port), sections, pools_table(batch), classes))


def _timeouts(setup: Setup) -> TomlTable:
    e2e: TomlTable = {} if setup.shipped_timeouts else {"end_to_end_timeout": E2E_TIMEOUT_S}
    return {"timeouts": e2e, "metrics": {"backend_scrape_interval": 1.0}}


def _cluster(setup: Setup, redis_url: str | None) -> TomlTable:
    if setup.cluster is None:
        return {}
    if redis_url is None:
        raise RuntimeError("a [cluster] setup before the lab's redis-server started")
    return {"cluster": {"redis_url": redis_url, "namespace": setup.cluster, "replica_id": setup.replica}}


def proc_stats(pid: int, engine_ports: Sequence[int], own_ports: Sequence[int] = ()) -> ProcStats:
    """Descriptors, RSS, sockets to the engines and CLOSE-WAIT sockets on ``own_ports`` of ``pid`` (zeros once it is gone)."""
    try:
        fd_dir = Path(f"/proc/{pid}/fd")
        inodes = set()
        fds = 0
        for fd in os.listdir(fd_dir):
            fds += 1
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        rss = 0.0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
        engines = {f"{port:04X}" for port in engine_ports}
        own = {f"{port:04X}" for port in own_ports}
        conns = close_wait = 0
        for table in ("tcp", "tcp6"):
            for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = row.split()
                if cols[9] not in inodes:
                    continue
                if cols[2].rsplit(":", 1)[1] in engines:
                    conns += 1
                elif cols[1].rsplit(":", 1)[1] in own and cols[3] == _CLOSE_WAIT:
                    close_wait += 1
        return ProcStats(fds, round(rss, 1), conns, close_wait)
    except OSError:
        return ProcStats(0, 0.0, 0, 0)


@dataclass
class Result:
    command: str
    commit: str
    cpu_count: int
    options: dict[str, Any]
    capacity_req_per_s: dict[str, float]
    phases: list[PhaseResult]
    wall_s: float = 0.0
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
