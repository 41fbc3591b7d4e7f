"""Fair shares between tenants waiting at one priority: start tags over tokens (router/queueing/fair_share.py, router/queueing/queue.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial

import pytest
import trio
import trio.testing
from hypothesis import given, settings, strategies as st

from tailguard.router.admission import RouterRequest
from tailguard.router.config import ConfigError, QueueOrder, parse_config, render_config
from tailguard.router.errors import QueueFull, QueueTimeout
from tailguard.router.queueing import FairClock, Share
from tailguard.router.quotas import Caller
from tests.helpers.config_text import BASE
from tests.helpers.router import chat, router_over_engines, two_pool_config, with_digest
from tests.router.queueing.test_queue import Slots

A, B = Share("a", tokens=100), Share("b", tokens=100)


def test_one_tenants_tags_keep_its_arrival_order_and_an_idle_one_starts_at_the_clock() -> None:
    clock = FairClock()
    tags = [clock.start(A) for _ in range(3)]
    assert tags == [0.0, 100.0, 200.0]
    clock.granted(tags[1], A)
    assert clock.start(B) == 100.0  # B was idle: it starts at the clock, with no credit banked
    clock.settle(A, 10, 60)  # one of A's requests generated 10 of the 60 max_tokens charged for it
    assert clock.finish("a") == 250.0 and clock.start(A) == 250.0


def test_weights_divide_the_charge_and_a_refused_request_hands_its_charge_back() -> None:
    clock = FairClock()
    heavy = Share("heavy", weight=4.0, tokens=100)
    assert [clock.start(heavy) for _ in range(2)] == [0.0, 25.0]
    first, second = clock.start(A), clock.start(A)
    clock.withdraw(A)  # one of them got no seat: A is charged for one prompt, whichever it was
    assert (first, second, clock.finish("a")) == (0.0, 100.0, 100.0)
    assert clock.start(A, after=second) == 100.0  # never before A's newest waiter


async def test_waiters_that_time_out_leave_their_tenant_no_debt(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(0)
    now = trio.current_time()

    async def gives_up(deadline: float) -> None:
        with pytest.raises(QueueTimeout):
            await slots.queue.get(0, deadline, None, retry_after=1.0, share=A)

    async with trio.open_nursery() as nursery:
        for i in range(5):  # A's clients give up one after another, oldest first, never served
            nursery.start_soon(gives_up, now + 1 + i * 0.1)
            await trio.testing.wait_all_tasks_blocked()
    assert slots.queue.fair.finish("a") == 0.0
    order: list[tuple[int, str]] = []
    slots.capacity = 0
    async with trio.open_nursery() as nursery:
        for name, share in (("b0", B), ("b1", B), ("a5", A)):
            nursery.start_soon(parked, slots, share, order, name)
            await trio.testing.wait_all_tasks_blocked()
        slots.capacity = 3
        slots.queue.dispatch()
    assert granted_order(order) == ["b0", "a5", "b1"]


async def parked(slots: Slots, share: Share, order: list[tuple[int, str]], name: str, *, priority: int = 0) -> None:
    """Wait for a slot; ``order`` gets (its grant's number, ``name``): Slots numbers its grants in the order it gives them."""
    order.append((await slots.queue.get(priority, math.inf, None, retry_after=1.0, share=share), name))


def granted_order(order: list[tuple[int, str]]) -> list[str]:
    """The names in the order their slots were granted (tasks wake in an order of Trio's own)."""
    return [name for _, name in sorted(order)]


async def test_a_light_tenant_is_served_before_a_heavy_ones_backlog(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(1)
    slots.queue.get_nowait(0, None, A)
    order: list[tuple[int, str]] = []
    async with trio.open_nursery() as nursery:
        for i in range(5):  # A's backlog: five more of its requests, queued first
            nursery.start_soon(parked, slots, A, order, f"a{i}")
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(parked, slots, B, order, "b")
        await trio.testing.wait_all_tasks_blocked()
        # A was served 100 tokens and B none: B's start tag (0) is before A's first waiter's (100)
        assert (slots.queue.ahead_of(0), slots.queue.ahead_of(0, 50.0)) == (6, 1)
        for _ in range(6):
            slots.release()
            await trio.testing.wait_all_tasks_blocked()
    assert granted_order(order) == ["b", "a0", "a1", "a2", "a3", "a4"]


async def test_without_shares_the_order_is_arrival_and_priority_still_comes_first(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(1)
    slots.queue.get_nowait(0, None)
    order: list[tuple[int, str]] = []
    async with trio.open_nursery() as nursery:
        for name, share, priority in (("x0", Share(""), 1), ("x1", Share(""), 1), ("b", B, 1), ("urgent", A, 0)):
            nursery.start_soon(partial(parked, slots, share, order, name, priority=priority))
            await trio.testing.wait_all_tasks_blocked()
        for _ in range(4):
            slots.release()
            await trio.testing.wait_all_tasks_blocked()
    assert granted_order(order) == ["urgent", "x0", "x1", "b"]


async def test_weights_three_to_one_share_the_tokens_three_to_one(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(2)
    heavy, light = Share("three", weight=3.0, tokens=164), Share("one", weight=1.0, tokens=164)  # 100 prompt + 64 max_tokens
    served = {"three": 0, "one": 0}

    async def backlogged(share: Share) -> None:
        while True:  # bounded by the nursery's deadline below
            await slots.queue.get(0, math.inf, None, retry_after=1.0, share=share)
            served[share.tenant] += 100 + 50
            await trio.sleep(1.0)
            slots.queue.fair.settle(share, 50, 64)  # it generated 50 of its 64
            slots.release()

    with trio.move_on_after(300):
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(backlogged, heavy)
                nursery.start_soon(backlogged, light)
    assert served["three"] / served["one"] == pytest.approx(3.0, rel=0.1)


async def test_a_full_queue_displaces_the_waiter_furthest_past_its_share(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(1, max_waiting=2)
    slots.queue.get_nowait(0, None, A)
    outcomes: dict[str, str] = {}

    async def wait(name: str, share: Share) -> None:
        try:
            await slots.queue.get(0, math.inf, None, retry_after=1.0, share=share)
            outcomes[name] = "served"
        except QueueFull:
            outcomes[name] = "full"

    async with trio.open_nursery() as nursery:
        for name, share in (("a0", A), ("a1", A), ("b", B), ("a2", A)):
            nursery.start_soon(wait, name, share)
            await trio.testing.wait_all_tasks_blocked()
        for _ in range(2):
            slots.release()
            await trio.testing.wait_all_tasks_blocked()
    # B came third to a queue of two A's: A's newest made room; A's next found B and a0 before it.
    assert outcomes == {"a1": "full", "a2": "full", "a0": "served", "b": "served"}


def quick_chat(request_id: str) -> RouterRequest:
    return chat("quick?", max_tokens=8, request_id=request_id)


def quick_message(request_id: str) -> RouterRequest:
    """An Anthropic Messages API request (the simulator answers it as vLLM's /v1/messages does)."""
    return RouterRequest(kind="messages", request_id=request_id, messages=[{"role": "user", "content": "quick?"}], max_tokens=8)


async def seating_order(queue_order: QueueOrder, heavy_requests: int, request_for: Callable[[str], RouterRequest] = quick_chat) -> list[str]:
    """The order a one-seat pool's requests got their seat: ``heavy_requests`` of one caller, then one of another."""
    base = two_pool_config(interactive_cap=1, interactive_timeout=60.0)
    interactive, batch = base.pools
    config = with_digest(base, queue_order, pools=(dataclasses.replace(interactive, queue_order=queue_order), batch))
    heavy, light = Caller("heavy", frozenset(), None), Caller("light", frozenset(), None)
    order: list[str] = []
    async with router_over_engines(config) as fleet:

        async def ask(caller: Caller, request_id: str) -> None:
            request = request_for(request_id)
            with trio.CancelScope(deadline=fleet.router.deadline_for(request)):
                async with fleet.router.open(request, caller=caller) as completion:
                    order.append(request_id)
                    await completion.read()

        async with trio.open_nursery() as nursery:
            for i in range(heavy_requests):
                nursery.start_soon(ask, heavy, f"heavy{i}")
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, light, "light")
    return order


async def test_the_router_queues_each_caller_in_its_share(autojump_clock: trio.testing.MockClock) -> None:
    # First come, first served would put light last.
    assert await seating_order("fair", 4) == ["heavy0", "light", "heavy1", "heavy2", "heavy3"]


async def test_messages_api_requests_queue_in_their_callers_share_as_chats_do(autojump_clock: trio.testing.MockClock) -> None:
    assert await seating_order("fair", 4, quick_message) == ["heavy0", "light", "heavy1", "heavy2", "heavy3"]


def test_weight_is_read_checked_and_rendered() -> None:
    keys = '\n[[auth.keys]]\nname = "big"\nkey_sha256 = "' + "a" * 64 + '"\n'
    config = parse_config(BASE + keys + "weight = 3\n")
    assert config.auth.keys[0].weight == 3.0
    assert dataclasses.replace(config.auth.keys[0], weight=1.0) == parse_config(BASE + keys).auth.keys[0]
    assert "weight" in render_config(config)
    for bad in ("0", "-1", '"high"'):
        with pytest.raises(ConfigError) as raised:
            parse_config(BASE + keys + f"weight = {bad}\n")
        assert "auth.keys[0].weight" in str(raised.value)


async def test_queue_order_arrival_serves_callers_first_come_first_served(autojump_clock: trio.testing.MockClock) -> None:
    assert await seating_order("arrival", 3) == ["heavy0", "heavy1", "heavy2", "light"]


def test_queue_order_is_read_checked_and_rendered() -> None:
    config = parse_config(BASE.replace("[pools.interactive]\n", '[pools.interactive]\nqueue_order = "arrival"\n', 1))
    assert (config.pool("interactive").queue_order, config.pool("batch").queue_order) == ("arrival", "fair")
    assert "arrival, across callers" in render_config(config)
    with pytest.raises(ConfigError) as raised:
        parse_config(BASE.replace("[pools.interactive]\n", '[pools.interactive]\nqueue_order = "lifo"\n', 1))
    assert "pools.interactive.queue_order" in str(raised.value)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 500), st.floats(0.1, 5.0), st.booleans()), min_size=1, max_size=30
    ),
    st.integers(1, 3),
)
def test_each_tenant_is_served_in_its_arrival_order_whatever_the_others_do(
    arrivals: list[tuple[str, int, float, bool]], seats: int
) -> None:
    """Random tenants, costs, patience and releases: no tenant's requests ever pass one another."""
    served: list[tuple[int, str, int]] = []  # (the grant's number, tenant, arrival index)

    async def main() -> None:
        slots = Slots(seats)

        async def one(index: int, tenant: str, tokens: int, patience: float) -> None:
            with trio.move_on_after(patience):
                granted = await slots.queue.get(0, math.inf, None, retry_after=1.0, share=Share(tenant, tokens=tokens))
                served.append((granted, tenant, index))
                await trio.sleep(1.0)
                slots.release()

        async with trio.open_nursery() as nursery:
            for index, (tenant, tokens, patience, pause) in enumerate(arrivals):
                nursery.start_soon(one, index, tenant, tokens, patience)
                await trio.sleep(0.3 if pause else 0.0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for tenant in "abc":
        mine = [index for _, who, index in sorted(served) if who == tenant]
        assert mine == sorted(mine)
