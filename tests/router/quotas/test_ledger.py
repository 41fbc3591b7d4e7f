"""The shared admission ledger on a real redis-server: grants, leases, priority, fallback and recovery."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import coredis.exceptions
import pytest
import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.backend import ConnectorTransport
from tailguard.router.config import (
    ApiKeyConfig,
    AuthConfig,
    ClassConfig,
    ClusterConfig,
    Config,
    ConfigError,
    ServerConfig,
    TimeoutsConfig,
    parse_config,
    render_config,
)
from tailguard.router.errors import CallerOverLimit
from tailguard.router.observe import RequestRecord
from tailguard.router.quotas import NO_TERMS, NO_WAITER, AdmissionLedger, Caller, Demand, LedgerStore, Synced, SyncTerms, Want
from tailguard.server.logs import configured_logging
from tailguard.server.metrics import Metrics
from tailguard.server.redis_ledger import RedisLedger
from tailguard.sim import PROFILES, Engine, SimApp
from tailguard.sim.canned import sim_canned_transport
from tests.helpers.config_text import BASE
from tests.helpers.engines import MODEL
from tests.helpers.redis_server import RedisServer, redis_client
from tests.helpers.router import BATCH_URL, INTERACTIVE_URL, chat, run_to_end, two_pool_config

CAP = 10
TTL = 0.4  # real seconds: Redis expires leases on its own clock
CLOCK_MARGIN = 0.005  # seconds: Redis's clock in a script and its key expiry may differ by a millisecond


def shared_engines() -> tuple[dict[str, Engine], dict[str, ConnectorTransport]]:
    """In-process engines for both pools, and one transport each that every replica's router shares."""
    engines = {url: Engine(PROFILES["latency"], name=url) for url in (INTERACTIVE_URL, BATCH_URL)}
    return engines, {url: sim_canned_transport(SimApp(engine, model=MODEL)) for url, engine in engines.items()}


class Replica:
    """One replica's view of one capped resource, and its budget."""

    def __init__(self, name: str, ledger: LedgerStore, *, static_share: float = 0.5, block: int = 0) -> None:
        self.in_use = 0
        self.waiting = 0
        self.best_waiting = NO_WAITER
        self.granted = 0
        config = ClusterConfig(redis_url="", replica_id=name, lease_ttl=TTL, static_share=static_share, block=block)
        self.budget = AdmissionLedger(config, ledger, self.demands)

    def demands(self) -> list[Demand]:
        return [Demand("pool:x", CAP, self.in_use, self.waiting, self.best_waiting, self._apply)]

    def _apply(self, seats: int) -> None:
        self.granted = seats

    async def need(self, in_use: int, waiting: int = 0, best_waiting: int = NO_WAITER) -> int:
        self.in_use, self.waiting, self.best_waiting = in_use, waiting, best_waiting
        await self.budget.sync_once()
        return self.granted


async def test_grants_never_add_up_past_the_cap_and_come_back_when_released(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "t1") as ledger:
        a, b = Replica("a", ledger), Replica("b", ledger)
        assert await a.need(0, waiting=7) == 7
        assert await b.need(0, waiting=7) == 3  # only what a does not hold
        assert await ledger.grants("pool:x") == {"a": 7, "b": 3}
        assert await a.need(2) == 2  # a's demand fell: it gives seats back
        assert await b.need(3, waiting=5) == 8
        assert sum((await ledger.grants("pool:x")).values()) <= CAP


class OnRedisClock:
    """A replica's store that keeps when Redis answered its last sync, on Redis's own clock: the one leases lapse on.

    A lease is judged by that clock, not by how long this process took to ask
    (on a loaded machine a sync may come late; it never comes early).
    """

    def __init__(self, ledger: LedgerStore) -> None:
        self.ledger = ledger
        self.now = 0.0

    async def sync(
        self, replica: str, lease_ttl: float, wants: Sequence[Want], incarnation: str = "", *, terms: SyncTerms = NO_TERMS
    ) -> Synced:
        synced = await self.ledger.sync(replica, lease_ttl, wants, incarnation, terms=terms)
        self.now = synced.now
        return synced


async def lease_samples(ask: Callable[[], Awaitable[int]], clock: OnRedisClock, until: Callable[[int], bool]) -> list[tuple[float, int]]:
    """Grants, each with when Redis answered it, asked for again and again (``ask``) until ``until(grant)``."""
    samples: list[tuple[float, int]] = []
    with trio.fail_after(10):  # a bound for a broken lease, not a measure of one
        while not samples or not until(samples[-1][1]):
            if samples:
                await trio.sleep(TTL / 20)
            granted = await ask()
            samples.append((clock.now, granted))
    return samples


async def test_a_dead_replicas_seats_return_within_the_lease(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "t2") as ledger:
        dead_clock, alive_clock = OnRedisClock(ledger), OnRedisClock(ledger)
        dead, alive = Replica("dead", dead_clock), Replica("alive", alive_clock)
        assert await dead.need(8) == 8  # then it stops syncing, as after kill -9
        lapses = dead_clock.now + TTL  # its lease's end, on Redis's clock
        samples = await lease_samples(lambda: alive.need(0, waiting=8), alive_clock, lambda granted: granted == 8)
        assert all(granted == 2 for at, granted in samples if at < lapses - CLOCK_MARGIN), samples  # not before the lease's end
        assert [granted for at, granted in samples if at > lapses + CLOCK_MARGIN] in ([], [8]), samples  # the first sync after it
        assert await ledger.grants("pool:x") == {"alive": 8}  # the dead one's entry is gone


async def test_a_more_urgent_request_waiting_elsewhere_gets_the_next_free_seat(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "t3") as ledger:
        a, b = Replica("a", ledger), Replica("b", ledger)
        assert await a.need(5) == 5 and await b.need(5) == 5  # the cap is full
        assert await b.need(5, waiting=1, best_waiting=1) == 5  # a long request waits on b
        assert await a.need(5, waiting=1, best_waiting=0) == 5  # a short one waits on a
        # One of b's requests ends. b hears of a's short request at this sync: the ledger keeps b's grant
        # (b may have seated its long one while the sync was under way) and b gives back at its next sync
        # what it does not use, though its own long one waits.
        assert await b.need(4, waiting=1, best_waiting=1) == 5
        assert await b.need(4, waiting=1, best_waiting=1) == 4
        assert await a.need(5, waiting=1, best_waiting=0) == 6  # the seat goes to a's short request
        assert await b.need(4, waiting=1, best_waiting=1) == 4
        assert sum((await ledger.grants("pool:x")).values()) == CAP


class AdmitsDuringSync:
    """A replica's store: while its sync is on the wire, ``during`` runs (requests it admits meanwhile)."""

    def __init__(self, ledger: RedisLedger) -> None:
        self.ledger = ledger
        self.during: Callable[[], None] = lambda: None

    async def sync(
        self, replica: str, lease_ttl: float, wants: Sequence[Want], incarnation: str = "", *, terms: SyncTerms = NO_TERMS
    ) -> Synced:
        self.during()
        return await self.ledger.sync(replica, lease_ttl, wants, incarnation, terms=terms)


async def test_a_replica_yielding_to_a_more_urgent_waiter_keeps_the_seats_it_filled_during_the_sync(redis: RedisServer) -> None:
    """Seats a replica seats during a sync's round trip count: the ledger never records fewer than it may be using.

    (Found by bench cluster at 9/8 once endpoints published their waiters: the ledger recorded the
    in-use count sent, and the replica had filled two more seats of its grant meanwhile.)
    """
    async with RedisLedger(redis.url, "t9") as ledger:
        store = AdmitsDuringSync(ledger)
        a, b = Replica("a", store, block=2), Replica("b", ledger)
        assert await a.need(CAP - 2) == CAP  # 8 in use and a block of 2: the whole cap
        assert await b.need(0, waiting=2, best_waiting=0) == 0  # a short request waits on b

        def admit_two() -> None:
            a.in_use += 2  # a's own arrivals take its two spare seats while its sync is on the wire

        store.during = admit_two
        assert await a.need(CAP - 2) == CAP  # sent "8 in use", but 10 run when the answer comes
        store.during = lambda: None
        assert await b.need(0, waiting=2, best_waiting=0) == 0  # so nothing is free for b yet
        assert a.in_use + b.granted <= CAP
        a.in_use -= 1  # one of a's requests ends; a heard of b's waiter at its last sync
        assert await a.need(a.in_use) == CAP - 1  # it gives back what it does not use
        assert await b.need(0, waiting=2, best_waiting=0) == 1  # and the short request on b gets it
        assert sum((await ledger.grants("pool:x")).values()) <= CAP


async def test_redis_down_falls_back_to_static_shares_and_recovers_without_double_counting(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "t4") as ledger:
        a, b = Replica("a", ledger, static_share=0.5), Replica("b", ledger, static_share=0.5)
        assert await a.need(2) == 2 and await b.need(0, waiting=8) == 8
        redis.stop()
        # At once: no more than the grant the ledger counted, nor the static share (5).
        assert await a.need(2, waiting=6) == 2 and await b.need(8) == 5
        assert a.budget.mode == b.budget.mode == "fallback"
        await trio.sleep(TTL)
        # After the lease: every replica has noticed; each has its static share.
        assert await a.need(2, waiting=6) == 5 and await b.need(8) == 5
        redis.start()  # an empty Redis: the ledger is rebuilt from what the replicas claim
        seen: list[int] = []
        with trio.fail_after(10):
            while a.budget.mode != "ledger":
                seen.append(await a.need(5, waiting=3))
                await trio.sleep(0.05)
        assert max(seen) <= 5  # the first answer after Redis returns too: b may still run its static 5
        # While the others may still be on their static shares: at most ours.
        assert await a.need(5, waiting=3) == 5
        assert await b.need(8) == 5  # b is back too; its 8 in use wait for the others to go
        grants = await ledger.grants("pool:x")
        assert grants == {"a": 5, "b": 5} and sum(grants.values()) <= CAP
        for _ in range(10):  # the recovery window passes; both keep syncing, as they do
            await trio.sleep(TTL / 4)
            await a.need(5)
            await b.need(8)
        assert await b.need(8) == 5  # a holds 5: nothing is counted twice
        assert await a.need(2) == 2 and await b.need(8) == 8
        assert sum((await ledger.grants("pool:x")).values()) == CAP


async def test_a_redis_outage_logs_one_line_when_it_begins_and_one_when_it_ends(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a line per failed sync, nor coredis's retries (three a sync): logged as ``serve`` logs."""
    config = ClusterConfig(redis.url, replica_id="quiet", lease_ttl=0.4, sync_interval=0.02)
    root = logging.getLogger()
    with configured_logging("INFO", "text"):  # the levels a serving process has; its handler is replaced by caplog's
        root.handlers = [caplog.handler]
        async with RedisLedger(redis.url, "t-quiet", timeout=0.1) as ledger, trio.open_nursery() as nursery:
            budget = AdmissionLedger(config, ledger, lambda: [Demand("pool:x", CAP, 1, 0, NO_WAITER, lambda seats: None)])
            await nursery.start(budget.run)
            assert budget.mode == "ledger"
            caplog.clear()
            redis.stop()
            with trio.fail_after(20):
                await until(lambda: budget.mode == "fallback")
                failures = budget.failures
                await until(lambda: budget.failures >= failures + 30)  # a while away: thirty failed syncs
                redis.start()  # an empty Redis: the sync script is loaded again
                await until(lambda: budget.mode == "ledger")
                syncs = budget.syncs
                await until(lambda: budget.syncs >= syncs + 10)
            nursery.cancel_scope.cancel()
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert len(lines) == 2, lines
    (away, back) = lines
    assert away[:2] == ("tailguard.cluster", "WARNING") and "is away" in away[2] and "quiet" in away[2]
    assert back[:2] == ("tailguard.cluster", "INFO") and "is back after" in back[2]
    assert re.search(r"\((3\d|[4-9]\d|\d{3,}) syncs failed", back[2]), back[2]


async def test_a_sync_is_tried_once_the_next_sync_is_the_retry() -> None:
    """coredis's own retries (two more a call) would spend the sync's half-lease deadline on a
    Redis that is away, and log each attempt: a server that hangs up at once sees one connection."""
    connections = 0

    async def hang_up(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(functools.partial(trio.serve_tcp, hang_up, 0, host="127.0.0.1"))
        url = f"redis://127.0.0.1:{listener.socket.getsockname()[1]}/0"
        async with RedisLedger(url, "t-once", timeout=0.5) as ledger:
            with trio.fail_after(5), pytest.raises(coredis.exceptions.ConnectionError):
                await ledger.sync("r", 1.0, [Want("pool:x", CAP, 1, NO_WAITER, 1)])
            await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert connections == 1


async def test_two_routers_on_one_ledger_never_send_an_engine_more_than_its_cap(redis: RedisServer) -> None:
    """Two replicas, one engine of 4 seats behind both: alone each would run 4, together still 4."""
    base = two_pool_config(interactive_cap=4, interactive_timeout=20.0)
    engines, transports = shared_engines()
    routers = [
        Router(
            dataclasses.replace(base, cluster=ClusterConfig(redis.url, namespace="t5", replica_id=name, lease_ttl=1.0, sync_interval=0.02, block=1)),
            transport_factory=lambda endpoint: transports[endpoint.url],
            seed=0,
        )
        for name in ("a", "b")
    ]
    answered: list[str] = []
    async with RedisLedger(redis.url, "t5") as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        for router in routers:
            await nursery.start(functools.partial(router.run, ledger=ledger))

        async def ask(router: Router, i: int) -> None:
            _, routing = await run_to_end(router, chat(f"q{i}", max_tokens=32, request_id=f"r{i}"))
            answered.append(routing.pool)

        async with trio.open_nursery() as load:
            for i in range(24):
                load.start_soon(ask, routers[i % 2], i)
        grants = await ledger.grants("pool:interactive")
        nursery.cancel_scope.cancel()
    assert answered == ["interactive"] * 24
    assert 3 <= engines[INTERACTIVE_URL].statistics().max_running_seen <= 4  # the cap held across both replicas, and was used
    assert sum(grants.values()) <= 4
    assert all(r.health()["cluster"]["mode"] == "ledger" for r in routers)


async def test_without_redis_a_replica_serves_on_its_static_share_and_says_degraded(autojump_clock: trio.testing.MockClock) -> None:
    """On virtual time: nothing answers on the port, so nothing but the router's own timers moves the clock."""
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"  # nothing listens there
    cluster = ClusterConfig(dead, replica_id="alone", lease_ttl=0.3, sync_interval=0.05, static_share=0.5)
    # In fallback the static share comes once requests admitted before the outage have ended: the e2e deadline.
    base = two_pool_config(interactive_cap=4, timeouts=TimeoutsConfig(end_to_end_timeout=0.8), interactive_timeout=0.5, batch_timeout=0.5)
    config = dataclasses.replace(base, cluster=cluster)
    engines, transports = shared_engines()
    router = Router(config, transport_factory=lambda endpoint: transports[endpoint.url], seed=0)
    async with RedisLedger(dead, "t6", timeout=0.1) as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        await nursery.start(functools.partial(router.run, ledger=ledger))
        health = router.health()
        assert health["status"] == "degraded" and health["cluster"]["mode"] == "fallback"
        page = Metrics(router).render().decode()
        assert 'tailguard_cluster_mode{mode="fallback"} 1.0' in page and 'tailguard_cluster_grant_seats{resource="pool:interactive"} 0.0' in page
        assert router.statistics().pool("interactive").max_concurrency == 0  # min(grant 0, share) at once
        await trio.sleep(0.6)
        assert router.statistics().pool("interactive").max_concurrency == 0  # twice the lease, not yet the e2e deadline
        await trio.sleep(0.3)  # past the end-to-end deadline: nothing admitted before the outage can still run
        assert router.statistics().pool("interactive").max_concurrency == 2  # half of 4
        async with trio.open_nursery() as load:
            for i in range(6):
                load.start_soon(run_to_end, router, chat(f"q{i}", max_tokens=16, request_id=f"r{i}"))
        assert engines[INTERACTIVE_URL].statistics().max_running_seen <= 2
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ('[cluster]\nredis_url = "http://x"\n', "redis://"),
        ('[cluster]\nredis_url = "redis://x"\nstatic_share = 1.5\n', "static_share"),
        ('[cluster]\nredis_url = "redis://x"\nlease_ttl = 1\nsync_interval = 0.5\n', "sync_interval"),
        ("[cluster]\n", "redis_url"),
    ],
)
def test_cluster_mistakes_are_named(section: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_config(BASE + "\n" + section)


# -- [cluster] and server.workers in the shipped config.toml and check-config ---------------

SHIPPED = Path(__file__).resolve().parents[3] / "config.toml"
_HEADER = re.compile(r"^(?:# )?\[([a-z_.]+)\]\s*$")
_KEY = re.compile(r"^(?:# )?([a-z_]+) = (.*)$")


def documented_keys(text: str, table: str) -> dict[str, tuple[str, str]]:
    """{key: (value as written, the comment above it)} of ``[table]`` in the shipped file, its
    keys set or commented out (``# key = value``); the table ends at the next header or rule."""
    keys: dict[str, tuple[str, str]] = {}
    inside = False
    comment: list[str] = []
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header or line.startswith("# ----"):
            inside, comment = bool(header) and header[1] == table, []  # type: ignore[index]
            continue
        key = _KEY.match(line)
        if inside and key:
            keys[key[1]] = (key[2], " ".join(comment))
            comment = []
        elif inside and line.startswith("#"):
            comment.append(line.lstrip("# "))
        elif not line.strip():
            comment = []
    return keys


def reader_keys(kind: type) -> set[str]:
    """The keys a config table takes, from its dataclass: host and port come as one *_listen key,
    and a field that is a table of its own (``[server.http_tls]``) is not a key of this one."""
    keys = set()
    for field in dataclasses.fields(kind):
        if "Config" in str(field.type):
            continue
        keys.add(field.name.replace("_host", "_listen").replace("_port", "_listen"))
    return keys


@pytest.mark.parametrize(("table", "kind"), [("server", ServerConfig), ("cluster", ClusterConfig)])
def test_the_shipped_config_documents_every_key_with_its_default(table: str, kind: type) -> None:
    documented = documented_keys(SHIPPED.read_text(encoding="utf-8"), table)
    assert set(documented) == reader_keys(kind), f"[{table}] in config.toml"
    for key, (_, comment) in documented.items():
        assert "Default" in comment or "Required" in comment, f"{table}.{key}: no default stated"


def test_the_documented_cluster_and_workers_examples_parse_to_the_defaults() -> None:
    """Uncommented, the shipped file's [cluster] and server.workers lines are what leaving them out
    gives (but redis_url, which is required): the comments cannot drift from the reader."""
    text = SHIPPED.read_text(encoding="utf-8")
    (workers, _) = documented_keys(text, "server")["workers"]
    cluster = documented_keys(text, "cluster")
    assert "\n# workers = " in text and "\n# [cluster]\n" in text, "both stay commented out: the defaults"
    example = "\n".join(f"{key} = {value}" for key, (value, _) in cluster.items())
    config = parse_config(text.replace("\n# workers = ", "\nworkers = ") + "\n[cluster]\n" + example + "\n")
    assert config.server.workers == int(workers) == ServerConfig().workers
    assert config.cluster == ClusterConfig(redis_url=tomllib.loads(f"v = {cluster['redis_url'][0]}")["v"])
    assert parse_config(text).cluster is None


def test_check_config_shows_every_cluster_key_and_the_workers_but_no_password() -> None:
    text = SHIPPED.read_text(encoding="utf-8")
    alone = render_config(parse_config(text))
    assert re.search(r"^  workers +1 ", alone, re.M) and re.search(r"^cluster\n  redis_url +none ", alone, re.M)
    shared = render_config(parse_config(text + '\n[cluster]\nredis_url = "redis://tg:s3cret@redis:6379/0"\nblock = 3\n'))
    section = shared[shared.index("\ncluster\n") :].split("\n\n")[0]
    for key in reader_keys(ClusterConfig):
        assert re.search(rf"^  {key} ", section, re.M), key
    assert "redis://tg:***@redis:6379/0" in section and "s3cret" not in shared
    assert re.search(r"^  block +3 ", section, re.M)


def test_without_a_cluster_section_nothing_changes() -> None:
    assert parse_config(BASE).cluster is None
    config = parse_config(BASE + '\n[cluster]\nredis_url = "redis://127.0.0.1:6379/0"\nreplica_id = "r1"\n')
    assert config.cluster == ClusterConfig("redis://127.0.0.1:6379/0", replica_id="r1")


async def test_an_api_keys_cap_holds_across_two_replicas(redis: RedisServer) -> None:
    """A key with max_concurrency 2, called through both replicas at once: never 3 in flight."""
    key = ApiKeyConfig("webapp", "0" * 64, frozenset(), 2)
    base = dataclasses.replace(two_pool_config(interactive_cap=8), auth=AuthConfig(keys=(key,)))
    engines, transports = shared_engines()
    routers = [
        Router(
            dataclasses.replace(base, cluster=ClusterConfig(redis.url, namespace="t7", replica_id=name, lease_ttl=1.0, sync_interval=0.02, block=1)),
            transport_factory=lambda endpoint: transports[endpoint.url],
            seed=0,
        )
        for name in ("a", "b")
    ]
    caller = Caller("webapp", frozenset(), 2)
    outcomes = {"ok": 0, "over": 0}
    async with RedisLedger(redis.url, "t7") as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        for router in routers:
            await nursery.start(functools.partial(router.run, ledger=ledger))

        async def ask(router: Router, i: int) -> None:
            await trio.sleep(0.05 * (i // 2))  # pairs, one on each replica, while earlier ones still run
            try:
                async with router.open(chat(f"q{i}", max_tokens=100, request_id=f"k{i}"), caller=caller) as completion:
                    await completion.read()
                outcomes["ok"] += 1
            except CallerOverLimit:
                outcomes["over"] += 1

        async with trio.open_nursery() as load:
            for i in range(12):
                load.start_soon(ask, routers[i % 2], i)
        nursery.cancel_scope.cancel()
    # The key's are the only requests: the engine's own running count is the key's concurrency.
    assert engines[INTERACTIVE_URL].statistics().max_running_seen == 2  # its cap, held across both replicas
    assert outcomes["ok"] >= 2 and outcomes["ok"] + outcomes["over"] == 12


async def test_a_sync_says_when_a_request_waits_on_another_replica(redis: RedisServer) -> None:
    """Then every replica syncs ten times as often, so seats come back within milliseconds."""
    async with RedisLedger(redis.url, "t8") as ledger:
        quiet = await ledger.sync("a", TTL, [Want("pool:x", CAP, 2, in_use=2)])
        assert quiet.grants == [2] and not quiet.contended
        await ledger.sync("b", TTL, [Want("pool:x", CAP, 9, best_waiting=0, in_use=8)])  # b has a request waiting
        busy = await ledger.sync("a", TTL, [Want("pool:x", CAP, 3, in_use=1)])
        assert busy.contended and busy.grants == [1]  # a keeps only what it uses: b's request is more urgent


def cluster_routers(
    redis: RedisServer, namespace: str, base: Config, names: Sequence[str], transports: dict[str, ConnectorTransport], *, block: int
) -> list[Router]:
    """One Router per replica name on one ledger; every replica's calls reach the same in-process engines."""
    return [
        Router(
            dataclasses.replace(
                base, cluster=ClusterConfig(redis.url, namespace=namespace, replica_id=name, lease_ttl=1.0, sync_interval=0.05, block=block)
            ),
            transport_factory=lambda endpoint: transports[endpoint.url],
            seed=0,
        )
        for name in names
    ]


async def watch_ledger(ledger: RedisLedger, caps: dict[str, int], most: dict[str, int]) -> None:
    """Record the largest total grant Redis holds for each resource, read every few milliseconds, until cancelled."""
    while True:
        for resource in caps:
            total = sum((await ledger.grants(resource)).values())
            most[resource] = max(most.get(resource, 0), total)
        await trio.sleep(0.002)


async def ask_as(
    router: Router, caller: Caller, request_id: str, outcomes: list[str], *, max_tokens: int = 40, held: trio.Event | None = None
) -> None:
    """One request of ``caller``'s key; its outcome ("ok" or "429") is appended. With ``held``, once admitted it
    keeps its seat of the key (open, unread) until ``held`` is set."""
    try:
        async with router.open(chat(request_id, max_tokens=max_tokens, request_id=request_id), caller=caller) as completion:
            if held is not None:
                await held.wait()
            await completion.read()
        outcomes.append("ok")
    except CallerOverLimit:
        outcomes.append("429")


@pytest.mark.parametrize("block", [2, 0])
async def test_a_key_over_its_grant_here_waits_for_the_next_sync_instead_of_429(redis: RedisServer, block: int) -> None:
    """Finding 3: one replica alone, key cap 16: 5 concurrent requests are 5 answers, as without [cluster]."""
    key = ApiKeyConfig("webapp", "0" * 64, frozenset(), 16)
    base = dataclasses.replace(two_pool_config(interactive_cap=16), auth=AuthConfig(keys=(key,)))
    engines, transports = shared_engines()
    [router] = cluster_routers(redis, f"f3a{block}", base, ["only"], transports, block=block)
    caller = Caller("webapp", frozenset(), 16)
    outcomes: list[str] = []
    most: dict[str, int] = {}
    async with RedisLedger(redis.url, f"f3a{block}") as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        await nursery.start(functools.partial(router.run, ledger=ledger))
        nursery.start_soon(watch_ledger, ledger, {"key:webapp": 16}, most)
        with trio.fail_after(10):
            async with trio.open_nursery() as load:
                for i in range(5):
                    load.start_soon(ask_as, router, caller, f"q{i}", outcomes)
        nursery.cancel_scope.cancel()
    assert outcomes == ["ok"] * 5
    assert engines[INTERACTIVE_URL].statistics().max_running_seen == 5  # all five ran at once: none waited out a sync's worth
    assert most["key:webapp"] <= 16


async def test_idle_replicas_give_a_keys_block_back_and_429_comes_only_when_the_cap_is_full(redis: RedisServer) -> None:
    """Finding 3 across replicas: key cap 4, b idle with its block; c's 4 callers all run, a 5th anywhere is 429 at once.

    "At once": while c's four hold their seats, which they keep until the 5th
    has its answer. A 5th that waited for a seat (or for its queue timeout, 30 s
    here) would get none before the test's bound.
    """
    key = ApiKeyConfig("webapp", "0" * 64, frozenset(), 4)
    base = dataclasses.replace(two_pool_config(interactive_cap=8, interactive_timeout=30.0), auth=AuthConfig(keys=(key,)))
    engines, transports = shared_engines()
    a, b, c = cluster_routers(redis, "f3b", base, ["a", "b", "c"], transports, block=2)
    caller = Caller("webapp", frozenset(), 4)
    outcomes: list[str] = []
    refused: list[str] = []
    most: dict[str, int] = {}
    async with RedisLedger(redis.url, "f3b") as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        for router in (a, b, c):
            await nursery.start(functools.partial(router.run, ledger=ledger))
        for router in (a, b):  # a and b served the key once (b's request took a's idle block); c never has
            await ask_as(router, caller, f"once-{router.statistics().cluster.replica}", outcomes)  # type: ignore[union-attr]
        with trio.fail_after(5):
            while (await ledger.grants("key:webapp")).get("b") != 2:  # b, idle, holds its block
                await trio.sleep(0.01)
        assert "c" not in await ledger.grants("key:webapp")  # nothing of the key there: c never synced it
        outcomes.clear()
        nursery.start_soon(watch_ledger, ledger, {"key:webapp": 4}, most)
        held = trio.Event()
        with trio.fail_after(10):
            async with trio.open_nursery() as load:
                for i in range(4):
                    load.start_soon(functools.partial(ask_as, c, caller, f"c{i}", outcomes, max_tokens=100, held=held))
                await until(lambda: c.caller_in_flight.get("webapp") == 4)  # the cap is full, on c alone
                await ask_as(a, caller, "a-over", refused)
                assert outcomes == []  # c's four still hold their seats
                held.set()
        nursery.cancel_scope.cancel()
    assert outcomes == ["ok"] * 4 and refused == ["429"]
    assert engines[INTERACTIVE_URL].statistics().max_running_seen == 4
    assert most["key:webapp"] <= 4


async def test_a_replica_with_a_queue_gets_more_than_its_block_of_an_endpoint_from_idle_ones(redis: RedisServer) -> None:
    """Finding 4: engine cap 8, block 4; a is idle, b has 8 requests: the engine runs 8, never more, and the ledger agrees."""
    base = two_pool_config(interactive_cap=8, interactive_timeout=5.0)
    engines, transports = shared_engines()
    a, b = cluster_routers(redis, "f4", base, ["a", "b"], transports, block=4)
    answered: list[str] = []
    most: dict[str, int] = {}
    async with RedisLedger(redis.url, "f4") as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        for router in (a, b):
            await nursery.start(functools.partial(router.run, ledger=ledger))
        endpoint = f"endpoint:{INTERACTIVE_URL}"
        assert await ledger.grants(endpoint) == {"a": 4, "b": 4}
        nursery.start_soon(watch_ledger, ledger, {endpoint: 8, "pool:interactive": 8}, most)

        async def ask(i: int) -> None:
            await run_to_end(b, chat(f"q{i}", max_tokens=100, request_id=f"r{i}"))
            answered.append(f"r{i}")

        with trio.fail_after(10):
            async with trio.open_nursery() as load:
                for i in range(8):
                    load.start_soon(ask, i)
        nursery.cancel_scope.cancel()
    assert len(answered) == 8
    assert engines[INTERACTIVE_URL].statistics().max_running_seen == 8  # more than b's block of 4: a gave its seats back
    assert most[endpoint] <= 8 and most["pool:interactive"] <= 8


def shared_pool_config(cap: int) -> Config:
    """One pool (one engine of ``cap`` seats) serving a short class (priority 0) and a long one (priority 1)."""
    base = two_pool_config(interactive_cap=cap)
    classes = (ClassConfig("short", "interactive", 10.0, 0, 500, 128), ClassConfig("long", "interactive", 10.0, 1))
    return dataclasses.replace(base, classes=classes)


class Requests:
    """Requests started by a test: each keeps its own record and can be ended (its client goes away) on demand."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.records: dict[str, RequestRecord] = {}
        self._scopes: dict[str, trio.CancelScope] = {}

    def start(self, router: Router, request_id: str, max_tokens: int) -> None:
        record = self.records[request_id] = RequestRecord(request_id, "http", trio.current_time())
        scope = self._scopes[request_id] = trio.CancelScope()

        async def run() -> None:
            with scope:
                async with router.open(chat(request_id, max_tokens=max_tokens, request_id=request_id), record=record) as completion:
                    await completion.read()

        self._nursery.start_soon(run)

    def end(self, request_id: str) -> None:
        self._scopes[request_id].cancel()

    def admitted(self, request_id: str) -> bool:
        return self.records[request_id].admitted_at is not None


async def until(condition: Callable[[], bool]) -> None:
    """Wait (polling every few ms, bounded by the caller's fail_after) until ``condition()`` holds."""
    while not condition():
        await trio.sleep(0.003)


async def heard_of_a_waiter(router: Router, ledger: RedisLedger, resource: str, waiter: str) -> None:
    """Until ``router`` has completed a sync begun after ``waiter``'s wait was in Redis's own want key."""
    while waiter not in await ledger.wants(resource):
        await trio.sleep(0.003)
    status = router.statistics().cluster
    assert status is not None
    seen = status.syncs
    await until(lambda: router.statistics().cluster.syncs >= seen + 2)  # type: ignore[union-attr]


LONG = 4000  # max_tokens of a long request: minutes on the engine, so it ends only when the test ends it
SHORT = 16


@dataclasses.dataclass
class TwoReplicas:
    """Replicas a and b over one engine of cap 2 (block 0), its two seats taken by a's long L1 and L2."""

    engine: Engine
    a: Router
    b: Router
    ledger: RedisLedger
    requests: Requests
    most: dict[str, int]  # the most seats Redis's grant keys ever added up to, per watched resource


@contextlib.asynccontextmanager
async def two_replicas_full_of_long(redis: RedisServer, namespace: str, watched: Sequence[str]) -> AsyncIterator[TwoReplicas]:
    engines, transports = shared_engines()
    a, b = cluster_routers(redis, namespace, shared_pool_config(2), ["a", "b"], transports, block=0)
    most: dict[str, int] = {}
    async with RedisLedger(redis.url, namespace) as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        for router in (a, b):
            await nursery.start(functools.partial(router.run, ledger=ledger))
        nursery.start_soon(watch_ledger, ledger, dict.fromkeys(watched, 2), most)
        requests = Requests(nursery)
        with trio.fail_after(10):
            for name in ("L1", "L2"):
                requests.start(a, name, LONG)
            await until(lambda: engines[INTERACTIVE_URL].statistics().running == 2)
        yield TwoReplicas(engines[INTERACTIVE_URL], a, b, ledger, requests, most)
        nursery.cancel_scope.cancel()


async def test_a_seat_freed_on_a_replica_goes_to_a_more_urgent_waiter_on_another_before_its_own_queue(redis: RedisServer) -> None:
    """Finding 7: a runs and queues long requests, a short one waits on b; a's next freed seat is the short one's.

    Engine cap 2, block 0. The router's own records say who was admitted when; Redis's grant keys never add up past 2.
    """
    endpoint = f"endpoint:{INTERACTIVE_URL}"
    async with two_replicas_full_of_long(redis, "f7", [endpoint, "pool:interactive"]) as two:
        a, requests = two.a, two.requests
        with trio.fail_after(10):
            for name in ("L3", "L4"):
                requests.start(a, name, LONG)
            await until(lambda: a.statistics().pool("interactive").queue.waiting == 2)
            requests.start(two.b, "S", SHORT)
            await heard_of_a_waiter(a, two.ledger, "pool:interactive", "b")
            assert not requests.admitted("S")
            requests.end("L1")
            await trio.testing.wait_all_tasks_blocked()
            # The seat went back to the ledger, not to a's own long requests.
            assert not requests.admitted("L3") and not requests.admitted("L4")
            assert a.statistics().pool("interactive").max_concurrency == 1

            def queued_long() -> bool:
                return requests.admitted("L3") or requests.admitted("L4")

            await until(lambda: requests.admitted("S") or queued_long())
            assert requests.admitted("S") and not queued_long(), "a's own long request took the seat"
            # Once the short request has ended and b waits for nothing, a's long ones get their seats back.
            await until(queued_long)
        records = requests.records
        next_long = min(r.admitted_at for r in (records["L3"], records["L4"]) if r.admitted_at is not None)
        assert records["S"].admitted_at is not None and records["S"].admitted_at < next_long
    assert two.engine.statistics().max_running_seen == 2
    assert two.most[endpoint] <= 2 and two.most["pool:interactive"] <= 2


async def test_a_seat_freed_on_a_replica_goes_at_once_to_its_own_waiter_as_urgent_as_the_one_elsewhere(redis: RedisServer) -> None:
    """A short request waits on a and on b: the seat a frees is a's short request's, in the release itself, no sync."""
    async with two_replicas_full_of_long(redis, "f7b", ["pool:interactive"]) as two:
        a, requests = two.a, two.requests
        with trio.fail_after(10):
            requests.start(a, "L3", LONG)
            requests.start(a, "Sa", SHORT)
            await until(lambda: a.statistics().pool("interactive").queue.waiting == 2)
            requests.start(two.b, "Sb", SHORT)
            await heard_of_a_waiter(a, two.ledger, "pool:interactive", "b")
            requests.end("L1")
            await trio.testing.wait_all_tasks_blocked()
            assert requests.admitted("Sa") and not requests.admitted("Sb") and not requests.admitted("L3")
            assert a.statistics().pool("interactive").max_concurrency == 2  # nothing given back
    assert two.engine.statistics().max_running_seen == 2
    assert two.most["pool:interactive"] <= 2


async def test_between_equally_urgent_waiters_on_two_replicas_the_older_gets_the_freed_seat(redis: RedisServer) -> None:
    """Finding 8: a runs 2 long requests (engine cap 2); a short one waits on b, then a younger short one on a.

    The seat a frees goes to b's older short request, not to a's own (first come, first served across
    replicas); then a's. The router's records say who was admitted when; Redis's grant keys never add up past 2.
    """
    endpoint = f"endpoint:{INTERACTIVE_URL}"
    async with two_replicas_full_of_long(redis, "f8", [endpoint, "pool:interactive"]) as two:
        a, b, requests = two.a, two.b, two.requests
        with trio.fail_after(10):
            requests.start(b, "Sb", SHORT)
            await until(lambda: b.statistics().pool("interactive").queue.waiting == 1)
            # Older by more than the tolerance (half the 0.05 s sync interval): on its own clock, not a sleep-and-hope.
            older_by = requests.records["Sb"].arrival + 0.1
            await until(lambda: trio.current_time() > older_by)
            requests.start(a, "Sa", SHORT)
            await until(lambda: a.statistics().pool("interactive").queue.waiting == 1)
            await heard_of_a_waiter(a, two.ledger, "pool:interactive", "b")
            await heard_of_a_waiter(b, two.ledger, "pool:interactive", "a")
            requests.end("L1")
            await trio.testing.wait_all_tasks_blocked()
            assert not requests.admitted("Sa"), "a's own younger request took the seat"
            await until(lambda: requests.admitted("Sa") or requests.admitted("Sb"))
            assert requests.admitted("Sb") and not requests.admitted("Sa")
            await until(lambda: requests.admitted("Sa"))  # b's short request ends; then a's gets a seat
        records = requests.records
        assert records["Sb"].admitted_at is not None and records["Sa"].admitted_at is not None
        assert records["Sb"].admitted_at < records["Sa"].admitted_at
    assert two.engine.statistics().max_running_seen == 2
    assert two.most[endpoint] <= 2 and two.most["pool:interactive"] <= 2


async def test_seat_grants_grow_again_once_every_replica_has_synced_after_an_outage_not_two_leases_later(redis: RedisServer) -> None:
    """Issue 32, item 5: after Redis returns, a replica's queue waited ``2 x lease_ttl`` at its fallback share (23 queue_timeouts).

    Grants are held to the fallback caps only until every replica alive before the outage has synced
    since (each then has its grant recorded): here a, b, a again, well within the two leases.
    """
    async with RedisLedger(redis.url, "r1", timeout=0.1) as ledger:
        a, b = Replica("a", ledger, static_share=0.5), Replica("b", ledger, static_share=0.5)
        assert await a.need(2) == 2 and await b.need(2) == 2
        redis.pause()
        assert await a.need(2) == 2 and await b.need(2) == 2
        assert a.budget.mode == b.budget.mode == "fallback"
        await trio.sleep(TTL)  # past the lease: each serves its static share
        assert await a.need(5, waiting=5) == 5 and await b.need(0) == 5
        redis.resume()
        assert await a.need(5, waiting=5) == 5  # back, held: b may still run its static 5
        assert a.budget.mode == "ledger"
        assert await b.need(0) == 0  # b is back too, and uses nothing
        await a.need(5, waiting=5)  # a hears that every replica alive before is back
        assert await a.need(5, waiting=5) == CAP
        assert sum((await ledger.grants("pool:x")).values()) <= CAP


@pytest.mark.parametrize("how", ["flushall", "restart"])
async def test_a_redis_that_lost_its_memory_under_the_replicas_never_grants_past_the_cap(redis: RedisServer, how: str) -> None:
    """Issue 32, item 5: a Redis emptied between two syncs (FLUSHALL, or restarted on the same port) is no outage.

    Without a failed sync nobody fell back, and the first replica to sync found an empty ledger:
    a's queue got the whole cap while b still ran 4 of it. The ledger's epoch says its memory is new:
    the sync is refused before anything is granted, and each replica claims again what it uses.
    """
    async with RedisLedger(redis.url, f"lost-{how}", timeout=0.2) as ledger:
        a, b = Replica("a", ledger), Replica("b", ledger)
        assert await a.need(6) == 6 and await b.need(4) == 4
        if how == "flushall":
            async with redis_client(redis.url) as client:
                await client.flushall()
        else:
            redis.stop()
            redis.start()
        seen = [await a.need(6, waiting=4) for _ in range(3)]
        assert max(seen) + b.in_use <= CAP, seen  # b still runs its 4: a keeps its 6
        assert await b.need(4) == 4
        assert max([await a.need(6, waiting=4) for _ in range(3)]) == 6
        assert await ledger.grants("pool:x") == {"a": 6, "b": 4}
        assert await b.need(0) == 0  # b's requests end: a's queue gets them
        # A memory that is new cannot say who was alive before: grants stay held two sync intervals at
        # least (a replica that began syncing after a's last answer claims its own by then).
        await trio.sleep(2 * ClusterConfig(redis_url="").sync_interval)
        await b.need(0)  # (replicas sync every interval; here by hand)
        await a.need(6, waiting=4)
        assert await a.need(6, waiting=4) == CAP


async def test_a_sync_redis_runs_after_the_replica_gave_up_on_it_changes_nothing(redis: RedisServer) -> None:
    """A sync queued in a stopped Redis runs when it resumes: its wants are stale by then (the replica fell back)."""
    async with RedisLedger(redis.url, "late", timeout=2.0) as ledger:
        a = Replica("a", ledger)
        assert await a.need(2) == 2
        redis.pause()
        assert await a.need(8) == 2 and a.budget.mode == "fallback"  # sent, given up on after half a lease
        redis.resume()
        async with RedisLedger(redis.url, "late") as other:  # another client: after the stale sync in Redis's order
            assert await other.grants("pool:x") == {"a": 2}


async def test_what_a_process_left_of_a_key_is_not_counted_once_another_process_took_its_replica_id(redis: RedisServer) -> None:
    """A key's resources are not in every sync now: a pod restarted under its name never rewrites the key's entries.

    Its last process held 3 of key k's 4 seats and had a request waiting; the new one syncs, the key
    untouched. Its entries name the old process, so b counts neither the seats nor the waiter.
    """
    async with RedisLedger(redis.url, "pod") as ledger:
        key = Want("key:k", 4, 3, best_waiting=0, in_use=3, sparse=True)
        assert (await ledger.sync("pod-0", 5.0, [key], "first")).grants == [3]
        await ledger.sync("pod-0", 5.0, [], "second")  # the restarted process: its lease names it
        answer = await ledger.sync("b", 5.0, [Want("key:k", 4, 4, best_waiting=1, sparse=True)], "b1")
        assert answer.grants == [4] and answer.urgent == [NO_WAITER] and not answer.yielding[0]
        assert await ledger.grants("key:k") == {"b": 4}


class Carried:
    """The ledger, with the resources each sync carried (a probe, while Redis was away, carries none: not listed)."""

    def __init__(self, ledger: LedgerStore) -> None:
        self.ledger = ledger
        self.sent: list[list[str]] = []

    async def sync(
        self, replica: str, lease_ttl: float, wants: Sequence[Want], incarnation: str = "", *, terms: SyncTerms = NO_TERMS
    ) -> Synced:
        if not terms.probe:
            self.sent.append([want.resource for want in wants])
        return await self.ledger.sync(replica, lease_ttl, wants, incarnation, terms=terms)


async def test_api_keys_that_send_nothing_are_in_no_sync(redis: RedisServer) -> None:
    """Issue 32, item 3: every key with a max_concurrency was in every sync, ten times a second, whether it sent or not."""
    keys = tuple(ApiKeyConfig(f"key-{i}", f"{i:064x}", frozenset(), 2) for i in range(300))
    base = dataclasses.replace(two_pool_config(interactive_cap=8), auth=AuthConfig(keys=keys))
    engines, transports = shared_engines()
    [router] = cluster_routers(redis, "idle-keys", base, ["only"], transports, block=1)
    async with RedisLedger(redis.url, "idle-keys") as ledger, trio.open_nursery() as nursery:
        store = Carried(ledger)
        for engine in engines.values():
            await nursery.start(engine.run)
        await nursery.start(functools.partial(router.run, ledger=store))
        outcomes: list[str] = []
        await ask_as(router, Caller("key-7", frozenset(), 2), "once", outcomes)
        with trio.fail_after(5):
            while len(store.sent) < 20:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert outcomes == ["ok"]
    carried = {resource for sent in store.sent for resource in sent if resource.startswith("key:")}
    assert carried == {"key:key-7"}  # the one key that sent; the 299 others never
    assert all(len(sent) <= 5 for sent in store.sent[-5:])  # then only the pools and endpoints (and key-7 going quiet)
