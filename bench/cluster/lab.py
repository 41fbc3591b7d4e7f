"""What the cluster benchmark's modules share: its constants, options and keys, and the lab of processes it runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import trio

from bench.harness.client import HOST
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.procs import RESULTS_ROOT, free_ports, start_tailguard, wait_ready
from bench.harness.redis import RedisProcess
from bench.harness.replicas import KeySpec, Replica
from bench.harness.toml import TomlValue

RESULTS = RESULTS_ROOT / "cluster"


PHASES = ("cost", "load", "kill", "outage", "skew", "affinity")


OUTAGES = ("outage_stop", "outage_pause", "outage_skew")


NAMESPACE = "bench-cluster"


BATCH_QUEUE_TIMEOUT = 10.0  # real s (interactive: tailguard_config's 3 s)


MAX_QUEUE = 64


ANSWERED = ("ok", "429", "503", "timeout")  # one complete answer each (a 504 is "timeout")


PHASE_DRAIN = BATCH_QUEUE_TIMEOUT + 15.0  # kill and outage runs: every request ends (a long one runs ~9 s at time scale 2)


LEDGER_POLL_S = 0.02


HEALTH_POLL_S = 0.25


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
    affinity_requests: int = 800  # the affinity phase's requests, over all replicas


# -- processes -------------------------------------------------------------------------


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
    affinity: tuple[int, ...] = ()  # the affinity phase's pool of instant engines

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
        self, name: str, namespace: str | None, static_share: float = 1.0, instant: bool = False, block: int | None = None, key_caps: bool = True,
        *, pools: tuple[PoolSpec, PoolSpec] | None = None, access_log: bool = False,
    ) -> Replica:
        """A tailguard process (HTTP only), with ``[cluster]`` in ``namespace`` unless None; ``wait_ready`` before use.

        ``pools`` replaces the capped (or ``instant``) engines' pools; ``access_log``
        runs it at INFO, so its log holds a line per request.
        """
        http_port, grpc_port = free_ports(2)
        sections: dict[str, TomlValue] = {}
        if namespace is not None:
            o = self.options
            sections["cluster"] = {
                "redis_url": self.redis.url, "namespace": namespace, "replica_id": name, "lease_ttl": o.lease_ttl,
                "sync_interval": o.sync_interval, "static_share": static_share, "block": o.block if block is None else block,
            }  # fmt: skip
        capped = key_caps and self.options.key_caps
        sections["auth"] = {"keys": [key.table(capped) for key in KEYS]}
        text = tailguard_config(http_port, grpc_port, *(pools or self.pools(instant)), batch_queue_timeout=BATCH_QUEUE_TIMEOUT, sections=sections)
        config = self.tmp / f"{name}.toml"
        config.write_text(text)
        log_path = self.tmp / f"{name}.log"
        log = log_path.open("ab")
        self.logs.append(log)
        level = ["--log-level", "INFO"] if access_log else []
        process = await start_tailguard(self.nursery, config, log=log, extra_args=["--no-grpc", *level])
        return Replica(name, http_port, process, log_path)

    async def group(
        self, names: Sequence[str], namespace: str | None, static_share: float = 1.0, instant: bool = False, block: int | None = None,
        key_caps: bool = True, *, pools: tuple[PoolSpec, PoolSpec] | None = None, access_log: bool = False,
    ) -> list[Replica]:
        """Several replicas started at once (``replica``'s arguments); returns when every one answers /health 200."""
        replicas = [
            await self.replica(name, namespace, static_share, instant, block, key_caps, pools=pools, access_log=access_log) for name in names
        ]
        async with trio.open_nursery() as ready:
            for r in replicas:
                ready.start_soon(wait_ready, r.port, r.process, r.name)
        return replicas


