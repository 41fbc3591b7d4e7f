"""A continuous-batching engine that behaves like one GPU running vLLM, in Trio time.

The engine is a plain object with one task (``run``) that loops over steps:

1. Schedule (vLLM V1 with chunked prefill, decodes first):
   every decoding sequence gets one token; then sequences still prefilling get
   chunks from what is left of ``max_num_batched_tokens``; then, unless the
   step preempted, waiting sequences are admitted in the queue's order while a
   seat (``max_num_seqs``), step budget and KV cache for their whole sequence
   so far are free (vLLM 0.32's ``--scheduler-reserve-full-isl``, on by
   default; ``EngineParams.scheduler_reserve_full_isl = False``: for their
   first chunk only), less cached blocks a running sequence holds. The head
   of the queue blocks the rest, as in vLLM.
2. Sleep the step's duration (``EngineParams.step_ms`` x ``time_scale``).
3. Every sequence whose prefill is complete emits one token; sequences that
   reach ``max_tokens``, the context limit or a (seeded) EOS finish.

KV cache is allocated per scheduled chunk, as vLLM's ``allocate_slots`` does
for a step's ``num_new_tokens``: a prompt's first chunk at admission, each
later chunk when it is scheduled, one token per decode. When a running
sequence's tokens do not fit, the newest running sequence is preempted
(vLLM's ``self.running.pop()``): its cache is freed and it goes back to the
head of the queue to recompute its prompt plus what it has generated (vLLM's
recompute mode); if the victim was the sequence itself, the running loop
ends. A step that preempted admits nobody (vLLM's waiting loop runs only ``if
not preempted_reqs``, in both policies). Admission checks the whole sequence
(prompt, plus output after a preemption) against the free KV but allocates
only the first chunk, as vLLM 0.32 does; with the gate off the engine admits
more than that and preempts long prompts chunk after chunk.

With ``EngineParams.scheduling_policy = "priority"`` (vLLM's
``--scheduling-policy priority``) the engine follows vLLM V1's
``Scheduler.schedule`` under ``SchedulingPolicy.PRIORITY``
(vllm/v1/core/sched/scheduler.py, vllm/v1/core/sched/request_queue.py): the
queue is ordered by (priority, arrival), lower first; when a running
sequence's tokens do not fit, the running sequence with the largest
(priority, arrival) is preempted -- possibly one already planned this step,
which hands its tokens back, or the sequence itself. A waiting sequence never
preempts a running one, whatever its priority: a full batch
(``max_num_seqs``) or cache makes it wait for a seat, as in vLLM
(vllm-project/vllm issue 40004). docs/vllm-priority.md has the sources.

A consumer that goes away calls ``abort``: the sequence leaves the batch and
frees its seat and cache at once, so the next step no longer carries it.

With ``EngineParams.prefix_caching`` (vLLM V1's automatic prefix caching,
on by default; ``bench/sim/prefix_cache.py``, shared with the sweep's
engine) a prompt's full 16-token blocks stay cached after its sequence ends,
and a new sequence whose leading blocks are cached starts its prefill after
them (``Sequence.cached_tokens``); a preempted one re-hits its own blocks.
A cached block is stored once: sequences that share a prefix share its
blocks, counted once in the KV in use (``kv_used_tokens``: every running
sequence's private tokens plus the distinct cached blocks they hold), as
vLLM's block pool ref-counts one physical block.

Time is read only through ``trio.current_time()``, so under
``trio.testing.MockClock(autojump_threshold=0)`` an hour of traffic runs in
seconds and every number is deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from .params import EngineParams
from .prefix_cache import PrefixCache, prompt_block_keys
from .sequence import Sequence
from .tokens import VOCABULARY_SIZE, output_rng


class EngineRequestError(ValueError):
    """The request cannot run on this engine (vLLM answers these with 400)."""


class EngineQueueFull(Exception):
    """The engine's admission check refuses the request (vLLM answers 503 at once).

    ``reason`` is vLLM's: "max_num_queued_reqs" (that many requests in
    flight already) or "max_num_queued_tokens" (that many prompt tokens of
    requests not yet past their prefill). Not an ``EngineRequestError``: the
    request is fine, the engine is busy, and another engine (or this one,
    later) would take it.
    """

    def __init__(self, in_flight: int, limit: int, reason: str = "max_num_queued_reqs") -> None:
        unit = "requests in flight" if reason == "max_num_queued_reqs" else "prompt tokens waiting for their first token"
        super().__init__(f"{in_flight} {unit}, the limit is {limit}")
        self.in_flight = in_flight
        self.limit = limit
        self.reason = reason


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of the engine, in the terms vLLM's /metrics uses."""

    running: int
    waiting: int
    kv_used_tokens: int  # distinct KV in use: a block shared by several sequences counts once
    kv_capacity_tokens: int
    steps: int
    preemptions: int
    finished_total: int
    aborted_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    max_running_seen: int
    max_kv_used_seen: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's counter)
    prefix_cache_hits: int = 0  # of them, tokens found cached
    prefix_cache_preempted_hits: int = 0  # tokens a preempted sequence found cached again (vLLM's preempted_hits)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use (vLLM's kv_cache_usage_perc, 0..1): distinct blocks, a shared one once."""
        return self.kv_used_tokens / self.kv_capacity_tokens


FinishHook = Callable[[Sequence], None]
# Once per step that emitted tokens: the sequences whose first token it was, and
# the other tokens' gaps since their sequence's previous token (Trio seconds -> tokens).
TokenHook = Callable[[list[Sequence], dict[float, int]], None]


class Engine:
    """One simulated GPU running vLLM. Start ``run`` in a nursery, then ``submit``."""

    def __init__(
        self,
        params: EngineParams,
        *,
        time_scale: float = 1.0,
        seed: int = 0,
        name: str = "engine",
    ) -> None:
        """The queue, the batch, the KV cache in use, and the counters ``statistics()`` reports.

        Deliberately repeated: ``tailguard.server.advise.replay.engine.SweepEngine``
        keeps the same state and counters (and ``tailguard.server.advise.replay.point``
        reports them alike) because it runs this engine's schedule in
        aggregate, for sweeps too long to step token by token. It stays a
        second copy so this engine stays the readable reference; ``python -m
        bench sweep`` (``bench/sweep/check.py``) replays seeded traffic through
        both and reports where their timestamps and preemptions differ.
        """
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.params = params
        self.time_scale = time_scale
        self.seed = seed
        self.name = name
        self._finish_hooks: list[FinishHook] = []
        self._token_hooks: list[TokenHook] = []
        self._prefill_queued_tokens = 0  # prompt tokens of sequences not yet past their first token (vLLM's queued tokens)
        self._priority_policy = params.scheduling_policy == "priority"
        self._waiting: deque[Sequence] = deque()  # fcfs
        # priority: (priority, arrival order, sequence), vLLM's Request.__lt__ order
        self._queue: list[tuple[int, int, Sequence]] = []
        self._waiting_count = 0
        self._running: list[Sequence] = []
        # Tokens the running sequences hold, a cached block shared by several
        # counted once (private tokens + PrefixCache.held_blocks whole blocks).
        self._kv_used = 0
        self._cache = PrefixCache(params.kv_cache_tokens, params.block_size) if params.prefix_caching else None
        self._work = trio.lowlevel.ParkingLot()
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._steps = 0
        self._preemptions = 0
        self._finished_total = 0
        self._aborted_total = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._max_running_seen = 0
        self._max_kv_used_seen = 0

    # -- public surface -------------------------------------------------

    def add_finish_hook(self, hook: FinishHook) -> None:
        """Call ``hook(sequence)`` whenever a sequence ends (metrics use this)."""
        self._finish_hooks.append(hook)

    def add_token_hook(self, hook: TokenHook) -> None:
        """Call ``hook(firsts, gaps)`` after every step that emitted tokens (TokenHook); metrics use it for TTFT and ITL.

        Once a step, not once a token: a step's decodes share one gap, so the
        per-token cost is a dict increment.
        """
        self._token_hooks.append(hook)

    def check_admission(self, n: int = 1) -> None:
        """vLLM's ``AsyncLLM.check_admission``: raise EngineQueueFull if ``n`` more sequences would pass a queue limit.

        ``max_num_queued_reqs`` counts requests in flight, waiting and running
        alike, a request of ``n`` choices as ``n``; ``max_num_queued_tokens``
        counts the prompt tokens of requests that have not had their first
        token yet (a hit or a chunk already prefilled not subtracted, as vLLM
        counts them), and refuses once they reach the limit.
        """
        params = self.params
        queue_cap = params.max_num_queued_reqs
        in_flight = len(self._running) + self._waiting_count
        if queue_cap is not None and in_flight + n > queue_cap:
            raise EngineQueueFull(in_flight, queue_cap)
        token_cap = params.max_num_queued_tokens
        if token_cap is not None and self._prefill_queued_tokens >= token_cap:
            raise EngineQueueFull(self._prefill_queued_tokens, token_cap, "max_num_queued_tokens")

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        prompt_key: str = "",
        seed: int | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        choice: int = 0,
        prefill_only: bool = False,
    ) -> Sequence:
        """Queue a request; returns its sequence. ``max_tokens=None`` fills the context.

        ``prefill_only`` is a pooling request (vLLM's ``--runner pooling``):
        its prompt, up to ``max_model_len`` tokens, is prefilled as any other,
        and the sequence ends "stop" when its prefill completes, with no
        token (``max_tokens`` is ignored).

        ``choice`` is the sequence's index among a request's ``n`` (vLLM runs
        each choice as a sequence of its own): the same prompt, its own output.

        ``priority`` orders the queue under the priority policy and is ignored
        under fcfs, as vLLM V1 ignores it. Raises EngineRequestError when
        prompt plus max_tokens exceed ``max_model_len`` (vLLM's 400), or a
        count is out of range; EngineQueueFull when ``max_num_queued_reqs``
        requests are in flight already, or ``max_num_queued_tokens`` prompt
        tokens wait for their first token (vLLM's 503; checked for the first
        choice only: a request of ``n`` choices is admitted once, by
        ``check_admission(n)``). ``cache_salt`` (vLLM's request field) keys
        the prompt's blocks apart from other salts'.
        """
        if not choice:
            self.check_admission()
        limit = self.params.max_model_len
        if prompt_tokens < 1:
            raise EngineRequestError("the prompt must contain at least one token")
        if prefill_only:
            if prompt_tokens > limit:
                raise EngineRequestError(f"the prompt's {prompt_tokens} tokens exceed max_model_len={limit}")
            max_tokens = 1
        elif max_tokens is None:
            max_tokens = limit - prompt_tokens
        if max_tokens < 1:
            raise EngineRequestError(f"max_tokens must be at least 1, got {max_tokens}")
        if prompt_tokens + max_tokens > limit and not prefill_only:
            raise EngineRequestError(  # vLLM's renderer's words (2026), for counted token ids
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {prompt_tokens} input tokens, "
                f"for a total of {prompt_tokens + max_tokens} tokens. Please reduce the length of "
                "the input prompt or the number of requested output tokens."
            )
        if min_tokens < 0 or min_tokens > max_tokens:
            raise EngineRequestError(f"min_tokens must be in [0, max_tokens], got {min_tokens}")
        rng = output_rng(self.seed if seed is None else seed, prompt_key if not choice else f"{prompt_key}#{choice}")
        sequence = Sequence(
            request_id if request_id is not None else f"{self.name}-{next(self._ids)}",
            prompt_tokens,
            max_tokens,
            rng,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            priority=priority,
            arrival=trio.current_time(),
            arrival_seq=next(self._arrivals),
            prefill_only=prefill_only,
        )
        if self._cache is not None:
            sequence._block_keys = prompt_block_keys(prompt_key, prompt_tokens, cache_salt, self._cache.block_size)
        if self._priority_policy:
            heapq.heappush(self._queue, (priority, sequence._arrival_seq, sequence))
        else:
            self._waiting.append(sequence)
        self._waiting_count += 1
        self._prompt_tokens_total += prompt_tokens
        self._prefill_queued_tokens += prompt_tokens
        self._work.unpark_all()
        return sequence

    def abort(self, sequence: Sequence) -> None:
        """Drop a sequence at once: its seat and KV cache are free for the next step."""
        if sequence.finished:
            return
        if sequence._kv_held:  # running sequences always hold cache
            self._running.remove(sequence)
            self._release_kv(sequence)
        else:
            self._waiting_count -= 1  # removed lazily from the deque
        self._aborted_total += 1
        self._end(sequence, "abort")

    def statistics(self) -> EngineStatistics:
        cache = self._cache
        return EngineStatistics(
            running=len(self._running),
            waiting=self._waiting_count,
            kv_used_tokens=self._kv_used,
            kv_capacity_tokens=self.params.kv_cache_tokens,
            steps=self._steps,
            preemptions=self._preemptions,
            finished_total=self._finished_total,
            aborted_total=self._aborted_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            max_running_seen=self._max_running_seen,
            max_kv_used_seen=self._max_kv_used_seen,
            prefix_cache_queries=cache.queries if cache else 0,
            prefix_cache_hits=cache.hits if cache else 0,
            prefix_cache_preempted_hits=cache.preempted_hits if cache else 0,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The engine loop: schedule, sleep the step's duration, emit tokens. Runs forever."""
        task_status.started()
        step_end = trio.current_time()
        while True:
            if not self._running and not self._waiting_count:
                await self._work.park()
                step_end = trio.current_time()
                continue
            plan, step_ms, preempted = self._schedule()
            if not plan and preempted:
                continue  # the state changed: vLLM schedules its next step at once
            if not plan:
                # Nothing fits (e.g. the queue head needs KV that running
                # sequences hold, and none of them can decode): wait for change.
                await self._work.park()
                step_end = trio.current_time()
                continue
            # Steps are laid end to end on the engine's own timeline, so the
            # simulator's CPU time does not slow the simulated GPU down.
            step_end = max(step_end, trio.current_time() - 0.05) + step_ms / 1000 * self.time_scale
            await trio.sleep_until(step_end)
            self._complete(plan)

    # -- the step -----------------------------------------------------

    def _schedule(self) -> tuple[list[tuple[Sequence, int]], float, bool]:
        """Pick this step's sequences and token counts and allocate their KV; also say whether it preempted.

        Modelled on vLLM V1's ``Scheduler.schedule`` (vllm/v1/core/sched/scheduler.py),
        decodes ahead of prefill chunks: every running sequence's tokens of
        this step get KV (``allocate_slots`` for its ``num_new_tokens``, a
        chunk at a time, never the whole prompt ahead), and when they do not
        fit the newest running sequence (fcfs: ``self.running.pop()``) or the
        largest (priority, arrival) one (priority) is preempted -- a victim
        already planned this step hands its tokens back -- until they fit or
        the sequence itself was the victim, which ends the running loop. The
        waiting loop runs only ``if not preempted_reqs``, under both
        policies, and admits the queue's head while a seat, the step budget
        and KV for the rest of its sequence are free (``_admission_cost``).
        """
        params = self.params
        budget = params.max_num_batched_tokens
        plan: dict[Sequence, int] = {}  # in scheduling order; a victim leaves it
        preemptions = self._preemptions
        stopped = False

        # Decodes first: one token each, growing the cache by one.
        for sequence in list(self._running):
            if not sequence._kv_held or sequence._computed < sequence._prefill_target:
                continue  # preempted above, or still prefilling
            if budget < 1:
                break
            got, handed_back = self._allocate(sequence, 1, plan)
            budget += handed_back
            if not got:
                stopped = True
                break
            budget -= 1
            plan[sequence] = 1

        # Then sequences part-way through a chunked prefill, a chunk's KV each.
        for sequence in [] if stopped else list(self._running):
            remaining = sequence._prefill_target - sequence._computed
            if remaining <= 0 or not sequence._kv_held or budget < 1:
                continue  # decoding, preempted above, or no budget left
            chunk = min(remaining, budget)
            got, handed_back = self._allocate(sequence, chunk, plan)
            budget += handed_back
            if not got:
                break
            budget -= chunk
            plan[sequence] = chunk

        # Then new sequences in the queue's order, unless this step preempted.
        preempted = self._preemptions > preemptions
        while not preempted and budget >= 1 and len(self._running) < params.max_num_seqs:
            head = self._waiting_head()
            if head is None:
                break
            hit = hit_cost = 0
            if self._cache is not None:
                self._cache.make_room(self._kv_used)
                hit = self._cache.lookup(head._block_keys, head._prefill_target)
                hit_cost = self._cache.unheld(head._block_keys[: hit // self._cache.block_size]) * self._cache.block_size
            chunk = min(head._prefill_target - hit, budget)
            needed = head._prefill_target - hit if params.scheduler_reserve_full_isl else chunk
            if self._kv_used + hit_cost + needed > params.kv_cache_tokens:
                break
            self._admit(head, hit, hit_cost, chunk)
            budget -= chunk
            plan[head] = chunk

        self._max_running_seen = max(self._max_running_seen, len(self._running))
        self._max_kv_used_seen = max(self._max_kv_used_seen, self._kv_used)
        if self._cache is not None:  # the held cache grew: free blocks make way
            self._cache.make_room(self._kv_used)
        steps = list(plan.items())
        prefill_tokens = sum(n for s, n in steps if s._computed < s._prefill_target)
        context_tokens = sum(s._computed + n for s, n in steps)
        step_ms = params.step_ms(len(steps), prefill_tokens, context_tokens) if steps else 0.0
        return steps, step_ms, preempted

    def _allocate(self, sequence: Sequence, tokens: int, plan: dict[Sequence, int]) -> tuple[bool, int]:
        """KV for ``tokens`` more of a running sequence, preempting until they fit (vLLM's ``allocate_slots`` loop).

        Returns whether the sequence got them (False: it was the victim
        itself) and the step's tokens handed back by victims already planned.
        """
        handed_back = 0
        while self._kv_used + tokens > self.params.kv_cache_tokens:
            if self._priority_policy:
                victim = max(self._running, key=lambda s: (s.priority, s._arrival_seq))
            else:
                victim = self._running[-1]
            handed_back += plan.pop(victim, 0)  # its cache, this step's tokens included, is freed below
            self._preempt(victim)
            if victim is sequence:
                return False, handed_back
        self._kv_used += tokens
        sequence._kv_held += tokens
        return True, handed_back

    def _waiting_head(self) -> Sequence | None:
        """The queue's head (fcfs: arrival; priority: (priority, arrival)), dropping aborted ones."""
        if self._priority_policy:
            while self._queue and self._queue[0][2].finished:
                heapq.heappop(self._queue)
            return self._queue[0][2] if self._queue else None
        while self._waiting and self._waiting[0].finished:
            self._waiting.popleft()
        return self._waiting[0] if self._waiting else None

    def _complete(self, plan: list[tuple[Sequence, int]]) -> None:
        """End of a step: advance every scheduled sequence, emit and finish."""
        self._steps += 1
        now = trio.current_time()
        params = self.params
        firsts: list[Sequence] = []
        gaps: dict[float, int] = {}
        for sequence, tokens in plan:
            if sequence.finished:  # aborted during the step
                continue
            sequence._computed += tokens
            if self._cache is not None:  # its prompt blocks computed in full are cached now
                self._cache_computed(sequence)
            if sequence._computed < sequence._prefill_target:
                continue
            if sequence.prefill_only:  # a pooling request ends with its prefill
                self._finish(sequence, "stop")
                continue
            sequence.token_ids.append(sequence._rng.randrange(VOCABULARY_SIZE))
            self._generation_tokens_total += 1
            produced = len(sequence.token_ids)
            if sequence.first_token_at is None:
                sequence.first_token_at = now
                self._prefill_queued_tokens -= sequence.prompt_tokens
                firsts.append(sequence)
            else:
                gap = now - sequence.last_token_at  # type: ignore[operator]  # set with the first token
                gaps[gap] = gaps.get(gap, 0) + 1
            sequence.last_token_at = now
            if produced >= sequence.max_tokens or sequence.prompt_tokens + produced >= params.max_model_len:
                self._finish(sequence, "length")
            elif (
                params.eos_probability
                and not sequence.ignore_eos
                and produced >= sequence.min_tokens
                and sequence._rng.random() < params.eos_probability
            ):
                self._finish(sequence, "stop")
            else:
                sequence._wake()
        if self._token_hooks and (firsts or gaps):
            for hook in self._token_hooks:
                hook(firsts, gaps)

    def _finish(self, sequence: Sequence, reason: str) -> None:
        self._running.remove(sequence)
        self._release_kv(sequence)
        self._finished_total += 1
        self._end(sequence, reason)

    def _end(self, sequence: Sequence, reason: str) -> None:
        if sequence.first_token_at is None:  # it never reached its first token: no longer queued
            self._prefill_queued_tokens -= sequence.prompt_tokens
        sequence.finish_reason = reason
        sequence.finished_at = trio.current_time()
        sequence._wake()
        for hook in self._finish_hooks:
            hook(sequence)
        if reason == "abort":
            self._work.unpark_all()

    def _cache_computed(self, sequence: Sequence) -> None:
        """Pin the prompt blocks a step completed; one that another sequence holds is shared from now on."""
        assert self._cache is not None
        held, entered = self._cache.extend(sequence._block_keys, sequence._blocks_held, sequence._computed)
        if held > sequence._blocks_held:
            # its new blocks leave its private tokens; those nobody held enter the shared ones
            self._kv_used += (entered - (held - sequence._blocks_held)) * self._cache.block_size
            sequence._blocks_held = held

    def _release_kv(self, sequence: Sequence) -> None:
        if self._cache is not None:  # its blocks stay cached, free, most recently used
            block = self._cache.block_size
            self._kv_used -= sequence._kv_held - sequence._blocks_held * block  # its private tokens
            self._kv_used -= self._cache.release(sequence._block_keys[: sequence._blocks_held]) * block
            sequence._blocks_held = 0
        else:
            self._kv_used -= sequence._kv_held
        sequence._kv_held = 0

    def _admit(self, head: Sequence, hit: int, hit_cost: int, chunk: int) -> None:
        """Seat the queue's head with its ``hit`` cached tokens and KV for its first ``chunk``.

        ``hit_cost``: the tokens of its hit blocks that no running sequence
        held, which now count in the KV in use.
        """
        if self._priority_policy:
            heapq.heappop(self._queue)
        else:
            self._waiting.popleft()
        self._waiting_count -= 1
        self._running.append(head)
        if head.scheduled_at is None:
            head.scheduled_at = trio.current_time()
        head._computed = hit
        head._kv_held = hit + chunk
        self._kv_used += hit_cost + chunk
        if self._cache is not None:
            head._blocks_held = self._cache.admit(head._block_keys, hit, head.prompt_tokens, preempted=bool(head.preemptions))
            if not head.preemptions:
                head.cached_tokens = hit

    def _preempt(self, victim: Sequence) -> None:
        """Free a running sequence's cache; it recomputes from the queue's head.

        Under the priority policy "the head" is its place by (priority,
        arrival): vLLM's ``PriorityRequestQueue.prepend_request`` re-adds it.
        """
        self._running.remove(victim)
        self._release_kv(victim)
        victim._prefill_target = victim.prompt_tokens + len(victim.token_ids)
        victim._computed = 0
        victim.preemptions += 1
        self._preemptions += 1
        if self._priority_policy:
            heapq.heappush(self._queue, (victim.priority, victim._arrival_seq, victim))
        else:
            self._waiting.appendleft(victim)
        self._waiting_count += 1
