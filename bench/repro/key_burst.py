"""Repro of finding 3: one replica alone on the ledger, key cap 16, 5 concurrent requests -> some 429.

``--no-cluster``: the same without [cluster], for comparison.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import trio

from bench.harness.client import CHAT_PATH, KeepAliveClient, http_request
from bench.harness.config import PoolSpec, tailguard_config
from bench.harness.procs import free_ports, start_process, start_tailguard, wait_ready
from bench.harness.redis import RedisProcess
from bench.harness.replicas import KeySpec
from bench.harness.toml import TomlTable


async def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    async with trio.open_nursery() as n:
        e1, e2, rp, hp, gp = free_ports(5)
        redis = RedisProcess(n, rp, open(tmp / "r.log", "ab"))
        await redis.start()
        sim = await start_process(n, [sys.executable, "-m", "tailguard.sim", "--engines", f"{e1}:instant,{e2}:instant"], None)
        await wait_ready(e1, sim, "sim")
        key = KeySpec("web", 1.0, 16)
        cluster: TomlTable = {"redis_url": redis.url, "namespace": "repro", "replica_id": "only", "block": 2}
        sections: TomlTable = {"auth": {"keys": [key.table()]}}
        if "--no-cluster" not in sys.argv:
            sections = {"cluster": cluster, **sections}
        pools = PoolSpec("interactive", [(e1, 64)], 64, 64), PoolSpec("batch", [(e2, 64)], 64, 64)
        (tmp / "c.toml").write_text(tailguard_config(hp, gp, *pools, sections=sections))
        tg = await start_tailguard(n, tmp / "c.toml", extra_args=["--no-grpc"])
        await wait_ready(hp, tg, "tg")
        await trio.sleep(1)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": False}
        req = http_request(hp, CHAT_PATH, body).replace(b"\r\n", f"\r\nAuthorization: Bearer {key.secret}\r\n".encode(), 1)
        statuses: list[int] = []

        async def one() -> None:
            c = KeepAliveClient(hp)
            statuses.append((await c.exchange(req)).status)
            await c.aclose()

        for attempt in range(3):
            statuses.clear()
            async with trio.open_nursery() as m:
                for _ in range(5):
                    m.start_soon(one)
            print(f"burst {attempt}: statuses {sorted(statuses)} (key cap {key.max_concurrency})")
            await trio.sleep(0.5)
        n.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
