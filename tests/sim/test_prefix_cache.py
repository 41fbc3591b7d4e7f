"""The simulator's automatic prefix cache (vLLM V1's), asserted in virtual time."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from tailguard.sim import PROFILES, Engine, EngineParams, Sequence
from tailguard.sim.__main__ import build_parser
from tailguard.sim.prefix_cache import BLOCK_SIZE, PrefixCache, block_hashes
from tailguard.sim.tokens import prompt_token_ids
from tests.helpers.engines import MODEL, in_process_engine

# Prefill costs 1 ms per 10 tokens, so a cached prefix shows in TTFT.
CACHED = EngineParams(
    max_num_seqs=4,
    max_num_batched_tokens=4000,
    max_model_len=4000,
    kv_cache_tokens=100_000,
    base_ms=10.0,
    per_seq_ms=1.0,
    per_context_token_ms=0.0,
    prefill_tokens_per_ms=10.0,
    prefix_caching=True,
)


async def run_alone(engine: Engine, prompt_key: str, prompt_tokens: int, **kwargs: object) -> Sequence:
    sequence = engine.submit(prompt_tokens, 4, prompt_key=prompt_key, **kwargs)  # type: ignore[arg-type]
    await sequence.wait_finished()
    return sequence


def ttft(sequence: Sequence) -> float:
    assert sequence.first_token_at is not None
    return sequence.first_token_at - sequence.arrival


async def serve_in_turn(params: EngineParams, prompts: list[tuple[str, int]], **kwargs: object) -> list[Sequence]:
    async with trio.open_nursery() as nursery:
        engine = Engine(params)
        await nursery.start(engine.run)
        done = [await run_alone(engine, key, tokens, **kwargs) for key, tokens in prompts]
        nursery.cancel_scope.cancel()
    return done


def test_token_ids_are_stable_counted_and_share_a_prefix() -> None:
    text = "lorem ipsum " * 100
    ids = prompt_token_ids(text, 300)
    assert ids == prompt_token_ids(text, 300) and len(ids) == 300
    other = prompt_token_ids(text + " and then something else", 306)
    assert other[:300] == ids
    assert prompt_token_ids("short", 10)[2:] != prompt_token_ids("shore", 10)[2:]  # the padding hashes the whole text


def test_block_hashes_chain_and_salt() -> None:
    ids = list(range(40))
    keys = block_hashes(ids)
    assert len(keys) == 2  # only full blocks
    changed = block_hashes([99, *ids[1:]])
    assert changed[0] != keys[0] and changed[1] != keys[1]  # block 1 matches only if block 0 does
    assert block_hashes(ids, "tenant-a")[0] != keys[0]


async def test_the_same_prompt_twice_hits_its_full_blocks(autojump_clock: trio.testing.MockClock) -> None:
    first, second = await serve_in_turn(CACHED, [("doc", 1000), ("doc", 1000)])
    assert first.cached_tokens == 0
    assert second.cached_tokens == 1000 // BLOCK_SIZE * BLOCK_SIZE == 992
    assert ttft(first) * 1000 == pytest.approx(10.0 + 1.0 + 1000 / 10.0)
    assert ttft(second) * 1000 == pytest.approx(10.0 + 1.0 + 8 / 10.0)  # only the partial block is prefilled


async def test_a_whole_cached_prompt_still_computes_its_last_token(autojump_clock: trio.testing.MockClock) -> None:
    _, second = await serve_in_turn(CACHED, [("doc", 64), ("doc", 64)])
    assert second.cached_tokens == 48  # vLLM recomputes the last block so the last token has logits


async def test_a_shared_prefix_hits_only_its_blocks(autojump_clock: trio.testing.MockClock) -> None:
    prefix = "x" * 4000  # 1,000 tokens: 62 full blocks, the 63rd shared in part
    done = await serve_in_turn(CACHED, [(prefix + " question one?", 1004), (prefix + " another question", 1005)])
    assert done[1].cached_tokens == 1000 // BLOCK_SIZE * BLOCK_SIZE


async def test_a_different_cache_salt_misses(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        engine = Engine(CACHED)
        await nursery.start(engine.run)
        await run_alone(engine, "doc", 1000, cache_salt="a")
        other = await run_alone(engine, "doc", 1000, cache_salt="b")
        same = await run_alone(engine, "doc", 1000, cache_salt="a")
        nursery.cancel_scope.cancel()
    assert other.cached_tokens == 0
    assert same.cached_tokens == 992


async def test_caching_off_is_todays_engine(autojump_clock: trio.testing.MockClock) -> None:
    off = CACHED.replace(prefix_caching=False)
    first, second = await serve_in_turn(off, [("doc", 1000), ("doc", 1000)])
    assert second.cached_tokens == 0
    assert ttft(second) == pytest.approx(ttft(first), abs=1e-12)
    assert ttft(second) * 1000 == pytest.approx(10.0 + 1.0 + 1000 / 10.0)


def test_lru_evicts_the_least_recently_freed_and_never_a_held_block() -> None:
    cache = PrefixCache(capacity_tokens=4 * BLOCK_SIZE)
    old, new, running = block_hashes(list(range(32)), "old"), block_hashes(list(range(32)), "new"), block_hashes(list(range(16)), "run")
    for keys in (old, new):
        cache.hold(keys)
        cache.release(keys)
    cache.hold(running)
    cache.make_room(held_tokens=2 * BLOCK_SIZE)  # 2 of 4 blocks held: 2 free may stay
    assert cache.match(old, 1000) == 0
    assert cache.match(new, 1000) == 2
    assert cache.cached(running[0])
    cache.make_room(held_tokens=4 * BLOCK_SIZE)  # no room left for free blocks at all
    assert cache.match(new, 1000) == 0 and cache.cached(running[0])


async def test_engine_evicts_under_a_small_cache(autojump_clock: trio.testing.MockClock) -> None:
    small = CACHED.replace(kv_cache_tokens=4000, max_model_len=2000)
    done = await serve_in_turn(small, [("a", 1600), ("b", 1600), ("c", 1600), ("b", 1600), ("a", 1600)])
    # Room for 250 blocks. When "c" (100 blocks, growing by its decodes) runs, 200 are free:
    # "a"'s, freed first, make way, tail first (vLLM frees a request's blocks in reverse),
    # so "b" still hits in full and "a" only its 49 leading blocks.
    assert [s.cached_tokens for s in done] == [0, 0, 0, 1584, 49 * BLOCK_SIZE]


async def test_metrics_and_usage_report_the_cache(autojump_clock: trio.testing.MockClock) -> None:
    request = {"model": MODEL, "prompt": "y" * 400, "max_tokens": 3}
    async with in_process_engine(CACHED, prompt_tokens_details=True) as (engine, client):
        first = (await client.post("/v1/completions", json=request)).json()
        second = (await client.post("/v1/completions", json=request)).json()
        streamed = await client.post("/v1/completions", json={**request, "stream": True, "stream_options": {"include_usage": True}})
        text = (await client.get("/metrics")).text
    # vLLM 0.32 with --enable-prompt-tokens-details: always, a miss's 0 included; a completion has no created_cache_tokens
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 96, "created_cache_tokens": None, "multimodal_tokens": None}
    usage_events = [line for line in streamed.text.splitlines() if '"usage"' in line]
    assert '"prompt_tokens_details":{"cached_tokens":96}' in usage_events[-1]  # a stream's usage leaves the nulls out
    stats = engine.statistics()
    assert stats.prefix_cache_queries == 3 * 100 and stats.prefix_cache_hits == 2 * 96
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="sim-llama-3.1-8b"} 300.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-llama-3.1-8b"} 192.0' in text
    assert "vllm:kv_cache_usage_perc" in text


async def test_a_preempted_sequence_re_hits_its_own_blocks(autojump_clock: trio.testing.MockClock) -> None:
    tight = CACHED.replace(kv_cache_tokens=1000, max_model_len=1000)
    async with trio.open_nursery() as nursery:
        engine = Engine(tight)
        await nursery.start(engine.run)
        first = engine.submit(480, 400, prompt_key="first")
        second = engine.submit(480, 400, prompt_key="second")
        await first.wait_finished()
        await second.wait_finished()
        nursery.cancel_scope.cancel()
    assert (first.preemptions, second.preemptions) == (0, 1)
    assert second.cached_tokens == 0  # cold at its first admission
    # Its 30 prompt blocks stayed cached, tail first evicted while "first" grew to 880 tokens
    # (55 of the 62 blocks): the 7 leading ones are hit again.
    assert engine.statistics().prefix_cache_preempted_hits == 7 * BLOCK_SIZE


def test_the_cli_turns_the_cache_on_and_off() -> None:
    parser = build_parser()
    assert parser.parse_args(["--prefix-caching", "true"]).prefix_caching is True
    assert parser.parse_args(["--prefix-caching", "False"]).prefix_caching is False
    assert parser.parse_args([]).prefix_caching is None  # the profile's value stands
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix-caching", "maybe"])


async def test_a_cache_salt_must_be_a_string(autojump_clock: trio.testing.MockClock) -> None:
    async with in_process_engine(CACHED) as (_, client):
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": 7})
    assert response.status_code == 400
    assert "cache_salt" in response.text


def test_the_cache_is_on_by_default_in_every_profile() -> None:
    assert EngineParams().prefix_caching is True  # vLLM V1's default
    assert all(params.prefix_caching for params in PROFILES.values())
    assert PROFILES["instant"].replace(prefix_caching=False).prefix_caching is False


async def test_chat_usage_reports_cached_tokens_plain_and_streamed(autojump_clock: trio.testing.MockClock) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "z" * 800}], "max_tokens": 2}
    async with in_process_engine(CACHED, prompt_tokens_details=True) as (_, client):
        first = (await client.post("/v1/chat/completions", json=request)).json()
        plain = (await client.post("/v1/chat/completions", json=request)).json()
        streamed = await client.post(
            "/v1/chat/completions", json={**request, "stream": True, "stream_options": {"include_usage": True}}
        )
    # 200 + 4 + 3 = 207 tokens: 12 full blocks
    assert first["usage"]["prompt_tokens"] == 207
    # a chat also says which full blocks it cached anew (created_cache_tokens)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 12 * BLOCK_SIZE, "multimodal_tokens": None}
    assert plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 12 * BLOCK_SIZE, "created_cache_tokens": 0, "multimodal_tokens": None}
    usage = [json.loads(line[len("data: ") :]) for line in streamed.text.splitlines() if '"usage"' in line]
    assert usage[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 12 * BLOCK_SIZE, "created_cache_tokens": 0}


async def test_prompt_tokens_details_need_vllms_flag(autojump_clock: trio.testing.MockClock) -> None:
    """Without --enable-prompt-tokens-details vLLM 0.32 sends the details as null, hit or not, and none in a stream."""
    request = {"model": MODEL, "prompt": "y" * 400, "max_tokens": 3}
    async with in_process_engine(CACHED) as (_, client):
        await client.post("/v1/completions", json=request)
        hit = (await client.post("/v1/completions", json=request)).json()
        streamed = await client.post("/v1/completions", json={**request, "stream": True, "stream_options": {"include_usage": True}})
    assert hit["usage"]["prompt_tokens_details"] is None
    assert "prompt_tokens_details" not in streamed.text


def _gauge(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


async def test_kv_usage_counts_held_blocks_not_free_cached_ones(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM's kv_cache_usage_perc leaves out free blocks that still hold a cached prefix."""
    async with in_process_engine(CACHED) as (engine, client):
        sequence = engine.submit(1000, 50, prompt_key="doc")
        await trio.sleep(0.5)  # prefilled and decoding
        running = _gauge((await client.get("/metrics")).text, "vllm:kv_cache_usage_perc")
        await sequence.wait_finished()
        idle = (await client.get("/metrics")).text
    assert 1000 / 100_000 < running <= (1000 + 50) / 100_000  # its prompt and the tokens so far
    assert _gauge(idle, "vllm:kv_cache_usage_perc") == 0.0  # its 62 blocks are cached, free, not in use
    assert engine._cache is not None and engine._cache.free_cached_blocks == 1000 // BLOCK_SIZE


async def test_block_size_sets_the_unit_of_a_hit_as_vllms_cpu_build_does(autojump_clock: trio.testing.MockClock) -> None:
    """vLLM's CPU build caches 128-token blocks: a 300-token prompt seen again hits 256, not 288 (16-token blocks)."""
    coarse = CACHED.replace(block_size=128)
    request = {"model": MODEL, "messages": [{"role": "user", "content": "z" * 1180}], "max_tokens": 2}
    async with in_process_engine(coarse, prompt_tokens_details=True) as (engine, client):
        first = (await client.post("/v1/chat/completions", json=request)).json()
        second = (await client.post("/v1/chat/completions", json=request)).json()
        text = (await client.get("/metrics")).text
    assert first["usage"]["prompt_tokens"] == 302
    assert first["usage"]["prompt_tokens_details"]["created_cache_tokens"] == 256  # two full blocks cached anew
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert second["usage"]["prompt_tokens_details"]["created_cache_tokens"] == 0
    assert 'block_size="128"' in text and f'num_gpu_blocks="{coarse.kv_cache_tokens // 128}"' in text
    assert build_parser().parse_args(["--block-size", "128"]).block_size == 128
    with pytest.raises(ValueError, match="block_size"):
        CACHED.replace(block_size=0)
