"""Prefix-affinity placement wired through the router: the key at admission, the placement on the lease and record, retries."""

from __future__ import annotations

import random

import httpx
import trio
import trio.testing

from tailguard.router.dispatch import Router
from tailguard.router.policies import PrefixAffinity, rendezvous_order
from tailguard.router.prefix_key import key_chars, prefix_key, prefix_key_of
from tailguard.router.request import RouterRequest
from tailguard.router.telemetry import RequestRecord
from tailguard.sim.canned import canned_transport
from tests.router_helpers import chat, router_over_engines, two_pool_config

URLS = tuple(f"http://interactive-{i}:8000" for i in range(3))
SYSTEM = "You are the support agent of ACME. Answer in one sentence. " * 20  # longer than the key covers


async def placed(router: Router, request: RouterRequest) -> RequestRecord:
    """Run ``request`` to its end; its record (endpoint, placement)."""
    record = RequestRecord(request.request_id, "http", trio.current_time())
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
    async with router_over_engines(two_pool_config(interactive_urls=URLS)) as fleet:
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
        pool.policy = PrefixAffinity(random.Random(0))
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
        no_key = await placed(fleet.router, RouterRequest(kind="completion", request_id="n", prompt="", max_tokens=4))
        assert no_key.placement == "no_key"
