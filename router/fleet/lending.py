"""Lending: a pool's idle seats serving another pool's requests, under its ``[pools.X.lend]`` rules.

Apart from :class:`~.pool.Pool` because it is a policy between pools, not a
pool's own book-keeping: which pools lend to which, when a seat may go
(a reserve kept, the lender's own requests first, the lender's promise kept,
the two sides' engines compared when lending "busier"), and when a bound
that lifts with time alone offers the seats again. A pool holds one
``Lending`` and seats what it allows.

What a borrowed prompt may cost the lender is decided by what the lender's
own classes are promised (their ``ttft`` objective): an engine takes a
borrowed request only while the engine's first-byte model predicts that a
request of the lender's own, sent after it, still gets its first byte within
``PROMISE_SHARE`` of the tightest such promise, and while the lender's own
streams there lately did. The expert stall bounds (``prefills``,
``ttft_budget``, ``max_prompt_tokens``, ``max_imbalance``), where a file sets
any, govern instead, as written.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import trio

from ..queueing import SKIP, Skip
from .endpoint import Endpoint
from .lender_latency import RecentPeak

if TYPE_CHECKING:
    from .pool import Lease, Pool, Ticket

# The share of the lender's ttft promise a borrowed prompt may bring its own next request to, predicted:
# the promise is a percentile (P99), the prediction a mean that is off 0.5-3x on single calls, so a mean
# well inside it. 0.4 of the shipped 0.5 s is the 0.2 s the shipped ttft_budget held before.
PROMISE_SHARE = 0.4


class Lending:
    """One pool's lending: its lenders and borrowers, the seats it lends now, and the rules each lent seat passes."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self.lenders: list[Pool] = []  # pools that lend this one idle seats, in the order asked
        self.borrowers: list[Pool] = []  # pools this one lends to (``config.lend.to``)
        self.lent = 0  # seats of this pool serving other pools' requests now
        self.borrowed = 0  # seats of lenders serving this pool's requests now
        self.own_peak = RecentPeak()  # its own requests' seats lately: what lending "busier" keeps free
        self._borrowers_woken_at = math.inf  # the earliest timed offer of idle seats to the borrowers' waiters
        self.borrowed_total: dict[str, int] = {}  # this pool's requests seated by each lender, ever
        # The tightest time to first token the pool's own classes are promised (their objectives; set at each
        # reload), None when none is: what a borrowed prompt may cost its own requests.
        self.promise: float | None = None
        # And the tightest seconds a token after the first (their itl objectives), None when none is.
        self.token_promise: float | None = None

    @property
    def by_promise(self) -> bool:
        """The lender's promise, not the expert stall bounds, decides what a borrowed prompt may cost (none of those is set)."""
        return self.promise is not None and not self._pool.config.lend.stall_bounds

    @property
    def watches_pace(self) -> bool:
        """Its endpoints keep a recent mean of their own streams' seconds a token (``Endpoint.own_token_gap``)."""
        return self.by_promise and self.token_promise is not None

    @property
    def watches_first_tokens(self) -> bool:
        """Its endpoints keep a recent mean of their own streams' time to first byte (``Endpoint.own_first_token``)."""
        return self._pool.config.lend.ttft_budget is not None or self.by_promise

    def own_idle(self) -> bool:
        """No request of this pool's own holds a seat, nor held one in the last 30-60 s (``RecentPeak``).

        The stall bounds on lending (``prefills``, ``max_prompt_tokens``)
        keep the pool's own requests from waiting behind borrowed prompts;
        with none of them about, nobody waits, and the bounds are off until
        the next one comes.
        """
        return self._pool.in_flight == self.lent and not self.own_peak.peak(trio.current_time())

    def closed_to_borrowers(self, prompt_tokens: int = 0) -> set[Endpoint]:
        """Endpoints that take no borrowed request of ``prompt_tokens`` (estimated) now.

        By the lender's promise (``by_promise``): those where a request of the
        pool's own sent after it is predicted to wait past ``PROMISE_SHARE``
        of the promise for its first byte (the engine's first-byte model, on
        the prompts queued there and this one), or where the pool's own
        streams lately did. Under the expert bounds: ``lend.prefills``
        borrowed requests still in prefill there, or the pool's own streams
        there lately slower to their first byte than ``lend.ttft_budget``.

        A pool whose own requests hold no seat and held none lately
        (``RecentPeak``) has nobody to keep, so no bound holds then, until its
        next own request.
        """
        if self.by_promise:
            return self._over_promise(prompt_tokens)
        lend = self._pool.config.lend
        now = trio.current_time()
        bound = None if self.own_idle() else lend.prefills
        closed = set() if bound is None else {e for e in self._pool.endpoints if e.borrowed_prefilling >= bound}
        if lend.ttft_budget is not None:
            closed |= self._slow_lately(lend.ttft_budget, now)
        return closed

    def _over_promise(self, prompt_tokens: int) -> set[Endpoint]:
        """``closed_to_borrowers`` by the lender's promise."""
        if self.promise is None or self.own_idle():
            return set()
        budget = PROMISE_SHARE * self.promise
        now = trio.current_time()
        closed = {e for e in self._pool.endpoints if e.first_byte_model.predict(e.prefill_backlog + prompt_tokens) > budget}
        if self.token_promise is not None:  # every sequence lent slows each step its own streams' tokens wait for
            gap = PROMISE_SHARE * self.token_promise
            slowed = {e for e in self._pool.endpoints if e.own_token_gap.over(gap, now)}
            for endpoint in slowed:  # as _slow_lately: stale evidence frees no seat, so a timer offers the seats then
                self.wake_borrowers_at(endpoint.own_token_gap.stale_at)
            closed |= slowed
        return closed | self._slow_lately(budget, now)

    def own_stream_ended(self, endpoint: Endpoint, seconds_a_token: float) -> None:
        """One of the pool's own streams on ``endpoint`` ended, its tokens after the first ``seconds_a_token`` apart on average
        (called where ``watches_pace``)."""
        endpoint.own_token_gap.observe(seconds_a_token, trio.current_time())

    def _slow_lately(self, budget: float, now: float) -> set[Endpoint]:
        """Endpoints whose own streams lately waited longer than ``budget`` for their first byte."""
        slow = {e for e in self._pool.endpoints if e.own_first_token.over(budget, now)}
        for endpoint in slow:  # its evidence goes stale with time alone: no seat frees then
            self.wake_borrowers_at(endpoint.own_first_token.stale_at)
        return slow

    def own_seats_ended(self) -> None:
        """The pool's own requests hold no seat now: its stall bounds lift once their peak is forgotten, with no seat freed then."""
        lend = self._pool.config.lend
        if lend.to and (lend.prefills is not None or lend.max_prompt_tokens is not None or self.by_promise):
            self.wake_borrowers_at(self.own_peak.forgotten_at())

    def wake_borrowers_at(self, when: float) -> None:
        """Offer this pool's idle seats to its borrowers' waiters at ``when``: a bound that lifts with time, not with a seat.

        A Trio system task (a sleep, then a dispatch, that cannot fail), as
        a busy engine's spell ends: a lease has no nursery to leave a timer in.
        At most one is pending per pool at a time, the earliest asked for.
        """
        if not self.borrowers or when >= self._borrowers_woken_at or when <= trio.current_time():
            return
        self._borrowers_woken_at = when
        trio.lowlevel.spawn_system_task(self._wake_borrowers, when, name=f"lend bounds of {self._pool.name} lift")

    async def _wake_borrowers(self, when: float) -> None:
        await trio.sleep_until(when)
        if self._borrowers_woken_at == when:
            self._borrowers_woken_at = math.inf
        for borrower in self.borrowers:
            borrower.queue.dispatch()

    def borrow(self, lender: Pool, ticket: Ticket) -> Lease | Skip | None:
        """A seat ``lender`` lends ``ticket`` under its rules, counted as borrowed from it."""
        lent = lender.lending.lend(ticket, self._pool)
        if lent is not None and not isinstance(lent, Skip):
            self.borrowed_total[lender.name] = self.borrowed_total.get(lender.name, 0) + 1
            self.borrowed += lent.seats
        return lent

    def less_busy_than(self, borrower: Pool, ticket: Ticket) -> bool:
        """An endpoint here that would take the borrowed request is less busy, with it and the reserve, than ``borrower``'s least busy with it.

        Busy two ways: its fill (``Endpoint.fill``: the seats taken, each
        weighted by the context it attends to, since every sequence and
        every token of context slows each step), and the prompt tokens
        queued for prefill there (a prompt waits behind them; few sequences
        may hold a long queue of long prompts). A borrower whose classes
        are promised a first token needs both: a cheaper step and no longer
        a prefill queue (a short chat turn sent to an engine prefilling
        documents would lose its first token to them); any other borrower
        either. The endpoints looked at are those the lending rule would
        seat it among (open to borrowers; holding the most borrowed seats
        where the pool keeps lent seats apart, ``Pool.isolates_lent``). The reserve here is at least what
        the pool's own requests took lately beyond what they hold now
        (``RecentPeak``): lent to a long job, a seat is away for its whole
        generation. What ``lend`` would refuse anyway is refused first, at
        no cost.
        """
        if self.refusal(ticket, borrower) is not False:
            return False
        lend = self._pool.config.lend
        tokens = ticket.prompt_tokens + ticket.max_tokens
        need = ticket.sequences
        theirs = borrower.least_fill(tokens, need)  # both sides with all its sequences: n of them weigh n seats either way
        if theirs is None:
            return False
        own = self._pool.in_flight - self.lent
        keep = max(lend.reserve, self.own_peak.peak(trio.current_time()) - own)
        if self._pool.in_flight + need + keep > self._pool.seats:
            return False
        closed = self.closed_to_borrowers(ticket.prompt_tokens)
        candidates = [e for e in self._pool.endpoints if e.room_for(need) and e not in closed]
        if not candidates:
            return False
        if self._pool.isolates_lent:
            most = max(e.borrowed for e in candidates)
            candidates = [e for e in candidates if e.borrowed == most]
        cheaper = min(e.fill(need + keep, need * tokens) for e in candidates) < theirs
        my_backlog = min(e.prefill_backlog for e in candidates)
        their_backlog = min(e.prefill_backlog for e in borrower.endpoints if e.room_for(need))
        if borrower.lending.promise is not None:  # promised a first token: no later to it, as well as a cheaper step
            return cheaper and my_backlog <= their_backlog
        return cheaper or my_backlog + ticket.prompt_tokens < their_backlog

    def lend(self, ticket: Ticket, borrower: Pool) -> Lease | Skip | None:
        """An idle seat of this pool for another pool's request, under ``config.lend``'s rules.

        None while a request of this pool's own as urgent or more waits (its
        class wins the next seat; a borrower's more urgent request, a lower
        ``priority`` number, comes before a less urgent own one: under
        overload the batch pool's queued long jobs do not keep short
        requests off its engines), while the seats lent are at ``max_seats``, or while
        taking one would leave fewer than ``reserve`` free. SKIP when a seat
        could be lent but not to this request: a model this pool does not
        serve, a prompt over the prefill budget, max_tokens over its bound,
        or more than the engines' context.
        """
        refused = self.refusal(ticket, borrower)
        if refused is not False:
            return refused
        lease = self._pool.seat(ticket, borrower)
        if lease is not None and not isinstance(lease, Skip):
            self.lent += lease.seats
        return lease

    def refusal(self, ticket: Ticket, borrower: Pool) -> Skip | None | Literal[False]:
        """Why ``lend`` would not seat ``ticket`` now: None (no seat for any borrower), SKIP (not for this one), False (nothing)."""
        lend = self._pool.config.lend
        own_first = self._pool.queue.most_urgent()
        if (own_first is not None and own_first <= ticket.priority) or (lend.max_seats is not None and self.lent >= lend.max_seats):
            return None
        if self._pool.in_flight + ticket.sequences + lend.reserve > self._pool.seats:
            return None
        return False if self.would_lend(ticket, borrower) else SKIP

    def would_lend(self, ticket: Ticket, borrower: Pool) -> bool:
        """Whether ``config.lend``'s rules let this pool's seats serve ``borrower``'s ``ticket`` at all (room aside):
        a model it serves, a prompt within the prefill bound (while the pool has own requests to stall,
        ``own_idle``, and the split is not too uneven, ``outweighed_by``), max_tokens within its bound,
        the engines' context."""
        lend = self._pool.config.lend
        return not (
            ticket.model not in self._pool.config.models
            or (
                lend.max_prompt_tokens is not None
                and ticket.prompt_tokens > lend.max_prompt_tokens
                and not self.own_idle()
                and not self.outweighed_by(borrower)
            )
            or (lend.max_output_tokens is not None and ticket.output_tokens > lend.max_output_tokens)
            or ticket.prompt_tokens + ticket.max_tokens > self._pool.config.max_model_len
        )

    def outweighed_by(self, borrower: Pool) -> bool:
        """``borrower``'s least busy endpoint is fuller than this pool's would be by more than ``lend.max_imbalance`` of its seats.

        The prompt bound keeps this pool's own requests fast at the cost of
        the borrower's; past that imbalance the borrower's requests lose more
        (every step there runs more sequences) than a long prompt here costs,
        so the bound yields until the two come back within it. A borrower
        with no seat free is as uneven as it gets.
        """
        margin = self._pool.config.lend.max_imbalance
        if margin is None:
            return False
        mine = self._pool.least_fill()
        if mine is None:
            return False
        theirs = borrower.least_fill()
        return theirs is None or theirs - mine > margin
