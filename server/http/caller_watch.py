"""Noticing callers who leave, without a task per request.

A caller that hangs up must cancel its request (and with it the engine's
generation), so something has to wait on the caller's socket while the
request waits on the engine. A task per request for that (spawned, then
cancelled) was 13% of the router's CPU for a short request at concurrency
1. Most requests are over sooner than a caller could be told apart from a
slow network, so a watch starts only once its request has run for
``grace`` seconds: one task here starts the watches that come due, and a
request that ends first costs an append to a deque and, later, a pop.

A caller who leaves is noticed ``grace`` seconds after its watch was asked
for (once the request's body is read and parsed) at the latest, and at once
after that; a stream's next send notices it sooner.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("tailguard.http")

WATCH_AFTER_S = 0.05


class Watch:
    """One request's watch: pending until due, then a task in the watch's nursery until stopped."""

    __slots__ = ("_watch", "_since", "_scope", "_finished", "_stopped")

    def __init__(self, watch: Callable[[], Awaitable[None]], since: float) -> None:
        self._watch = watch
        self._since = since
        self._scope: trio.CancelScope | None = None
        self._finished: trio.Event | None = None
        self._stopped = False

    async def stop(self) -> None:
        """End the watch; returns once it no longer reads the caller's socket (the next request may)."""
        self._stopped = True
        if self._finished is None:  # not due yet: the watch's task drops it when it gets there
            return
        if self._scope is not None:
            self._scope.cancel()
        with trio.CancelScope(shield=True):  # the socket must be free before anyone else reads it
            await self._finished.wait()

    async def _run(self) -> None:
        assert self._finished is not None
        try:
            if self._stopped:
                return
            with trio.CancelScope() as self._scope:
                await self._watch()
        except Exception as error:  # a bug in one request's watch must not end the server's
            log.error("watching a caller failed unexpectedly", exc_info=error)
        finally:
            self._finished.set()


class CallerWatch:
    """Starts each request's watch once the request has run ``grace`` seconds; ``run`` must be running."""

    def __init__(self, grace: float = WATCH_AFTER_S) -> None:
        self.grace = grace
        # Oldest first; a watch stopped before it was due stays until the task
        # reaches it (a deque, not a dict: popping a dict's front one by one
        # rescans its deleted slots, 35 ms for 10,000 streams coming due at once).
        self.pending: collections.deque[Watch] = collections.deque()
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self.started = 0  # watches that came due (tests and benchmarks read it)

    def watch(self, until_gone: Callable[[], Awaitable[None]]) -> Watch:
        """Run ``until_gone`` (it returns when the caller left) if the request lasts; ``await .stop()`` at its end."""
        if self._nursery is None:
            raise RuntimeError("CallerWatch.run is not running: nobody would notice a caller leave")
        entry = Watch(until_gone, trio.current_time())
        self.pending.append(entry)
        if not self._wake.is_set():
            self._wake.set()
        return entry

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the watches that come due, until cancelled (their tasks with it)."""
        pending = self.pending
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:
                    while pending and pending[0]._stopped:
                        pending.popleft()
                    if pending:
                        since = pending[0]._since
                    else:
                        self._wake = trio.Event()
                        await self._wake.wait()
                        # Look again a grace later, even if the new one ended meanwhile:
                        # a wake-up per request is what this saves.
                        since = trio.current_time()
                    await trio.sleep_until(since + self.grace)
                    now = trio.current_time()
                    while pending:
                        entry = pending[0]
                        if entry._stopped:
                            pending.popleft()
                            continue
                        if entry._since + self.grace > now:  # the sum slept until, to the bit
                            break
                        pending.popleft()
                        entry._finished = trio.Event()
                        self.started += 1
                        nursery.start_soon(entry._run)
            finally:
                self._nursery = None
