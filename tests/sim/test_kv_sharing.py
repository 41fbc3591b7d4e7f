"""A cached prefix is stored once and ref-counted, in both simulated engines, as vLLM's block pool does.

vLLM V1 keeps one physical block per cached block hash and a reference count
(vllm/v1/core/block_pool.py, ``KVCacheBlock.ref_cnt``): requests that share a
prefix share its blocks, ``kv_cache_usage_perc`` is ``1 - free / total``
blocks, and a waiting request pays at admission only for the blocks it does
not find held (``get_num_blocks_to_allocate`` counts a hit on a free cached
block, never one a running request holds). So 32 requests behind one warm
system prompt run side by side in a cache that holds the prompt 12 times,
not 11 of them with the cache full.
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
from tailguard.sim.prefix_cache import prompt_block_keys
from tailguard.sim.tokens import count_text_tokens

SEATS = 32
KV_TOKENS = 24_000
PARAMS = EngineParams(
    max_num_seqs=SEATS,
    max_num_batched_tokens=4096,
    max_model_len=8192,
    kv_cache_tokens=KV_TOKENS,
    base_ms=10.0,
    per_seq_ms=0.0,
    per_context_token_ms=0.0,
    prefill_tokens_per_ms=100.0,
)
SYSTEM = ("You are a helpful assistant. " * 276)[:8000]  # 2,000 tokens: 125 full blocks
OUTPUT_TOKENS = 100


def _question(n: int) -> str:
    return f"{SYSTEM}Question {n:03d}: " + "what is the weather like today? " * 5


class _Stats(Protocol):
    @property
    def max_running_seen(self) -> int: ...
    @property
    def max_kv_used_seen(self) -> int: ...
    @property
    def preemptions(self) -> int: ...


class _Done(Protocol):
    async def wait_finished(self) -> None: ...


async def _serve(kind: str, clock: trio.testing.MockClock, texts: Sequence[str]) -> _Stats:
    """Warm the cache with the system prompt alone, then submit every text at once and let them finish."""
    async with trio.open_nursery() as nursery:
        if kind == "sim":
            engine = Engine(PARAMS)
            await nursery.start(engine.run)

            def submit(text: str, n: int) -> _Done:
                return engine.submit(count_text_tokens(text), OUTPUT_TOKENS, prompt_key=text, ignore_eos=True)

            statistics = engine.statistics
        else:
            timeline = Timeline(clock)
            await nursery.start(timeline.run)
            sweep = SweepEngine(PARAMS, timeline)

            def submit(text: str, n: int) -> _Done:
                tokens = count_text_tokens(text)
                return sweep.submit(tokens, OUTPUT_TOKENS, block_keys=prompt_block_keys(text, tokens), rank=n)

            statistics = sweep.statistics  # type: ignore[assignment]
        await submit(SYSTEM, 0).wait_finished()
        sequences = [submit(text, n + 1) for n, text in enumerate(texts)]
        for sequence in sequences:
            await sequence.wait_finished()
        stats = statistics()
        nursery.cancel_scope.cancel()
    return stats


@pytest.mark.parametrize("kind", ["sim", "sweep"])
async def test_requests_behind_one_warm_system_prompt_share_its_kv(kind: str, autojump_clock: trio.testing.MockClock) -> None:
    """32 requests behind a warm 2,000-token prompt on a 32-seat engine with 24,000 KV tokens.

    Counted once per sequence (the simulator before), 11 ran at once with
    the cache full; stored once, all 32 run together and the cache holds
    the prompt once plus each request's own tail: well under 40%.
    """
    texts = [_question(n) for n in range(SEATS)]
    tail = count_text_tokens(texts[0]) - count_text_tokens(SYSTEM)
    stats = await _serve(kind, autojump_clock, texts)
    assert stats.max_running_seen == SEATS
    assert stats.preemptions == 0
    # the prompt's 125 blocks once, then per request its own tail and output
    assert stats.max_kv_used_seen <= 2000 + SEATS * (tail + OUTPUT_TOKENS)
    assert stats.max_kv_used_seen < 0.4 * KV_TOKENS
