"""The watch on callers who leave: none for a request that ends within the grace, one after it."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from tailguard.server.http.caller_watch import CallerWatch

GRACE = 0.05


async def test_a_request_that_ends_within_the_grace_starts_no_watch(autojump_clock: trio.testing.MockClock) -> None:
    calls: list[float] = []

    async def until_gone() -> None:
        calls.append(trio.current_time())

    callers = CallerWatch(GRACE)
    async with trio.open_nursery() as nursery:
        await nursery.start(callers.run)
        for _ in range(100):  # back to back, as at concurrency 1
            watch = callers.watch(until_gone)
            await trio.sleep(GRACE / 10)
            await watch.stop()
        await trio.sleep(10 * GRACE)
        nursery.cancel_scope.cancel()
    assert calls == [] and callers.started == 0 and not callers.pending


async def test_a_watch_starts_at_the_grace_and_stop_returns_once_it_ended(autojump_clock: trio.testing.MockClock) -> None:
    events: list[tuple[str, float]] = []

    async def until_gone() -> None:
        events.append(("started", trio.current_time()))
        try:
            await trio.sleep_forever()
        finally:
            events.append(("ended", trio.current_time()))

    callers = CallerWatch(GRACE)
    async with trio.open_nursery() as nursery:
        await nursery.start(callers.run)
        begun = trio.current_time()
        watch = callers.watch(until_gone)
        await trio.sleep(3 * GRACE)
        assert [name for name, _ in events] == ["started"] and events[0][1] == pytest.approx(begun + GRACE) and callers.started == 1
        await watch.stop()
        assert [name for name, _ in events] == ["started", "ended"]  # the socket is free before stop returns
        nursery.cancel_scope.cancel()


async def test_watches_stopped_before_they_are_due_are_passed_over_and_the_next_starts_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    started: list[float] = []

    async def until_gone() -> None:
        started.append(trio.current_time())
        await trio.sleep_forever()

    callers = CallerWatch(GRACE)
    async with trio.open_nursery() as nursery:
        await nursery.start(callers.run)
        for _ in range(1000):  # a burst that ends before the grace, then one that lasts
            await callers.watch(until_gone).stop()
        await trio.sleep(GRACE / 2)
        begun = trio.current_time()
        lasting = callers.watch(until_gone)
        await trio.sleep(2 * GRACE)
        assert started == [begun + GRACE] and callers.started == 1 and not callers.pending
        await lasting.stop()
        nursery.cancel_scope.cancel()


async def test_a_caller_who_left_is_told_at_the_grace_and_each_watch_once(autojump_clock: trio.testing.MockClock) -> None:
    told: list[tuple[int, float]] = []

    def until_gone(index: int) -> object:
        async def watch() -> None:
            told.append((index, trio.current_time()))  # the caller is already gone: it returns at once

        return watch

    callers = CallerWatch(GRACE)
    async with trio.open_nursery() as nursery:
        await nursery.start(callers.run)
        begun = trio.current_time()
        watches = []
        for index in range(5):
            watches.append(callers.watch(until_gone(index)))  # type: ignore[arg-type]
            await trio.sleep(GRACE / 4)
        await trio.sleep(4 * GRACE)
        for watch in watches:
            await watch.stop()
        nursery.cancel_scope.cancel()
    assert [index for index, _ in told] == [0, 1, 2, 3, 4]
    for index, at in told:  # each within a grace of its own due time, never before it
        assert begun + index * GRACE / 4 + GRACE <= at <= begun + index * GRACE / 4 + 2 * GRACE


async def test_a_watch_that_fails_is_logged_and_the_others_go_on(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    told: list[str] = []

    async def broken() -> None:
        raise KeyError("a bug")

    async def gone() -> None:
        told.append("gone")

    callers = CallerWatch(GRACE)
    with caplog.at_level(logging.ERROR):
        async with trio.open_nursery() as nursery:
            await nursery.start(callers.run)
            first, second = callers.watch(broken), callers.watch(gone)
            await trio.sleep(3 * GRACE)
            await first.stop()
            await second.stop()
            nursery.cancel_scope.cancel()
    assert told == ["gone"]
    assert [record.exc_info[0] for record in caplog.records if record.exc_info] == [KeyError]


async def test_a_watch_with_nothing_running_it_is_refused() -> None:
    async def gone() -> None:
        return None

    with pytest.raises(RuntimeError, match="nobody would notice"):
        CallerWatch(GRACE).watch(gone)
