"""What the chaos run, its attacks and its report share: options, the running lab, the result types.

Kept apart from ``bench.chaos.run`` so that ``attacks`` and ``report`` import
these without importing the run that imports them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.chaos.client import HttpPool, RequestSpec
from bench.harness.config import PoolSpec
from bench.harness.config import tailguard_config as shared_config
from bench.harness.grpc import AsyncioThread
from bench.harness.procs import RESULTS_ROOT, start_tailguard, wait_ready
from tailguard.router.config_types import ServerConfig
from tailguard.server.grpc.service import gate_ceiling

RESULTS = RESULTS_ROOT / "chaos"
HOST = "127.0.0.1"
E2E_TIMEOUT_S = 8.0  # tailguard's end_to_end_timeout here: a hung request ends within it
CLIENT_SLACK_S = 4.0  # the client waits this much longer before it calls a request unanswered
SEATS_PER_ENGINE = 8  # interactive endpoints' max_concurrency
BATCH_SEATS = 16  # the batch engine's max_concurrency
QUEUE = 64  # each pool's max_queue
SETTLE_MAX_S = 15.0
FD_SLACK = 10  # descriptors a phase may leave behind (besides CLOSE-WAIT client sockets)
MAX_NORMAL_REQUESTS = 5_000  # a count bound on one phase's normal traffic, beside its time bound
_CLOSE_WAIT = "08"  # the state column of /proc/net/tcp


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
    overload_pool: str = "batch"
    normal_rate: float = 20.0
    seed: int = 0
    attacks: tuple[str, ...] = ()
    serve_args: tuple[str, ...] = ()
    out: Path = RESULTS
    name: str = "chaos"


DEFAULT = Options(
    quick=False, window=4.0, pre=1.0, post=4.0, surrogate_s=10, fuzz=400, fuzz_rate=80.0, probe_rounds=5,
    cancels=300, cancel_rate=100.0, reloads=250, reload_interval=0.02, grpc_calls=(2000, 5000), huge_mib=32, overload_s=10.0,
)  # fmt: skip
QUICK = replace(
    DEFAULT, quick=True, window=2.0, pre=0.5, post=2.5, surrogate_s=5, fuzz=150, probe_rounds=2, cancels=120,
    reloads=100, grpc_calls=(5000,), huge_mib=8, overload_s=5.0, name="chaos-quick",
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
    client_timeout: float = E2E_TIMEOUT_S + CLIENT_SLACK_S
    capacity: dict[str, float] = field(default_factory=dict)  # pool -> requests a second it can finish

    def write_config(self, a_cap: int = SEATS_PER_ENGINE, interactive_queue: int = QUEUE) -> None:
        """Replace the config file at once (tailguard never reads half a file)."""
        fresh = self.config_path.with_suffix(".new")
        fresh.write_text(tailguard_config(self.tg_port, self.grpc_port, self.engines, a_cap, interactive_queue))
        os.replace(fresh, self.config_path)

    async def set_fault(self, engine: str, fault: dict[str, Any]) -> None:
        """Switch one engine's fault mode through the simulator's admin port."""
        admin = HttpPool(self.admin_port)
        spec = RequestSpec(f"/_sim/faults/{self.engines[engine]}", json.dumps(fault).encode())
        reply = await admin.request(spec, 5.0, keep=False)
        if reply.status != 200:
            raise RuntimeError(f"the simulator refused fault {fault}: {reply.status} {reply.body[:200]!r}")

    async def scrape(self, port: int) -> dict[tuple[str, str], float] | None:
        """A /metrics page as {(sample name, sorted labels): value}; None when it does not answer."""
        reply = await HttpPool(port).request(RequestSpec("/metrics", b"", method="GET", headers=()), 2.0, keep=False)
        if reply.status != 200:
            return None
        samples: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(reply.body.decode("utf-8", "replace")):
            for sample in family.samples:
                samples[(sample.name, ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())))] = sample.value
        return samples

    async def tailguard_sum(self, name: str) -> float | None:
        samples = await self.scrape(self.tg_port)
        return None if samples is None else sum(v for (n, _), v in samples.items() if n == name)

    async def loop_lag_buckets(self) -> tuple[dict[float, float], float, float] | None:
        """tailguard's event-loop lag histogram now: ({upper bound: cumulative count}, sum, worst); None if it does not answer."""
        samples = await self.scrape(self.tg_port)
        if samples is None:
            return None
        buckets = {
            float(labels.removeprefix("le=")): value for (name, labels), value in samples.items() if name == "tailguard_event_loop_lag_seconds_bucket"
        }
        total = samples.get(("tailguard_event_loop_lag_seconds_sum", ""), 0.0)
        return buckets, total, samples.get(("tailguard_event_loop_lag_max_seconds", ""), 0.0)

    async def reload_counts(self) -> dict[str, float]:
        samples = await self.scrape(self.tg_port) or {}
        return {
            labels.removeprefix("result="): value for (name, labels), value in samples.items() if name == "tailguard_config_reloads_total"
        }

    async def busy(self) -> tuple[float | None, float | None, float | None]:
        """(seats in use, requests queued) in tailguard; sequences running or waiting in the engines."""
        samples = await self.scrape(self.tg_port)
        seats = queued = None
        if samples is not None:
            seats = sum(v for (n, _), v in samples.items() if n == "tailguard_pool_in_flight")
            queued = sum(v for (n, _), v in samples.items() if n == "tailguard_pool_queue_length")
        engine = 0.0
        for port in self.engines.values():
            page = await self.scrape(port)
            if page is None:
                return seats, queued, None
            engine += sum(v for (n, _), v in page.items() if n in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        return seats, queued, engine

    async def ensure_tailguard(self) -> int | None:
        """Restart tailguard if it exited; its exit code then."""
        code = self.tailguard.returncode
        if code is None:
            return None
        self.write_config()
        self.tailguard = await start_tailguard(self.nursery, self.config_path, log=self.tg_log_file, extra_args=self.options.serve_args)
        await wait_ready(self.tg_port, self.tailguard, "tailguard (restarted)")
        return code


def tailguard_config(
    tg_port: int, grpc_port: int, engines: dict[str, int], a_cap: int = SEATS_PER_ENGINE, interactive_queue: int = QUEUE
) -> str:
    """tailguard's config: two pools, the shipped classes, an 8 s end-to-end timeout.

    The interactive pool is set up as its docs advise for hung engines: a
    first-byte timeout well inside the end-to-end one, and the completion
    health probe, which sees an engine that answers /health but hangs.
    """
    hardened = ("first_byte_timeout = 2.0", 'health_check = "completion"')
    interactive = PoolSpec(
        "interactive", [(engines["a"], a_cap), (engines["b"], SEATS_PER_ENGINE)], 2 * SEATS_PER_ENGINE, interactive_queue, extra=hardened
    )
    batch = PoolSpec("batch", [(engines["c"], BATCH_SEATS)], BATCH_SEATS, QUEUE)
    timeouts = ["[timeouts]", f"end_to_end_timeout = {E2E_TIMEOUT_S}", "", "[metrics]", "backend_scrape_interval = 1.0", ""]
    return shared_config(tg_port, grpc_port, interactive, batch, batch_queue_timeout=5.0, sections=timeouts)


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


def shipped_gate_queue() -> int:
    """The interactive pool's max_queue with which the gRPC gate may reach the shipped one (``server.grpc_max_calls``).

    The gate's ceiling is twice what the pools can seat and queue, plus 64,
    where that is below the cap (``server.grpc.service.gate_ceiling``): with
    this lab's 16 + 16 seats and queues of 64 that is 368, under the shipped
    1,000 that a flood must meet.
    """
    shipped, queue = ServerConfig.grpc_max_calls, QUEUE
    while gate_ceiling(shipped, 2 * SEATS_PER_ENGINE + queue + BATCH_SEATS + QUEUE) < shipped:
        queue += 16
    return queue
