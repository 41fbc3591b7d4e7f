"""Endpoints from DNS, against a real DNS server and real simulated engines.

The DNS server is dnslib's, in a thread, on 127.0.0.1 at a free UDP port,
answering from a zone the test changes. A and AAAA records carry no port,
so every engine listens on the same port at its own loopback address
(127.0.0.2, 127.0.0.3, ...: Linux routes all of 127/8 to lo), as the pods of
a headless Service each have their own IP and the same port.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSError, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

from tailguard.router import Router
from tailguard.router.config import ConfigError, DnsEndpointsConfig, load_config, parse_config, render_config
from tailguard.router.errors import QueueTimeout
from tailguard.router.fleet import Ticket
from tailguard.server.app import Running
from tailguard.sim import Engine, SimApp
from tailguard.sim.canned import canned_transport
from tailguard.sim.http import serve as serve_sim
from tests.helpers.engines import MODEL
from tests.helpers.sockets import QUICK, eventually, tailguard

NAME = "vllm-latency.default.svc.cluster.local"
MESSAGES = [{"role": "user", "content": "Hello there."}]
ENGINE = QUICK.replace(base_ms=2.0)  # ~2 ms a token: a 20-token answer runs ~40 ms
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


class Zone(BaseResolver):  # type: ignore[misc]
    """A zone of A/AAAA records the test edits while the server answers from another thread.

    ``mode``: "answer" from the zone, "servfail" to everything, or "drop"
    (no reply at all: the client times out).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, list[str]] = {}
        self._mode = "answer"
        self.queries = 0

    def set(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self._records[name.lower()] = list(addresses)

    def remove(self, name: str) -> None:
        with self._lock:
            self._records.pop(name.lower(), None)

    def set_mode(self, mode: str) -> None:
        with self._lock:
            self._mode = mode

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        name = str(request.q.qname).rstrip(".").lower()
        with self._lock:
            self.queries += 1
            mode, addresses = self._mode, self._records.get(name)
        if mode == "drop":
            raise DNSError("dropped on purpose")  # dnslib's handler sends nothing back
        reply = request.reply()
        if mode == "servfail":
            reply.header.rcode = RCODE.SERVFAIL
        elif addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        else:
            for address in addresses:
                version = ipaddress.ip_address(address).version
                if request.q.qtype == QTYPE.A and version == 4:
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=0))
                elif request.q.qtype == QTYPE.AAAA and version == 6:
                    reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(address), ttl=0))
        return reply


@contextmanager
def dns_server() -> Iterator[tuple[Zone, int]]:
    """The zone and the UDP port of a DNS server on 127.0.0.1."""
    zone = Zone()
    server = DNSServer(zone, address="127.0.0.1", port=0, logger=DNSLogger(logf=lambda _: None))
    server.start_thread()
    try:
        yield zone, server.server.server_address[1]
    finally:
        server.stop()
        server.server.server_close()


@dataclass
class Pods:
    port: int
    engines: dict[str, Engine]  # address -> its engine


@asynccontextmanager
async def pods(hosts: list[str]) -> AsyncIterator[Pods]:
    """A simulated engine at each loopback address, all on one port (the first one's free port)."""
    engines: dict[str, Engine] = {}
    port = 0
    async with trio.open_nursery() as nursery:
        for host in hosts:
            engine = Engine(ENGINE)
            await nursery.start(engine.run)
            port = await nursery.start(serve_sim, SimApp(engine, model=MODEL).handle, host, port)
            engines[host] = engine
        yield Pods(port, engines)
        nursery.cancel_scope.cancel()


def toml(dns_port: int, port: int, *, cap: int = 2, pool_cap: int = 5, interval: float = 0.05, timeout: float = 0.3) -> str:
    return f"""
[server]
http_listen = "127.0.0.1:0"
reload_poll_interval = 0

[timeouts]
health_check_interval = 60

[discovery]
nameserver = "127.0.0.1:{dns_port}"
interval = {interval}
timeout = {timeout}

[pools.latency]
max_concurrency = {pool_cap}
max_queue = 1000
max_model_len = 32768
models = ["{MODEL}"]
endpoints_dns = [{{ name = "{NAME}", port = {port}, max_concurrency = {cap} }}]

[classes.chat]
pool = "latency"
queue_timeout = 20.0
priority = 0
"""


def pool_urls(running: Running) -> set[str]:
    return {e.url for e in running.router.statistics().endpoints if e.pool == "latency"}


def urls(port: int, *hosts: str) -> set[str]:
    return {f"http://{host}:{port}" for host in hosts}


async def test_pods_added_and_removed_under_traffic_drop_no_request_and_exceed_no_cap(tmp_path: Path) -> None:
    with dns_server() as (zone, dns_port):
        async with pods(HOSTS) as fleet:
            first, second, third = HOSTS
            zone.set(NAME, [first, second])
            path = tmp_path / "config.toml"
            path.write_text(toml(dns_port, fleet.port, cap=2, pool_cap=5))
            async with tailguard(load_config(path), path) as running:
                await eventually(lambda: pool_urls(running) == urls(fleet.port, first, second))
                statuses: list[int] = []
                most_in_pool = 0
                most_running = 0  # across the engines at once

                async def client() -> None:
                    async with httpx.AsyncClient(base_url=running.http_url, timeout=30) as http:
                        for _ in range(25):
                            response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 40})
                            statuses.append(response.status_code)

                async def watch() -> None:
                    nonlocal most_in_pool, most_running
                    while True:
                        most_in_pool = max(most_in_pool, running.router.statistics().pool("latency").in_flight)
                        most_running = max(most_running, sum(e.statistics().running for e in fleet.engines.values()))
                        await trio.sleep(0.002)

                async with trio.open_nursery() as watcher:
                    watcher.start_soon(watch)
                    async with trio.open_nursery() as clients:
                        for _ in range(8):
                            clients.start_soon(client)
                        # A pod goes, another comes, while the first still runs requests.
                        await eventually(lambda: fleet.engines[first].statistics().running == 2)
                        leaving = running.router.endpoint(f"http://{first}:{fleet.port}")
                        zone.set(NAME, [second, third])
                        await eventually(lambda: pool_urls(running) == urls(fleet.port, second, third))
                        gone = fleet.engines[first].statistics()
                        assert gone.running > 0  # retired with its requests still running: they finish there
                        served_before = gone.finished_total + gone.running
                        await eventually(lambda: fleet.engines[third].statistics().finished_total >= 5)
                        after = fleet.engines[first].statistics()
                        assert after.finished_total + after.running == served_before  # nobody new went there
                        # Retired as a reload retires: its client closed when its last request ended.
                        assert leaving.retired and leaving.pool_name is None
                        await eventually(lambda: leaving.in_flight == 0 and leaving.open_clients == 0)
                        assert running.router.statistics().backend_clients == 2
                        # It comes back: a fresh endpoint, traffic again.
                        zone.set(NAME, [first, second, third])
                        await eventually(lambda: pool_urls(running) == urls(fleet.port, *HOSTS))
                        await eventually(lambda: fleet.engines[first].statistics().finished_total > served_before)
                    watcher.cancel_scope.cancel()
            assert statuses == [200] * 200
            for engine in fleet.engines.values():
                stats = engine.statistics()
                assert stats.max_running_seen <= 2, stats  # the per-endpoint cap, through every change
                assert stats.aborted_total == 0
            assert most_in_pool <= 5 and most_running <= 5  # the pool's cap, with three endpoints of 2 seats


async def test_a_failed_or_empty_answer_keeps_the_last_addresses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with dns_server() as (zone, dns_port):
        async with pods(HOSTS[:2]) as fleet:
            first, second = HOSTS[:2]
            zone.set(NAME, [first, second])
            config = parse_config(toml(dns_port, fleet.port, interval=0.05, timeout=0.2))
            async with tailguard(config) as running:
                discovery = running.router.discovery
                key = f"latency/{NAME}:{fleet.port}"
                both = urls(fleet.port, first, second)
                await eventually(lambda: pool_urls(running) == both)

                async def ask() -> int:
                    async with httpx.AsyncClient(base_url=running.http_url, timeout=10) as http:
                        response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
                        return response.status_code

                for mode in ("servfail", "drop", "nxdomain"):
                    failures = discovery.statistics().names[key].failures
                    if mode == "nxdomain":
                        zone.set_mode("answer")
                        zone.remove(NAME)
                    else:
                        zone.set_mode(mode)
                    await eventually(lambda: discovery.statistics().names[key].failures >= failures + 2)
                    assert pool_urls(running) == both, mode
                    assert discovery.statistics().names[key].addresses == (first, second)
                    assert await ask() == 200
                warnings = [r.getMessage() for r in caplog.records if r.name == "tailguard.discovery"]
                assert any("keeping its last 2 addresses" in m for m in warnings), warnings
                # An answer again: it is the new set.
                zone.set(NAME, [second])
                await eventually(lambda: pool_urls(running) == urls(fleet.port, second))
                assert not discovery.statistics().names[key].failing


async def test_a_reload_resolves_again_at_once_and_applies_a_new_cap(tmp_path: Path) -> None:
    with dns_server() as (zone, dns_port):
        async with pods(HOSTS[:2]) as fleet:
            first, second = HOSTS[:2]
            zone.set(NAME, [first])
            path = tmp_path / "config.toml"
            path.write_text(toml(dns_port, fleet.port, cap=2, interval=3600))  # no round of its own in this test
            async with tailguard(load_config(path), path) as running:
                assert running.reloader is not None
                await eventually(lambda: pool_urls(running) == urls(fleet.port, first))
                zone.set(NAME, [first, second])
                path.write_text(toml(dns_port, fleet.port, cap=3, interval=3600))
                assert await running.reloader.reload()
                caps = {e.max_concurrency for e in running.router.statistics().endpoints}
                assert caps == {3}  # the known address takes the new cap with the reload itself
                await eventually(lambda: pool_urls(running) == urls(fleet.port, first, second))
                assert {e.max_concurrency for e in running.router.statistics().endpoints} == {3}


async def test_an_address_back_before_its_requests_end_keeps_their_seats(autojump_clock: trio.testing.MockClock) -> None:
    config = parse_config(toml(5353, 8000, cap=2, pool_cap=3))
    source = config.pool("latency").endpoints_dns[0]
    router = Router(config, transport_factory=lambda _: canned_transport(lambda request: httpx.Response(200)))  # pods that pass their probes
    pool = router.pool("latency")
    router.replace_discovered("latency", [(source, "127.0.0.2"), (source, "127.0.0.3")])
    await router.check_health()  # a new address takes requests once a probe has passed
    ticket = Ticket("chat", MODEL, 10, 10)
    leases = [await pool.admit(0, trio.current_time() + 1, ticket, retry_after=1) for _ in range(3)]
    endpoint = router.endpoint("http://127.0.0.2:8000")
    running_there = endpoint.in_flight
    assert running_there >= 1
    router.replace_discovered("latency", [(source, "127.0.0.3")])  # the pod goes, its requests run on
    assert endpoint.retired and endpoint.in_flight == running_there
    assert [e.url for e in pool.endpoints] == ["http://127.0.0.3:8000"]
    with pytest.raises(QueueTimeout):  # the pool's cap counts them: no seat for a fourth
        await pool.admit(0, trio.current_time() + 1, ticket, retry_after=1)
    router.replace_discovered("latency", [(source, "127.0.0.3"), (source, "127.0.0.2")])  # and is back
    assert router.endpoint("http://127.0.0.2:8000") is endpoint  # the same count: its cap holds
    assert endpoint.in_flight == running_there and not endpoint.retired
    for lease in leases:
        lease.release()
    assert pool.in_flight == 0 and endpoint.in_flight == 0
    await router.aclose()


def test_endpoints_dns_config_is_checked_and_shown() -> None:
    base = toml(5353, 8000)
    config = parse_config(base)
    pool = config.pool("latency")
    assert pool.endpoints == ()
    assert pool.endpoints_dns == (DnsEndpointsConfig(NAME, 8000, 2),)
    assert config.discovery.nameserver == "127.0.0.1" and config.discovery.nameserver_port == 5353
    assert pool.endpoints_dns[0].endpoint("fd00::1").url == "http://[fd00::1]:8000"
    shown = render_config(config)
    assert f"http://{NAME}:8000 (each A/AAAA address), max_concurrency 2 each" in shown
    assert "nameserver  127.0.0.1:5353" in shown

    broken = base.replace(f'name = "{NAME}", port = 8000', 'name = "10.0.0.7", port = 70000, scheme = "ftp"')
    broken = broken.replace('nameserver = "127.0.0.1:5353"', 'nameserver = "dns.local"')
    with pytest.raises(ConfigError) as refused:
        parse_config(broken)
    problems: Any = refused.value.problems
    assert [p.split(":")[0] for p in problems] == [
        "pools.latency.endpoints_dns[0].name",
        "pools.latency.endpoints_dns[0].port",
        "pools.latency.endpoints_dns[0].scheme",
        "discovery.nameserver",
    ], problems
