"""``tailguard serve --workers 2``: both worker processes send one prefix to the same engine (rendezvous hashing, no shared state)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_workers import free_run, requests_served, wait_healthy
from tests.helpers.process import ROOT, exited
from tests.helpers.redis_server import REDIS
from tests.helpers.sockets import QUICK, engines_on_sockets

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (.ci/run installs it)")

SYSTEM = "You are the support agent of ACME Corp. Be brief and polite. " * 20  # the shared prefix, past the key's 1,024 characters
REQUESTS = 24


async def test_two_workers_place_one_prefix_on_one_engine(tmp_path: Path) -> None:
    http = free_run(3)  # the shared port and each worker's own
    async with engines_on_sockets([QUICK, QUICK, QUICK]) as backends:
        first, second, batch = backends.urls
        text = (ROOT / "config.toml").read_text()
        old = '    { url = "http://127.0.0.1:8001", max_concurrency = 256 },\n'
        assert text.count(old) == 1
        text = text.replace(old, f'    {{ url = "{first}", max_concurrency = 128 }},\n    {{ url = "{second}", max_concurrency = 128 }},\n')
        text = text.replace("http://127.0.0.1:8002", batch).replace("127.0.0.1:8080", f"127.0.0.1:{http}")
        text = text.replace("reload_poll_interval = 1.0", "reload_poll_interval = 0").replace("drain_timeout = 30.0", "drain_timeout = 5.0")
        path = tmp_path / "config.toml"
        path.write_text(text)
        process = subprocess.Popen(
            [sys.executable, "-m", "tailguard.server", "serve", "--workers", "2", "--no-grpc", "--config", str(path), "--log-format", "text"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            own = [f"http://127.0.0.1:{http + 1 + i}" for i in range(2)]
            async with httpx.AsyncClient(timeout=30) as client:
                for url in own:
                    await wait_healthy(client, url + "/health")
                for i in range(REQUESTS):  # a fresh connection each: the kernel spreads them over both workers
                    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Order {i}: where is it?"}], "max_tokens": 2}
                    async with httpx.AsyncClient(timeout=30) as fresh:
                        response = await fresh.post(f"http://127.0.0.1:{http}/v1/chat/completions", json=body)
                        assert response.status_code == 200, response.text
                served = [requests_served((await client.get(url + "/metrics")).text) for url in own]
            assert sum(served) == REQUESTS and min(served) > 0, served  # both workers placed some
            finished = sorted(engine.statistics().finished_total for engine in backends.engines[:2] if engine is not None)
            assert finished == [0, REQUESTS]  # and every one of them went to the prefix's one home
            process.terminate()
            assert await exited(process, timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
