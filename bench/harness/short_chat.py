"""One small pool of short chat turns on one simulated latency engine: the turn's shape, the engine, its capacity and its process.

The retry and tenants drivers load the same pool with the same turn, so
the rate that keeps every seat busy, the draws of ``max_tokens`` and the
simulator's command line are worked out once, here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import IO

import trio

from bench.harness.procs import start_simulator
from tailguard.server.advise.replay.mix import engine_capacity
from tailguard.sim.params import PROFILES, EngineParams

PROMPT_TOKENS = 64  # every request: a short chat turn (the simulator's token count)
MAX_TOKENS = (32, 64)  # each request's max_tokens, drawn uniformly (seeded): equal lengths would free seats in lockstep


def latency_engine(seats: int) -> EngineParams:
    """The simulator's latency profile with ``seats`` seats (its max_num_seqs, and the pool's max_concurrency)."""
    return PROFILES["latency"].replace(max_num_seqs=seats)


def capacity_gpu(seats: int) -> float:
    """Requests per GPU second the engine sustains with every seat busy (``mix.engine_capacity`` over the uniform max_tokens)."""
    return engine_capacity(latency_engine(seats), [(1.0, PROMPT_TOKENS, m) for m in range(MAX_TOKENS[0], MAX_TOKENS[1] + 1)])


def max_tokens_draws(seed: int) -> Callable[[], int]:
    """Seeded draws of max_tokens, uniform over MAX_TOKENS."""
    rng = random.Random(seed)
    return lambda: rng.randint(*MAX_TOKENS)


async def start_engine(nursery: trio.Nursery, port: int, seats: int, time_scale: float, seed: int, log: IO[bytes]) -> trio.Process:
    """``python -m tailguard.sim``: the latency engine on ``port`` with ``seats`` seats; cancelling ``nursery`` stops it."""
    return await start_simulator(nursery, [(port, "latency")], time_scale, log, ["--max-num-seqs", str(seats), "--seed", str(seed)])
