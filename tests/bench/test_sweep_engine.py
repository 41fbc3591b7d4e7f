"""The sweep's aggregate engine model against the simulator's engine, timestamp for timestamp."""

from __future__ import annotations

import pytest

from bench.sweep.check import engine_agreement


@pytest.mark.parametrize(
    ("profile", "rate", "seconds"),
    [("throughput", 4.0, 20.0), ("latency", 40.0, 10.0), ("throughput", 60.0, 40.0)],
)
def test_sweep_engine_matches_the_simulator(profile: str, rate: float, seconds: float) -> None:
    """Same seeded submissions and hang-ups: every first-token and finish time is the same."""
    agreement = engine_agreement(profile, rate, seconds)
    assert agreement.requests > 20 and agreement.hang_ups > 0
    assert agreement.differing == 0 and agreement.max_difference_s == 0.0
    assert agreement.preemptions_sweep == agreement.preemptions_reference
    if rate == 60.0:  # past the engine's capacity: the KV cache fills and sequences are preempted
        assert agreement.preemptions_reference > 0


@pytest.mark.parametrize(
    ("kv_cache_tokens", "full_isl"),
    # a shared document's blocks count once: it takes a 60,000-token cache (not 120,000) to preempt
    [(None, True), (60_000, True), (60_000, False)],
)
def test_sweep_engine_matches_the_simulator_on_shared_prefixes(kv_cache_tokens: int | None, full_isl: bool) -> None:
    """Shared documents (and another cache_salt for a share of them): the same hits, evictions and timestamps, under either admission gate."""
    agreement = engine_agreement(
        "throughput", 50.0, 30.0, documents=4, kv_cache_tokens=kv_cache_tokens, scheduler_reserve_full_isl=full_isl
    )
    assert agreement.prefix_hits_reference > 100_000  # the documents are cached and hit
    assert agreement.agrees, agreement
    if kv_cache_tokens is not None:  # a cache too small for the batch: preempted, re-hit, evicted
        assert agreement.preemptions_reference > 0
