"""The measured gate on open gRPC calls (server/grpc/gate.py): its rule, and what grpc core says waits in it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import grpc
import pytest

from tailguard.server.grpc.gate import BACKOFF, BURST_CALLS, FLOOR, GROWTH, MIN_BACKLOG, WAIT_TARGET, Backlog, CallGate, follow_grpc
from tailguard.server.grpc.gen.tailguard.v1 import tailguard_pb2 as pb, tailguard_pb2_grpc as pb_grpc
from tailguard.server.malloc import trimmer


def test_the_gate_starts_at_its_floor_and_grows_only_while_it_binds_and_nothing_waits() -> None:
    gate = CallGate(1000)
    assert gate.limit == FLOOR
    gate.tick(0, 100.0, 10)  # far from binding: no reason to grow
    assert gate.limit == FLOOR
    assert not gate.admit(FLOOR)  # refused: it binds
    gate.tick(0, 100.0, FLOOR)
    assert gate.limit == int(FLOOR * GROWTH)
    for _ in range(40):
        gate.admit(gate.limit)
        gate.tick(0, 100.0, gate.limit)
    assert gate.limit == 1000  # never above its ceiling


def test_the_gate_backs_off_while_calls_wait_in_grpc_and_not_below_its_floor() -> None:
    gate = CallGate(1000)
    for _ in range(20):
        gate.admit(gate.limit)
        gate.tick(0, 100.0, gate.limit)
    high = gate.limit
    gate.tick(MIN_BACKLOG - 1, 1.0, high)  # a few calls in flight between core and a handler: no backlog
    assert gate.limit >= high
    gate.tick(500, 100.0, high)  # the newest waits 5 s > WAIT_TARGET
    assert gate.limit == int(high * BACKOFF) and gate.statistics().wait == pytest.approx(500 / 100.0)
    gate.tick(100, 1000.0, 100)  # 0.1 s: under the target, but far from binding: holds
    assert gate.limit == int(high * BACKOFF)
    for _ in range(40):
        gate.tick(10_000, 50.0, gate.limit)
    assert gate.limit == FLOOR
    gate.tick(MIN_BACKLOG, 0.0, 3)  # calls wait and none is picked up: as long a wait as can be
    assert gate.limit == FLOOR and gate.statistics().wait > WAIT_TARGET


def test_the_ceiling_follows_the_pools_room() -> None:
    gate = CallGate(1000)
    for _ in range(20):
        gate.admit(gate.limit)
        gate.tick(0, 100.0, gate.limit)
    gate.set_ceiling(200)
    assert gate.limit == 200
    gate.set_ceiling(10)  # below the floor: the ceiling wins
    assert gate.limit == 10 and not gate.admit(10)
    gate.set_ceiling(1000)
    assert gate.limit == FLOOR  # and grows again from there, as it binds
    assert CallGate(4).limit == 4


class _Parked(pb_grpc.CompletionsServicer):  # type: ignore[misc]  # generated, untyped
    """Each Chat waits until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> pb.CompletionResponse:
        await self.release.wait()
        return pb.CompletionResponse(content="ok")

    async def ChatStream(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:
        yield pb.CompletionChunk()  # pragma: no cover


@contextmanager
def _server() -> Iterator[tuple[asyncio.AbstractEventLoop, _Parked, Backlog, int]]:
    """A grpc.aio server on its own loop and thread, with its Backlog."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servicer = _Parked()

    async def start() -> tuple[grpc.aio.Server, Backlog, int]:
        before = Backlog.server_ids()
        server = grpc.aio.server()
        pb_grpc.add_CompletionsServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        backlog = Backlog.around(before)
        await server.start()
        return server, backlog, port

    server, backlog, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield loop, servicer, backlog, port
    finally:
        loop.call_soon_threadsafe(servicer.release.set)
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _eventually(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_grpc_core_says_which_calls_wait_to_be_picked_up() -> None:
    """Calls inside a handler are not waiting; calls core holds while the loop is stopped are."""
    with _server() as (loop, servicer, backlog, port), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.CompletionsStub(channel)
        held = [stub.Chat.future(pb.ChatRequest(), timeout=30) for _ in range(5)]
        _eventually(lambda: backlog.waiting(0) == 5)  # all five started in core...
        assert backlog.waiting(5) == 0  # ...and each is inside a handler: none waits
        loop.call_soon_threadsafe(time.sleep, 1.0)  # the server's loop stops: nothing is picked up
        time.sleep(0.05)
        waiting = [stub.Chat.future(pb.ChatRequest(), timeout=30) for _ in range(20)]
        _eventually(lambda: backlog.waiting(5) == 20, timeout=0.9)
        loop.call_soon_threadsafe(servicer.release.set)
        for call in held + waiting:
            assert call.result().content == "ok"
        _eventually(lambda: backlog.waiting(0) == 0)


def test_after_a_burst_the_idle_front_end_returns_freed_memory_once() -> None:
    """RSS after a gRPC flood (issue 32, item 10): once idle after BURST_CALLS calls, the allocator's free pages go back (server/malloc.py)."""
    released: list[float] = []
    state = {"open": 0, "picked": 0}

    async def run() -> None:
        loop = asyncio.get_running_loop()
        follow = loop.create_task(
            follow_grpc(CallGate(1000), Backlog(None), lambda: state["open"], lambda: 0, lambda: state["picked"], lambda: released.append(loop.time()))
        )
        await asyncio.sleep(0.01)  # it has started, with no call picked up yet
        state["open"], state["picked"] = 10, BURST_CALLS - 1  # a burst, still under way
        await asyncio.sleep(0.3)
        state["open"] = 0  # idle, one call short of a burst
        await asyncio.sleep(1.2)
        assert released == []
        state["open"], state["picked"] = 1, BURST_CALLS + 1
        await asyncio.sleep(0.3)
        state["open"] = 0
        await asyncio.sleep(2.5)  # idle: once, not every idle second
        follow.cancel()

    asyncio.run(run())
    assert len(released) == 1


def test_returning_freed_memory_is_safe_to_call() -> None:
    trimmer()()
