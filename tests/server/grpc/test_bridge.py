"""The asyncio <-> Trio bridge across two threads: results, errors, cancellation, back-pressure."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import pytest
import trio
import trio.lowlevel

from tailguard.server.grpc.bridge import TrioPortal, open_asyncio_host


async def test_a_call_returns_its_result_and_raises_its_error_on_the_asyncio_side() -> None:
    async def double(value: int) -> int:
        await trio.lowlevel.checkpoint()
        return 2 * value

    async def fail() -> None:
        raise ValueError("from trio")

    async with open_asyncio_host() as host, trio.open_nursery() as nursery:
        portal = TrioPortal(nursery, host.loop)
        threads: list[str] = []

        async def on_asyncio() -> tuple[int, str]:
            threads.append(threading.current_thread().name)
            result = await portal.call(double, 21)
            try:
                await portal.call(fail)
            except ValueError as error:
                return result, str(error)
            return result, "no error"

        assert await host.run(on_asyncio) == (42, "from trio")
        assert threads == ["grpc-asyncio"]  # the asyncio side ran on the host's thread, not Trio's


async def test_cancelling_the_asyncio_caller_cancels_the_trio_work() -> None:
    async with open_asyncio_host() as host, trio.open_nursery() as nursery:
        portal = TrioPortal(nursery, host.loop)
        started, cancelled = trio.Event(), trio.Event()

        async def forever() -> None:
            started.set()
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()

        async def on_asyncio() -> str:
            task = asyncio.get_running_loop().create_task(portal.call(forever))
            await asyncio.sleep(0.05)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return "cancelled"
            return "finished"

        assert await host.run(on_asyncio) == "cancelled"
        with trio.fail_after(5):
            await cancelled.wait()
        assert started.is_set()


async def test_cancelling_the_trio_caller_cancels_the_asyncio_task() -> None:
    async with open_asyncio_host() as host:
        ended = threading.Event()

        async def on_asyncio() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                ended.set()

        with trio.move_on_after(0.1):
            await host.run(on_asyncio)
        assert ended.is_set()  # run() waited for the task to finish being cancelled


async def _consume(portal: TrioPortal, produce: Callable[..., Awaitable[None]], take: int | None) -> list[int]:
    taken: list[int] = []
    async for item in portal.stream(produce, buffer=4):
        taken.append(item)
        if take is not None and len(taken) == take:
            break
    return taken


async def test_a_stream_delivers_every_item_in_order_then_its_error() -> None:
    async def produce(emit: Callable[[int], Awaitable[None]]) -> None:
        for item in range(1000):
            await emit(item)
        raise ValueError("after 1000")

    async with open_asyncio_host() as host, trio.open_nursery() as nursery:
        portal = TrioPortal(nursery, host.loop)
        got: list[int] = []

        async def on_asyncio() -> str:
            try:
                async for item in portal.stream(produce, buffer=4):
                    got.append(item)
            except ValueError as error:
                return str(error)
            return "no error"

        assert await host.run(on_asyncio) == "after 1000"
        assert got == list(range(1000))


async def test_a_slow_consumer_holds_the_producer_at_the_buffer_and_leaving_cancels_it() -> None:
    emitted: list[int] = []
    stopped = trio.Event()

    async def produce(emit: Callable[[int], Awaitable[None]]) -> None:
        try:
            for item in range(100):
                await emit(item)
                emitted.append(item)
        finally:
            stopped.set()

    async with open_asyncio_host() as host, trio.open_nursery() as nursery:
        portal = TrioPortal(nursery, host.loop)

        async def take_one_then_stall() -> list[int]:
            stream = portal.stream(produce, buffer=4)
            first = [await anext(stream)]
            await asyncio.sleep(0.2)  # the producer fills the buffer meanwhile, then waits
            held = len(emitted)
            assert isinstance(stream, AsyncGenerator)
            await stream.aclose()  # leaving the iteration cancels the producer
            return [*first, held]

        first, held = await host.run(take_one_then_stall)
        assert first == 0
        # the consumer's batch (at most the buffer's 4) and 4 more waiting: never all 100
        assert held <= 4 + 4
        with trio.fail_after(5):
            await stopped.wait()
        assert len(emitted) < 100


@pytest.mark.parametrize("take", [1, 7])
async def test_breaking_out_early_stops_the_producer(take: int) -> None:
    stopped = trio.Event()

    async def endless(emit: Callable[[int], Awaitable[None]]) -> None:
        try:
            item = 0
            while True:
                await emit(item)
                item += 1
        finally:
            stopped.set()

    async with open_asyncio_host() as host, trio.open_nursery() as nursery:
        portal = TrioPortal(nursery, host.loop)
        assert await host.run(lambda: _consume(portal, endless, take)) == list(range(take))
        with trio.fail_after(5):
            await stopped.wait()


async def test_the_host_thread_ends_with_the_block() -> None:
    async with open_asyncio_host("bridge-test") as host:
        assert any(t.name == "bridge-test" for t in threading.enumerate())
        assert await host.run(lambda: asyncio.sleep(0, result="ran")) == "ran"
    assert not any(t.name == "bridge-test" for t in threading.enumerate())
    assert host.loop.is_closed()


async def test_a_burst_posted_from_asyncio_runs_in_slices_between_which_trio_runs() -> None:
    """Issue 20, defect 1: thousands of posts at once (a gRPC flood) must not hold the Trio loop for one long turn."""
    async with open_asyncio_host() as host, trio.open_nursery() as nursery:
        portal = TrioPortal(nursery, host.loop)
        turns = [0]  # Trio scheduling batches seen by a task that checkpoints in a loop
        seen: list[int] = []

        async def count_turns() -> None:
            while True:
                turns[0] += 1
                await trio.lowlevel.checkpoint()

        nursery.start_soon(count_turns)
        done = trio.Event()
        total = 1000

        def one() -> None:
            seen.append(turns[0])
            if len(seen) == total:
                done.set()

        def burst() -> None:  # on the asyncio thread, while the Trio thread sleeps: all posted before any runs
            for _ in range(total):
                portal.post(one)

        await trio.lowlevel.checkpoint()
        host.loop.call_soon_threadsafe(burst)
        time.sleep(0.5)  # blocks the Trio thread, as a busy turn would
        with trio.fail_after(10):
            await done.wait()
        nursery.cancel_scope.cancel()
    # At most one slice of 64 before and one after each turn of the other task (batch order varies).
    assert max(seen.count(turn) for turn in set(seen)) <= 2 * 64
