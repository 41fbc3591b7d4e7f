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
