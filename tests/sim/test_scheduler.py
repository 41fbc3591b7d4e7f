"""Three points of vLLM V1's scheduler, in both simulated engines: KV per scheduled chunk, the full-sequence admission gate, and no admission after a preemption.

vLLM's ``Scheduler.schedule`` (vllm/v1/core/sched/scheduler.py) calls
``kv_cache_manager.allocate_slots(request, num_new_tokens)`` for the tokens
each request runs in this step, never for a whole prompt ahead; a waiting
request is admitted only if the free blocks hold its whole sequence so far
(``full_sequence_must_fit=scheduler_reserve_full_isl``, True by default in
0.32; ``--no-scheduler-reserve-full-isl`` checks the first chunk only); and
its waiting loop runs only ``if not preempted_reqs``. ``tailguard.sim.Engine``
and the sweep's ``SweepEngine`` must both do so (and agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import pytest
import trio
import trio.testing

from tailguard.server.advise.replay.clock import Timeline
from tailguard.server.advise.replay.engine import SweepEngine
from tailguard.sim import Engine, EngineParams

# Every step is exactly 10 ms (prefill and attention free), so a sample at
# 5 ms past a multiple of 10 sees one step's batch.
STEP_S = 0.010
TIGHT = EngineParams(
    max_num_seqs=4,
    max_num_batched_tokens=100,
    max_model_len=3000,
    kv_cache_tokens=3000,
    base_ms=10.0,
    per_seq_ms=0.0,
    per_context_token_ms=0.0,
    prefill_tokens_per_ms=0.0,
    prefix_caching=False,  # about KV accounting, not hits
)
FIRST_CHUNK_GATE = TIGHT.replace(scheduler_reserve_full_isl=False)  # the gate before vLLM 0.32's default


class _Stats(Protocol):
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def kv_used_tokens(self) -> int: ...
    @property
    def preemptions(self) -> int: ...


Sample = tuple[int, int, int, int]  # preemptions, running, waiting, kv used


def _sample(stats: _Stats) -> Sample:
    return stats.preemptions, stats.running, stats.waiting, stats.kv_used_tokens


async def _run(
    kind: str, clock: trio.testing.MockClock, shapes: Sequence[tuple[int, int]], steps: int, params: EngineParams = FIRST_CHUNK_GATE
) -> list[Sample]:
    """Submit ``shapes`` (prompt, max_tokens) at once and sample the engine mid-step for ``steps`` steps.

    ``steps=0``: run until every sequence ends, and sample once after.
    """
    samples: list[Sample] = []
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        if kind == "sim":
            engine = Engine(params)
            await nursery.start(engine.run)
            ends = [engine.submit(prompt, out, prompt_key=f"p{n}", ignore_eos=True) for n, (prompt, out) in enumerate(shapes)]
            stats = engine.statistics
        else:
            timeline = Timeline(clock)
            await nursery.start(timeline.run)
            sweep = SweepEngine(params, timeline)
            ends = [sweep.submit(prompt, out, rank=n) for n, (prompt, out) in enumerate(shapes)]  # type: ignore[misc]
            stats = sweep.statistics  # type: ignore[assignment]
        for step in range(steps):
            await trio.sleep_until(start + (step + 0.5) * STEP_S)
            samples.append(_sample(stats()))
        if not steps:
            for sequence in ends:
                await sequence.wait_finished()
            samples.append(_sample(stats()))
        nursery.cancel_scope.cancel()
    return samples


@pytest.mark.parametrize("kind", ["sim", "sweep"])
async def test_kv_is_allocated_per_chunk_so_a_long_prompt_is_admitted_and_preempted(
    kind: str, autojump_clock: trio.testing.MockClock
) -> None:
    """A 2,000-token prompt beside a 1,500-token sequence in a 3,000-token cache.

    Reserving whole prompts it would wait for the first to finish; per chunk
    it is admitted for its first 99 tokens, grows a chunk a step, and is
    preempted (it is the newest) when the next chunk does not fit.
    """
    samples = await _run(kind, autojump_clock, [(1500, 1000), (2000, 10)], 40)
    first_decode = 15  # 1,500 tokens at 100 a step
    assert samples[first_decode][1:3] == (2, 0)  # admitted while the first decodes
    assert samples[first_decode][3] == 1500 + 1 + 99
    preempted = next(i for i, s in enumerate(samples) if s[0])
    assert samples[preempted - 1][3] + 1 + 99 > TIGHT.kv_cache_tokens  # its next chunk did not fit
    assert samples[preempted][1:3] == (1, 1)


@pytest.mark.parametrize("kind", ["sim", "sweep"])
async def test_a_step_that_preempted_admits_nobody(kind: str, autojump_clock: trio.testing.MockClock) -> None:
    """The victim's first chunk fits at once after its preemption, yet it waits one step (``if not preempted_reqs``)."""
    samples = await _run(kind, autojump_clock, [(1500, 1000), (2000, 10)], 40)
    preempted = next(i for i, s in enumerate(samples) if s[0])
    _, running, waiting, kv = samples[preempted]
    assert (running, waiting) == (1, 1) and kv + 1 + 99 <= TIGHT.kv_cache_tokens  # it would fit
    assert samples[preempted + 1][1:3] == (2, 0)  # and is admitted by the next step


@pytest.mark.parametrize("kind", ["sim", "sweep"])
async def test_the_full_sequence_gate_keeps_a_prompt_waiting_that_the_cache_cannot_finish(
    kind: str, autojump_clock: trio.testing.MockClock
) -> None:
    """vLLM 0.32's default: the 2,000-token prompt waits (its whole prompt does not fit beside the 1,501) instead of being admitted and preempted."""
    samples = await _run(kind, autojump_clock, [(1500, 1000), (2000, 10)], 40, TIGHT)
    assert TIGHT.scheduler_reserve_full_isl  # on by default, as in vLLM 0.32
    assert all(s[0] == 0 for s in samples)
    assert samples[15][1:4] == (1, 1, 1501)  # decoding alone, the long prompt waiting


LONG = EngineParams(
    max_num_seqs=8,
    max_num_batched_tokens=2048,
    max_model_len=32768,
    kv_cache_tokens=40_000,
    base_ms=10.0,
    per_seq_ms=0.0,
    per_context_token_ms=0.0,
    prefill_tokens_per_ms=0.0,
    prefix_caching=False,
)
LONG_PROMPTS = [(tokens, 64) for tokens in (30_000, 8_000, 20_000, 12_000, 25_000, 9_000, 16_000, 28_000)]


@pytest.mark.parametrize("kind", ["sim", "sweep"])
async def test_long_prompts_on_a_small_cache_are_not_preempted_in_a_loop(kind: str, autojump_clock: trio.testing.MockClock) -> None:
    """Prompts of 8-30k tokens on a 40,000-token cache: the first-chunk gate admits them chunk by chunk into each other's way."""
    full = await _run(kind, autojump_clock, LONG_PROMPTS, 0, LONG)
    first_chunk = await _run(kind, autojump_clock, LONG_PROMPTS, 0, LONG.replace(scheduler_reserve_full_isl=False))
    assert full[-1][0] == 0
    assert first_chunk[-1][0] >= 20


async def test_the_sweep_engine_wakes_a_first_token_waiter_at_the_first_token(autojump_clock: trio.testing.MockClock) -> None:
    """The virtual fleet's first byte (EngineResponse.start) is the engine's first token, not the submission nor the end."""
    async with trio.open_nursery() as nursery:
        timeline = Timeline(autojump_clock)
        await nursery.start(timeline.run)
        sweep = SweepEngine(TIGHT, timeline)
        submitted = trio.current_time()
        sequence = sweep.submit(1500, 50, rank=0)  # 15 steps of prefill at 100 tokens a step
        await sequence.wait_first_token()
        woke = trio.current_time()
        await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    assert sequence.first_token_at is not None and sequence.finished_at is not None
    assert woke == sequence.first_token_at and submitted < woke < sequence.finished_at
