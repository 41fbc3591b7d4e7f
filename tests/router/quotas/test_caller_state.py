"""Per-caller state and series are bounded: keys rotated by reloads leave nothing behind, idle state expires, /metrics stays small.

The router keeps budget windows, fair-share tags and in-flight counts per
caller; /metrics has the ``tailguard_caller_*`` series. Each must follow the
callers in use, not every key ever seen (issue 32, item 4): a removed key's
state goes once its last request ended, idle state once it can no longer
matter, and at most ``[metrics] caller_series`` callers have series by name.
Virtual time throughout; sizes are read through ``statistics()`` and the
rendered page, never private attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from tailguard.router.config import ApiKeyConfig, AuthConfig, Config, MetricsConfig
from tailguard.router.observe import RequestRecord
from tailguard.router.queueing import FairClock, Share
from tailguard.router.quotas import Budgets, hash_key
from tailguard.router.upkeep import FORGET_INTERVAL
from tailguard.server.caller_series import OTHER, TURN, CallerSeries
from tailguard.server.metrics import SECONDS_BUCKETS
from tests.helpers.router import chat, router_over_engines, two_pool_config
from tests.router.observe.test_telemetry import Observed

GENERATIONS = 3  # the keys of the file, then two reloads that replace every one


def keys(generation: int, count: int) -> AuthConfig:
    return AuthConfig(
        keys=tuple(
            ApiKeyConfig(f"k{generation}-{i}", hash_key(f"secret-{generation}-{i}"), tokens_per_minute=100_000) for i in range(count)
        )
    )


def rotated(config: Config, generation: int, count: int) -> Config:
    return dataclasses.replace(config, auth=keys(generation, count), digest=f"keys-{generation}")


def caller_lines(page: str) -> list[str]:
    return [line for line in page.splitlines() if 'caller="' in line]


def callers_on(page: str) -> set[str]:
    return {sample.labels["caller"] for family in text_string_to_metric_families(page) for sample in family.samples if "caller" in sample.labels}


async def test_keys_rotated_by_reloads_leave_bounded_series_and_no_state_behind(autojump_clock: trio.testing.MockClock) -> None:
    """1,000 keys, each sending one request, replaced twice by reloads: what is left an idle minute later is bounded."""
    count, limit = 1_000, 20
    base = dataclasses.replace(two_pool_config(interactive_cap=64, max_queue=4096), metrics=MetricsConfig(caller_series=limit))
    config = rotated(base, 0, count)
    async with router_over_engines(config) as fleet, trio.open_nursery() as nursery:
        router = fleet.router
        observed = Observed(router)
        await nursery.start(router.run)
        seats = trio.CapacityLimiter(32)

        async def one(generation: int, i: int) -> None:
            async with seats:
                caller = router.authenticate(f"Bearer secret-{generation}-{i}")
                await observed.run(chat(f"hello {i}", max_tokens=4, request_id=f"g{generation}-{i}"), caller=caller)

        for generation in range(GENERATIONS):
            if generation:
                router.apply(rotated(base, generation, count))
            async with trio.open_nursery() as senders:
                for i in range(count):
                    senders.start_soon(one, generation, i)
        await trio.sleep(FORGET_INTERVAL)  # the next look: the removed keys' windows go, the last ones' are a minute's
        busy = router.statistics().kept
        await trio.sleep(70)  # idle: every budget window has emptied, no request runs
        page = observed.metrics.render().decode()
        idle = router.statistics().kept
        nursery.cancel_scope.cancel()
    assert all(record.outcome == "ok" for record in observed.records)
    # At most `limit` callers by name, the rest as one; ~35 lines a caller, not 35 x 3,000.
    names = callers_on(page)
    assert OTHER in names and len(names) <= limit + 1, len(names)
    assert len(caller_lines(page)) <= 40 * (limit + 1), len(caller_lines(page))
    assert not any(name.startswith(("k0-", "k1-")) for name in names)  # removed keys' series went
    assert busy.budget_windows == count  # the removed keys' windows went with them
    assert idle.budget_windows == 0 and idle.in_flight == 0
    assert idle.fair_tags == 0  # the pools are idle: no tag orders anything
    assert idle.fair_served <= count  # totals of the keys configured now only
    assert observed.metrics.callers.statistics().named <= limit


def record(caller: str, at: float, tokens: int = 10, *, reason: str | None = None) -> RequestRecord:
    """A finished request of ``caller`` at ``at``, served with ``tokens`` prompt and completion tokens (or refused)."""
    done = RequestRecord(f"r-{caller}-{at}", "http", at - 0.1, caller=caller)
    done.finished_at = at
    if reason is None:
        done.prompt_tokens, done.completion_tokens, done.admitted_at, done.outcome = tokens, tokens, at - 0.05, "ok"
    else:
        done.reason, done.outcome = reason, "rejected"
    return done


class Fixed:
    """What a CallerSeries reads of the router, set by the test."""

    def __init__(self, known: set[str], limit: int) -> None:
        self.known = known
        self.limit = limit
        self.in_flight: dict[str, int] = {}

    def series(self) -> CallerSeries:
        return CallerSeries(SECONDS_BUCKETS, lambda: self.limit, lambda: self.known, lambda: self.in_flight)


def scrape(series: CallerSeries, in_flight: Mapping[str, int] | None = None) -> dict[tuple[str, ...], float]:
    """Every sample of the caller families: (name, caller, kind or reason or le) -> value."""
    values: dict[tuple[str, ...], float] = {}
    for family in series.collect(in_flight or {}, {}):
        for sample in family.samples:
            labels = sample.labels
            values[(sample.name, labels["caller"], labels.get("kind", labels.get("reason", labels.get("le", ""))))] = sample.value
    return values


def tokens_of(values: Mapping[tuple[str, ...], float]) -> dict[str, float]:
    """Per caller: prompt and completion tokens."""
    out: dict[str, float] = {}
    for (name, caller, _), value in values.items():
        if name == "tailguard_caller_tokens_total":
            out[caller] = out.get(caller, 0.0) + value
    return out


def test_every_series_stays_monotonic_and_a_sum_over_callers_counts_each_token_once() -> None:
    """A busier caller displaces the quietest named one at a turn: no series goes down, nothing is counted twice."""
    state = Fixed({"a", "b", "c", "d"}, limit=2)
    series = state.series()
    sent = 0.0
    scrapes: list[dict[tuple[str, ...], float]] = []
    now = 1.0
    for minute in range(6):
        for _ in range(20):
            now += 0.1
            for caller, tokens in (("a", 50), ("b", 1), ("c", 200 if minute >= 2 else 0), ("d", 1)):
                if tokens:
                    series.observe(record(caller, now, tokens))
                    sent += 2 * tokens
            scrapes.append(scrape(series))
        now = (minute + 1) * TURN + 1.0
    gone = 0.0  # what the series that went had counted when they were last scraped
    for before, after in zip(scrapes, scrapes[1:], strict=False):
        for key, value in after.items():
            if key in before and key[0].endswith(("_total", "_count", "_bucket", "_sum")):
                assert value >= before[key], key  # a series that is there never goes down
        went = set(tokens_of(before)) - set(tokens_of(after))
        gone += sum(tokens_of(before)[caller] for caller in went)
    first, last = tokens_of(scrapes[0]), tokens_of(scrapes[-1])
    assert set(first) == {"a", "b", OTHER} and set(last) == {"a", "c", OTHER}  # c, the busiest, took b's place; d (as quiet) never had one
    assert sum(last.values()) + gone == sent  # nothing folded into (other): each token in one series once


def test_a_removed_keys_series_goes_when_its_last_request_ends_and_never_comes_back() -> None:
    state = Fixed({"a", "b"}, limit=10)
    series = state.series()
    series.observe(record("a", 1.0))
    series.observe(record("b", 1.0))
    state.known = {"b"}  # a reload removed a's key, while one of its requests runs
    state.in_flight = {"a": 1}
    assert {"a", "b"} <= set(tokens_of(scrape(series, state.in_flight)))
    state.in_flight = {}
    assert set(tokens_of(scrape(series))) == {"b", OTHER}
    series.observe(record("a", 2.0))  # its last request, finished after: counted as nobody's in particular
    after = scrape(series)
    assert "a" not in tokens_of(after) and tokens_of(after)[OTHER] == 20
    assert series.statistics().named == 1


def test_unnamed_callers_are_summed_under_other_and_the_bound_follows_the_config() -> None:
    state = Fixed({f"k{i}" for i in range(50)}, limit=5)
    series = state.series()
    for i in range(50):
        series.observe(record(f"k{i}", 1.0))
    values = scrape(series, {"k0": 2, "k40": 3, "k41": 1})
    assert set(tokens_of(values)) == {"k0", "k1", "k2", "k3", "k4", OTHER}
    assert tokens_of(values)[OTHER] == 45 * 20
    assert values[("tailguard_caller_in_flight", "k0", "")] == 2 and values[("tailguard_caller_in_flight", OTHER, "")] == 4
    state.limit = 2  # a reload lowered the bound: the quietest named callers go at the next turn
    series.observe(record("k0", TURN + 2.0))
    assert series.statistics().named == 2
    state.limit = 0
    series.turn(2 * TURN + 3.0)
    assert set(tokens_of(scrape(series))) == {OTHER}


def test_an_empty_budget_window_is_forgotten_and_reading_one_makes_none() -> None:
    budgets = Budgets()
    assert budgets.in_window("idle", 0.0) == (0, 0) and budgets.oldest("idle", 0.0) is None
    assert "idle" not in budgets and len(budgets) == 0  # reading a caller's budgets keeps nothing for it
    grant = budgets.admit("busy", 100, tokens_per_minute=1_000, requests_per_minute=None, now=0.0)
    budgets.admit("gone", 100, tokens_per_minute=1_000, requests_per_minute=None, now=0.0)
    budgets.forget(30.0, keep=lambda name: name != "gone")  # a reload removed "gone"
    assert "busy" in budgets and "gone" not in budgets
    budgets.forget(60.0, keep=lambda name: True)  # a minute on: busy's window is empty
    assert len(budgets) == 0
    grant.settle(40, served=True)  # a request admitted before its window went still settles, harmlessly
    assert budgets.in_window("busy", 60.0) == (0, 0)


def test_a_fair_clock_forgets_tags_when_its_queue_is_idle_and_removed_tenants_entirely() -> None:
    clock = FairClock()
    for tenant in ("a", "b", "c"):
        clock.granted(clock.start(Share(tenant, tokens=100)), Share(tenant, tokens=100))
    assert clock.statistics().tagged == 3 and clock.finish("a") > clock.virtual
    clock.forget(lambda tenant: tenant != "c", idle=False)  # busy: tags above the clock still order arrivals
    stats = clock.statistics()
    assert (stats.tagged, stats.served) == (2, 2)
    clock.forget(lambda tenant: True, idle=True)  # nothing waits or runs: a busy period is over
    assert clock.statistics().tagged == 0 and clock.virtual == 100.0
    assert clock.start(Share("a", tokens=10)) == clock.start(Share("new", tokens=10))  # everyone starts level
