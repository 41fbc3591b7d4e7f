"""Per-key token and request budgets shared by the replicas: each admits within its grant of the ledger.

Under ``[cluster]`` a key's ``tokens_per_minute`` and ``requests_per_minute``
are two more resources of the shared ledger (router/quotas/ledger.py), beside
seats: ``tokens:NAME`` and ``requests:NAME``, their caps the whole budgets.
What a replica *uses* of one is what its sliding window holds (the last
minute's admissions, settled); its grant never falls below that, and grows
by a block (``cluster.block`` of the largest request the key has sent here)
so a steady key needs no round trip. So the grants add up to at most the
budget, each replica's window stays within its grant, and no 60 s admits
more than the budget fleet-wide -- while a key that sends everything to one
replica can use all of it, where static shares gave it a quarter of four.

A request whose cost its replica's grant does not hold waits, in class
priority order and until its queue deadline, for a sync to grant more (its
cost is in the demand; idle replicas give their spare back). It is refused
(429 ``token_budget_exceeded``) when the budget is full across the
replicas, as the first sync begun after it came finds it, or at its
deadline; its Retry-After says when the windows should hold it (exact for
this replica's own admissions; the others' taken as come evenly since the
oldest of them, which each sync tells).

A replica that dies (kill -9) is not forgotten at its lease: what it
admitted in its last minute was admitted, so the ledger keeps counting its
grant (``Want.hold``) until its window would have emptied, at most 60 s
plus the lease after its last sync; a restarted process under the same
replica id does not inherit it. Beside the grant the ledger records a
*reserve*, ``static_share`` of what no replica holds (``Want.share``), that
no other replica is granted: with Redis away each replica falls back at once
to ``min(grant + reserve, static_share)`` of each budget, so a tenant well
under its budget is not held to its last grant, and to its static share once
everything admitted under a larger grant has left the window. A refusal then
says when either comes (``_exceeded``).

A key is in a sync only while it changes: a request comes, is admitted or
settles, or its window's oldest admission leaves (``due``). Once its
windows are empty and nobody waits, it asks for nothing and the ledger
forgets it here until its next request (router/quotas/ledger_roster.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import trio

from ..errors import BudgetExceeded, QueueFull, QueueTimeout
from ..queueing import WaitQueue
from .budgets import WINDOW, Budgets, Grant
from .ledger import AdmissionLedger
from .ledger_terms import NO_WAITER, Arrivals, Demand

__all__ = ["BudgetGrants", "KeyBudget"]


@dataclass(frozen=True)
class _Ask:
    """A waiter's ticket: when it came (a "full" verdict counts only from a sync begun after it) and its cost."""

    came: float
    tokens: int


class KeyBudget:
    """This replica's grants of one key's budgets, the requests waiting for more, and its Demands."""

    def __init__(self, shared: AdmissionLedger, windows: Budgets, name: str) -> None:
        self.name = name
        self.tokens_per_minute: int | None = None
        self.requests_per_minute: int | None = None
        self.granted_tokens = 0
        self.granted_requests = 0
        self._shared = shared
        self._windows = windows
        self._largest = 1  # the largest cost the key has asked of this replica: the spare block's unit
        self._waiting_tokens = 0
        self._unsettled = 0  # grants given and not settled yet: their settlement still stirs this object
        self._arrivals = Arrivals()
        self._queue: WaitQueue[Grant | bool, _Ask] = WaitQueue(self._grant, max_waiting=1 << 30)

    @property
    def _resources(self) -> tuple[str, str]:
        return f"tokens:{self.name}", f"requests:{self.name}"

    def elsewhere(self) -> tuple[int, int]:
        """(tokens, requests) of the budgets in use on the other replicas, as the last sync found them."""
        tokens, requests = self._resources
        return self._shared.in_use_elsewhere(tokens), self._shared.in_use_elsewhere(requests)

    def demands(self) -> list[Demand]:
        """The key's budgets as this replica uses them now (only those that are set).

        With nothing in its windows and nobody waiting, it asks for nothing
        (no spare block, no reserve): its grant goes back and the ledger
        forgets the key here until its next request (router/quotas/ledger_roster.py).
        """
        now = trio.current_time()
        tokens, requests = self._windows.in_window(self.name, now)
        first = self._arrivals.first()
        priority, oldest = (NO_WAITER, math.inf) if first is None else first
        waiting = self._queue.waiting
        names = self._resources
        first_admitted = self._windows.oldest(self.name, now)
        since = math.inf if first_admitted is None else first_admitted
        idle = first_admitted is None and waiting == 0
        share = 0.0 if idle else self._shared.config.static_share  # what it may use beyond its grant should Redis go
        out: list[Demand] = []
        if self.tokens_per_minute is not None:
            block = 0 if idle else self._shared.config.block * self._largest
            out.append(
                Demand(names[0], self.tokens_per_minute, tokens, self._waiting_tokens, priority, self._apply_tokens,
                       oldest=oldest, hold=WINDOW, block=block, used_since=since, share=share, sparse=True)
            )
        if self.requests_per_minute is not None:
            out.append(
                Demand(names[1], self.requests_per_minute, requests, waiting, priority, self._apply_requests,
                       oldest=oldest, hold=WINDOW, block=0 if idle else None, used_since=since, share=share, sparse=True)
            )
        for name, budget in zip(names, (self.tokens_per_minute, self.requests_per_minute)):
            if budget is None and self._shared.holds(name):  # a reload took the budget away: its grant goes back
                out.append(Demand(name, 0, 0, hold=WINDOW, block=0, sparse=True))
        return out

    def due(self) -> float:
        """When the oldest admission in its window here leaves it (its use changes, unasked); inf: the window is empty."""
        first = self._windows.oldest(self.name, trio.current_time())
        return math.inf if first is None else first + WINDOW

    async def reserve(self, tokens: int, *, priority: int, deadline: float) -> Grant:
        """Count a request that may cost ``tokens`` in this replica's window, waiting for a grant until ``deadline``.

        Raises:
          BudgetExceeded: the budget is full across the replicas (or, with
            the ledger away, this replica's static share is), or ``deadline`` passed.
        """
        self._largest = max(self._largest, tokens)
        came = trio.current_time()
        if not self._fits(tokens, came):
            self._shared.wake()  # ask the ledger now, not at the next tick
        turn = self._arrivals.add(priority, came)
        self._waiting_tokens += tokens
        self._shared.stir(self)
        try:
            got = await self._queue.get(priority, deadline, _Ask(came, tokens), retry_after=0.0)
        except (QueueTimeout, QueueFull):
            got = False
        finally:
            self._waiting_tokens -= tokens
            self._arrivals.discard(turn)
            self._shared.stir(self)  # admitted (its window grew) or not (it waits no more)
        if not isinstance(got, Grant):
            raise self._exceeded(tokens, trio.current_time())
        got.settled = self._settled
        self._unsettled += 1
        return got

    def _settled(self) -> None:
        """A request of the key settled what it cost: the ledger hears of the key's use at the next sync."""
        self._unsettled -= 1
        self._shared.stir(self)

    def forgettable(self) -> bool:
        """Nothing of the key in its windows here, waiting, or still to settle, and no grant held: nothing of it to keep."""
        idle = self._queue.waiting == 0 and self._unsettled == 0 and self.name not in self._windows
        return idle and self.granted_tokens == 0 and self.granted_requests == 0

    def _fits(self, tokens: int, now: float) -> bool:
        over = self._windows.shortfall(
            self.name, tokens, tokens_per_minute=self._allowed_tokens(), requests_per_minute=self._allowed_requests(), now=now
        )
        return not over

    def _allowed_tokens(self) -> int | None:
        return None if self.tokens_per_minute is None else min(self.tokens_per_minute, self.granted_tokens)

    def _allowed_requests(self) -> int | None:
        return None if self.requests_per_minute is None else min(self.requests_per_minute, self.granted_requests)

    def _grant(self, ask: _Ask) -> Grant | bool | None:
        """A grant, admitted; False: refused (full across the replicas, or no ledger to ask); None: wait for a sync."""
        now = trio.current_time()
        if self._fits(ask.tokens, now):
            return self._windows.admit(
                self.name, ask.tokens, tokens_per_minute=self.tokens_per_minute, requests_per_minute=self.requests_per_minute,
                now=now, elsewhere=self.elsewhere(),
            )
        shared = self._shared
        if shared.mode != "ledger":
            return False
        if shared.synced_from > ask.came and self._full(ask.tokens, now):
            return False
        return None

    def _full(self, tokens: int, now: float) -> bool:
        """The budget holds no room for the request across the replicas (theirs as of the last sync)."""
        here_tokens, here_requests = self._windows.in_window(self.name, now)
        there_tokens, there_requests = self.elsewhere()
        if self.tokens_per_minute is not None and here_tokens + there_tokens + tokens > self.tokens_per_minute:
            return True
        return self.requests_per_minute is not None and here_requests + there_requests + 1 > self.requests_per_minute

    def _exceeded(self, tokens: int, now: float) -> BudgetExceeded:
        """The refusal, with when the windows should hold the request: the later of its two budgets."""
        here_tokens, here_requests = self._windows.in_window(self.name, now)
        there_tokens, there_requests = self.elsewhere()
        alone = self._shared.mode != "ledger"  # the static share is all there is: only this window counts
        if alone:
            there_tokens = there_requests = 0
        waits: list[float] = []
        why: list[str] = []
        budgets = ((self.tokens_per_minute, self._allowed_tokens(), here_tokens, there_tokens, tokens, "tokens"),
                   (self.requests_per_minute, self._allowed_requests(), here_requests, there_requests, 1, "requests"))
        for whole, allowed, here, there, cost, count in budgets:
            if whole is None or allowed is None:
                continue
            limit = allowed if alone else whole
            over = here + there + cost - limit
            if over <= 0:
                continue
            resource = self._resources[0 if count == "tokens" else 1]
            never = cost > limit
            if alone:  # the static share may come before this window has room under the cap it has now
                wait = math.inf if never else self._wait(over, resource, here, there, count, False, now)
                wait = min(wait, self._once_static(here, cost, whole, count, now))
                wait = WINDOW if math.isinf(wait) else wait
            else:
                wait = self._wait(over, resource, here, there, count, never, now)
            waits.append(wait)
            left = max(0, limit - here - there)
            scope = "this replica's static share (the shared ledger is unreachable)" if alone else "across the replicas"
            why.append(f"has {left} of its {whole} {count} a minute left {scope}, this request may take {cost}")
        # It fitted by the time it gave up: no grant came before its queue deadline (the ledger back from
        # an outage holds grants until the replicas alive before are back, at most this long).
        wait = max(waits, default=max(self._shared.config.sync_interval, self._shared.recovering_for()))
        if not why:
            why.append("got no grant of its budget from the other replicas before its queue deadline")
        return BudgetExceeded(f"the caller {self.name!r} {' and '.join(why)}; retry after {wait:.1f} s", retry_after=wait)

    def _wait(self, over: int, resource: str, here: int, there: int, count: str, never: bool, now: float) -> float:
        """Seconds until ``over`` of ``count`` leaves the windows: this one's oldest first, then the others'.

        The others' windows are known by their sums and the age of their
        oldest admission (each sync says): what they hold is taken to have
        come evenly since then, so it leaves evenly from a minute after it.
        """
        if never:
            return WINDOW
        if over <= here:
            return self._windows.wait_for(self.name, over, count, now)
        first = self._shared.in_use_elsewhere_since(resource)
        if first is None or there <= 0:
            return WINDOW  # the others said nothing of their windows' ages: the longest they can take
        share = (over - here) / there  # of the others' use, after all of this replica's has left
        theirs = first + WINDOW + share * max(0.0, now - first) - now
        return min(WINDOW, max(self._windows.reset_in(self.name, count, now), theirs, 0.0))

    def _once_static(self, here: int, cost: int, whole: int, count: str, now: float) -> float:
        """With the ledger away: seconds until this replica's static share of ``whole`` holds the request (inf: never)."""
        settles = self._shared.settles_in(WINDOW)
        static = self._shared.static(whole)
        if settles is None or cost > static:
            return math.inf
        over = here + cost - static
        return max(settles, self._windows.wait_for(self.name, over, count, now) if over > 0 else 0.0)

    def _apply_tokens(self, granted: int) -> None:
        self.granted_tokens = granted
        self._queue.dispatch()

    def _apply_requests(self, granted: int) -> None:
        self.granted_requests = granted
        self._queue.dispatch()


class BudgetGrants:
    """Every budgeted key's share on this replica, made at its first request; each joins the ledger's syncs as it stirs."""

    def __init__(self, shared: AdmissionLedger, windows: Budgets) -> None:
        self.shared = shared
        self._windows = windows
        self._keys: dict[str, KeyBudget] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def forget(self) -> int:
        """Drop the shares of keys with nothing in their windows, nothing waiting, and nothing in the ledger; how many went."""
        gone = [name for name, key in self._keys.items() if key.forgettable() and not self.shared.tracks(key)]
        for name in gone:
            del self._keys[name]
        return len(gone)

    def get(self, name: str) -> KeyBudget | None:
        """Key ``name``'s share, if it has one; nothing made or changed (a reader on another thread may ask)."""
        return self._keys.get(name)

    def of(self, name: str, tokens_per_minute: int | None, requests_per_minute: int | None) -> KeyBudget:
        """Key ``name``'s share (a reload may change its budgets: they are taken from each request's caller)."""
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = KeyBudget(self.shared, self._windows, name)
        if (key.tokens_per_minute, key.requests_per_minute) != (tokens_per_minute, requests_per_minute):
            key.tokens_per_minute, key.requests_per_minute = tokens_per_minute, requests_per_minute
            self.shared.stir(key)
        return key
