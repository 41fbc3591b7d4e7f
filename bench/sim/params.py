"""Engine parameters and the named profiles, calibrated to an 8B model on one H100.

The cost model of one engine step (one forward pass of a continuous batch):

    step_ms = base_ms
            + per_seq_ms * sequences in the step
            + prefill tokens in the step / prefill_tokens_per_ms
            + per_context_token_ms * tokens of context the step attends to

The figures are derived in docs/simulator.md ("Calibration"): decode steps
of ~7.8 ms at batch 1 and ~29 ms at batch 256 with ~1k tokens of context per
sequence, prefill at ~25k tokens/s, ~400k tokens of KV cache.

vLLM's own defaults for the OpenAI server (``EngineArgs`` in
vllm/engine/arg_utils.py, ``get_batch_defaults``) depend on the GPU:
``max_num_seqs`` 1,024 and ``max_num_batched_tokens`` 8,192 on a GPU with at
least 70 GiB that is not an A100 (H100, H200, MI300X), 256 and 2,048
otherwise (v0.28 adds a tier of 16,384 batched tokens at 160 GiB and more,
B200/B300). ``VLLM_SERVER_DEFAULTS`` holds the table. ``EngineParams``'
defaults are the small-GPU pair although the cost model is an H100's, and
every profile departs from the H100 pair on purpose (``PROFILES``).

``scheduling_policy`` is vLLM's ``--scheduling-policy``: "fcfs" (vLLM's
default) or "priority", which orders the waiting queue by the request's
``priority`` field and preempts the lowest-priority running sequence when the
KV cache runs short (docs/vllm-priority.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)


@dataclass(frozen=True)
class VllmDefaults:
    """The scheduler limits vLLM's OpenAI server picks when none are given."""

    max_num_seqs: int
    max_num_batched_tokens: int


# get_batch_defaults, UsageContext.OPENAI_API_SERVER, by GPU.
VLLM_SERVER_DEFAULTS: dict[str, VllmDefaults] = {
    ">= 70 GiB, not A100": VllmDefaults(max_num_seqs=1024, max_num_batched_tokens=8192),
    "smaller, or A100": VllmDefaults(max_num_seqs=256, max_num_batched_tokens=2048),
}


@dataclass(frozen=True)
class EngineParams:
    """What one simulated GPU running vLLM can do, and how fast."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 32768
    kv_cache_tokens: int = 400_000
    base_ms: float = 7.7
    per_seq_ms: float = 0.033
    per_context_token_ms: float = 0.00005
    prefill_tokens_per_ms: float = 25.0
    eos_probability: float = 0.0
    scheduling_policy: SchedulingPolicy = "fcfs"
    # vLLM's --max-num-queued-reqs: requests in flight (waiting + running) past
    # which a new one is refused at once with 503; None = unbounded, vLLM's default.
    max_num_queued_reqs: int | None = None
    # vLLM's --max-num-queued-tokens: once the prompt tokens of requests that have
    # not had their first token reach this, a new request is refused with 503;
    # None = unbounded, vLLM's default.
    max_num_queued_tokens: int | None = None
    # vLLM V1's automatic prefix caching (--enable-prefix-caching, on by default
    # in vLLM): full 16-token prompt blocks stay cached in the KV cache
    # (kv_cache_tokens // 16 blocks) until evicted, least recently freed first.
    # Every H100 profile keeps ~400k tokens = 25,000 blocks: an 8B model in bf16
    # (16 GiB of weights; 128 KiB of KV per token: 32 layers x 8 KV heads x 128
    # x 2 x 2 bytes) leaves ~50 GiB of an 80 GiB H100 at 0.9 utilisation.
    # On by default, as in vLLM V1, in every profile ("instant" too: a hit
    # costs the simulator ~nothing at 2k tokens); both engines model it
    # (bench/sim/prefix_cache.py). ``--prefix-caching false`` turns it off.
    prefix_caching: bool = True
    # vLLM's --block-size: tokens per KV block, the prefix cache's unit (only
    # full blocks are cached and hit). 16 on CUDA; vLLM's CPU backend uses 128.
    block_size: int = 16
    # vLLM's --scheduler-reserve-full-isl (SchedulerConfig.scheduler_reserve_full_isl,
    # True by default in 0.32): a waiting request is admitted only if the KV
    # cache's free blocks hold its whole sequence so far -- the prompt, plus
    # the output already generated when it resumes after a preemption; not
    # max_tokens -- less its cached blocks that a running request holds
    # (allocate_slots(full_sequence_must_fit=True)). Only its first chunk is
    # allocated. False (--no-scheduler-reserve-full-isl) is the older gate:
    # KV for the first chunk only, which admits a long prompt that the cache
    # cannot finish, and preempts it chunk after chunk.
    scheduler_reserve_full_isl: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("base_ms", "per_seq_ms", "per_context_token_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.prefill_tokens_per_ms < 0:
            raise ValueError("prefill_tokens_per_ms must not be negative (0 means instant prefill)")
        if not 0.0 <= self.eos_probability < 1.0:
            raise ValueError(f"eos_probability must be in [0, 1), got {self.eos_probability}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or None), got {value}")
        if self.kv_cache_tokens < self.max_model_len:
            raise ValueError("kv_cache_tokens must hold at least one max_model_len sequence")

    def step_ms(self, sequences: int, prefill_tokens: int, context_tokens: int) -> float:
        """Duration of one step that runs ``sequences`` with these token counts."""
        prefill = prefill_tokens / self.prefill_tokens_per_ms if self.prefill_tokens_per_ms else 0.0
        return (
            self.base_ms
            + self.per_seq_ms * sequences
            + prefill
            + self.per_context_token_ms * context_tokens
        )

    def replace(self, **changes: object) -> EngineParams:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


PROFILES: dict[str, EngineParams] = {
    # Few seats and a small step budget (vLLM's small-GPU budget, a sixteenth
    # of the H100 default's seats): a long prompt can stall a step for at most
    # 2048/25 = 82 ms, and a full batch of 64 decodes in ~13 ms a token.
    "latency": EngineParams(max_num_seqs=64, max_num_batched_tokens=2048),
    # vLLM's H100 step budget (8,192 batched tokens) with a quarter of its
    # 1,024 seats: 256 already costs ~29 ms a token at ~1k context each, and
    # on an 8B model ~400k tokens of KV cache cannot hold 1,024 such sequences.
    "throughput": EngineParams(max_num_seqs=256, max_num_batched_tokens=8192),
    # No GPU cost at all: for measuring the router's own overhead.
    "instant": EngineParams(
        max_num_seqs=1024,
        max_num_batched_tokens=1 << 20,
        base_ms=0.0,
        per_seq_ms=0.0,
        per_context_token_ms=0.0,
        prefill_tokens_per_ms=0.0,
        kv_cache_tokens=1 << 26,
    ),
}
