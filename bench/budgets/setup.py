"""The budget benchmark's processes: one simulated engine, one redis-server, the replicas sharing one budgeted key.

Built from the cluster benchmark's lab (``RedisProcess``, ``Replica``,
``stop_all``) and the harness's process helpers; each replica's config is
one pool of the one engine (seats that never bind), one class, ``[cluster]``
on the Redis, and the key with ``tokens_per_minute``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import trio

from bench.budgets.model import KEY_NAME, KEY_SECRET, MAX_QUEUE, NAMESPACE, POOL, Options, replica_name
from bench.harness.config import PoolSpec, one_class, pools_table, server_table
from bench.harness.procs import free_ports, start_simulator, start_tailguard, wait_ready
from bench.harness.redis import RedisProcess
from bench.harness.replicas import Replica, stop_all
from bench.harness.toml import TomlTable, dumps, merged
from tailguard.router.quotas import hash_key


def replica_config(o: Options, name: str, http_port: int, grpc_port: int, engine_port: int, redis_url: str) -> str:
    """One replica's config.toml: ``[cluster]`` in the benchmark's namespace, the budgeted key, one pool, one class."""
    pool = PoolSpec(POOL, [(engine_port, o.seats)], o.seats, MAX_QUEUE)
    cluster: TomlTable = {
        "redis_url": redis_url, "namespace": NAMESPACE, "replica_id": name,
        "lease_ttl": o.lease_ttl, "sync_interval": o.sync_interval, "static_share": o.static_share,
    }  # fmt: skip
    key: TomlTable = {"name": KEY_NAME, "key_sha256": hash_key(KEY_SECRET), "tokens_per_minute": o.budget}
    sections: TomlTable = {"cluster": cluster, "auth": {"keys": [key]}}
    return dumps(merged(server_table(http_port, grpc_port), sections, pools_table(pool), one_class(POOL, o.queue_timeout)))


@dataclass
class Fleet:
    """The running processes a run drives: Redis (paused by the timeline) and the replicas (one killed by it)."""

    redis: RedisProcess
    replicas: list[Replica]


@asynccontextmanager
async def fleet(o: Options, tmp: Path) -> AsyncIterator[Fleet]:
    """Every process started and ready; on the way out Redis resumed (if paused) and everything stopped."""
    logs: list[IO[bytes]] = []

    def log(name: str) -> IO[bytes]:
        logs.append((tmp / f"{name}.log").open("ab"))
        return logs[-1]

    try:
        async with trio.open_nursery() as nursery:
            engine_port, redis_port = free_ports(2)
            redis = RedisProcess(nursery, redis_port, log("redis"))
            await redis.start()
            sim = await start_simulator(nursery, [(engine_port, "latency")], o.time_scale, log("sim"), ["--max-num-seqs", str(o.seats)])
            await wait_ready(engine_port, sim, "the simulator")
            replicas = [await _replica(nursery, o, tmp, replica_name(i), engine_port, redis.url, log) for i in range(o.replicas)]
            async with trio.open_nursery() as ready:
                for r in replicas:
                    ready.start_soon(wait_ready, r.port, r.process, r.name)
            try:
                yield Fleet(redis, replicas)
            finally:
                if redis.paused:  # no checkpoint before it: runs even when cancelled
                    redis.pause(False)
                with trio.CancelScope(shield=True):
                    await stop_all([r for r in replicas if r.alive])
                nursery.cancel_scope.cancel()
    finally:
        for f in logs:
            f.close()


async def _replica(nursery: trio.Nursery, o: Options, tmp: Path, name: str, engine_port: int, redis_url: str, log: Callable[[str], IO[bytes]]) -> Replica:
    http_port, grpc_port = free_ports(2)
    config = tmp / f"{name}.toml"
    config.write_text(replica_config(o, name, http_port, grpc_port, engine_port, redis_url))
    process = await start_tailguard(nursery, config, log=log(name), extra_args=["--no-grpc"])
    return Replica(name, http_port, process, tmp / f"{name}.log")
