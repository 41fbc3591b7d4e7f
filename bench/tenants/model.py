"""What a tenants run is made of: its options, the two tenants' keys and request shape, the set-ups."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from bench.harness import short_chat
from bench.harness.procs import RESULTS_ROOT
from bench.harness.short_chat import MAX_TOKENS, PROMPT_TOKENS

RESULTS = RESULTS_ROOT / "tenants"
TENANTS = ("A", "B")  # A bursts or is backlogged; B is the steady one whose latency is measured
KEYS = {"A": "bench-tenants-key-a", "B": "bench-tenants-key-b"}  # sent as Authorization: Bearer KEY; the config holds their SHA-256
QUEUE_TIMEOUT_GPU_S = 3.0  # the shipped interactive class's queue_timeout, GPU s (scaled to real in the config)
SETUPS = ("solo", "fair", "fifo", "b-first")  # scenario 1, in run order
BACKLOG_QUEUE_TIMEOUT_GPU_S = 10.0  # scenario 2: long enough that no backlogged waiter times out (shares, not deadlines, are measured)
B_FIRST_WEIGHT = 100.0  # b-first: B's weight, so high that B is all but always next (the floor a pool that never preempts allows)


@dataclass(frozen=True)
class Options:
    """One run's parameters; times in real seconds unless said."""

    seats: int = 8  # the engine's max_num_seqs and the pool's max_concurrency
    time_scale: float = 3.0
    b_load: float = 0.4  # B's steady rate, a fraction of the pool's capacity
    a_burst: float = 2.5  # A's rate while bursting, a multiple of the capacity (5x its fair half)
    burst_on: float = 10.0
    burst_off: float = 5.0
    warmup: float = 5.0
    seconds: float = 40.0  # scenario 1's measured window
    drain: float = 15.0  # longest wait after the last arrival
    backlog_seconds: float = 60.0  # scenario 2's measured window
    backlog_warmup: float = 5.0
    backlog: int = 0  # requests each tenant keeps outstanding in scenario 2 (0: twice the seats plus 4)
    weights: tuple[float, float] = (3.0, 1.0)  # A, B in scenario 2
    max_queue: int = 1024
    seed: int = 1
    out: Path = RESULTS
    name: str = "tenants"

    @property
    def capacity_gpu(self) -> float:
        """Requests per GPU second the pool sustains with every seat busy (the engine model, ``short_chat.capacity_gpu``)."""
        return short_chat.capacity_gpu(self.seats)

    @property
    def capacity(self) -> float:
        """The same, per real second."""
        return self.capacity_gpu / self.time_scale

    @property
    def service_gpu_ms(self) -> float:
        """GPU ms a mean request holds its seat in a full batch (prefill, then its tokens): a seat frees every this / seats."""
        engine, tokens = short_chat.latency_engine(self.seats), sum(MAX_TOKENS) / 2
        step = engine.step_ms(self.seats, 0, int(self.seats * (PROMPT_TOKENS + tokens / 2)))
        return PROMPT_TOKENS / engine.prefill_tokens_per_ms + tokens * step

    @property
    def outstanding(self) -> int:
        return self.backlog or 2 * self.seats + 4

    @property
    def horizon(self) -> float:
        return self.warmup + self.seconds


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN where either is missing or the denominator is 0."""
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator
