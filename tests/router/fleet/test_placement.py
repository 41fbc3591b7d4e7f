"""Prefix-affinity placement wired through the router: the key at admission, the placement on the lease and record, retries."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import trio
import trio.testing

from tailguard.router import Router
from tailguard.router.admission import RouterRequest, key_chars, prefix_key, prefix_key_of
from tailguard.router.config import PlacementConfig
from tailguard.router.errors import BackendRejected
from tailguard.router.fleet import PrefixAffinity, rendezvous_order
from tailguard.router.observe import RequestRecord
from tailguard.sim.canned import canned_transport
from tests.helpers.router import chat, router_over_engines, two_pool_config, with_digest

URLS = tuple(f"http://interactive-{i}:8000" for i in range(3))
SYSTEM = "You are the support agent of ACME. Answer in one sentence. " * 20  # longer than the key covers


async def placed(router: Router, request: RouterRequest, record: RequestRecord | None = None) -> RequestRecord:
    """Run ``request`` to its end; its record (endpoint, placement)."""
    record = record if record is not None else RequestRecord(request.request_id, "http", trio.current_time())
    with trio.CancelScope(deadline=router.deadline_for(request)):
        async with router.open(request, record=record) as completion:
            await completion.read()
    return record


def test_the_key_of_a_request_is_the_key_of_its_body() -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "my order?"}]
    assert prefix_key_of(RouterRequest(kind="chat", request_id="r", messages=messages)) == prefix_key({"messages": messages})
    completion = RouterRequest(kind="completion", request_id="r", prompt=[1, 2, 3])
    assert prefix_key_of(completion) == prefix_key({"prompt": [1, 2, 3]})
    hinted = RouterRequest(kind="completion", request_id="r", prompt="x", params={"user": "u1"}, session="s")
    assert prefix_key_of(hinted) == prefix_key({"prompt": "y", "user": "u1"}, "other")
    by_session = RouterRequest(kind="completion", request_id="r", prompt="x", session="s")
    assert prefix_key_of(by_session) == prefix_key({"prompt": "y"}, "s")
    # Fewer blocks: fewer leading characters count.
    short = RouterRequest(kind="completion", request_id="r", prompt="a" * key_chars(1) + "b")
    assert prefix_key_of(short, 1) == prefix_key({"prompt": "a" * key_chars(1) + "c"}, chars=key_chars(1))


async def test_least_loaded_placement_is_named_so(autojump_clock: trio.testing.MockClock) -> None:
    base = two_pool_config(interactive_urls=URLS)
    interactive, batch = base.pools
    config = with_digest(base, "least", pools=(dataclasses.replace(interactive, placement=PlacementConfig(mode="least_loaded")), batch))
    async with router_over_engines(config) as fleet:
        record = await placed(fleet.router, chat(SYSTEM))
        assert record.placement == "least_loaded" and record.endpoint in URLS


async def test_one_prefix_goes_home_and_its_retry_follows_the_rendezvous_order(autojump_clock: trio.testing.MockClock) -> None:
    refused: list[str] = []
    refuse: set[str] = set()

    def refusing(url: str, inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and url in refuse:
                refused.append(url)
                raise httpx.ConnectError("connection refused", request=request)
            return await inner.handle_async_request(request)

        return canned_transport(handle)

    async with router_over_engines(two_pool_config(interactive_urls=URLS), wrap=refusing) as fleet:
        pool = fleet.router.pool("interactive")
        assert isinstance(pool.policy, PrefixAffinity)  # the default
        request = chat(SYSTEM + "my order?")
        key = prefix_key_of(request)
        assert key is not None
        order = [e.url for e in rendezvous_order(key, pool.endpoints)]
        for i in range(5):  # one after another: the home is within the bound each time
            record = await placed(fleet.router, chat(SYSTEM + f"question {i}", request_id=f"r{i}"))
            assert (record.endpoint, record.placement) == (order[0], "home")
        refuse.add(order[0])  # the home refuses: the retry goes to the key's second choice, not the least loaded
        record = await placed(fleet.router, chat(SYSTEM + "again", request_id="retry"))
        assert refused == [order[0]]
        assert (record.endpoint, record.placement) == (order[1], "spilled")
        # No prompt text, no key. vLLM 0.32 refuses an empty prompt (400), but only after it was placed.
        no_key = RequestRecord("n", "http", trio.current_time())
        with pytest.raises(BackendRejected):
            await placed(fleet.router, RouterRequest(kind="completion", request_id="n", prompt="", max_tokens=4), no_key)
        assert no_key.placement == "no_key"


def home_of(router: Router, text: str, pool: str = "interactive") -> list[str]:
    """The rendezvous order (URLs) of the prompt ``text``'s key over the pool's endpoints now."""
    key = prefix_key_of(chat(text))
    assert key is not None
    return [e.url for e in rendezvous_order(key, router.pool(pool).endpoints)]


async def test_a_burst_of_one_prefix_fills_its_home_to_the_bound_then_spills_and_no_cap_is_passed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with router_over_engines(two_pool_config(interactive_cap=4, interactive_urls=URLS, max_queue=64)) as fleet:
        order = home_of(fleet.router, SYSTEM)
        records: list[RequestRecord] = []

        async def one(i: int) -> None:
            records.append(await placed(fleet.router, chat(SYSTEM + f"question {i}", max_tokens=64, request_id=f"r{i}")))

        async with trio.open_nursery() as nursery:
            for i in range(24):  # twice the pool's 12 seats: the rest wait
                nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
            by_url = {e.url: e.in_flight for e in fleet.router.pool("interactive").endpoints}
            assert by_url == dict.fromkeys(URLS, 4)  # every seat taken, none over its cap
        assert max(fleet.engine(url).statistics().max_running_seen for url in URLS) <= 4
        first = [r for r in records if r.queue_seconds == 0]
        assert {r.placement for r in records} <= {"home", "spilled"}
        assert sum(r.endpoint == order[0] for r in records) >= len(records) / 3  # the home takes its share and more
        assert any(r.placement == "spilled" for r in first)  # the bound spilled the burst down the order


async def test_affinity_leaves_an_ejected_home_and_comes_back_when_it_does(autojump_clock: trio.testing.MockClock) -> None:
    async with router_over_engines(two_pool_config(interactive_urls=URLS)) as fleet:
        order = home_of(fleet.router, SYSTEM)
        home = fleet.router.endpoint(order[0])
        home.ejected_until = trio.current_time() + 5.0  # outlier detection's verdict (router/fleet/outlier.py)
        during = await placed(fleet.router, chat(SYSTEM + "while out", request_id="a"))
        assert (during.endpoint, during.placement) == (order[1], "home")  # the next in the order is its home meanwhile
        await trio.sleep(5.1)
        after = await placed(fleet.router, chat(SYSTEM + "back", request_id="b"))
        assert (after.endpoint, after.placement) == (order[0], "home")


async def test_an_endpoint_leaving_on_reload_moves_only_its_keys_and_a_reload_rebuilds_the_policy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    base = two_pool_config(interactive_urls=URLS)
    async with router_over_engines(base) as fleet:
        router = fleet.router
        texts = [f"tenant {i} system prompt " * 8 for i in range(30)]
        before = {text: (await placed(router, chat(text, request_id=f"a{n}"))).endpoint for n, text in enumerate(texts)}
        assert len(set(before.values())) == 3  # spread over the engines
        gone = URLS[1]
        interactive, batch = base.pools
        fewer = dataclasses.replace(interactive, endpoints=tuple(e for e in interactive.endpoints if e.url != gone), max_concurrency=16)
        router.apply(with_digest(base, "fewer", pools=(fewer, batch)))
        after = {text: (await placed(router, chat(text, request_id=f"b{n}"))).endpoint for n, text in enumerate(texts)}
        assert {t for t in texts if before[t] != after[t]} == {t for t in texts if before[t] == gone}
        policy = router.pool("interactive").policy
        router.apply(with_digest(base, "same", pools=(fewer, batch)))
        assert router.pool("interactive").policy is policy  # nothing of placement changed: the same policy
        least = dataclasses.replace(fewer, placement=PlacementConfig(mode="least_loaded"))
        router.apply(with_digest(base, "least", pools=(least, batch)))
        assert not isinstance(router.pool("interactive").policy, PrefixAffinity)
        assert (await placed(router, chat(texts[0], request_id="c"))).placement == "least_loaded"
        router.apply(with_digest(base, "tight", pools=(dataclasses.replace(fewer, placement=PlacementConfig(load_factor=1.0)), batch)))
        policy = router.pool("interactive").policy
        assert isinstance(policy, PrefixAffinity) and policy.c == 1.0
