"""The simulated engine's model of vLLM, asserted in virtual time."""

from __future__ import annotations

import math
import statistics

import pytest
import trio
import trio.testing

from tailguard.sim import PROFILES, Engine, EngineParams, EngineRequestError, Sequence

# A cost model with round numbers, so expected times are easy to write down.
ROUND = EngineParams(
    max_num_seqs=4,
    max_num_batched_tokens=1000,
    max_model_len=4000,
    kv_cache_tokens=100_000,
    base_ms=10.0,
    per_seq_ms=1.0,
    per_context_token_ms=0.0,
    prefill_tokens_per_ms=0.0,
)


async def start(nursery: trio.Nursery, params: EngineParams, **kwargs: object) -> Engine:
    engine = Engine(params, **kwargs)  # type: ignore[arg-type]
    await nursery.start(engine.run)
    return engine


async def token_times(sequence: Sequence) -> list[float]:
    """The time each token of ``sequence`` appeared, as a reader sees it."""
    times: list[float] = []
    while not sequence.finished:
        await sequence.wait_for_tokens(len(times))
        times.extend([trio.current_time()] * (len(sequence.token_ids) - len(times)))
    return times


async def test_lone_request_matches_the_cost_formula(autojump_clock: trio.testing.MockClock) -> None:
    params = PROFILES["latency"]
    prompt, max_tokens = 500, 20
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, params)
        t0 = trio.current_time()
        sequence = engine.submit(prompt, max_tokens)
        await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    ttft_ms = params.base_ms + params.per_seq_ms + prompt / params.prefill_tokens_per_ms + params.per_context_token_ms * prompt
    decode_ms = sum(
        params.base_ms + params.per_seq_ms + params.per_context_token_ms * (prompt + k) for k in range(1, max_tokens)
    )
    assert sequence.first_token_at is not None and sequence.finished_at is not None
    assert (sequence.first_token_at - t0) * 1000 == pytest.approx(ttft_ms, rel=1e-9)
    assert (sequence.finished_at - t0) * 1000 == pytest.approx(ttft_ms + decode_ms, rel=1e-9)
    assert sequence.finish_reason == "length"
    assert len(sequence.token_ids) == max_tokens


async def test_calibration_matches_published_decode_steps() -> None:
    params = EngineParams()
    # Published decode step times with ~1k tokens of context per sequence.
    for batch, published_ms in [(1, 7.8), (32, 10.0), (64, 13.0), (128, 18.0), (256, 29.0)]:
        assert params.step_ms(batch, 0, batch * 1000) == pytest.approx(published_ms, rel=0.06)
    # An 8,192-token prefill chunk stalls the step for ~0.3 s.
    assert 300 <= params.step_ms(1, 8192, 8192) <= 350


async def test_throughput_saturates_at_the_predicted_capacity(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, ROUND)
        t0 = trio.current_time()
        sequences = [engine.submit(10, 10) for _ in range(12)]
        await trio.testing.wait_all_tasks_blocked()
        # One step in: four seats taken, eight wait, first come first served.
        await trio.sleep(0.001)
        stats = engine.statistics()
        assert (stats.running, stats.waiting) == (4, 8)
        for sequence in sequences:
            await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    # Four sequences a step of 10 + 4 x 1 ms; each needs 10 steps; batches run back to back.
    finish_ms = [round((s.finished_at - t0) * 1000, 6) for s in sequences]  # type: ignore[operator]
    assert finish_ms == [140.0] * 4 + [280.0] * 4 + [420.0] * 4
    tokens_per_s = 12 * 10 / 0.420
    assert tokens_per_s == pytest.approx(4 / 0.014)  # seats / step time
    assert engine.statistics().max_running_seen == 4


async def test_long_prompt_stretches_running_short_sequences(autojump_clock: trio.testing.MockClock) -> None:
    params = PROFILES["latency"]
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, params)
        shorts = [engine.submit(20, 300, prompt_key=str(i)) for i in range(4)]
        readers = []
        results: dict[int, list[float]] = {}

        async def read(index: int, sequence: Sequence) -> None:
            results[index] = await token_times(sequence)

        for index, sequence in enumerate(shorts):
            nursery.start_soon(read, index, sequence)
            readers.append(index)
        await trio.sleep(0.5)  # the shorts are decoding at full speed
        long_at = trio.current_time()
        long = engine.submit(8000, 10)
        for sequence in shorts:
            await sequence.wait_finished()
        await long.wait_finished()
        nursery.cancel_scope.cancel()

    gaps = [(b - a) * 1000 for a, b in zip(results[0], results[0][1:])]
    times = results[0][1:]
    before = [g for g, t in zip(gaps, times) if t <= long_at]
    stalled = [g for g in gaps if g > 50]
    # Alone, four decodes take ~7.8 ms a token.
    assert 7.8 <= statistics.median(before) <= 8.0
    # The 8,000-token prompt is prefilled in 2,044-token chunks (2,048 minus
    # the four decodes): four steps, each stretched by the chunk's prefill.
    assert len(stalled) == math.ceil(8000 / (params.max_num_batched_tokens - 4))
    chunk_ms = params.step_ms(5, 2044, 0)
    assert max(stalled) == pytest.approx(chunk_ms, rel=0.01)
    assert max(stalled) / statistics.median(before) > 10


async def test_seats_and_kv_cache_are_never_exceeded(autojump_clock: trio.testing.MockClock) -> None:
    params = ROUND.replace(max_num_seqs=8, max_model_len=1000, kv_cache_tokens=2000)
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, params)
        sequences = [engine.submit(200, 600, prompt_key=str(i)) for i in range(20)]
        for sequence in sequences:
            await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    stats = engine.statistics()
    assert stats.max_running_seen == 8
    assert stats.max_kv_used_seen <= 2000
    assert stats.preemptions > 0  # the cache filled up mid-decode
    assert stats.kv_used_tokens == 0 and stats.running == 0 and stats.waiting == 0
    assert all(s.finish_reason == "length" and len(s.token_ids) == 600 for s in sequences)

    # A preempted sequence recomputes; its output is the same as if it had run alone.
    preempted = next(s for s in sequences if s.preemptions)
    async with trio.open_nursery() as nursery:
        alone = await start(nursery, ROUND.replace(max_model_len=1000))
        again = alone.submit(200, 600, prompt_key=str(sequences.index(preempted)))
        await again.wait_finished()
        nursery.cancel_scope.cancel()
    assert again.token_ids == preempted.token_ids


async def test_abort_frees_the_seat_within_one_step(autojump_clock: trio.testing.MockClock) -> None:
    params = ROUND.replace(max_num_seqs=2)
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, params)
        first, second, third = (engine.submit(10, 1000) for _ in range(3))
        await trio.sleep(0.1)
        assert (engine.statistics().running, engine.statistics().waiting) == (2, 1)
        engine.abort(first)
        stats = engine.statistics()
        assert (stats.running, stats.waiting) == (1, 1)
        assert stats.kv_used_tokens == second.prompt_tokens + len(second.token_ids)
        await third.wait_for_tokens(0)  # admitted and prefilled at the next step
        assert trio.current_time() - (first.finished_at or 0) <= 2 * params.step_ms(2, 0, 0) / 1000
        assert first.finish_reason == "abort" and engine.statistics().aborted_total == 1

        # Aborting a waiting request removes it from the queue at once.
        fourth = engine.submit(10, 10)
        assert engine.statistics().waiting == 1
        engine.abort(fourth)
        assert engine.statistics().waiting == 0
        engine.abort(second)
        engine.abort(third)
        await trio.sleep(0.1)
        assert engine.statistics().running == 0 and engine.statistics().kv_used_tokens == 0
        nursery.cancel_scope.cancel()


async def test_output_is_deterministic_per_seed_and_prompt(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, ROUND)
        runs = [
            engine.submit(10, 30, prompt_key="hello"),
            engine.submit(10, 30, prompt_key="hello"),
            engine.submit(10, 30, prompt_key="other"),
            engine.submit(10, 30, prompt_key="hello", seed=7),
        ]
        for sequence in runs:
            await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids
    assert runs[0].token_ids != runs[3].token_ids


async def test_eos_probability_min_tokens_and_ignore_eos(autojump_clock: trio.testing.MockClock) -> None:
    params = ROUND.replace(eos_probability=0.2, max_num_seqs=64)
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, params)
        early = [engine.submit(10, 200, prompt_key=str(i)) for i in range(20)]
        floored = [engine.submit(10, 200, prompt_key=str(i), min_tokens=50) for i in range(20)]
        forced = engine.submit(10, 200, ignore_eos=True)
        for sequence in [*early, *floored, forced]:
            await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    lengths = [len(s.token_ids) for s in early]
    assert all(s.finish_reason == "stop" for s in early)
    assert 2 <= statistics.mean(lengths) <= 12  # geometric, mean 1/0.2 = 5
    assert all(len(s.token_ids) >= 50 for s in floored)
    assert forced.finish_reason == "length" and len(forced.token_ids) == 200


async def test_time_scale_slows_the_gpu_by_its_factor(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        engine = await start(nursery, ROUND, time_scale=10.0)
        t0 = trio.current_time()
        sequence = engine.submit(10, 5)
        await sequence.wait_finished()
        nursery.cancel_scope.cancel()
    assert (sequence.finished_at or 0) - t0 == pytest.approx(10 * 5 * 0.011)


async def test_requests_over_the_context_are_refused() -> None:
    engine = Engine(ROUND)
    with pytest.raises(EngineRequestError, match="maximum context length is 4000 tokens"):
        engine.submit(3000, 1001)
    with pytest.raises(EngineRequestError):
        engine.submit(0, 10)
    with pytest.raises(EngineRequestError):
        engine.submit(10, 0)
    # Without max_tokens the sequence may fill the rest of the context, like vLLM.
    assert engine.submit(3000, None).max_tokens == 1000
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineParams(max_num_seqs=0)


def test_the_docs_state_vllms_defaults_and_the_profiles_as_the_code_does() -> None:
    from pathlib import Path

    from tailguard.sim import VLLM_SERVER_DEFAULTS

    big = VLLM_SERVER_DEFAULTS[">= 70 GiB, not A100"]
    small = VLLM_SERVER_DEFAULTS["smaller, or A100"]
    assert (big.max_num_seqs, big.max_num_batched_tokens) == (1024, 8192)
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (256, 2048)
    default = EngineParams()
    assert (default.max_num_seqs, default.max_num_batched_tokens) == (small.max_num_seqs, small.max_num_batched_tokens)
    text = (Path(__file__).resolve().parents[2] / "docs" / "simulator.md").read_text()
    assert "1,024 / 8,192 on GPUs with >= 70 GiB that are not an A100" in text
    assert "256 / 2,048 otherwise" in text
    for name, params in PROFILES.items():
        batched = "1M" if params.max_num_batched_tokens == 1 << 20 else str(params.max_num_batched_tokens)
        assert f"| `{name}` | {params.max_num_seqs} | {batched} |" in text, name
