"""The one bridge between grpcio's asyncio world and tailguard's Trio world.

grpcio cannot run on Trio (``grpc.aio`` is asyncio-only), and its sync server
costs a thread per open stream. So when gRPC is on, the process runs an
asyncio loop as the *host* and Trio as a *guest* on the same thread
(``trio.lowlevel.start_guest_run``): grpc.aio handlers run in asyncio, the
router and the HTTP front end in Trio. Measured on a prototype: ~21,800
relayed chunks/s and 9 threads at 2,000 open streams, against 3,400 chunks/s
and a thread per stream for the sync server.

Rules this module keeps so nobody else has to:

- asyncio code never calls Trio APIs; it goes through the Trio token's
  ``run_sync_soon``. Trio code may call asyncio's *synchronous* methods
  (``Future.set_result``, ``Event.set``): both run on the host thread.
- A cancelled asyncio caller cancels the Trio scope of its work.
- A stream's hand-off buffer is bounded: the Trio producer waits while the
  asyncio consumer is behind (back-pressure, no unbounded memory).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import outcome
import trio

log = logging.getLogger("tailguard.grpc_bridge")

T = TypeVar("T")
Emit = Callable[[T], Awaitable[None]]


def run_with_asyncio_host(trio_main: Callable[[AsyncioHost], Awaitable[T]]) -> T:
    """Run ``trio_main(host)`` as a Trio guest of a fresh asyncio loop; return its result.

    The loop is not ``asyncio.run``'s: that would install its own SIGINT
    handler and fight Trio's.
    """
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_host(loop, trio_main))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _host(loop: asyncio.AbstractEventLoop, trio_main: Callable[[AsyncioHost], Awaitable[T]]) -> T:
    done: asyncio.Future[outcome.Outcome[T]] = loop.create_future()
    host = AsyncioHost(loop)
    trio.lowlevel.start_guest_run(
        trio_main,
        host,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        done_callback=done.set_result,
    )
    result = await done
    return result.unwrap()


class AsyncioHost:
    """What Trio code may ask of the asyncio host: run a coroutine there."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    async def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """From Trio: run ``make()`` as an asyncio task and wait for it.

        Cancelling the Trio caller cancels the asyncio task (and waits for it
        to finish, so nothing outlives its caller).
        """
        finished = trio.Event()
        token = trio.lowlevel.current_trio_token()
        task = self.loop.create_task(make())
        task.add_done_callback(lambda _: token.run_sync_soon(finished.set))
        try:
            await finished.wait()
        except trio.Cancelled:
            task.cancel()
            with trio.CancelScope(shield=True):
                await finished.wait()
            raise
        return task.result()


class _Call:
    """One piece of Trio work started from asyncio, cancellable from asyncio."""

    __slots__ = ("scope", "cancelled")

    def __init__(self) -> None:
        self.scope: trio.CancelScope | None = None
        self.cancelled = False

    def cancel(self) -> None:  # runs in Trio, via run_sync_soon
        self.cancelled = True
        if self.scope is not None:
            self.scope.cancel()


class TrioPortal:
    """What asyncio code may ask of Trio: call a function, or consume a stream.

    Create it inside Trio (it captures the Trio token) with a nursery that
    outlives every call.
    """

    def __init__(self, nursery: trio.Nursery, loop: asyncio.AbstractEventLoop) -> None:
        self._nursery = nursery
        self._loop = loop
        self._token = trio.lowlevel.current_trio_token()

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """From asyncio: run ``await fn(*args)`` in Trio and return its result.

        Exceptions raised by ``fn`` are raised here; cancelling this
        coroutine cancels ``fn``'s Trio scope.
        """
        future: asyncio.Future[T] = self._loop.create_future()
        call = _Call()
        self._token.run_sync_soon(self._nursery.start_soon, self._run_call, call, future, fn, args)
        try:
            return await future
        except asyncio.CancelledError:
            self._token.run_sync_soon(call.cancel)
            raise

    async def _run_call(self, call: _Call, future: asyncio.Future[T], fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> None:
        with trio.CancelScope() as scope:
            call.scope = scope
            if call.cancelled:
                scope.cancel()
            try:
                result = await fn(*args)
            except trio.Cancelled:
                if not future.done():
                    future.set_exception(ConnectionAbortedError("tailguard is shutting down"))
                raise
            except Exception as error:  # delivered to the asyncio caller, not lost
                if not future.done():
                    future.set_exception(error)
            else:
                if not future.done():
                    future.set_result(result)

    def stream(self, fn: Callable[..., Awaitable[None]], *args: Any, buffer: int = 32) -> AsyncIterator[Any]:
        """From asyncio: iterate what ``await fn(emit, *args)`` emits in Trio.

        ``emit`` waits while ``buffer`` items are not yet consumed. Leaving
        the iteration early (or being cancelled) cancels ``fn``.
        """
        pipe: _Pipe[Any] = _Pipe(self._token, buffer)
        self._token.run_sync_soon(self._nursery.start_soon, self._run_stream, pipe, fn, args)
        return pipe.consume()

    async def _run_stream(self, pipe: _Pipe[Any], fn: Callable[..., Awaitable[None]], args: tuple[Any, ...]) -> None:
        with trio.CancelScope() as scope:
            pipe.call.scope = scope
            if pipe.call.cancelled:
                scope.cancel()
            try:
                await fn(pipe.send, *args)
            except trio.Cancelled:
                pipe.close(ConnectionAbortedError("tailguard is shutting down"))
                raise
            except Exception as error:
                pipe.close(error)
            else:
                pipe.close(None)


class _Pipe(Generic[T]):
    """A bounded hand-off from a Trio producer to an asyncio consumer (same thread)."""

    def __init__(self, token: trio.lowlevel.TrioToken, buffer: int) -> None:
        self._token = token
        self._buffer = buffer
        self._items: collections.deque[T] = collections.deque()
        self._readable = asyncio.Event()
        self._writable: trio.Event | None = None
        self._closed = False
        self._error: BaseException | None = None
        self.call = _Call()

    # Trio side.
    async def send(self, item: T) -> None:
        while len(self._items) >= self._buffer:
            self._writable = trio.Event()
            await self._writable.wait()
        self._items.append(item)
        self._readable.set()

    def close(self, error: BaseException | None) -> None:
        self._closed = True
        self._error = error
        self._readable.set()

    def _wake_writer(self) -> None:  # runs in Trio, via run_sync_soon
        if self._writable is not None:
            self._writable.set()

    # asyncio side.
    async def consume(self) -> AsyncIterator[T]:
        try:
            while True:
                while not self._items and not self._closed:
                    self._readable.clear()
                    await self._readable.wait()
                if self._items:
                    item = self._items.popleft()
                    if len(self._items) == self._buffer - 1:
                        self._token.run_sync_soon(self._wake_writer)
                    yield item
                    continue
                if self._error is not None:
                    raise self._error
                return
        finally:
            if not self._closed:
                self._token.run_sync_soon(self.call.cancel)
