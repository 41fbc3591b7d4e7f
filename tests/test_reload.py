"""Hot reload through the real process: SIGHUP and file changes, under live traffic."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from .http_helpers import QUICK, engines_on_sockets, eventually, tailguard
from .sim_helpers import MODEL

MESSAGES = [{"role": "user", "content": "Summarise the meeting notes."}]


def toml(interactive: list[str], batch: list[str], *, poll: float = 0.0, extra: str = "", cap: int = 4) -> str:
    """Two pools over the given endpoints, ``cap`` seats each, and the shipped classes."""

    def endpoints(urls: list[str]) -> str:
        return ", ".join(f'{{ url = "{u}", max_concurrency = {cap} }}' for u in urls)

    return f"""
[server]
http_listen = "127.0.0.1:0"
reload_poll_interval = {poll}

[pools.interactive]
max_concurrency = {cap * len(interactive)}
max_queue = 100
max_model_len = 32768
models = ["{MODEL}"]
endpoints = [{endpoints(interactive)}]

[pools.batch]
max_concurrency = {cap * len(batch)}
max_queue = 100
max_model_len = 32768
models = ["{MODEL}"]
simulate_profile = "throughput"
endpoints = [{endpoints(batch)}]

[classes.interactive]
pool = "interactive"
max_prompt_tokens = 500
max_output_tokens = 128
queue_timeout = 10.0
priority = 0

[classes.batch]
pool = "batch"
queue_timeout = 20.0
priority = 1
{extra}
"""


async def test_sighup_moves_an_endpoint_under_traffic_and_refuses_a_broken_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from router.config import load_config

    slower = QUICK.replace(base_ms=3.0)
    async with engines_on_sockets([slower, slower, slower]) as backends:
        a, b, c = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b, c]))
        async with tailguard(load_config(path), path) as running:
            assert running.reloader is not None
            statuses: list[int] = []
            pools_of_c: set[str] = set()

            async def client(i: int) -> None:
                async with httpx.AsyncClient(base_url=running.http_url, timeout=30) as http:
                    for j in range(12):
                        max_tokens = 16 if i % 2 else 200
                        response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": max_tokens})
                        statuses.append(response.status_code)

            async def observe() -> None:
                while True:
                    for pool in running.router.statistics().pools:
                        if any(e.url == c and e.in_flight for e in running.router._pools[pool.name].endpoints):
                            pools_of_c.add(pool.name)
                    await trio.sleep(0.005)

            async with trio.open_nursery() as nursery:
                watcher = trio.CancelScope()

                async def watch() -> None:
                    with watcher:
                        await observe()

                nursery.start_soon(watch)
                async with trio.open_nursery() as clients:
                    for i in range(8):
                        clients.start_soon(client, i)
                    await eventually(lambda: backends.engines[2].statistics().running > 0)  # type: ignore[union-attr]
                    path.write_text(toml([a, c], [b]))
                    os.kill(os.getpid(), signal.SIGHUP)
                    await eventually(lambda: running.reloader.reloads_ok == 1)  # type: ignore[union-attr]
                    assert running.router.statistics().pool("interactive").max_concurrency == 8

                    # A broken file is refused, logged, and the running config stays.
                    digest = running.router.config.digest
                    path.write_text(toml([a], [b, c], extra="[classes.batch.oops]\nx = 1\n").replace("queue_timeout = 20.0", "queue_timeout = 500.0"))
                    os.kill(os.getpid(), signal.SIGHUP)
                    await eventually(lambda: running.reloader.reloads_failed == 1)  # type: ignore[union-attr]
                    assert running.router.config.digest == digest
                    refused = [r.getMessage() for r in caplog.records if r.name == "tailguard.reload"]
                    assert any("refused" in m and "classes.batch.oops" in m for m in refused), refused
                watcher.cancel()
            assert statuses and set(statuses) == {200}, statuses
            assert len(statuses) == 96
            assert pools_of_c == {"interactive", "batch"}


async def test_a_changed_file_is_picked_up_without_a_signal(tmp_path: Path) -> None:
    from router.config import load_config

    async with engines_on_sockets([QUICK, QUICK]) as backends:
        a, b = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b], poll=0.05))
        async with tailguard(load_config(path), path) as running, httpx.AsyncClient(base_url=running.http_url) as http:
            assert (await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16})).headers["x-tailguard-pool"] == "interactive"
            path.write_text(toml([a], [b], poll=0.05).replace("max_output_tokens = 128", "max_output_tokens = 8"))
            await eventually(lambda: running.reloader.reloads_ok == 1)  # type: ignore[union-attr]
            response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16})
            assert response.headers["x-tailguard-pool"] == "batch"
            limits = (await http.get("/v1/limits")).json()
            assert limits["classes"][0]["max_output_tokens"] == 8


async def test_reload_warns_of_inverted_timeout_layers_and_counts_results(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from router.config import load_config

    async with engines_on_sockets([QUICK, QUICK]) as backends:
        a, b = backends.urls
        path = tmp_path / "config.toml"
        path.write_text(toml([a], [b]))
        async with tailguard(load_config(path), path) as running:
            assert running.reloader is not None
            path.write_text(toml([a], [b], extra="[timeouts]\nend_to_end_timeout = 120\nfront_proxy_timeout = 60\n"))
            assert await running.reloader.reload()
            warnings = [r.getMessage() for r in caplog.records if r.name == "tailguard" and r.levelname == "WARNING"]
            assert any("front_proxy_timeout (60 s)" in m and "end_to_end_timeout (120 s)" in m for m in warnings), warnings
            path.write_text("[pools.nope]\n")
            assert not await running.reloader.reload()
            page = running.metrics.render().decode()
            assert 'tailguard_config_reloads_total{result="ok"} 1.0' in page
            assert 'tailguard_config_reloads_total{result="failed"} 1.0' in page
            assert f'tailguard_config_info{{digest="{running.router.config.digest}"}} 1.0' in page
