"""Virtual time for the fleet model: timed callbacks, fired by one task that moves the MockClock.

Under ``MockClock(autojump_threshold=0)`` every timed wake-up is a Trio
sleep: a cancel scope whose deadline delivers ``Cancelled`` through the
sleeper, ~20 µs of CPU. The sweep has about three per request (its arrival,
the engine steps that start and end it), so it keeps its own heap of timers
instead. One task waits until every other task is blocked -- the moment
autojump would move the clock -- then jumps the clock to the earlier of its
next timer and Trio's next deadline, and calls the timers that are due, in
time order. Trio's own deadlines (the router's queue deadlines, the caller's
timeout) still fire on time, and everything runnable at one instant runs
before the clock moves on, as with autojump.

Callbacks run inside that task: they must not block (set events, start
tasks with ``nursery.start_soon``, call ``Timeline.call_at``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import trio
import trio.testing

_MAX_JUMPS = 64  # a jump can land an ulp short of its target; a few more close the gap


class Timer:
    """A pending callback; ``cancel`` is idempotent and O(1) (removed lazily)."""

    __slots__ = ("at", "callback", "cancelled")

    def __init__(self, at: float, callback: Callable[[], None]) -> None:
        self.at = at
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Timeline:
    """Timed callbacks in virtual time. Start ``run`` in a nursery first."""

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()
        self._added = trio.Event()
        self.fired = 0

    def call_at(self, at: float, callback: Callable[[], None]) -> Timer:
        """Call ``callback()`` once the clock reaches ``at`` (at once if it has)."""
        timer = Timer(at, callback)
        heapq.heappush(self._heap, (at, next(self._order), timer))
        self._added.set()
        return timer

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Move the clock and fire timers, forever."""
        task_status.started()
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if not self._tick():
                self._added = trio.Event()
                await self._added.wait()  # no timer and no deadline: nothing can happen until a timer is set

    def _tick(self) -> bool:
        """Jump to the next instant something is due; fire our timers due then. False: nothing is."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        at = heap[0][0] if heap else math.inf
        now = trio.current_time()
        deadline = now + trio.lowlevel.current_statistics().seconds_to_next_deadline
        if deadline < at:
            if math.isinf(deadline):
                return False
            self._jump_to(deadline)  # Trio's run loop fires it next
            return True
        self._jump_to(at)
        now = trio.current_time()
        while heap and heap[0][0] <= now:
            timer = heapq.heappop(heap)[2]
            if not timer.cancelled:
                self.fired += 1
                timer.callback()
        return True

    def _jump_to(self, at: float) -> None:
        """Move the clock to ``at`` or just past it (float sums can fall an ulp short)."""
        for _ in range(_MAX_JUMPS):
            now = trio.current_time()
            if now >= at:
                return
            self._clock.jump(max(at - now, math.ulp(at)))
        raise RuntimeError(f"the clock did not reach {at!r}")
