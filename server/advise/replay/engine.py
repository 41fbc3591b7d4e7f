"""The fleet model's engine: ``tailguard.sim.Engine``'s model of one GPU, stepped in aggregate.

``tailguard.sim.Engine`` touches every running sequence on every step (a token, a
reader to wake): ~70 sequences x ~40 steps a second per engine, tens of
millions of Python operations per simulated hour. A sweep needs two instants
of each request, its first token and its end, so this engine runs the same
schedule -- vLLM V1 with chunked prefill, decodes first, then prefill chunks,
KV allocated per scheduled chunk, then (unless the step preempted)
first-come-first-served admission while a seat, the step budget and KV for
the rest of the sequence (vLLM 0.32's ``--scheduler-reserve-full-isl``; with
it off, for the first chunk) are free; recompute preemption of the newest
sequence when a decode or a chunk finds the cache full; the same prefix
cache (``tailguard.sim.prefix_cache``, fed the prompt's block keys), whose
shared blocks count once in the KV in use -- with three economies:

- A decoding sequence's progress is a linear function of the step number
  since the step that ended its prefill (its *anchor*), so a decode step costs
  O(1): the batch's size and its summed context are two running totals, and
  who finishes when is a heap keyed by step number.
- Steps are computed on demand (``_advance(now)``, on every submit and
  abort), and the engine has no task: a ``Timeline`` timer calls it at the
  end of the next step that ends a sequence -- across any number of
  decode-only steps -- instead of once a step. Only a submit or an abort can
  change a decode-only batch before then, and both bring the engine up to
  date and move the timer to the end of the step in progress.
- A decode step the cache cannot take is planned one sequence at a time, in
  running order, exactly as ``tailguard.sim.Engine`` does (preemptions included).

Step durations are ``EngineParams.step_ms`` of the same counts, laid end to
end on the same timeline, so first-token and finish times are those of
``tailguard.sim.Engine`` (``bench/sweep/check.py`` replays seeded traffic through
both and reports the largest difference, shared-prefix traffic included).
After a step that preempted, or while the queue's head waits on KV that an
eviction could shrink, it steps one step at a time. Not modelled: output
token ids and EOS (``eos_probability`` must be 0), per-token readers,
``/metrics``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from tailguard.sim.engine import EngineRequestError
from tailguard.sim.params import EngineParams
from tailguard.sim.prefix_cache import PrefixCache

from .clock import Timeline, Timer

LOOKAHEAD_STEPS = 64  # decode-only steps computed ahead per wake: a submit usually cuts the run short anyway


class SweepSequence:
    """One request inside the engine: where it is and its two timestamps (Trio time).

    While ``decoding``, ``computed``, ``kv_held`` and ``produced`` hold their
    values at the end of step ``anchor``; each later step adds one to each.
    """

    __slots__ = (
        "request_id",
        "prompt_tokens",
        "limit",
        "first_token_at",
        "finished_at",
        "finish_reason",
        "target",
        "computed",
        "kv_held",
        "produced",
        "decoding",
        "anchor",
        "finish_step",
        "order",
        "submitted_at",
        "rank",
        "preemptions",
        "block_keys",
        "blocks_held",
        "cached_tokens",
        "_waiter",
    )

    def __init__(self, request_id: str, prompt_tokens: int, limit: int, submitted_at: float, rank: float) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.limit = limit  # output tokens at which it ends ("length")
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.target = prompt_tokens  # tokens to prefill (prompt, plus output after a preemption)
        self.computed = 0
        self.kv_held = 0
        self.produced = 0
        self.decoding = False
        self.anchor = 0
        self.finish_step = 0
        self.order = 0  # running order (admission count), for ties
        self.submitted_at = submitted_at
        self.rank = rank  # orders submissions of one instant
        self.preemptions = 0
        self.block_keys: Sequence[bytes] = ()  # the prompt's full blocks' chained keys (prefix caching)
        self.blocks_held = 0  # how many leading keys it pins in the cache
        self.cached_tokens = 0  # prompt tokens found cached at first admission (vLLM's num_cached_tokens)
        self._waiter: trio.lowlevel.Task | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def wait_finished(self) -> None:
        """Return once the sequence has ended (finished or aborted); one waiter at a time."""
        await trio.lowlevel.checkpoint()
        while self.finish_reason is None:
            await self._park()

    async def wait_first_token(self) -> None:
        """Return once the engine has produced the first token (or the sequence ended): when a router sees its first byte."""
        await trio.lowlevel.checkpoint()
        while self.first_token_at is None and self.finish_reason is None:
            await self._park()

    async def _park(self) -> None:
        """Sleep until the next wake (the first token, or the end).

        A bare park rather than a ``trio.Event``: one per request, and the
        sweep makes hundreds of thousands.
        """
        if self._waiter is not None:
            raise RuntimeError(f"{self.request_id} already has a waiter")
        self._waiter = trio.lowlevel.current_task()

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _wake(self) -> None:
        if self._waiter is not None:
            trio.lowlevel.reschedule(self._waiter)
            self._waiter = None


@dataclass(frozen=True)
class SweepEngineStatistics:
    steps: int
    wakes: int  # times the timeline called the engine back (fewer than steps: decode-only runs are skipped)
    preemptions: int
    finished: int
    aborted: int
    max_running_seen: int
    max_kv_used_seen: int
    prefix_cache_queries: int = 0  # as tailguard.sim.EngineStatistics'
    prefix_cache_hits: int = 0
    prefix_cache_preempted_hits: int = 0
    running: int = 0  # now, as tailguard.sim.EngineStatistics'
    waiting: int = 0
    kv_used_tokens: int = 0


class _Plan:
    """The step being planned: its counts so far, and who is in it."""

    __slots__ = ("number", "budget", "count", "prefill", "context", "entries", "planned", "decodes_done", "preempted", "fragile")

    def __init__(self, number: int, budget: int) -> None:
        self.number = number
        self.budget = budget  # of max_num_batched_tokens, left
        self.count = 0  # sequences
        self.prefill = 0  # prefill tokens
        self.context = 0  # tokens of context attended to
        self.entries: dict[SweepSequence, int] = {}  # prefill chunks, in scheduling order
        self.planned: set[SweepSequence] = set()  # decodes planned one by one (the cache was short)
        self.decodes_done = False  # past the decode loop: every decoding sequence is in the step
        self.preempted = 0
        self.fragile = False  # the head did not fit, but eviction may shrink its hit and so its need

    def add(self, sequence: SweepSequence, chunk: int, context: int) -> None:
        self.entries[sequence] = chunk
        self.count += 1
        self.prefill += chunk
        self.context += context
        self.budget -= chunk

    def drop(self, tokens: int, prefill: int, context: int) -> None:
        """A planned sequence was preempted: it hands its tokens back."""
        self.count -= 1
        self.prefill -= prefill
        self.context -= context
        self.budget += tokens


class SweepEngine:
    """One simulated GPU on a Timeline: ``submit``, and ``abort`` to hang up."""

    def __init__(self, params: EngineParams, timeline: Timeline, *, time_scale: float = 1.0, name: str = "engine") -> None:
        """The same state and counters as ``tailguard.sim.Engine.__init__``, on purpose: this engine is its schedule in aggregate.

        The likeness with ``tailguard.sim.engine`` (and the statistics the fleet
        model builds from it) is deliberate; ``python -m bench sweep``
        (``bench/sweep/check.py``) checks the two agree on seeded traffic:
        first-token and finish times, preemptions, who ended how.
        """
        if params.eos_probability:
            raise ValueError("the sweep engine has no output tokens, so no EOS: eos_probability must be 0")
        if params.max_num_seqs >= params.max_num_batched_tokens:
            raise ValueError("max_num_seqs must be below max_num_batched_tokens (every step then has room for a prefill)")
        if params.base_ms <= 0 or time_scale <= 0:
            raise ValueError("base_ms and time_scale must be positive: every step takes time")
        if params.scheduling_policy != "fcfs":
            # bench.sim.Engine models vLLM's priority policy; this aggregate
            # model does not, and must not answer as if it did.
            raise ValueError("the sweep engine models vLLM's fcfs policy only; use tailguard.sim.Engine for priority")
        self.params = params
        self.timeline = timeline
        self.time_scale = time_scale
        self.name = name
        self._waiting: deque[SweepSequence] = deque()  # aborted ones are dropped lazily
        self._waiting_count = 0
        self._running: dict[SweepSequence, None] = {}  # admission order
        self._prefilling: list[SweepSequence] = []  # running, prefill not done, admission order
        self._decoding = 0  # running sequences past their prefill
        self._context_base = 0  # sum of (computed - anchor - 1) over them
        self._finishes: list[tuple[int, int, SweepSequence]] = []  # (step, order, sequence); stale ones skipped
        self._kv_used = 0  # private tokens + the cache's held blocks: a shared block counts once
        self._cache = PrefixCache(params.kv_cache_tokens, params.block_size) if params.prefix_caching else None
        self._careful = False  # the step in progress preempted, or its head may fit sooner: take the next one a step at a time
        self._step = 0  # number of the step in progress (or of the last one)
        self._step_end: float | None = None  # None: no step in progress
        self._entries: list[tuple[SweepSequence, int]] = []  # its explicit (sequence, tokens): prefills
        self._kick = False  # a submit or abort since the engine last found nothing to run
        self._wake_at = math.inf
        self._alarm: Timer | None = None
        self._orders = itertools.count()
        self._ids = itertools.count()
        # The counters of tailguard.sim.Engine, repeated on purpose (that engine's
        # __init__ says why); bench/sweep/check.py compares the two engines' runs.
        self._steps = 0
        self._wakes = 0
        self._preemptions = 0
        self._finished = 0
        self._aborted = 0
        self._max_running = 0
        self._max_kv = 0

    # -- public surface -------------------------------------------------

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        *,
        block_keys: Sequence[bytes] = (),
        request_id: str | None = None,
        rank: float = 0.0,
    ) -> SweepSequence:
        """Queue a request. Raises EngineRequestError when it cannot run here (vLLM's 400).

        ``block_keys`` are the prompt's (``prefix_cache.prompt_block_keys`` of
        its text and ``cache_salt``, as ``tailguard.sim.Engine`` computes
        them); none: nothing to hit or cache.

        Requests submitted at one instant queue in ``rank`` order (the sweep
        passes the arrival index): several callers woken at one instant run
        in an order Trio randomises, and the table must not depend on it.
        """
        limit = self.params.max_model_len
        if prompt_tokens < 1 or max_tokens < 1:
            raise EngineRequestError("the prompt and max_tokens must be at least one token")
        if prompt_tokens + max_tokens > limit:
            raise EngineRequestError(f"{prompt_tokens} + {max_tokens} tokens are over max_model_len {limit}")
        now = trio.current_time()
        self._advance(now)
        sequence = SweepSequence(request_id or f"{self.name}-{next(self._ids)}", prompt_tokens, max_tokens, now, rank)
        sequence.block_keys = block_keys
        # Behind a head that the decode-only step in progress could not admit,
        # a newcomer changes nothing until a sequence ends (which wakes us).
        blocked = self._waiting_count > 0 and self._step_end is not None and not self._entries
        self._enqueue(sequence)
        self._kick = True
        if not blocked:
            self._wake(now if self._step_end is None else self._step_end)
        return sequence

    def _enqueue(self, sequence: SweepSequence) -> None:
        """Append to the queue, before same-instant submissions of higher rank."""
        waiting = self._waiting
        position = len(waiting)
        while position and waiting[position - 1].submitted_at == sequence.submitted_at and waiting[position - 1].rank > sequence.rank:
            position -= 1
        waiting.insert(position, sequence)
        self._waiting_count += 1

    def abort(self, sequence: SweepSequence) -> None:
        """Drop a sequence at once: its seat and KV cache are free for the next step."""
        if sequence.finished:
            return
        now = trio.current_time()
        self._advance(now)
        if sequence.finished:
            return
        if sequence in self._running:
            del self._running[sequence]
            if sequence.decoding:
                self._stop_decoding(sequence, planned=self._step - sequence.anchor, emitted=self._step - 1 - sequence.anchor)
            else:
                self._prefilling.remove(sequence)
            self._release_kv(sequence)
        else:
            self._waiting_count -= 1
        self._aborted += 1
        self._end(sequence, "abort", now)
        self._kick = True
        self._wake(now if self._step_end is None else self._step_end)

    def statistics(self) -> SweepEngineStatistics:
        """The counters, and the batch as of now (the steps ended by now are run first)."""
        self._advance(trio.current_time())
        self._wake(self._next_wake())
        cache = self._cache
        return SweepEngineStatistics(
            self._steps,
            self._wakes,
            self._preemptions,
            self._finished,
            self._aborted,
            self._max_running,
            self._max_kv,
            cache.queries if cache else 0,
            cache.hits if cache else 0,
            cache.preempted_hits if cache else 0,
            len(self._running),
            self._waiting_count,
            self._kv_used,
        )

    # -- time ---------------------------------------------------------------

    def _on_alarm(self) -> None:
        """A step that matters has ended (or a submit found the engine idle): catch up."""
        self._alarm = None
        self._wake_at = math.inf
        self._wakes += 1
        now = trio.current_time()
        self._advance(now)
        if self._step_end is None and self._kick:
            self._plan(now)
        self._wake(self._next_wake())

    def _wake(self, at: float) -> None:
        """Be called back at ``at`` if that is sooner than planned."""
        if at < self._wake_at:
            self._wake_at = at
            if self._alarm is not None:
                self._alarm.cancel()
            self._alarm = self.timeline.call_at(at, self._on_alarm) if at < math.inf else None

    def _advance(self, now: float) -> None:
        """Run every step that ends by ``now``, planning each next one at its start."""
        while self._step_end is not None and self._step_end <= now:
            end = self._step_end
            self._complete(end)
            self._plan(end)

    def _next_wake(self) -> float:
        """The end of the next step that ends a sequence, or after which a step needs care."""
        end = self._step_end
        if end is None:
            return math.inf
        if self._entries or self._careful:
            return end  # prefills (or a preemption) change the batch: take it a step at a time
        heap = self._finishes
        while heap and not (heap[0][2].decoding and heap[0][2].finish_step == heap[0][0]):
            heapq.heappop(heap)
        stop = min(heap[0][0] if heap else self._step, self._step + LOOKAHEAD_STEPS)
        params, scale = self.params, self.time_scale
        n, base, kv, cap = self._decoding, self._context_base, self._kv_used, params.kv_cache_tokens
        step = self._step
        while step < stop and kv + n <= cap:  # decode-only steps, at most LOOKAHEAD_STEPS
            step += 1
            kv += n
            end = end + params.step_ms(n, 0, base + n * step + n) / 1000 * scale
        return end

    # -- the step -----------------------------------------------------------

    def _plan(self, start: float) -> None:
        """Pick the step that starts at ``start``: decodes, prefill chunks, admissions (``Engine._schedule``)."""
        self._kick = False  # this plan sees every submission so far
        while True:
            plan = self._plan_step()
            if plan.count or not plan.preempted:
                break  # else the state changed and nothing runs: plan again at once, as Engine.run does
        self._max_running = max(self._max_running, len(self._running))
        self._max_kv = max(self._max_kv, self._kv_used)
        if self._cache is not None:  # the held cache grew: free blocks make way
            self._cache.make_room(self._kv_used)
        self._entries = list(plan.entries.items())
        # After a preemption the next step may admit; a head whose hit eviction may shrink may fit sooner.
        self._careful = bool(plan.preempted) or plan.fragile
        if not plan.count:
            self._step_end = None  # idle, or the queue's head does not fit: wait for a submit or abort
            return
        self._step = plan.number
        self._step_end = start + self.params.step_ms(plan.count, plan.prefill, plan.context) / 1000 * self.time_scale
        if self._careful:
            self._wake(self._step_end)

    def _plan_step(self) -> _Plan:
        params = self.params
        plan = _Plan(self._step + 1, params.max_num_batched_tokens)
        n = self._decoding
        stopped = False
        if n and self._kv_used + n > params.kv_cache_tokens:
            stopped = self._plan_decodes_one_by_one(plan)
        else:
            plan.count, plan.context = n, self._context_base + n * plan.number + n
            self._kv_used += n
            plan.budget -= n
        plan.decodes_done = True
        for sequence in [] if stopped else list(self._prefilling):
            if plan.budget < 1:
                break
            if not sequence.kv_held:
                continue  # preempted above
            chunk = min(sequence.target - sequence.computed, plan.budget)
            context = sequence.computed + chunk
            if not self._allocate(sequence, chunk, plan):
                break
            plan.add(sequence, chunk, context)
        if not plan.preempted:  # vLLM's waiting loop runs only if not preempted_reqs
            self._admit_waiting(plan)
        return plan

    def _admit_waiting(self, plan: _Plan) -> None:
        """Admit the queue's head while a seat, the budget and KV for the rest of its sequence are free (``Engine._schedule``)."""
        params, cache, waiting = self.params, self._cache, self._waiting
        while waiting and plan.budget >= 1 and len(self._running) < params.max_num_seqs:
            head = waiting[0]
            if head.finish_reason is not None:  # aborted while waiting
                waiting.popleft()
                continue
            hit = hit_cost = 0
            if cache is not None:
                cache.make_room(self._kv_used)
                hit = cache.lookup(head.block_keys, head.target)
                hit_cost = cache.unheld(head.block_keys[: hit // cache.block_size]) * cache.block_size
            chunk = min(head.target - hit, plan.budget)
            needed = head.target - hit if params.scheduler_reserve_full_isl else chunk
            if self._kv_used + hit_cost + needed > params.kv_cache_tokens:
                plan.fragile = hit > 0
                break
            waiting.popleft()
            self._waiting_count -= 1
            head.order = next(self._orders)
            self._running[head] = None
            self._prefilling.append(head)
            head.computed = hit
            head.kv_held = hit + chunk
            self._kv_used += hit_cost + chunk
            if cache is not None:
                head.blocks_held = cache.admit(head.block_keys, hit, head.prompt_tokens, preempted=bool(head.preemptions))
                if not head.preemptions:
                    head.cached_tokens = hit
            plan.add(head, chunk, hit + chunk)

    def _plan_decodes_one_by_one(self, plan: _Plan) -> bool:
        """Decodes when the cache is short: bench.sim.Engine's loop, preempting the newest; True if one preempted itself."""
        cap = self.params.kv_cache_tokens
        for sequence in list(self._running):
            if not sequence.decoding:
                continue
            while self._kv_used + 1 > cap:
                victim = next(reversed(self._running))
                self._preempt(victim, plan)
                if victim is sequence:
                    return True
            self._kv_used += 1
            plan.planned.add(sequence)
            plan.count += 1
            plan.context += sequence.computed + (plan.number - sequence.anchor - 1) + 1
            plan.budget -= 1
        return False

    def _allocate(self, sequence: SweepSequence, tokens: int, plan: _Plan) -> bool:
        """KV for ``tokens`` more of a prefilling sequence, preempting the newest until they fit; False if it was the victim."""
        while self._kv_used + tokens > self.params.kv_cache_tokens:
            victim = next(reversed(self._running))
            self._preempt(victim, plan)
            if victim is sequence:
                return False
        self._kv_used += tokens
        sequence.kv_held += tokens
        return True

    def _preempt(self, victim: SweepSequence, plan: _Plan) -> None:
        """Free a running sequence's cache; it recomputes prompt and output from the queue's head.

        A victim already planned this step leaves the plan and hands its
        tokens back, as in bench.sim.Engine.
        """
        del self._running[victim]
        step = plan.number
        if victim.decoding:
            got = plan.decodes_done or victim in plan.planned  # past the decode loop every decode is planned
            if got:
                plan.drop(1, 0, victim.computed + (step - victim.anchor - 1) + 1)
            self._stop_decoding(victim, planned=step - victim.anchor - (0 if got else 1), emitted=step - 1 - victim.anchor)
        else:
            chunk = plan.entries.pop(victim, 0)
            if chunk:
                plan.drop(chunk, chunk, victim.computed + chunk)
            self._prefilling.remove(victim)
        self._release_kv(victim)
        victim.target = victim.prompt_tokens + victim.produced
        victim.computed = 0
        victim.preemptions += 1
        self._preemptions += 1
        plan.preempted += 1
        self._waiting.appendleft(victim)
        self._waiting_count += 1

    def _complete(self, end: float) -> None:
        """End of the step in progress: sequences that reach their limit end; prefills that finish emit."""
        step = self._step
        self._steps += 1
        heap = self._finishes
        while heap and heap[0][0] <= step:
            finish_step, _, sequence = heapq.heappop(heap)
            if sequence.decoding and sequence.finish_step == finish_step:
                del self._running[sequence]
                self._stop_decoding(sequence, planned=step - sequence.anchor, emitted=step - sequence.anchor)
                self._release_kv(sequence)
                self._finished += 1
                self._end(sequence, "length", end)
        for sequence, tokens in self._entries:
            if sequence.finish_reason is not None:  # aborted during the step
                continue
            sequence.computed += tokens
            if self._cache is not None:  # its prompt blocks computed in full are cached now
                held, entered = self._cache.extend(sequence.block_keys, sequence.blocks_held, sequence.computed)
                if held > sequence.blocks_held:  # as Engine._cache_computed: shared blocks count once
                    self._kv_used += (entered - (held - sequence.blocks_held)) * self._cache.block_size
                    sequence.blocks_held = held
            if sequence.computed < sequence.target:
                continue
            sequence.produced += 1
            if sequence.first_token_at is None:
                sequence.first_token_at = end
                sequence._wake()  # the router's first byte (EngineResponse.start)
            self._prefilling.remove(sequence)
            if sequence.produced >= sequence.limit:
                del self._running[sequence]
                self._release_kv(sequence)
                self._finished += 1
                self._end(sequence, "length", end)
            else:
                self._start_decoding(sequence, step)

    def _start_decoding(self, sequence: SweepSequence, step: int) -> None:
        sequence.decoding = True
        sequence.anchor = step
        sequence.finish_step = step + sequence.limit - sequence.produced
        self._decoding += 1
        self._context_base += sequence.computed - step - 1
        heapq.heappush(self._finishes, (sequence.finish_step, sequence.order, sequence))

    def _stop_decoding(self, sequence: SweepSequence, *, planned: int, emitted: int) -> None:
        """Make its counters explicit: ``planned`` decode steps reserved cache, ``emitted`` produced a token."""
        self._decoding -= 1
        self._context_base -= sequence.computed - sequence.anchor - 1
        sequence.decoding = False
        sequence.kv_held += planned
        sequence.computed += emitted
        sequence.produced += emitted

    def _release_kv(self, sequence: SweepSequence) -> None:
        if self._cache is not None:  # its blocks stay cached, free, most recently used
            block = self._cache.block_size
            self._kv_used -= sequence.kv_held - sequence.blocks_held * block  # its private tokens
            self._kv_used -= self._cache.release(sequence.block_keys[: sequence.blocks_held]) * block
            sequence.blocks_held = 0
        else:
            self._kv_used -= sequence.kv_held
        sequence.kv_held = 0

    def _end(self, sequence: SweepSequence, reason: str, at: float) -> None:
        sequence.finish_reason = reason
        sequence.finished_at = at
        sequence._wake()
