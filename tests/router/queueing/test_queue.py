from __future__ import annotations

import math
import random
from functools import partial

import pytest
import trio
import trio.testing

from tailguard.router.errors import QueueFull, QueueTimeout
from tailguard.router.queueing import SKIP, Skip, WaitQueue, whole_seconds

INF = math.inf


class Slots:
    """A fake pool: ``capacity`` slots, tokens are ints, release re-dispatches.

    ``rate`` is its drain rate (slots freed a second) once all are taken; None: unknown.
    """

    def __init__(self, capacity: int, *, max_waiting: int = 100, rate: float | None = None) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.grants = 0
        self.rate = rate
        self.queue: WaitQueue[int, None] = WaitQueue(self.grant, max_waiting=max_waiting, drain_rate=self.drain_rate)

    def drain_rate(self) -> float | None:
        return self.rate if self.in_use >= self.capacity else None

    def grant(self, ticket: None) -> int | None:
        if self.in_use >= self.capacity:
            return None
        self.in_use += 1
        assert self.in_use <= self.capacity
        self.grants += 1
        return self.grants

    def release(self) -> None:
        assert self.in_use > 0
        self.in_use -= 1
        self.queue.dispatch()


async def serve_everyone(slots: Slots) -> None:
    """Dispatch and check nobody is left, so a bug fails instead of hanging."""
    slots.queue.dispatch()
    await trio.testing.wait_all_tasks_blocked()
    assert slots.queue.statistics().waiting == 0


async def test_fast_path_when_room() -> None:
    slots = Slots(2)
    assert await slots.queue.get(5, INF, None, retry_after=1) == 1
    assert slots.queue.get_nowait(5, None) == 2
    assert slots.in_use == 2
    stats = slots.queue.statistics()
    assert stats.granted_total == 0 and stats.waiting == 0
    with pytest.raises(trio.WouldBlock):
        slots.queue.get_nowait(0, None)
    assert slots.in_use == 2


async def test_get_is_a_checkpoint_and_takes_nothing_when_cancelled() -> None:
    slots = Slots(1)
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await slots.queue.get(0, INF, None, retry_after=1)
    assert slots.in_use == 0


async def test_get_nowait_defers_to_parked_waiters_as_urgent() -> None:
    slots = Slots(0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(slots.queue.get, 1, INF, None, retry_after=1))
        await trio.testing.wait_all_tasks_blocked()
        slots.capacity = 2  # room appeared but nobody dispatched yet
        with pytest.raises(trio.WouldBlock):
            slots.queue.get_nowait(1, None)
        with pytest.raises(trio.WouldBlock):
            slots.queue.get_nowait(2, None)
        assert slots.queue.get_nowait(0, None) == 1  # more urgent: may jump ahead
        await serve_everyone(slots)
    assert slots.in_use == 2
    assert slots.queue.statistics().granted_total == 1


async def test_priority_order_then_fifo() -> None:
    slots = Slots(1)
    slots.queue.get_nowait(0, None)
    served: list[str] = []

    async def waiter(name: str, priority: int) -> None:
        await slots.queue.get(priority, INF, None, retry_after=1)
        served.append(name)

    async with trio.open_nursery() as nursery:
        for name in "abcdef":
            nursery.start_soon(waiter, name, 1 if name < "d" else 0)
            await trio.testing.wait_all_tasks_blocked()
        assert dict(slots.queue.statistics().waiting_by_priority) == {0: 3, 1: 3}
        for count in range(1, 7):
            slots.release()
            await trio.testing.wait_all_tasks_blocked()
            assert len(served) == count
            assert slots.in_use == 1
    assert served == ["d", "e", "f", "a", "b", "c"]
    stats = slots.queue.statistics()
    assert stats.granted_total == 6 and stats.waiting == 0
    assert dict(stats.waiting_by_priority) == {}


async def test_deadline_raises_queue_timeout_at_exact_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots = Slots(0)
    start = trio.current_time()
    with pytest.raises(QueueTimeout) as info:
        await slots.queue.get(0, start + 3, None, retry_after=2)
    assert trio.current_time() - start == 3
    assert 2 <= info.value.retry_after < 3  # the floor, spread: nothing is measured
    assert "3.0 s" in info.value.message and f"retry after {whole_seconds(info.value.retry_after)} s" in info.value.message
    stats = slots.queue.statistics()
    assert stats.timed_out_total == 1 and stats.waiting == 0


async def test_deadline_already_passed_displaces_no_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots = Slots(0, max_waiting=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(slots.queue.get, 9, INF, None, retry_after=1))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueTimeout):
            await slots.queue.get(0, trio.current_time(), None, retry_after=1)
        assert slots.queue.statistics().waiting == 1
        slots.capacity = 1
        await serve_everyone(slots)
    assert slots.queue.statistics().rejected_full_total == 0


async def test_granted_before_deadline_returns_and_stays_quiet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots = Slots(1)
    slots.queue.get_nowait(0, None)
    got: list[int] = []

    async def waiter() -> None:
        got.append(await slots.queue.get(0, trio.current_time() + 30, None, retry_after=1))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(1)
        slots.release()
    await trio.sleep(60)  # past the deadline: nothing may fire
    assert got == [2]
    assert slots.queue.statistics().timed_out_total == 0


async def test_queue_full_rejects_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slots = Slots(0, max_waiting=2)
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(partial(slots.queue.get, 1, INF, None, retry_after=1))
        await trio.testing.wait_all_tasks_blocked()
        before = trio.current_time()
        with pytest.raises(QueueFull) as info:
            await slots.queue.get(1, before + 30, None, retry_after=4)
        assert trio.current_time() == before
        assert 4 <= info.value.retry_after < 6
        assert "2 requests already waiting" in info.value.message
        assert f"retry after {whole_seconds(info.value.retry_after)} s" in info.value.message
        with pytest.raises(QueueFull):  # less urgent: no one to displace either
            await slots.queue.get(2, before + 30, None, retry_after=4)
        stats = slots.queue.statistics()
        assert stats.waiting == 2 and stats.rejected_full_total == 2
        slots.capacity = 2
        await serve_everyone(slots)


async def test_more_urgent_arrival_displaces_least_urgent_latest() -> None:
    slots = Slots(0, max_waiting=3)
    outcomes: dict[str, object] = {}

    async def waiter(name: str, priority: int, retry_after: float) -> None:
        try:
            outcomes[name] = await slots.queue.get(
                priority, INF, None, retry_after=retry_after
            )
        except QueueFull as exc:
            outcomes[name] = exc

    async with trio.open_nursery() as nursery:
        for name, priority, retry_after in [("a", 1, 5), ("b", 2, 6), ("c", 1, 7)]:
            nursery.start_soon(waiter, name, priority, retry_after)
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "d", 0, 1)
        await trio.testing.wait_all_tasks_blocked()
        b = outcomes["b"]
        assert isinstance(b, QueueFull) and 6 <= b.retry_after < 9  # its own hint (floor 6), not the arrival's (1)
        assert "displaced" in b.message and f"retry after {whole_seconds(b.retry_after)} s" in b.message
        nursery.start_soon(waiter, "e", 0, 1)
        await trio.testing.wait_all_tasks_blocked()
        c = outcomes["c"]
        assert isinstance(c, QueueFull) and 7 <= c.retry_after < 10.5
        stats = slots.queue.statistics()
        assert stats.waiting == 3 and stats.rejected_full_total == 2
        assert dict(stats.waiting_by_priority) == {0: 2, 1: 1}
        slots.capacity = 3
        await serve_everyone(slots)
    assert outcomes["d"] == 1 and outcomes["e"] == 2 and outcomes["a"] == 3
    assert slots.queue.statistics().granted_total == 3


async def test_cancelled_waiter_is_skipped() -> None:
    slots = Slots(1)
    slots.queue.get_nowait(0, None)
    got: list[str] = []
    cancelled: list[str] = []

    async def waiter(name: str, scope: trio.CancelScope) -> None:
        with scope:
            await slots.queue.get(0, INF, None, retry_after=1)
            got.append(name)
        if scope.cancelled_caught:
            cancelled.append(name)

    scopes = {name: trio.CancelScope() for name in "abc"}
    async with trio.open_nursery() as nursery:
        for name in "abc":
            nursery.start_soon(waiter, name, scopes[name])
            await trio.testing.wait_all_tasks_blocked()
        scopes["a"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert cancelled == ["a"] and slots.queue.statistics().waiting == 2
        # Cancel and release in one synchronous step: the abort callback has
        # already removed "b", so the slot must go to "c".
        scopes["b"].cancel()
        slots.release()
        assert slots.in_use == 1
    assert got == ["c"] and cancelled == ["a", "b"]
    assert slots.in_use == 1 and slots.queue.statistics().waiting == 0


async def test_burst_with_random_cancellations() -> None:
    rng = random.Random(20240611)
    slots = Slots(5, max_waiting=1000)
    held: list[int] = []
    scopes: list[trio.CancelScope] = []
    results = {"served": 0, "cancelled": 0}

    async def waiter(priority: int, scope: trio.CancelScope) -> None:
        with scope:
            held.append(await slots.queue.get(priority, INF, None, retry_after=1))
            results["served"] += 1
        if scope.cancelled_caught:
            results["cancelled"] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(200):
            scope = trio.CancelScope()
            scopes.append(scope)
            nursery.start_soon(waiter, rng.randrange(4), scope)
        await trio.testing.wait_all_tasks_blocked()
        while results["served"] + results["cancelled"] < 200:
            if held and rng.random() < 0.6:
                held.pop(rng.randrange(len(held)))
                slots.release()
            else:
                rng.choice(scopes).cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert slots.in_use == len(held) <= slots.capacity
            stats = slots.queue.statistics()
            assert sum(stats.waiting_by_priority.values()) == stats.waiting
    while held:
        held.pop()
        slots.release()
    assert slots.in_use == 0
    stats = slots.queue.statistics()
    assert stats.waiting == 0
    assert results["cancelled"] > 0 and results["served"] > 5
    assert stats.granted_total + 5 == results["served"] == slots.grants


async def test_dead_entries_are_pruned() -> None:
    slots = Slots(0, max_waiting=1000)
    scopes = [trio.CancelScope() for _ in range(101)]

    async def waiter(scope: trio.CancelScope) -> None:
        with scope:
            await slots.queue.get(0, INF, None, retry_after=1)

    async with trio.open_nursery() as nursery:
        for scope in scopes:
            nursery.start_soon(waiter, scope)
        await trio.testing.wait_all_tasks_blocked()
        for scope in scopes[:100]:
            scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert slots.queue.statistics().waiting == 1
        assert len(slots.queue._best) <= 2 and len(slots.queue._worst) <= 2
        scopes[100].cancel()


async def test_lowering_max_waiting_keeps_waiters_rejects_arrivals() -> None:
    slots = Slots(0, max_waiting=3)
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(partial(slots.queue.get, 1, INF, None, retry_after=1))
        await trio.testing.wait_all_tasks_blocked()
        slots.queue.max_waiting = 1
        assert slots.queue.statistics().waiting == 3
        with pytest.raises(QueueFull):
            await slots.queue.get(1, INF, None, retry_after=1)
        slots.capacity = 2
        slots.queue.dispatch()
        await trio.testing.wait_all_tasks_blocked()
        assert slots.queue.statistics().waiting == 1
        with pytest.raises(QueueFull):
            await slots.queue.get(1, INF, None, retry_after=1)
        slots.capacity = 3
        slots.queue.dispatch()
        await trio.testing.wait_all_tasks_blocked()
        # Now there is room again.
        nursery.start_soon(partial(slots.queue.get, 1, INF, None, retry_after=1))
        await trio.testing.wait_all_tasks_blocked()
        assert slots.queue.statistics().waiting == 1
        slots.capacity = 4
        await serve_everyone(slots)
    assert slots.queue.statistics().rejected_full_total == 2


def test_max_waiting_must_not_be_negative() -> None:
    with pytest.raises(ValueError):
        WaitQueue[int, object](lambda _: 1, max_waiting=-1)


async def test_release_at_deadline_instant_goes_to_the_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The release runs at t == deadline before trio has expired the waiter's
    # deadline: the waiter must get the slot and no timeout may follow.
    slots = Slots(1)
    slots.queue.get_nowait(0, None)
    got: list[int] = []
    deadline = trio.current_time() + 3

    async def waiter() -> None:
        got.append(await slots.queue.get(0, deadline, None, retry_after=1))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        autojump_clock.jump(3)
        assert trio.current_time() == deadline
        slots.release()
    assert got == [2] and slots.in_use == 1
    stats = slots.queue.statistics()
    assert stats.timed_out_total == 0 and stats.granted_total == 1


async def test_deadline_and_release_in_same_instant_lose_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The releaser and the waiter's deadline wake in the same run-loop pass:
    # the waiter times out and the slot goes to the next waiter, not to it.
    slots = Slots(1)
    slots.queue.get_nowait(0, None)
    deadline = trio.current_time() + 3
    got: list[str] = []
    timed_out: list[str] = []

    async def waiter(name: str, until: float) -> None:
        try:
            await slots.queue.get(0, until, None, retry_after=1)
        except QueueTimeout:
            timed_out.append(name)
        else:
            got.append(name)

    async def releaser() -> None:
        await trio.sleep_until(deadline)
        slots.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "short", deadline)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "long", deadline + 30)
        nursery.start_soon(releaser)
    assert sorted(got + timed_out) == ["long", "short"]
    assert len(got) == slots.in_use == 1
    assert trio.current_time() == deadline
    stats = slots.queue.statistics()
    assert stats.waiting == 0 and stats.granted_total + stats.timed_out_total == 2


# -- failing fast on the expected wait -----------------------------------------------


async def park(slots: Slots, priority: int, count: int, nursery: trio.Nursery, *, deadline: float = INF) -> None:
    for _ in range(count):
        nursery.start_soon(partial(slots.queue.get, priority, deadline, None, retry_after=1))
    await trio.testing.wait_all_tasks_blocked()


async def test_expected_wait_over_the_budget_is_refused_at_once(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(1, rate=2.0)  # one slot, freed twice a second
    slots.queue.get_nowait(0, None)
    async with trio.open_nursery() as nursery:
        await park(slots, 1, 3, nursery)
        assert slots.queue.expected_wait(1) == 2.0  # 3 ahead + itself, at 2/s
        start = trio.current_time()
        with pytest.raises(QueueTimeout, match=r"expected for 2.0 s \(3 requests ahead\).*1.5 s") as caught:
            await slots.queue.get(1, INF, None, retry_after=4, max_wait=1.5)
        # The hint: a seat is expected in 2.0 s, under the floor of 4, spread over [4, 6).
        assert trio.current_time() == start and 4 <= caught.value.retry_after < 6
        # Within the budget, or more urgent than those parked: it waits in line.
        await park(slots, 0, 1, nursery)
        stats = slots.queue.statistics()
        assert stats.waiting == 4 and stats.refused_early_total == 1 and stats.timed_out_total == 0
        slots.capacity = 5
        await serve_everyone(slots)
    assert slots.in_use == 5


async def test_the_deadline_caps_the_budget(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(1, rate=1.0)
    slots.queue.get_nowait(0, None)
    with pytest.raises(QueueTimeout, match="expected for 1.0 s"):
        await slots.queue.get(0, trio.current_time() + 0.5, None, retry_after=1, max_wait=10.0)
    assert slots.queue.statistics().refused_early_total == 1


async def test_no_estimate_or_no_budget_means_no_refusal(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(1, rate=None)
    slots.queue.get_nowait(0, None)
    async with trio.open_nursery() as nursery:
        await park(slots, 0, 50, nursery)
        assert slots.queue.expected_wait(0) is None
        slots.rate = 1.0
        nursery.start_soon(partial(slots.queue.get, 0, INF, None, retry_after=1))  # max_wait None: never refused
        await trio.testing.wait_all_tasks_blocked()
        assert slots.queue.statistics().waiting == 51
        slots.capacity = 52
        await serve_everyone(slots)
    assert slots.queue.statistics().refused_early_total == 0


async def test_a_free_slot_is_never_refused(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(0, rate=0.001)
    async with trio.open_nursery() as nursery:
        await park(slots, 0, 3, nursery)
        slots.capacity = 1  # room appeared, nobody dispatched yet: the owner reports no rate
        nursery.start_soon(partial(slots.queue.get, 0, INF, None, retry_after=1, max_wait=0.0))
        await trio.testing.wait_all_tasks_blocked()
        # the arrival took its place in line, the first in line got the room, nobody was refused
        assert slots.queue.statistics().waiting == 3 and slots.in_use == 1
        assert slots.queue.statistics().refused_early_total == 0
        slots.capacity = 4
        await serve_everyone(slots)
    # And with the fast path open, max_wait does not matter at all.
    slots.capacity = 5
    assert await slots.queue.get(0, INF, None, retry_after=1, max_wait=0.0) == 5


async def test_a_hopeless_arrival_displaces_no_one(autojump_clock: trio.testing.MockClock) -> None:
    slots = Slots(1, max_waiting=3, rate=1.0)
    slots.queue.get_nowait(0, None)
    async with trio.open_nursery() as nursery:
        await park(slots, 0, 1, nursery)
        await park(slots, 1, 2, nursery)  # the queue is full; a priority-0 arrival could push a 1 out
        with pytest.raises(QueueTimeout):
            await slots.queue.get(0, INF, None, retry_after=1, max_wait=1.5)  # 1 ahead + itself at 1/s = 2 s
        stats = slots.queue.statistics()
        assert stats.waiting == 3 and stats.rejected_full_total == 0 and dict(stats.waiting_by_priority) == {0: 1, 1: 2}
        slots.capacity = 4
        await serve_everyone(slots)


async def test_a_skipped_waiter_keeps_its_place_and_blocks_no_one_behind_it() -> None:
    """A waiter the owner cannot serve now (its class at a limit) lets later ones through."""
    free = {"a": 0, "b": 0}  # resources free per kind

    def grant(kind: str) -> str | Skip | None:
        if not any(free.values()):
            return None
        if not free[kind]:
            return SKIP
        free[kind] -= 1
        return kind

    queue: WaitQueue[str, str] = WaitQueue(grant, max_waiting=10)
    served: list[str] = []

    async def wait(name: str, kind: str) -> None:
        served.append(name + ":" + await queue.get(0, INF, kind, retry_after=1))

    async with trio.open_nursery() as nursery:
        for name, kind in [("first", "a"), ("second", "b"), ("third", "a")]:
            nursery.start_soon(wait, name, kind)
            await trio.testing.wait_all_tasks_blocked()
        free["b"] = 1
        queue.dispatch()  # "first" (kind a) cannot be served: "second" gets the b
        await trio.testing.wait_all_tasks_blocked()
        assert served == ["second:b"]
        free["a"] = 1
        queue.dispatch()  # "first" kept its place ahead of "third"
        await trio.testing.wait_all_tasks_blocked()
        assert served == ["second:b", "first:a"] and queue.statistics().waiting == 1
        free["a"] = 1
        queue.dispatch()
    assert served == ["second:b", "first:a", "third:a"]
