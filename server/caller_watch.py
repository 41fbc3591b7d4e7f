"""Noticing callers who leave, without a task per request.

A caller that hangs up must cancel its request (and with it the engine's
generation), so something has to wait on the caller's socket while the
request waits on the engine. A task per request for that costs more than
the rest of a short request's routing together: at concurrency 1, router
CPU per request fell by a third without it. Most requests are over sooner
than a caller could be told apart from a slow network, so a watch starts
only once its request has run for ``grace`` seconds; one task here starts
the watches that come due, and a request that ends first costs a dict
insert and a delete.

A caller who leaves is noticed ``grace`` seconds after its watch was asked
for (once the request's body is read and parsed) at the latest, and at once
after that; a stream's next send notices it sooner.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("tailguard.http")

WATCH_AFTER_S = 0.05


class Watch:
    """One request's watch: pending until due, then a task in the watch's nursery until stopped."""

    __slots__ = ("_watch", "_owner", "_since", "_scope", "_finished", "_stopped")

    def __init__(self, owner: CallerWatch, watch: Callable[[], Awaitable[None]], since: float) -> None:
        self._owner = owner
        self._watch = watch
        self._since = since
        self._scope: trio.CancelScope | None = None
        self._finished: trio.Event | None = None
        self._stopped = False

    async def stop(self) -> None:
        """End the watch; returns once it no longer reads the caller's socket (the next request may)."""
        self._stopped = True
        if self._owner.pending.pop(self, False) is not False or self._finished is None:
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
        # Oldest first (a dict keeps insertion order): the task looks only at the front.
        self.pending: dict[Watch, bool] = {}
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self.started = 0  # watches that came due (tests and benchmarks read it)

    def watch(self, until_gone: Callable[[], Awaitable[None]]) -> Watch:
        """Run ``until_gone`` (it returns when the caller left) if the request lasts; ``await .stop()`` at its end."""
        if self._nursery is None:
            raise RuntimeError("CallerWatch.run is not running: nobody would notice a caller leave")
        entry = Watch(self, until_gone, trio.current_time())
        self.pending[entry] = True
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
                    if not pending:
                        self._wake = trio.Event()
                        await self._wake.wait()
                    # Once woken, look again only when the oldest could be due, even
                    # if it ended meanwhile: a wake-up per request is what this saves.
                    since = next(iter(pending))._since if pending else trio.current_time()
                    await trio.sleep_until(since + self.grace)
                    now = trio.current_time()
                    while pending:
                        entry = next(iter(pending))
                        if entry._since + self.grace > now:  # the sum slept until, to the bit
                            break
                        del pending[entry]
                        entry._finished = trio.Event()
                        self.started += 1
                        nursery.start_soon(entry._run)
            finally:
                self._nursery = None
