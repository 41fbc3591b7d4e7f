"""The one bridge between grpcio's asyncio world and tailguard's Trio world.

grpcio cannot run on Trio (``grpc.aio`` is asyncio-only), and its sync server
costs a thread per open stream. So Trio runs the process on the main thread
(the router, the HTTP front end, signals) and grpc.aio gets an asyncio loop
on a thread of its own (``AsyncioHost``). Measured: running Trio as a
*guest* of asyncio instead (``trio.lowlevel.start_guest_run``, one thread)
made every Trio I/O wait a round trip through a helper thread and the host
loop, and added ~0.6 ms to every HTTP request even with no gRPC traffic;
with the loop on its own thread an idle gRPC front end costs nothing.

Rules this module keeps so nobody else has to:

- Neither side calls the other's APIs: asyncio reaches Trio only through
  the Trio token's ``run_sync_soon``, Trio reaches asyncio only through the
  loop's ``call_soon_threadsafe``. Both are thread-safe.
- A cancelled asyncio caller cancels the Trio scope of its work.
- A stream's hand-off buffer is bounded: the Trio producer waits while the
  asyncio consumer is behind (back-pressure, no unbounded memory), and the
  consumer takes everything buffered per wake-up, so a busy stream costs
  one cross-thread wake-up per batch, not per item.
- Neither side can starve the other's loop: a wake-up runs at most
  ``_SLICE`` posted calls, and the rest go on in the next turn of that loop,
  after whatever else is ready there (a flood of gRPC calls arriving at once
  is thousands of posts; run in one go they stalled the Trio loop).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import trio

log = logging.getLogger("tailguard.grpc_bridge")

T = TypeVar("T")
Emit = Callable[[T], Awaitable[None]]

# How long closing the host waits for the loop's thread once its tasks are done.
_JOIN_SECONDS = 5.0
# Posted calls one wake-up runs before the loop's other work gets a turn.
_SLICE = 64


@asynccontextmanager
async def open_asyncio_host(name: str = "grpc-asyncio") -> AsyncIterator[AsyncioHost]:
    """From Trio: an asyncio loop running on a thread of its own until the block ends.

    On exit the loop's remaining tasks are cancelled, async generators
    closed, and the thread joined.
    """
    host = AsyncioHost(name)
    await host.start()
    try:
        yield host
    finally:
        with trio.CancelScope(shield=True):
            await host.stop()


class AsyncioHost:
    """An asyncio loop on its own thread; what Trio code may ask of it: run a coroutine there."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._stopped: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None

    async def start(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stopped = trio.Event()
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            if self._token is not None and self._stopped is not None:
                try:
                    self._token.run_sync_soon(self._stopped.set)
                except trio.RunFinishedError:
                    pass

    async def stop(self) -> None:
        """Stop the loop (its tasks cancelled) and wait, bounded, for its thread to end."""
        if self._stopped is None:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        with trio.move_on_after(_JOIN_SECONDS):
            await self._stopped.wait()
        if not self._stopped.is_set():
            log.warning("the asyncio host thread did not stop within %g s", _JOIN_SECONDS)
            return
        self._thread.join(_JOIN_SECONDS)  # it has closed its loop: only returning is left

    async def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """From Trio: run ``make()`` as an asyncio task and wait for it.

        Cancelling the Trio caller cancels the asyncio task (and waits for it
        to finish, so nothing outlives its caller).
        """
        finished = trio.Event()
        token = trio.lowlevel.current_trio_token()
        tasks: list[asyncio.Task[T]] = []

        def start() -> None:  # on the loop's thread
            task = self.loop.create_task(make())
            task.add_done_callback(lambda _: token.run_sync_soon(finished.set))
            tasks.append(task)

        self.loop.call_soon_threadsafe(start)
        try:
            await finished.wait()
        except trio.Cancelled:
            # call_soon_threadsafe is first in, first out: start() runs before this
            self.loop.call_soon_threadsafe(lambda: tasks[0].cancel())
            with trio.CancelScope(shield=True):
                await finished.wait()
            raise
        try:
            return tasks[0].result()
        except asyncio.CancelledError:
            raise ConnectionAbortedError("the asyncio host stopped") from None


def _settle(future: asyncio.Future[T], value: T | None, error: BaseException | None) -> None:
    """On the loop: deliver a Trio call's outcome, unless the caller has gone."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)  # type: ignore[arg-type]  # value is a T when error is None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Mailbox:
    """Calls posted from one thread to run on another, one wake-up per batch.

    ``wake(drain)`` is the other side's thread-safe entry (the Trio token's
    ``run_sync_soon`` or the loop's ``call_soon_threadsafe``). Each costs a
    write to a wake-up socket; under load many calls are posted while the
    other side is busy, and they ride on one wake-up.
    """

    __slots__ = ("_wake", "_gone", "_lock", "_calls", "_scheduled")

    def __init__(self, wake: Callable[[Callable[[], None]], object], gone: type[BaseException] | tuple[type[BaseException], ...]) -> None:
        self._wake = wake
        self._gone = gone  # what ``wake`` raises once the other side has finished
        self._lock = threading.Lock()
        self._calls: collections.deque[tuple[Callable[..., object], tuple[Any, ...]]] = collections.deque()
        self._scheduled = False

    def post(self, fn: Callable[..., object], *args: Any) -> bool:
        """Run ``fn(*args)`` on the other side soon; False if that side has finished."""
        with self._lock:
            self._calls.append((fn, args))
            if self._scheduled:
                return True
            self._scheduled = True
        try:
            self._wake(self._drain)
        except self._gone:
            with self._lock:
                self._calls.clear()
                self._scheduled = False
            return False
        return True

    def _drain(self) -> None:  # on the other side
        """Run up to ``_SLICE`` posted calls; if more wait, come back after the loop's other ready work."""
        with self._lock:
            calls = [self._calls.popleft() for _ in range(min(_SLICE, len(self._calls)))]
            more = bool(self._calls)
            if not more:
                self._scheduled = False
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:  # one failing call must not lose the rest of the batch
                log.exception("a call across the gRPC bridge failed")
        if more:
            try:
                self._wake(self._drain)  # queued behind what is ready now: the loop turns before the next slice
            except self._gone:
                with self._lock:
                    self._calls.clear()
                    self._scheduled = False


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
        token = trio.lowlevel.current_trio_token()
        self._to_trio = _Mailbox(token.run_sync_soon, trio.RunFinishedError)
        self._to_asyncio = _Mailbox(loop.call_soon_threadsafe, RuntimeError)  # RuntimeError: the loop is closed

    def post(self, fn: Callable[..., object], *args: Any) -> bool:
        """From asyncio: run ``fn(*args)`` (synchronous, quick) in Trio soon, without waiting; False if Trio has finished."""
        return self._to_trio.post(fn, *args)

    def _submit(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """From asyncio: start ``fn(*args)`` in the portal's nursery."""
        if not self._to_trio.post(self._start, fn, args):
            raise ConnectionAbortedError("tailguard is shutting down")

    def _start(self, fn: Callable[..., Awaitable[None]], args: tuple[Any, ...]) -> None:
        self._nursery.start_soon(fn, *args)

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """From asyncio: run ``await fn(*args)`` in Trio and return its result.

        Exceptions raised by ``fn`` are raised here; cancelling this
        coroutine cancels ``fn``'s Trio scope.
        """
        future: asyncio.Future[T] = self._loop.create_future()
        call = _Call()
        self._submit(self._run_call, call, future, fn, args)
        try:
            return await future
        except asyncio.CancelledError:
            self._to_trio.post(call.cancel)
            raise

    def _settle_soon(self, future: asyncio.Future[T], value: T | None, error: BaseException | None) -> None:
        self._to_asyncio.post(_settle, future, value, error)

    async def _run_call(self, call: _Call, future: asyncio.Future[T], fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> None:
        settle = self._settle_soon
        with trio.CancelScope() as scope:
            call.scope = scope
            if call.cancelled:
                scope.cancel()
            try:
                result = await fn(*args)
            except trio.Cancelled:
                settle(future, None, ConnectionAbortedError("tailguard is shutting down"))
                raise
            except Exception as error:  # delivered to the asyncio caller, not lost
                settle(future, None, error)
            else:
                settle(future, result, None)

    def stream(self, fn: Callable[..., Awaitable[None]], *args: Any, buffer: int = 32) -> AsyncIterator[Any]:
        """From asyncio: iterate what ``await fn(emit, *args)`` emits in Trio.

        ``emit`` waits while ``buffer`` items are not yet consumed. Leaving
        the iteration early (or being cancelled) cancels ``fn``.
        """
        pipe: _Pipe[Any] = _Pipe(self._to_trio, self._to_asyncio, self._loop, buffer)
        self._submit(self._run_stream, pipe, fn, args)
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
    """A bounded hand-off from a Trio producer to an asyncio consumer on another thread.

    The lock guards the buffer and the two parked sides; each side wakes the
    other only when it is parked, through the other's thread-safe entry.
    """

    def __init__(self, to_trio: _Mailbox, to_asyncio: _Mailbox, loop: asyncio.AbstractEventLoop, buffer: int) -> None:
        self._to_trio = to_trio
        self._to_asyncio = to_asyncio
        self._loop = loop
        self._buffer = buffer
        self._lock = threading.Lock()
        self._items: collections.deque[T] = collections.deque()
        self._consumer: asyncio.Future[None] | None = None  # the parked consumer's wake-up
        self._producer: trio.Event | None = None  # the parked producer's wake-up
        self._closed = False
        self._error: BaseException | None = None
        self.call = _Call()

    # Trio side.
    async def send(self, item: T) -> None:
        while True:
            with self._lock:
                if len(self._items) < self._buffer:
                    self._items.append(item)
                    waiter, self._consumer = self._consumer, None
                    break
                self._producer = writable = trio.Event()
            await writable.wait()
        if waiter is not None:
            self._to_asyncio.post(_wake, waiter)

    def close(self, error: BaseException | None) -> None:
        with self._lock:
            self._closed = True
            self._error = error
            waiter, self._consumer = self._consumer, None
        if waiter is not None:
            self._to_asyncio.post(_wake, waiter)

    # asyncio side.
    async def consume(self) -> AsyncIterator[T]:
        finished = False
        try:
            while True:
                with self._lock:
                    batch = list(self._items)
                    self._items.clear()
                    writer, self._producer = self._producer, None
                    closed, error = self._closed, self._error
                    waiter = None
                    if not batch and not closed:
                        waiter = self._consumer = self._loop.create_future()
                if writer is not None:
                    self._to_trio.post(writer.set)
                if waiter is not None:
                    await waiter
                    continue
                for item in batch:
                    yield item
                if not batch:  # closed, and everything sent has been consumed
                    finished = True
                    if error is not None:
                        raise error
                    return
        finally:
            if not finished:
                self._to_trio.post(self.call.cancel)
