"""What a retry run is made of: its options, the one request shape, the two set-ups, the pool's capacity."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.harness import short_chat
from bench.harness.procs import RESULTS_ROOT

RESULTS = RESULTS_ROOT / "retry"
HINTS = ("computed", "fixed")  # [timeouts] retry_after_hint of each set-up, in run order
RETRY_AFTER_S = 1.0  # [timeouts] retry_after: the fixed set-up's every hint, the computed one's floor
REFUSED = (429, 503)  # the statuses of a queue refusal (queue_full, queue_timeout)


@dataclass(frozen=True)
class Options:
    """One run's parameters; times in real seconds unless said."""

    seats: int = 8  # the engine's max_num_seqs and the pool's max_concurrency
    max_queue: int = 16  # the pool's wait queue: a 1.5x overload keeps it full
    queue_timeout_gpu: float = 3.0  # the class's queue_timeout, GPU s (scaled to real in the config)
    time_scale: float = 3.0
    load: float = 1.5  # the arrival rate, a multiple of the pool's capacity
    warmup: float = 15.0  # arrivals before it are sent but not counted (the queue fills, the retries reach their steady rate)
    seconds: float = 40.0  # the counted window of arrivals
    drain: float = 40.0  # longest wait after the last arrival for the retries to end
    max_retries: int = 3  # the SDK's max_retries
    attempt_timeout: float = 20.0  # the SDK's timeout of one attempt
    bin_s: float = 0.25  # the arrival histogram's bin
    seed: int = 1
    out: Path = RESULTS
    name: str = "retry"

    @property
    def capacity(self) -> float:
        """Requests per real second the pool sustains with every seat busy (``short_chat.capacity_gpu``, over the time scale)."""
        return short_chat.capacity_gpu(self.seats) / self.time_scale

    @property
    def rate(self) -> float:
        """The arrival rate, requests per real second."""
        return self.load * self.capacity

    @property
    def horizon(self) -> float:
        """The last arrival's latest offset."""
        return self.warmup + self.seconds
