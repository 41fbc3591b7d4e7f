"""Prefix affinity under DNS churn: a pod leaving moves only the prefixes it was home to, and they come back with it."""

from __future__ import annotations

from pathlib import Path

import httpx

from tailguard.router.config import load_config
from tailguard.server.app import Running
from tests.helpers.sockets import eventually, tailguard
from tests.router.fleet.test_discovery import HOSTS, NAME, Pods, dns_server, pods, pool_urls, toml, urls

PROMPTS = [f"Tenant {i}'s assistant: answer questions about tenant {i}'s products." for i in range(24)]


async def homes(client: httpx.AsyncClient, fleet: Pods) -> dict[str, str]:
    """Each prompt's engine (the pod whose finished count it raised), one request at a time."""
    where: dict[str, str] = {}
    for prompt in PROMPTS:
        before = {host: engine.statistics().finished_total for host, engine in fleet.engines.items()}
        response = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 2})
        assert response.status_code == 200
        (where[prompt],) = [host for host, engine in fleet.engines.items() if engine.statistics().finished_total > before[host]]
    return where


async def test_a_pod_leaving_moves_only_its_prefixes_and_they_come_back(tmp_path: Path) -> None:
    with dns_server() as (zone, dns_port):
        async with pods(HOSTS) as fleet:
            zone.set(NAME, HOSTS)
            path = tmp_path / "config.toml"
            path.write_text(toml(dns_port, fleet.port, cap=4, pool_cap=12))
            async with tailguard(load_config(path), path) as running, httpx.AsyncClient(base_url=running.http_url, timeout=30) as client:
                await eventually(lambda: pool_urls(running) == urls(fleet.port, *HOSTS))
                before = await homes(client, fleet)
                assert set(before.values()) == set(HOSTS)  # spread over the three
                leaving = HOSTS[1]
                zone.set(NAME, [HOSTS[0], HOSTS[2]])
                await eventually(lambda: pool_urls(running) == urls(fleet.port, HOSTS[0], HOSTS[2]))
                during = await homes(client, fleet)
                assert {p for p in PROMPTS if during[p] != before[p]} == {p for p in PROMPTS if before[p] == leaving}
                zone.set(NAME, HOSTS)
                # Back in the pool, and up: a returning address takes requests once its probe has passed.
                await eventually(lambda: healthy_urls(running) == urls(fleet.port, *HOSTS))
                assert await homes(client, fleet) == before  # each prefix back on its home


def healthy_urls(running: Running) -> set[str]:
    return {e.url for e in running.router.statistics().endpoints if e.pool == "latency" and e.healthy}
