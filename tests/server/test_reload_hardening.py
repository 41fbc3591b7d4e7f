"""Reloads that leak nothing and kill nothing (issue 10, defects 3 and 4).

Before: every reload that changed an endpoint's cap left its old HTTP client
and its keep-alive connections behind for good (250 reloads: 3,652
connections to the engine), and a reload whose simulated engine could not
start ended the whole process.
"""

from __future__ import annotations

import gc
import os
import socket
from pathlib import Path

import httpx
import pytest
import trio
import trio.lowlevel

from tailguard.router.backend import BackendClient, ConnectorTransport
from tailguard.router.config import EndpointConfig, load_config
from tailguard.server.app import serve
from tailguard.sim.canned import canned_transport
from tests.e2e.test_reload import toml
from tests.helpers.sockets import Backends, eventually, tailguard

MESSAGES = [{"role": "user", "content": "Hi"}]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def established_to(port: int) -> int:
    """TCP connections of this process's machine to 127.0.0.1:``port`` that are open now."""
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            remote, state = fields[2], fields[3]
            if state == "01" and remote == f"0100007F:{port:04X}":
                count += 1
    return count


def live_clients() -> int:
    gc.collect()
    return sum(isinstance(o, BackendClient) for o in gc.get_objects())


async def test_a_thousand_reloads_under_traffic_leave_no_connection_behind(tmp_path: Path, two_engines: Backends) -> None:
    a, b = two_engines.urls
    port = int(a.rsplit(":", 1)[1])
    path = tmp_path / "config.toml"
    path.write_text(toml([a], [b]))
    async with tailguard(load_config(path), path) as running:
        assert running.reloader is not None
        async with httpx.AsyncClient(base_url=running.http_url, timeout=30) as http:

            async def traffic(count: int) -> list[int]:
                statuses: list[int] = []

                async def one() -> None:
                    response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
                    statuses.append(response.status_code)

                async with trio.open_nursery() as nursery:
                    for _ in range(count):
                        nursery.start_soon(one)
                return statuses

            assert set(await traffic(4)) == {200}  # warm: keep-alive connections exist
            fds, connections, clients = open_fds(), established_to(port), live_clients()
            statuses: list[int] = []
            async with trio.open_nursery() as nursery:

                async def load() -> None:
                    for _ in range(50):  # bounded: ~200 requests spread over the reloads
                        statuses.extend(await traffic(4))
                        await trio.sleep(0.01)

                nursery.start_soon(load)
                verdicts: list[str] = []

                async def probe() -> None:
                    # Health probes run on their own clients: a reload never closes one under them.
                    for _ in range(60):
                        await running.router.check_health()
                        verdicts.append(running.router.health()["status"])
                        await trio.sleep(0.02)

                nursery.start_soon(probe)
                for i in range(1000):
                    path.write_text(toml([a], [b], cap=5 - i % 2))  # a new cap: a new client each time
                    assert await running.reloader.reload()
                    if i % 20 == 0:
                        await trio.lowlevel.checkpoint()
            assert running.reloader.reloads_ok == 1000
            assert verdicts and set(verdicts) == {"ready"}, verdicts
            assert statuses and set(statuses) == {200}, set(statuses)
            await eventually(lambda: running.router.statistics().backend_clients == 2, timeout=5)
            await eventually(lambda: established_to(port) <= connections + 4, timeout=5)
            await eventually(lambda: open_fds() <= fds + 8, timeout=5)
            assert live_clients() <= clients + 2  # at most the two current ones (start-up objects are frozen out of gc)


async def test_a_reload_that_cannot_start_its_engines_keeps_serving_the_old_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = []
    for _ in range(2):  # free ports for the two simulated engines of the first config
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    a, b = (f"http://127.0.0.1:{p}" for p in ports)
    path = tmp_path / "config.toml"
    path.write_text(toml([a], [b]))
    shutdown = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            running = await nursery.start(
                lambda task_status: serve(load_config(path), path, simulate=True, http_port=0, shutdown=shutdown, task_status=task_status)
            )
            digest = running.router.config.digest
            for extra in (f"http://127.0.0.1:{taken.getsockname()[1]}", "http://gpu-7.internal:8000"):
                path.write_text(toml([a], [b, extra]))
                assert not await running.reloader.reload()
                assert running.router.config.digest == digest
            assert running.reloader.reloads_failed == 2
            page = running.metrics.render().decode()
            assert 'tailguard_config_reloads_total{result="failed"} 2.0' in page
            logged = [r.getMessage() for r in caplog.records if r.name == "tailguard.reload"]
            assert sum("keeping the running config" in m for m in logged) == 2
            async with httpx.AsyncClient(base_url=running.http_url, timeout=30) as http:
                response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
                assert response.status_code == 200
            # A good reload after the failed ones still applies.
            path.write_text(toml([a], [b], cap=3))
            assert await running.reloader.reload()
            assert running.router.statistics().pool("interactive").max_concurrency == 3
            shutdown.set()
    finally:
        taken.close()


async def test_applying_a_config_is_all_or_nothing() -> None:
    from tailguard.router import Router
    from tests.helpers.router import BATCH_URL, INTERACTIVE_URL, two_pool_config, with_digest

    broken = "http://gpu-9:8000"

    def transport_for(endpoint: EndpointConfig) -> ConnectorTransport:
        if endpoint.url == broken:
            raise RuntimeError("cannot build a transport for gpu-9")
        return canned_transport(lambda request: httpx.Response(200))

    config = two_pool_config(interactive_cap=4)
    router = Router(config, transport_factory=transport_for)
    try:
        bigger = with_digest(two_pool_config(interactive_cap=6, interactive_urls=(INTERACTIVE_URL, broken)), "new")
        with pytest.raises(RuntimeError, match="gpu-9"):
            router.apply(bigger)
        # Nothing of the new config took: caps, endpoints, pools and digest are the old ones.
        stats = router.statistics()
        assert stats.config_digest == config.digest
        assert stats.pool("interactive").max_concurrency == 4
        assert [e.url for e in stats.endpoints] == [INTERACTIVE_URL, BATCH_URL]
        assert [e.max_concurrency for e in stats.endpoints] == [4, 16]
        assert stats.backend_clients == 2
    finally:
        await router.aclose()


async def test_a_client_that_cannot_be_built_for_a_new_cap_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from tailguard.router import Router
    from tailguard.router.fleet import endpoint
    from tests.helpers.router import two_pool_config, with_digest

    router = Router(two_pool_config(interactive_cap=4, batch_cap=4), transport_factory=lambda _: canned_transport(lambda r: httpx.Response(200)))
    built = 0
    real = BackendClient

    def fails_second(*args: object, **kwargs: object) -> BackendClient:
        nonlocal built
        built += 1
        if built == 2:
            raise OSError("no TLS context today")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(endpoint, "BackendClient", fails_second)
    before = {e.url: e.client for e in router.endpoints}
    try:
        with pytest.raises(OSError):
            router.apply(with_digest(two_pool_config(interactive_cap=8, batch_cap=8), "bigger"))
        stats = router.statistics()
        # Both endpoints keep their cap and the client they had; nothing half-applied.
        assert [e.max_concurrency for e in stats.endpoints] == [4, 4] and stats.pool("interactive").max_concurrency == 4
        assert {e.url: e.client for e in router.endpoints} == before
    finally:
        await router.aclose()


async def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return False
    await stream.aclose()
    return True


async def test_a_simulated_engine_stops_when_a_reload_removes_its_endpoint(tmp_path: Path) -> None:
    """Before: an engine started for an endpoint kept listening after a reload removed it
    (6 stray listeners after 6 add/remove cycles; issue 20, defect 6)."""
    ports = []
    for _ in range(3):  # free ports for the simulated engines (bound by the fleet, not here)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    a, b, c = (f"http://127.0.0.1:{p}" for p in ports)
    path = tmp_path / "config.toml"
    path.write_text(toml([a], [b]))
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        running = await nursery.start(
            lambda task_status: serve(load_config(path), path, simulate=True, http_port=0, shutdown=shutdown, task_status=task_status)
        )
        assert running.reloader is not None
        for cycle in range(6):
            path.write_text(toml([a], [b, c], cap=4 + cycle % 2))
            assert await running.reloader.reload()
            assert await listening(ports[2]), cycle
            path.write_text(toml([a], [b]))
            assert await running.reloader.reload()
            assert not await listening(ports[2]), cycle  # the removed endpoint's engine is gone
            assert await listening(ports[0]) and await listening(ports[1])
        async with httpx.AsyncClient(base_url=running.http_url, timeout=30) as http:
            response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
            assert response.status_code == 200
        shutdown.set()
