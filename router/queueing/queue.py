"""A priority + deadline wait queue for a resource handed out by a callback.

The owner (the GPU pool) decides *whether* a resource is free through its
``grant(ticket)`` callback; this queue only decides *who* gets it next: the
lowest priority number first; within a number, tenants in fair shares of
the tokens served (router/queueing/fair_share.py), each tenant's own first come
first served (callers without a share: arrival order, as one tenant). A
waiter's ``ticket`` (what it asked with) lets the owner refuse one waiter
and not the next (``SKIP``: a class at its own seat limit), so such a waiter
never blocks the ones behind it that could be served.

The hand-off is race-free because a parked task leaves the queue
synchronously, in the abort callback trio runs the moment the task is
cancelled or its deadline passes. So :meth:`WaitQueue.dispatch` can never
hand a resource to a task that will not receive it, and every value
``grant()`` returns reaches exactly one caller.

Failing fast: under sustained overload a bounded queue fills with requests
that will only wait out their deadline and then fail. When the owner can say
how fast it frees resources (its ``drain_rate()`` callback), :meth:`WaitQueue.get`
refuses at arrival a request whose expected wait -- everyone parked who is
served before it (more urgent, or as urgent and earlier in its fair share),
plus itself, at that rate -- is over what it may wait. The check
runs after the fast path failed and before the task parks, in the same
synchronous step, so it changes nothing in the hand-off.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, TypeVar, cast

import outcome
import trio

from ..errors import QueueFull, QueueTimeout
from .fair_share import NO_SHARE, FairClock, Share
from .retry_hint import RetryHints, whole_seconds

T = TypeVar("T")
K = TypeVar("K")


class Skip:
    """``grant``'s answer for "not this waiter; maybe the next"."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SKIP"


SKIP = Skip()


@dataclass(frozen=True)
class WaitQueueStatistics:
    """A snapshot of a :class:`WaitQueue`, read by tests and metrics.

    ``granted_total`` counts only resources handed to parked waiters, not the
    fast path; ``rejected_full_total`` counts every :exc:`QueueFull`,
    displaced waiters included; ``refused_early_total`` counts the
    :exc:`QueueTimeout` raised at arrival on the expected wait (not in
    ``timed_out_total``).
    """

    waiting: int
    max_waiting: int
    waiting_by_priority: Mapping[int, int]
    granted_total: int
    timed_out_total: int
    rejected_full_total: int
    refused_early_total: int = 0


class _Waiter:
    """One parked ``get()``; ``alive`` turns False the moment it leaves."""

    __slots__ = ("alive", "priority", "retry_after", "share", "since", "tag", "task", "ticket")

    def __init__(
        self, task: trio.lowlevel.Task, priority: int, retry_after: float, since: float, ticket: object, share: Share, tag: float
    ) -> None:
        self.task = task
        self.ticket = ticket
        self.priority = priority
        self.share = share
        self.tag = tag  # its start tag (FairClock): the order within its priority
        self.retry_after = retry_after
        self.since = since
        self.alive = True


# (priority, start tag, arrival sequence; each negated in the worst-first heap), waiter
_Entry = tuple[int, float, int, _Waiter]


def _peek(heap: list[_Entry]) -> _Waiter | None:
    """The first live waiter of ``heap``, dropping dead entries on the way."""
    while heap:
        waiter = heap[0][3]
        if waiter.alive:
            return waiter
        heapq.heappop(heap)
    return None


def _pruned(heap: list[_Entry]) -> list[_Entry]:
    live = [entry for entry in heap if entry[3].alive]
    heapq.heapify(live)
    return live


def _unknown_rate() -> float | None:
    return None


class WaitQueue(Generic[T, K]):
    """Tasks waiting for a resource that ``grant(ticket)`` hands out, best first.

    ``grant(ticket)`` returns a resource, None when none is free for anyone
    (so ``T`` must not itself include None), or ``SKIP`` when none is free
    for this ticket but a later waiter's may be served. The owner calls :meth:`dispatch` whenever one
    may have become free. At most ``max_waiting`` tasks park at once; past
    that a more urgent arrival displaces the least urgent waiter, and any
    other arrival is rejected with :exc:`QueueFull`.

    ``drain_rate()`` is the owner's estimate of resources freed per second
    while none is free, or None when it has none it trusts -- and whenever a
    resource is free, so that a request is never refused while one is.
    """

    def __init__(
        self,
        grant: Callable[[K], T | Skip | None],
        *,
        max_waiting: int,
        drain_rate: Callable[[], float | None] = _unknown_rate,
    ) -> None:
        self._grant = grant
        self._drain_rate = drain_rate
        self.max_waiting = max_waiting
        self._arrivals = itertools.count()
        self.fair = FairClock()
        # Each tenant's parked waiters, oldest first (dead ones dropped lazily): its newest bounds a new one's start tag.
        self._parked: dict[str, collections.deque[_Waiter]] = {}
        self.hints = RetryHints()
        # Both heaps hold every parked waiter: best first by (priority,
        # start tag, arrival) for dispatch, worst first for displacement. Leaving only
        # marks the waiter dead (as trio's Deadlines does); dead entries are
        # skipped when they surface and pruned once they are the majority.
        self._best: list[_Entry] = []
        self._worst: list[_Entry] = []
        self._by_priority: dict[int, int] = {}
        self._waiting = 0
        self._granted_total = 0
        self._timed_out_total = 0
        self._rejected_full_total = 0
        self._refused_early_total = 0

    @property
    def waiting(self) -> int:
        """Tasks parked now."""
        return self._waiting

    def most_urgent(self) -> int | None:
        """The lowest priority number parked now, or None when nobody waits."""
        return min(self._by_priority) if self._by_priority else None

    def first(self) -> tuple[int, float, K] | None:
        """The waiter the next free seat goes to, as (priority, when it parked, its ticket); None: nobody waits."""
        waiter = _peek(self._best)
        return None if waiter is None else (waiter.priority, waiter.since, cast(K, waiter.ticket))

    @property
    def max_waiting(self) -> int:
        """The bound on parked tasks; lowering it evicts no one already parked."""
        return self._max_waiting

    @max_waiting.setter
    def max_waiting(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"max_waiting must be >= 0, not {value}")
        self._max_waiting = value

    @trio.lowlevel.enable_ki_protection
    def get_nowait(self, priority: int, ticket: K, share: Share = NO_SHARE) -> T:
        """Take a resource if one is free and no one who comes first is waiting.

        Raises:
          trio.WouldBlock: if a waiter as urgent and as early in its share
            is parked, or ``grant(ticket)`` has nothing to give.
        """
        tag = self._start(share)
        best = _peek(self._best)
        value = None if best is not None and (best.priority, best.tag) <= (priority, tag) else self._grant(ticket)
        if value is None or isinstance(value, Skip):
            self.fair.withdraw(share)
            raise trio.WouldBlock
        self.fair.granted(tag, share)
        return value

    def ahead_of(self, priority: int, tag: float = math.inf) -> int:
        """Parked waiters that will be served before a new arrival at ``priority`` with start tag ``tag``
        (every one as urgent when no tag is given)."""
        ahead = sum(count for level, count in self._by_priority.items() if level < priority)
        if priority not in self._by_priority:
            return ahead
        worst = _peek(self._worst)
        if tag == math.inf or (worst is not None and worst.priority == priority and worst.tag <= tag):
            return ahead + self._by_priority[priority]  # everyone at this priority starts before it: one tenant, say
        return ahead + sum(1 for level, start, _, waiter in self._best if level == priority and start <= tag and waiter.alive)

    def expected_wait(self, priority: int, tag: float = math.inf) -> float | None:
        """Seconds an arrival at ``priority`` (start tag ``tag``) would wait now, or None when unknown.

        It needs one release for each waiter served before it and one for
        itself, at the owner's ``drain_rate()``. (Later, more urgent arrivals
        may still pass it: this is a lower bound on a busy queue.)
        """
        rate = self._drain_rate()
        if rate is None or rate <= 0:
            return None
        return (self.ahead_of(priority, tag) + 1) / rate

    @trio.lowlevel.enable_ki_protection
    async def get(
        self,
        priority: int,
        deadline: float,
        ticket: K,
        *,
        retry_after: float,
        max_wait: float | None = None,
        share: Share = NO_SHARE,
    ) -> T:
        """Take a resource, waiting in line until ``deadline`` if none is free.

        ``deadline`` is absolute, in :func:`trio.current_time` units;
        ``retry_after`` is the floor of the hint the errors below carry:
        when the owner knows its drain rate, the hint is when a seat is
        expected, spread (router/queueing/retry_hint.py). With
        ``max_wait`` (seconds), a request that cannot get a resource at once
        and whose :meth:`expected_wait` is over ``max_wait`` or past its
        deadline is refused without parking; None never refuses on the
        estimate. ``share`` is the tenant the request is for: within its
        priority it waits in its tenant's fair share (router/queueing/fair_share.py).

        Raises:
          QueueFull: if the queue is at its bound and no less urgent waiter
            can be displaced, or if this waiter is itself displaced.
          QueueTimeout: if ``deadline`` passes before a resource is free, or
            (at once) if the expected wait is over what this request may wait.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        tag = self._start(share)
        try:
            return await self._get(priority, deadline, ticket, retry_after, max_wait, share, tag)
        except BaseException:
            self.fair.withdraw(share)  # no seat: its prompt was not served
            raise

    def _start(self, share: Share) -> float:
        """A new request's start tag: its tenant's share, and never before that tenant's newest waiter."""
        parked = self._parked.get(share.tenant)
        while parked and not parked[-1].alive:
            parked.pop()
        return self.fair.start(share, parked[-1].tag if parked else 0.0)

    async def _get(
        self, priority: int, deadline: float, ticket: K, retry_after: float, max_wait: float | None, share: Share, tag: float
    ) -> T:
        """``get`` for a request whose start tag is ``tag``."""
        best = _peek(self._best)
        behind = best is not None and (best.priority, best.tag) <= (priority, tag)  # someone who comes first waits already
        if not behind:
            value = self._grant(ticket)
            if value is not None and not isinstance(value, Skip):
                self.fair.granted(tag, share)
                await trio.lowlevel.cancel_shielded_checkpoint()
                return value

        now = trio.current_time()
        if deadline <= now:
            # Don't displace anyone for a request that cannot wait at all.
            self._timed_out_total += 1
            hint = self._hint(priority, tag, retry_after)
            raise QueueTimeout(
                f"queue deadline already passed and no slot is free; retry after {whole_seconds(hint)} s",
                retry_after=hint,
            )
        if max_wait is not None:
            self._refuse_if_too_long(priority, tag, min(max_wait, deadline - now), retry_after)
        if self._waiting >= self._max_waiting:
            self._make_room(priority, tag, retry_after)

        waiter = _Waiter(trio.lowlevel.current_task(), priority, retry_after, now, ticket, share, tag)
        arrival = next(self._arrivals)
        heapq.heappush(self._best, (priority, tag, arrival, waiter))
        heapq.heappush(self._worst, (-priority, -tag, -arrival, waiter))
        self._parked.setdefault(share.tenant, collections.deque()).append(waiter)
        self._waiting += 1
        self._by_priority[priority] = self._by_priority.get(priority, 0) + 1
        if behind:
            # Those ahead may be waiting for what only they cannot have (SKIP):
            # take our turn in line now, rather than wait for the next release.
            mine = self._dispatch(waiter)
            if mine is not None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return mine

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._remove(waiter)
            return trio.lowlevel.Abort.SUCCEEDED

        with trio.move_on_at(deadline):
            granted: T = await trio.lowlevel.wait_task_rescheduled(abort)
            return granted
        # Only our own deadline lands here; outer cancellation propagates.
        self._timed_out_total += 1
        hint = self._hint(priority, tag, retry_after)
        raise QueueTimeout(
            f"waited {trio.current_time() - now:.1f} s in the queue without a free slot; retry after {whole_seconds(hint)} s",
            retry_after=hint,
        )

    def _hint(self, priority: int, tag: float, floor: float) -> float:
        """The Retry-After of a refusal now: when a seat would come for one more arrival like this one."""
        return self.hints.for_queue(self.ahead_of(priority, tag), self._drain_rate(), floor)

    @trio.lowlevel.enable_ki_protection
    def dispatch(self) -> None:
        """Hand resources to the best waiters until ``grant()`` runs dry.

        The owner calls this whenever room may have appeared: a resource
        released, a cap raised, an endpoint healthy again. Never blocks.
        """
        self._dispatch(None)

    def _dispatch(self, me: _Waiter | None) -> T | None:
        """``dispatch``; a resource for ``me`` (a waiter not yet parked) is returned, not rescheduled."""
        skipped: list[_Entry] = []
        try:
            while (waiter := _peek(self._best)) is not None:
                value = self._grant(waiter.ticket)  # type: ignore[arg-type]  # the ticket get() parked with
                if value is None:
                    return None
                if isinstance(value, Skip):  # set aside; it keeps its place for later
                    skipped.append(heapq.heappop(self._best))
                    continue
                self._remove(waiter)
                self.fair.granted(waiter.tag, waiter.share)
                if waiter is me:
                    return value
                self._granted_total += 1
                trio.lowlevel.reschedule(waiter.task, outcome.Value(value))
            return None
        finally:
            for entry in skipped:
                heapq.heappush(self._best, entry)

    @trio.lowlevel.enable_ki_protection
    def evict_all(self, error: Callable[[], BaseException]) -> int:
        """Wake every parked waiter with ``error()`` (each its own instance) instead of a resource; returns how many.

        The owner's way to say that what they wait for is gone (a reload
        removed it): they leave the line now, not at their deadlines.
        """
        evicted = 0
        while (waiter := _peek(self._best)) is not None:
            self._remove(waiter)  # its fair-share charge is handed back as ``get`` raises
            trio.lowlevel.reschedule(waiter.task, outcome.Error(error()))
            evicted += 1
        return evicted

    def statistics(self) -> WaitQueueStatistics:
        """Return a snapshot of the queue's size and counters."""
        return WaitQueueStatistics(
            waiting=self._waiting,
            max_waiting=self._max_waiting,
            waiting_by_priority=MappingProxyType(
                dict(sorted(self._by_priority.items()))
            ),
            granted_total=self._granted_total,
            timed_out_total=self._timed_out_total,
            rejected_full_total=self._rejected_full_total,
            refused_early_total=self._refused_early_total,
        )

    def _refuse_if_too_long(self, priority: int, tag: float, budget: float, retry_after: float) -> None:
        """Refuse now a request that would wait longer than ``budget`` seconds.

        Checked before a full queue displaces anyone: a request that would
        time out anyway must not push out one that might not.

        Raises:
          QueueTimeout: if :meth:`expected_wait` is known and over ``budget``.
        """
        expected = self.expected_wait(priority, tag)
        if expected is None or expected <= budget:
            return
        self._refused_early_total += 1
        hint = self.hints.spread(expected, retry_after)
        raise QueueTimeout(
            f"no slot is expected for {expected:.1f} s ({self.ahead_of(priority, tag)} requests ahead), "
            f"more than the {max(budget, 0.0):.1f} s this request may wait; retry after {whole_seconds(hint)} s",
            retry_after=hint,
        )

    def _make_room(self, priority: int, tag: float, retry_after: float) -> None:
        """Displace the waiter served last if it would be served after us: less urgent, or as urgent and further past its fair share.

        Raises:
          QueueFull: if every parked waiter comes before (``priority``, ``tag``).
        """
        self._rejected_full_total += 1
        worst = _peek(self._worst)
        if worst is None or (worst.priority, worst.tag) <= (priority, tag):
            hint = self._hint(priority, tag, retry_after)
            raise QueueFull(
                f"queue full: {self._waiting} requests already waiting; retry after {whole_seconds(hint)} s",
                retry_after=hint,
            )
        self._remove(worst)
        waited = trio.current_time() - worst.since
        hint = self._hint(worst.priority, worst.tag, worst.retry_after)
        error = QueueFull(
            f"queue full: displaced by a request served before it after waiting {waited:.1f} s; retry after {whole_seconds(hint)} s",
            retry_after=hint,
        )
        trio.lowlevel.reschedule(worst.task, outcome.Error(error))

    def _remove(self, waiter: _Waiter) -> None:
        """Take a parked waiter out of the line; its heap entries go stale."""
        waiter.alive = False
        self._waiting -= 1
        parked = self._parked[waiter.share.tenant]
        while parked and not parked[0].alive:  # a tenant's waiters mostly leave oldest first
            parked.popleft()
        if not parked:
            del self._parked[waiter.share.tenant]
        left = self._by_priority.pop(waiter.priority) - 1
        if left:
            self._by_priority[waiter.priority] = left
        if len(self._best) > 2 * self._waiting:
            self._best = _pruned(self._best)
        if len(self._worst) > 2 * self._waiting:
            self._worst = _pruned(self._worst)
