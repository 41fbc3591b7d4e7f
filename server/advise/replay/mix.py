"""The traffic mix the benchmarks and ``tailguard advise`` share: request shapes, bodies, capacity.

The origin's mix is 80% one-line chat questions (max_tokens 64) and 20%
~2,000-token documents to summarise (max_tokens 512); ``chat_mix`` is issue
12's second mix. Bodies are deterministic, and prompt sizes are the
simulator's own token counts, so a shape read back from a trace names the
same body every time. Capacity is computed from the engine model
(``EngineParams``): the load a benchmark asks for is a fraction of it.

Benchmarks send ``unique_payload`` / ``unique_body_for``: the same bodies
with a per-request nonce at the start of the first message, so no two
requests share a prefix block and a prefix cache (vLLM's, the simulator's)
cannot flatter them; the nonce replaces as many leading characters, so the
prompt's token count is unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tailguard.sim.params import EngineParams
from tailguard.sim.tokens import count_chat_tokens

CLASSES = ("short", "long")
SHORT_SHARE = 0.8
SHORT_MAX_TOKENS = 64
LONG_MAX_TOKENS = 512
LONG_DOCUMENT_CHARS = 8_000
SHORT_QUESTION = "What is the capital of France, and why is it famous?"

_WORDS = (
    "the engine schedules every sequence in a continuous batch while the router keeps short requests "
    "fast and long documents share the fleet under caps queues deadlines and pools of graphics processors"
).split()



@functools.lru_cache(maxsize=64)
def long_document(chars: int = LONG_DOCUMENT_CHARS, seed: int = 7) -> str:
    """Deterministic filler text of about ``chars`` characters (~4 chars a token).

    Memoised (a pure function of its arguments, a few sizes in any run):
    every request's unique body starts from it, and drawing it costs ~1 ms.
    """
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 16))).capitalize() + "."
        words.append(sentence)
        size += len(sentence) + 1
    return " ".join(words)


def payloads() -> dict[str, dict[str, object]]:
    """The two request bodies, by class."""
    document = long_document()
    return {
        "short": {
            "messages": [{"role": "user", "content": SHORT_QUESTION}],
            "max_tokens": SHORT_MAX_TOKENS,
            "stream": True,
        },
        "long": {
            "messages": [{"role": "user", "content": f"{document}\n\nSummarize the document above."}],
            "max_tokens": LONG_MAX_TOKENS,
            "stream": True,
        },
    }


NONCE_CHARS = 12  # 11 hex digits and a newline: 3 tokens by the simulator's rule


def request_nonce(number: int, *, seed: int = 0) -> str:
    """A prefix line unique to request ``number`` of a run seeded ``seed``.

    ``number`` XOR a 44-bit key derived from ``seed``: distinct numbers give
    distinct nonces within a run (no birthday collisions), and another seed
    gives other nonces, so a real engine's cache kept from an earlier run
    does not hit either.
    """
    return f"{(number ^ _nonce_key(seed)) & 0xFFFFFFFFFFF:011x}\n"


@functools.lru_cache(maxsize=16)
def _nonce_key(seed: int) -> int:
    """A run's 44-bit nonce key (memoised: a pure function, one or two seeds a run)."""
    return int.from_bytes(hashlib.blake2b(f"nonce:{seed}".encode(), digest_size=6).digest(), "big") >> 4


def _with_nonce(body: dict[str, object], number: int, seed: int) -> dict[str, object]:
    """``body`` with its first message's leading characters replaced by the request's nonce."""
    messages = body["messages"]
    assert isinstance(messages, list)
    first = dict(messages[0])
    nonce = request_nonce(number, seed=seed)
    first["content"] = nonce + str(first["content"])[len(nonce) :]
    return {**body, "messages": [first, *messages[1:]], "ignore_eos": True}


def unique_payload(kind: str, number: int, *, seed: int = 0) -> dict[str, object]:
    """Request ``number``'s body of class ``kind`` ("short" or "long"), sharing no prefix block with any other.

    ``payloads()[kind]`` with a nonce (``request_nonce``) over the first
    message's first ``NONCE_CHARS`` characters: the same prompt token count
    (for ASCII text, as the mix is), a different first block from every
    other ``number`` and ``seed``; with ``ignore_eos: true`` so the engine
    generates ``max_tokens`` as the engine model assumes. Deterministic.
    """
    return _with_nonce(payloads()[kind], number, seed)


def unique_body_for(prompt: int, max_tokens: int, number: int, *, seed: int = 0) -> dict[str, object]:
    """``body_for(prompt, max_tokens)`` made unique to request ``number`` as ``unique_payload`` does."""
    return _with_nonce(body_for(prompt, max_tokens), number, seed)


def prompt_tokens(payload: dict[str, object]) -> int:
    """The simulator's own count of a chat payload's prompt."""
    messages = payload["messages"]
    assert isinstance(messages, list)
    return count_chat_tokens([m["content"] for m in messages])


@dataclass(frozen=True)
class Capacity:
    """The single shared engine's capacity for this mix (GPU time, unscaled)."""

    req_per_s: float
    step_ms_full_batch: float
    mean_context_tokens: float
    kv_tokens_at_full_batch: float


def shared_capacity(params: EngineParams, short_prompt: int, long_prompt: int) -> Capacity:
    """Requests/s one engine sustains for the mix with every seat busy.

    Per request, on average: ``decode`` tokens, each one seat for one step,
    and ``prefill`` prompt tokens at ``prefill_tokens_per_ms``. A running
    sequence holds, on average over its decode steps, its prompt plus half its
    output as context. With all ``max_num_seqs`` seats busy, a step costs
    ``base + N (per_seq + per_context x context)`` ms and emits N tokens, so a
    request costs ``decode / N`` steps plus its prefill time.
    """
    shares = {"short": SHORT_SHARE, "long": 1 - SHORT_SHARE}
    output = {"short": SHORT_MAX_TOKENS, "long": LONG_MAX_TOKENS}
    prompt = {"short": short_prompt, "long": long_prompt}
    decode = sum(shares[c] * output[c] for c in CLASSES)
    prefill = sum(shares[c] * prompt[c] for c in CLASSES)
    # Context weighted by seat-steps (a long request holds a seat 8x longer).
    context = sum(shares[c] * output[c] * (prompt[c] + output[c] / 2) for c in CLASSES) / decode
    seats = params.max_num_seqs
    step_ms = params.base_ms + seats * (params.per_seq_ms + params.per_context_token_ms * context)
    request_ms = decode / seats * step_ms + prefill / params.prefill_tokens_per_ms
    return Capacity(1000 / request_ms, step_ms, context, seats * context)


INTERACTIVE_PROMPT_MAX = 500  # the shipped interactive class's thresholds (config.toml)
INTERACTIVE_OUTPUT_MAX = 128


def origin_shapes() -> dict[str, tuple[int, int]]:
    """(prompt tokens, max_tokens) of the origin's two requests, by class."""
    return {kind: (prompt_tokens(body), int(body["max_tokens"])) for kind, body in payloads().items()}  # type: ignore[call-overload]


def kind_of(prompt: int, max_tokens: int) -> str:
    """The class tailguard's shipped config would give this request."""
    return "short" if prompt <= INTERACTIVE_PROMPT_MAX and max_tokens <= INTERACTIVE_OUTPUT_MAX else "long"


Shape = tuple[str, float, int, int]  # (reporting class, share of arrivals, prompt tokens, max_tokens)


def origin_mix() -> list[Shape]:
    """The origin's traffic: 80% one-line questions (max_tokens 64), 20% documents to summarise (max_tokens 512)."""
    shapes = origin_shapes()
    return [("short", SHORT_SHARE, *shapes["short"]), ("long", 1 - SHORT_SHARE, *shapes["long"])]


def chat_mix() -> list[Shape]:
    """A mix where short requests take most of the GPU time (issue 12's second mix).

    90% chat turns (300 prompt tokens with their context, max_tokens 128);
    10% long ones of four shapes, 2.5% each, whose prompts straddle the
    prefill budgets a lending rule may set (256, 512, 1024 tokens): 200 and
    450 tokens asking for 512 out, 900 and 3,000 tokens asking for 256. On
    the engine model, short requests are ~72% of the GPU time (the origin's
    mix: ~21%).
    """
    return [
        ("short", 0.9, 300, 128),
        ("long", 0.025, 200, 512),
        ("long", 0.025, 450, 512),
        ("long", 0.025, 900, 256),
        ("long", 0.025, 3000, 256),
    ]


MIXES: dict[str, Callable[[], list[Shape]]] = {"origin": origin_mix, "chat": chat_mix}


def shapes_by_class(shapes: Sequence[Shape]) -> dict[str, list[tuple[float, int, int]]]:
    """``shapes`` as tail's mix: {class: [(share, prompt, max_tokens)]}."""
    mix: dict[str, list[tuple[float, int, int]]] = {}
    for kind, share, prompt, out in shapes:
        mix.setdefault(kind, []).append((share, prompt, out))
    return mix



def body_for(prompt: int, max_tokens: int) -> dict[str, object]:
    """A streaming chat body of ``prompt`` tokens (the origin's own when the shape is one of its two)."""
    for kind, shape in origin_shapes().items():
        if shape == (prompt, max_tokens):
            return payloads()[kind]
    chars = max(1, prompt - count_chat_tokens([""])) * 4
    text = long_document(chars + 100)[:chars]
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": True}


# -- capacity, from the engine model -------------------------------------------------


def engine_capacity(params: EngineParams, mix: Sequence[tuple[float, int, int]]) -> float:
    """Requests/s one engine sustains for ``mix`` = [(share, prompt, max_tokens)] with every usable seat busy.

    shared_capacity's model, plus the KV cache: seats are
    ``max_num_seqs`` or as many average contexts as the cache holds, whichever is fewer.
    """
    total = sum(share for share, _, _ in mix)
    decode = sum(s * out for s, _, out in mix) / total
    prefill = sum(s * p for s, p, _ in mix) / total
    context = sum(s * out * (p + out / 2) for s, p, out in mix) / total / decode
    seats = min(params.max_num_seqs, params.kv_cache_tokens / context)
    step_ms = params.base_ms + seats * (params.per_seq_ms + params.per_context_token_ms * context)
    return 1000 / (decode / seats * step_ms + prefill / params.prefill_tokens_per_ms)


def pooled_capacity(engines: int, params: EngineParams, mix: Sequence[tuple[float, int, int]]) -> float:
    """Total arrival rate (all classes) at which ``engines`` serving only ``mix`` are full; inf if the mix is empty."""
    share = sum(s for s, _, _ in mix)
    return math.inf if not mix or engines == 0 else engines * engine_capacity(params, mix) / share


# -- a client that times every token -------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of already sorted values; NaN if empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]
