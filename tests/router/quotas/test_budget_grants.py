"""Token and request budgets shared through the ledger: grants follow demand, never add up past a budget, outlive a dead replica."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.config import ClusterConfig
from tailguard.router.errors import BudgetExceeded
from tailguard.router.quotas import (
    NO_TERMS,
    NO_WAITER,
    AdmissionLedger,
    BudgetGrants,
    Budgets,
    Caller,
    Demand,
    LedgerStore,
    Synced,
    SyncTerms,
    Want,
)
from tailguard.server.redis_ledger import RedisLedger
from tailguard.sim import Engine
from tests.helpers.redis_server import RedisServer, redis_client
from tests.helpers.router import chat, two_pool_config
from tests.router.quotas.test_ledger import CLOCK_MARGIN, Carried, OnRedisClock, cluster_routers, lease_samples, shared_engines

CAP = 10
TTL = 0.4  # real seconds: Redis expires leases on its own clock
HOLD = 1.0  # how long a dead replica's grant still counts (a budget's window; 60 s in the router)


class Holder:
    """One replica's view of one resource whose use outlives its lease (a budget's window)."""

    def __init__(self, name: str, ledger: LedgerStore) -> None:
        self.in_use = 0
        self.granted = 0
        self.budget = AdmissionLedger(ClusterConfig(redis_url="", replica_id=name, lease_ttl=TTL, block=0), ledger, self.demands)

    def demands(self) -> list[Demand]:
        return [Demand("tokens:k", CAP, self.in_use, 0, NO_WAITER, self._apply, hold=HOLD)]

    def _apply(self, granted: int) -> None:
        self.granted = granted

    async def need(self, in_use: int) -> int:
        self.in_use = in_use
        await self.budget.sync_once()
        return self.granted


async def test_a_dead_replicas_budget_grant_counts_until_what_it_admitted_has_left_the_window(redis: RedisServer) -> None:
    """Seats return at the lease; a budget's grant only once its window is over, or the next minute admits it twice."""
    async with RedisLedger(redis.url, "b1") as ledger:
        dead_clock, alive_clock = OnRedisClock(ledger), OnRedisClock(ledger)
        dead, alive = Holder("dead", dead_clock), Holder("alive", alive_clock)
        assert await dead.need(8) == 8  # then it stops syncing, as after kill -9
        assert await alive.need(CAP) == 2
        leaves = dead_clock.now + TTL + HOLD  # what it admitted has left the window, on Redis's clock
        async with redis_client(redis.url) as client:
            assert await client.delete(["b1:alive:dead"]) == 1  # its lease lapses now (Redis would at TTL)
        samples = await lease_samples(lambda: alive.need(CAP), alive_clock, lambda granted: granted == CAP)
        assert samples[0][1] == 2 and samples[0][0] < leaves - CLOCK_MARGIN, samples  # its lease lapsed: still counted
        assert all(granted == 2 for at, granted in samples if at < leaves - CLOCK_MARGIN), samples  # not before the window's end
        assert [granted for at, granted in samples if at > leaves + CLOCK_MARGIN] in ([], [CAP]), samples  # the first sync after it
        assert await ledger.grants("tokens:k") == {"alive": CAP}


async def test_a_process_restarted_under_the_same_replica_id_does_not_inherit_what_the_last_one_admitted(redis: RedisServer) -> None:
    async with RedisLedger(redis.url, "b2") as ledger:
        first = Holder("pod-0", ledger)
        assert await first.need(8) == 8  # killed; its container starts again with the same host name and pid
        again = Holder("pod-0", ledger)
        assert again.budget.incarnation != first.budget.incarnation
        assert await again.need(CAP) == 2  # the earlier process's 8 still count, though the id lives
        assert await again.need(CAP) == 2


def sharing_routers(redis: RedisServer, namespace: str, replicas: int = 2, cap: int = 8) -> tuple[list[Router], dict[str, Engine]]:
    """Replicas on one ledger, one engine behind them all; budgets come with each request's caller."""
    engines, transports = shared_engines()
    names = [f"r{i}" for i in range(replicas)]
    return cluster_routers(redis, namespace, two_pool_config(interactive_cap=cap), names, transports, block=1), engines


async def ask(router: Router, caller: Caller, i: int, max_tokens: int) -> str:
    """One request of the caller: "ok", or the refusal's message."""
    try:
        async with router.open(chat(f"question {i}", max_tokens=max_tokens, request_id=f"q{i}"), caller=caller) as completion:
            await completion.read()
        return "ok"
    except BudgetExceeded as refusal:
        return f"429 {refusal.retry_after:.1f} {refusal}"


async def test_a_key_sending_to_one_replica_gets_its_whole_budget_and_the_replicas_together_never_more(redis: RedisServer) -> None:
    """Static shares gave one replica half of the budget; the ledger gives the whole of it to where it is asked."""
    routers, engines = sharing_routers(redis, "b3")
    caller = Caller("metered", frozenset(), None, tokens_per_minute=1_000)
    async with RedisLedger(redis.url, "b3") as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        for router in routers:
            await nursery.start(functools.partial(router.run, ledger=ledger))
        on_a = [await ask(routers[0], caller, i, 90) for i in range(12)]
        on_b = [await ask(routers[1], caller, 100 + i, 90) for i in range(3)]
        grants = await ledger.grants("tokens:metered")
        nursery.cancel_scope.cancel()
    served = on_a.count("ok")
    assert 6 <= served <= 10, on_a  # each may take ~100 tokens: more than half the budget (static share), never past it
    assert all(outcome.startswith("429") for outcome in on_a[served:]), on_a  # once full, it stays full: a minute's window
    assert all(outcome.startswith("429") and "across the replicas" in outcome for outcome in on_b), on_b
    assert all(0 < float(outcome.split()[1]) <= 60 for outcome in on_a[served:] + on_b)  # when the windows hold it
    assert sum(grants.values()) <= 1_000


async def test_a_request_over_its_replicas_grant_waits_for_the_next_sync_and_is_served(redis: RedisServer) -> None:
    """b holds no grant of the key until it is asked: its first request waits one round trip, not a 429."""
    routers, engines = sharing_routers(redis, "b4")
    caller = Caller("metered", frozenset(), None, tokens_per_minute=10_000, requests_per_minute=20)
    async with RedisLedger(redis.url, "b4") as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        for router in routers:
            await nursery.start(functools.partial(router.run, ledger=ledger))
        first = [await ask(routers[0], caller, i, 16) for i in range(3)]
        async with trio.open_nursery() as both:  # both replicas at once, more than a block each
            outcomes: list[str] = []

            async def one(router: Router, i: int) -> None:
                outcomes.append(await ask(router, caller, i, 16))

            for i in range(14):
                both.start_soon(one, routers[i % 2], 10 + i)
        requests = await ledger.grants("requests:metered")
        await trio.sleep(0.2)  # both have synced since: each knows the other's window
        left = routers[0].statistics().budgets_left["metered"]  # what /metrics shows of it
        nursery.cancel_scope.cancel()
    assert left.remaining_requests == 3  # 20 less 17, fleet-wide
    assert first == ["ok"] * 3
    assert outcomes.count("ok") == 14, outcomes  # 17 of 20 requests: all served, none refused for want of a sync
    assert sum(requests.values()) <= 20


class Unreachable:
    """A ledger store whose Redis is away: every sync fails."""

    async def sync(
        self, replica: str, lease_ttl: float, wants: Sequence[Want], incarnation: str = "", *, terms: SyncTerms = NO_TERMS
    ) -> Synced:
        raise ConnectionError("Redis is away")


async def test_with_the_ledger_away_a_key_gets_its_static_share_once_the_window_is_over(autojump_clock: trio.testing.MockClock) -> None:
    """At once no more than the grant the ledger counted (none here); after a window and a lease, the static share."""
    config = ClusterConfig(redis_url="", replica_id="alone", lease_ttl=2.0, static_share=0.25)
    windows = Budgets()
    shared = AdmissionLedger(config, Unreachable(), list)
    key = BudgetGrants(shared, windows).of("metered", 1_000, None)
    await shared.sync_once()
    assert shared.mode == "fallback" and key.granted_tokens == 0
    with pytest.raises(BudgetExceeded, match="static share"):
        await key.reserve(100, priority=0, deadline=trio.current_time() + 1.0)
    await trio.sleep(62.0)  # the window and the lease: nothing admitted under a larger grant can still count
    await shared.sync_once()
    assert key.granted_tokens == 250
    grants = [await key.reserve(100, priority=0, deadline=trio.current_time() + 1.0) for _ in range(2)]
    with pytest.raises(BudgetExceeded, match=r"has 50 of its 1000 tokens a minute left this replica's static share") as refused:
        await key.reserve(100, priority=0, deadline=trio.current_time() + 1.0)
    assert refused.value.retry_after == pytest.approx(60.0)  # the first of the two leaves the window then
    grants[0].settle(20, served=True)  # it cost 20, not 100: 80 come back at once
    await key.reserve(100, priority=0, deadline=trio.current_time() + 1.0)
    assert windows.in_window("metered", trio.current_time()) == (220, 3)


async def test_four_replicas_called_unevenly_at_once_admit_no_more_than_the_budget_between_them(redis: RedisServer) -> None:
    """Most requests on one replica, all at once: together they use the budget nearly whole, never past it."""
    routers, engines = sharing_routers(redis, "b5", replicas=4, cap=16)
    caller = Caller("metered", frozenset(), None, tokens_per_minute=3_000)
    used: list[int] = []
    refused: list[float] = []
    async with RedisLedger(redis.url, "b5") as ledger, trio.open_nursery() as nursery:
        for engine in engines.values():
            await nursery.start(engine.run)
        for router in routers:
            await nursery.start(functools.partial(router.run, ledger=ledger))

        async def one(router: Router, i: int) -> None:
            try:
                async with router.open(chat(f"question {i}", max_tokens=100, request_id=f"u{i}"), caller=caller) as completion:
                    await completion.read()
                    usage = completion.payload["usage"]
                used.append(usage["prompt_tokens"] + usage["completion_tokens"])
            except BudgetExceeded as refusal:
                refused.append(refusal.retry_after)

        async with trio.open_nursery() as load:
            for i in range(48):
                load.start_soon(one, routers[0 if i % 5 < 3 else 1 + i % 3], i)
        grants = await ledger.grants("tokens:metered")
        nursery.cancel_scope.cancel()
    assert sum(used) <= 3_000 and len(used) + len(refused) == 48
    assert sum(used) >= 2_000, (len(used), sum(used))  # two thirds at least: where static quarters gave one replica 750
    assert sum(grants.values()) <= 3_000
    # All were admitted within a second or two, here and elsewhere: the windows hold more only a minute on.
    assert refused and all(50 < wait <= 60 for wait in refused), refused


async def send_once(shared: AdmissionLedger, shares: BudgetGrants, names: Sequence[str]) -> None:
    """Each key asks for 100 tokens at once and settles at 60; syncs (by hand) grant them."""
    done: list[str] = []

    async def one(name: str) -> None:
        grant = await shares.of(name, 20_000, 600).reserve(100, priority=0, deadline=trio.current_time() + 30.0)
        grant.settle(60, served=True)
        done.append(name)

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(one, name)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(10):
            await shared.sync_once()
            await trio.testing.wait_all_tasks_blocked()
            if len(done) == len(names):
                break
    assert len(done) == len(names)


async def settle_syncs(shared: AdmissionLedger, store: Carried) -> list[list[str]]:
    """Sync until one carries nothing (bounded): what the syncs before it carried."""
    store.sent.clear()
    for _ in range(50):
        await shared.sync_once()
        if not store.sent[-1]:
            break
    assert not store.sent[-1], [len(sent) for sent in store.sent]
    return store.sent[:-1]


async def per_key_entries(redis: RedisServer, namespace: str) -> int:
    """The ledger's entries in Redis for keys named key-*: grants, uses, held windows."""
    async with redis_client(redis.url) as client:
        return len([key async for key in client.scan_iter(match=f"{namespace}:*:*:key-*")])


async def test_a_sync_carries_only_the_keys_in_use_not_every_key_that_ever_sent(redis: RedisServer, mock_clock: trio.testing.MockClock) -> None:
    """Issue 32, item 3: 2,000 keys each sent one request, then went quiet: no sync carries them, Redis forgets them.

    Each key is carried while it changes (its admission, its settlement), once more when its window
    empties (its grant goes back), then never until its next request, which is served at the first sync.
    """
    async with RedisLedger(redis.url, "s1", timeout=30.0) as ledger:
        store = Carried(ledger)
        shared = AdmissionLedger(ClusterConfig(redis_url="", replica_id="r", lease_ttl=10.0), store, list)
        windows = Budgets()
        shares = BudgetGrants(shared, windows)
        await shared.sync_once()
        names = [f"key-{i}" for i in range(2_000)]
        for first in range(0, len(names), 500):
            await send_once(shared, shares, names[first : first + 500])
        await settle_syncs(shared, store)
        await shared.sync_once()  # nothing changed: a sync carries no key at all
        assert store.sent[-1] == []
        await send_once(shared, shares, ["key-7"])  # one key active again: its two resources, only them
        assert store.sent[-1] == ["tokens:key-7", "requests:key-7"]
        assert await per_key_entries(redis, "s1") > 2_000  # each key's grant, use and held window are recorded

        mock_clock.jump(61.0)  # every window is empty: each key's grant goes back, once
        released = await settle_syncs(shared, store)
        assert sorted(resource for sent in released for resource in sent) == sorted(
            f"{budget}:{name}" for name in names for budget in ("tokens", "requests")
        )
        assert max(len(sent) for sent in released) <= 2 * 256  # a few hundred a sync (DUE_PER_SYNC), not all at once
        assert await per_key_entries(redis, "s1") == 0  # the ledger holds nothing of them
        assert shared.status().grants == {}
        # Nor does this process: once the windows are forgotten, no object per key is left (the upkeep's turn).
        assert len(shares) == 2_000
        windows.forget(trio.current_time(), lambda name: True)
        assert shares.forget() == 2_000 and len(shares) == 0

        store.sent.clear()
        await send_once(shared, shares, ["key-1999"])  # a quiet key's next request: served at the first sync
        assert store.sent == [["tokens:key-1999", "requests:key-1999"]]
        assert (await ledger.grants("tokens:key-1999"))["r"] >= 100


class KeyReplica:
    """One replica's share of key "k"'s token budget (1,000 a minute), its syncs by hand."""

    def __init__(self, name: str, ledger: LedgerStore, *, lease_ttl: float = TTL) -> None:
        config = ClusterConfig(redis_url="", replica_id=name, lease_ttl=lease_ttl, static_share=0.5, block=0)
        self.shared = AdmissionLedger(config, ledger, list)
        self.key = BudgetGrants(self.shared, Budgets()).of("k", 1_000, None)

    async def reserve(self, tokens: int, *, syncs: Sequence[KeyReplica] = (), deadline: float = 5.0) -> str:
        """Ask for ``tokens``; the replicas in ``syncs`` sync in turn (by hand) while it waits: "ok" or the refusal.

        After those syncs it waits for its answer no longer than its queue ``deadline``: "waiting" if none came.
        """
        outcome: list[str] = []
        answered = trio.Event()

        async def ask() -> None:
            try:
                await self.key.reserve(tokens, priority=0, deadline=trio.current_time() + deadline)
                outcome.append("ok")
            except BudgetExceeded as refusal:
                outcome.append(f"429 {refusal.retry_after:.2f} {refusal}")
            answered.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            for replica in syncs:
                if outcome:
                    break
                await replica.shared.sync_once()
                await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(deadline):
                await answered.wait()
            nursery.cancel_scope.cancel()
        return outcome[0] if outcome else "waiting"


async def two_using_100(ledger: LedgerStore, *, lease_ttl: float = TTL) -> tuple[KeyReplica, KeyReplica]:
    """Replicas a and b, each having admitted 100 tokens of the key, and synced since (twice each, by hand)."""
    a, b = KeyReplica("a", ledger, lease_ttl=lease_ttl), KeyReplica("b", ledger, lease_ttl=lease_ttl)
    for replica in (a, b):
        await replica.shared.sync_once()
    assert await a.reserve(100, syncs=[a]) == "ok"
    assert await b.reserve(100, syncs=[b]) == "ok"
    for replica in (a, b, a, b):  # (they sync every interval)
        await replica.shared.sync_once()
    return a, b


async def test_a_quiet_key_well_under_its_budget_is_served_through_a_redis_outage(redis: RedisServer) -> None:
    """Issue 32, item 5: with Redis away a key was frozen at its last grant (what it used, and a block) for a minute.

    The ledger records for each replica a reserve of what nobody holds (``static_share`` of it), so the
    replicas' grants and reserves never add up past the budget; with Redis away each may use its own at once.
    """
    async with RedisLedger(redis.url, "q1", timeout=0.1) as ledger:
        a, b = await two_using_100(ledger)
        redis.pause()
        for replica in (a, b):
            await replica.shared.sync_once()
            assert replica.shared.mode == "fallback"
        # 200 used of 1,000: a asks for 250 more, b for 150, at once and without the ledger.
        assert await a.reserve(250) == "ok"
        assert await b.reserve(150) == "ok"
        assert a.key.granted_tokens + b.key.granted_tokens <= 1_000  # the two fallback caps together
        redis.resume()


async def test_after_redis_returns_a_key_waiting_for_more_is_served_within_a_few_syncs(redis: RedisServer) -> None:
    """Issue 32, item 5: after Redis resumed, requests waited 3 s for a grant held for two leases, then 429 "retry after 0.1 s"."""
    async with RedisLedger(redis.url, "q2", timeout=0.1) as ledger:
        a, b = await two_using_100(ledger)
        redis.pause()
        for replica in (a, b):
            await replica.shared.sync_once()
        redis.resume()
        await a.shared.sync_once()
        assert a.shared.mode == "ledger"
        # 200 used of 1,000; a's request for 600 more is over its fallback cap (its static 500): it waits for
        # the ledger, which grows a's grant once b, alive before the outage, has synced too.
        assert await a.reserve(600, syncs=[b, a, a, a]) == "ok"


async def test_with_the_ledger_away_a_refusals_retry_after_says_when_the_static_share_comes(autojump_clock: trio.testing.MockClock) -> None:
    """Issue 32, item 5: Retry-After hints did not match how long refusals last (60 s for a share due in 62)."""
    config = ClusterConfig(redis_url="", replica_id="alone", lease_ttl=2.0, static_share=0.25)
    shared = AdmissionLedger(config, Unreachable(), list)
    key = BudgetGrants(shared, Budgets()).of("metered", 1_000, None)
    await shared.sync_once()
    with pytest.raises(BudgetExceeded) as refused:
        await key.reserve(100, priority=0, deadline=trio.current_time() + 1.0)
    assert refused.value.retry_after == pytest.approx(62.0)  # its window (60 s) and the lease after the outage began
    await trio.sleep(40.0)
    await shared.sync_once()
    with pytest.raises(BudgetExceeded) as refused:
        await key.reserve(100, priority=0, deadline=trio.current_time() + 1.0)
    assert refused.value.retry_after == pytest.approx(22.0)
    await trio.sleep(refused.value.retry_after)
    await shared.sync_once()
    await key.reserve(100, priority=0, deadline=trio.current_time() + 1.0)


async def test_a_refusal_while_grants_are_held_after_an_outage_says_how_long_they_are(redis: RedisServer) -> None:
    """A replica alive before the outage never came back (killed meanwhile): grants are held two leases, and the 429 says so."""
    async with RedisLedger(redis.url, "q3", timeout=0.1) as ledger:
        a, _ = await two_using_100(ledger, lease_ttl=1.0)
        redis.pause()
        await a.shared.sync_once()  # b is killed: it never syncs again
        await trio.sleep(0.5)  # away over half a lease: a replica may have fallen back to more than Redis counts
        redis.resume()
        await a.shared.sync_once()
        started = trio.current_time()
        outcome = await a.reserve(600, syncs=[a, a], deadline=0.3)  # the refusal comes with a sync; room for a slow one
        assert outcome.startswith("429") and "no grant" in outcome, outcome
        retry_after = float(outcome.split()[1])
        assert 0.5 < retry_after <= 2.0 - (trio.current_time() - started) + 0.01, outcome  # two leases, less what passed


async def test_a_budget_a_reload_took_away_goes_back_to_the_ledger(redis: RedisServer) -> None:
    """Its grant stood in Redis for as long as the replica lived: nothing sent it again."""
    async with RedisLedger(redis.url, "gone") as ledger:
        shared = AdmissionLedger(ClusterConfig(redis_url="", replica_id="r", lease_ttl=5.0), ledger, list)
        shares = BudgetGrants(shared, Budgets())
        await shared.sync_once()
        await send_once(shared, shares, ["key-1"])
        assert (await ledger.grants("tokens:key-1"))["r"] >= 100
        shares.of("key-1", None, 600)  # a reload: the key keeps its request budget only
        await shared.sync_once()
        assert await ledger.grants("tokens:key-1") == {}
        assert (await ledger.grants("requests:key-1"))["r"] >= 1


async def test_a_dead_replicas_grant_of_a_quiet_key_counts_from_its_last_sync_of_anything(redis: RedisServer) -> None:
    """A key is not in every sync: its replica may have admitted under its grant long after it last carried the key.

    So what a dead replica held of a budget counts until ``hold`` and the lease after its last sync of
    anything, not of that key alone (which was ``hold`` ago here: the others would take it at once).
    """
    async with RedisLedger(redis.url, "b6") as ledger:
        tokens = Want("tokens:k", CAP, 8, in_use=8, hold=HOLD, sparse=True)
        await ledger.sync("dead", TTL, [tokens], "one")
        started = trio.current_time()
        while trio.current_time() - started < HOLD:  # it syncs on without the key (it may admit under its grant)
            await ledger.sync("dead", TTL, [], "one")
            await trio.sleep(TTL / 4)
        await trio.sleep(TTL * 1.5)  # then dies: its lease lapses
        answer = await ledger.sync("alive", TTL, [Want("tokens:k", CAP, CAP, hold=HOLD, sparse=True)], "two")
        assert answer.grants == [CAP - 8]


async def test_a_dead_replicas_reserve_counts_only_if_redis_went_away_after_its_last_sync(redis: RedisServer) -> None:
    """Its reserve is usable only with Redis away: a replica killed while Redis answers never used it.

    Counting it for the minute after every kill -9 took a few percent of a busy budget from the others
    (bench budgets --quick); after an outage it counts, as the replica may have used it meanwhile.
    """
    async with RedisLedger(redis.url, "b7", timeout=0.1) as ledger:
        used = Want("tokens:k", CAP, 2, in_use=2, hold=HOLD, share=0.5, sparse=True)
        first = await ledger.sync("dead", TTL, [used], "one")
        assert first.grants == [2] and first.reserves == [4]  # half of the 8 nobody holds
        for _ in range(6):  # killed while Redis answers (another replica syncs on): its lease lapses
            await ledger.sync("alive", TTL, [], "two")
            await trio.sleep(TTL / 4)
        wanted = Want("tokens:k", CAP, CAP, hold=HOLD, sparse=True)
        assert (await ledger.sync("alive", TTL, [wanted], "two")).grants == [CAP - 2]  # its grant, not its reserve
        await ledger.sync("alive", TTL, [Want("tokens:k", CAP, 0, hold=HOLD, sparse=True)], "two")  # gives it back
        second = await ledger.sync("dead2", TTL, [used], "three")
        assert second.grants == [2] and second.reserves == [3]  # half of the 6 nobody holds
        redis.pause()
        await trio.sleep(TTL * 1.5)  # Redis away: "dead2" may serve its reserve (its fallback), then dies
        redis.resume()
        # Both grants, and dead2's reserve; not dead's, whose lease had lapsed before Redis went away.
        assert (await ledger.sync("alive", TTL, [wanted], "two")).grants == [CAP - 2 - 2 - 3]


async def test_a_keys_seats_are_forgotten_once_the_ledger_holds_none_of_them(redis: RedisServer, mock_clock: trio.testing.MockClock) -> None:
    """Issue 32, item 4 under [cluster]: a key's seats object stays while it is used or held in the ledger, then goes."""
    async with RedisLedger(redis.url, "seats-forgotten", timeout=30.0) as ledger:
        store = Carried(ledger)
        shared = AdmissionLedger(ClusterConfig(redis_url="", replica_id="r", lease_ttl=10.0), store, list)
        await shared.sync_once()
        seats = shared.key_seats("key-1", 2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(seats.take, 0, trio.current_time() + 30.0, 1.0)
            await trio.testing.wait_all_tasks_blocked()
            await shared.sync_once()  # grants it a seat
        assert seats.in_use == 1
        assert shared.forget_idle_keys() == 0 and shared.kept_keys == 1  # in use: kept
        seats.release()
        await settle_syncs(shared, store)
        assert shared.forget_idle_keys() == 0  # its grant is still the ledger's record: kept
        mock_clock.jump(61.0)  # idle seats go back
        await settle_syncs(shared, store)
        assert shared.forget_idle_keys() == 1 and shared.kept_keys == 0
        assert shared.key_seats("key-1", 2) is not seats  # its next request makes it anew
