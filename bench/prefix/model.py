"""What the shared-prefix benchmark plays: requests, conversations, workloads, and the engines they run on.

Times in a workload are GPU seconds (the simulator's unscaled time); the
runner multiplies them by the time scale. Every request names the ``key``
hand affinity pins it by (its tenant, conversation or document), and says
its ``kind``: "short" (an interactive answer, what the targets measure) or
"long" (background work beside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailguard.sim.params import PROFILES, EngineParams
from tailguard.sim.tokens import count_chat_tokens

MODEL = "sim-llama-3.1-8b"  # what every simulated engine serves
ENGINES = 4
SEATS = 32  # max_num_seqs of each engine, and its endpoint cap in tailguard
MAX_MODEL_LEN = 8192
INPUT_CAP_TOKENS = MAX_MODEL_LEN - 512  # tailguard's [limits] input_cap_tokens: room for the output
SHORT_MAX_TOKENS = 64
LONG_MAX_TOKENS = 256


@dataclass(frozen=True)
class Request:
    """One open-loop request: when it is sent, what it says, and what hand affinity pins it by."""

    at: float  # GPU s after the start
    kind: str  # "short" | "long"
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int
    key: str

    @property
    def prompt_tokens(self) -> int:
        """The simulator's count of the prompt (template included)."""
        return count_chat_tokens([content for _, content in self.messages])


@dataclass(frozen=True)
class Turn:
    """One user turn of a conversation, sent ``think`` GPU s after the previous answer ended."""

    user: str
    max_tokens: int
    think: float


@dataclass(frozen=True)
class Conversation:
    """A closed loop: each turn resends the whole history, the answers received included."""

    at: float  # GPU s after the start: the first turn
    key: str
    system: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    """One workload, generated: open-loop requests or conversations (or both), at a rate set from the fleet's capacity."""

    name: str
    description: str
    rate_req_s: float  # GPU req/s asked for
    capacity_req_s: float  # the fleet's modelled capacity for its shapes (every prompt token prefilled)
    warmup_s: float  # GPU s: requests sent before it are not measured
    end_s: float  # GPU s: the schedule's end (no conversation turn is sent after it)
    requests: tuple[Request, ...] = ()
    conversations: tuple[Conversation, ...] = ()
    notes: tuple[str, ...] = field(default=())


def body(messages: tuple[tuple[str, str], ...], max_tokens: int) -> dict[str, object]:
    """The chat body every set-up receives: streamed, ``ignore_eos`` so the engine generates ``max_tokens`` as its model assumes."""
    return {
        "model": MODEL,
        "messages": [{"role": role, "content": content} for role, content in messages],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


def engine_params(kv_cache_tokens: int) -> EngineParams:
    """Each engine: the latency profile (2,048 batched tokens a step) with SEATS seats, the prefix cache on, this KV cache."""
    return PROFILES["latency"].replace(
        max_num_seqs=SEATS, max_model_len=MAX_MODEL_LEN, kv_cache_tokens=kv_cache_tokens, prefix_caching=True
    )
