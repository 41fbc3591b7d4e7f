"""How late the Trio loop runs: a task that sleeps a fixed tick and records how late it woke.

Why: on a busy host (the gRPC front end's asyncio thread holding the GIL, a
CPU shared with the engines) the loop itself can stall for seconds, and a
timeout that fires in such a stall says nothing of the peer it waited for:
the peer's answer may have sat unread in a socket. So the router's verdicts
about engines ask whether the loop was late while they waited, and a wait
the stall cut short is not held against the engine (``Router.check_health``
asks :meth:`LoopLag.excuses`; the backend transport's connect asks
:func:`noticed_late`, having no monitor at hand).

The monitor wakes every ``tick`` s. A wake-up ``lag`` s late means the loop
ran nothing else of its own for about that long: it was stalled over
``[due, woke]``. A stall still in progress is seen too: the monitor may not
have run yet in the batch that follows it, so :meth:`LoopLag.stalled_since`
also counts how far past its due time the monitor is now.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

import trio

TICK_SECONDS = 0.05
# A timer noticed this late was noticed in a stall (ordinary scheduling jitter is
# a few ms); the smallest stall remembered for :meth:`LoopLag.stalled_since`.
LATE_SECONDS = 0.1
# A wait the loop stalled through for at least this fraction of its timeout
# left the peer too little of it to be judged: the timeout is the loop's.
EXCUSED_FRACTION = 0.25
# Stalls remembered: enough for any timeout the router uses at any stall rate
# (each is at least LATE_SECONDS long, so 256 cover 25 s of solid stall).
_REMEMBERED = 256
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclasses.dataclass(frozen=True)
class LoopLagStatistics:
    """The monitor's tally: every wake-up's lag, as a histogram, and the last and worst."""

    tick: float
    samples: int
    total: float  # the sum of all lags, s
    last: float  # the latest wake-up's lag, s
    worst: float  # the worst since the monitor started, s
    buckets: tuple[tuple[float, int], ...]  # (upper bound, wake-ups with lag <= it), cumulative; the last is +Inf


def noticed_late(deadline: float) -> bool:
    """Whether a timeout due at ``deadline`` is being handled in a stall of the loop.

    A stall that spans a deadline hides whatever became ready before it,
    however short the part after it: the caller should not blame its peer.
    """
    return trio.current_time() - deadline >= LATE_SECONDS


class LoopLag:
    """The loop's lateness, measured by :meth:`run`; read by :meth:`statistics` and :meth:`stalled_since`."""

    def __init__(self, tick: float = TICK_SECONDS) -> None:
        self.tick = tick
        self._due: float | None = None  # when the monitor should next wake; None while it is not running
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=_REMEMBERED)  # (due, woke)
        self._counts = [0] * (len(LAG_BUCKETS) + 1)
        self._samples = 0
        self._total = 0.0
        self._last = 0.0
        self._worst = 0.0

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Measure forever (one wake-up a tick: a few microseconds of work each)."""
        task_status.started()
        try:
            while True:
                due = self._due = trio.current_time() + self.tick
                await trio.sleep_until(due)
                self.record(due, trio.current_time())
        finally:
            self._due = None

    def record(self, due: float, woke: float) -> None:
        """One wake-up due at ``due`` that happened at ``woke`` (the monitor's; public for tests)."""
        lag = max(0.0, woke - due)
        self._counts[bisect.bisect_left(LAG_BUCKETS, lag)] += 1
        self._samples += 1
        self._total += lag
        self._last = lag
        self._worst = max(self._worst, lag)
        if lag >= LATE_SECONDS:
            self._stalls.append((due, woke))

    def stalled_since(self, start: float) -> float:
        """The longest part of one stall (of at least ``LATE_SECONDS``) between ``start`` and now, in s.

        Counts the stall in progress, if the monitor is overdue now.
        """
        now = trio.current_time()
        worst = 0.0
        if self._due is not None and now - self._due >= LATE_SECONDS:
            worst = now - max(self._due, start)
        for due, woke in reversed(self._stalls):  # newest first; at most _REMEMBERED
            if woke <= start:
                break
            worst = max(worst, woke - max(due, start))
        return worst

    def excuses(self, start: float, timeout: float) -> bool:
        """Whether a wait begun at ``start`` that timed out after ``timeout`` s was cut short by the loop.

        True when the loop stalled through at least ``EXCUSED_FRACTION`` of
        it: the peer had too little of its time for the timeout to judge it.
        """
        return self.stalled_since(start) >= timeout * EXCUSED_FRACTION

    def statistics(self) -> LoopLagStatistics:
        cumulative = 0
        buckets = []
        for bound, count in zip((*LAG_BUCKETS, float("inf")), self._counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        return LoopLagStatistics(self.tick, self._samples, self._total, self._last, self._worst, tuple(buckets))
