"""The synthetic shared-prefix workloads: tenants' system prompts, conversations, RAG documents, and nothing shared.

Each is seeded and deterministic. Only what the workload means to share is
shared: a tenant's system prompt, a conversation's history, a document;
every question and every "unique" prompt begins with the request's own
nonce (``text.unique``), so it shares no block with any other request.
Arrivals are Poisson at ``load`` times the fleet's modelled capacity for the
workload's own shapes with every prompt token prefilled, in seats the KV
cache can hold (``fleet_capacity``): what the engines could serve with no
cache hit to help. Token counts of shared texts are multiples of 16, so a shared
piece ends on a KV-cache block boundary.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.prefix.model import ENGINES, LONG_MAX_TOKENS, SHORT_MAX_TOKENS, Conversation, Request, Turn, Workload, engine_params
from bench.prefix.text import piece, unique
from tailguard.server.advise.replay.mix import pooled_capacity
from tailguard.sim.tokens import count_chat_tokens

MAX_REQUESTS = 4000  # per workload: a bound on every schedule whatever the rate and window
CAPACITY_SAMPLE = 400  # draws the capacity (and so the rate) is computed from
ANSWER_TOKENS_PER_TOKEN = 1.5  # an answer of n tokens, resent as text, counts ~1.5 n (" word" is 4-8 characters)


@dataclass(frozen=True)
class Spec:
    """What every generator needs: the seed, the load, and the schedule's length (GPU s)."""

    seed: int
    load: float
    warmup_s: float
    seconds: float  # measured window after the warm-up
    tenants: int = 24
    zipf: float = 1.0
    unique_share: float = 0.1  # tenants: the share of unique long documents beside the tenants' questions
    kv_cache_tokens: int = 1 << 26  # each engine's; the capacity's seats are as many contexts as it holds (at most SEATS)

    @property
    def length_s(self) -> float:
        return self.warmup_s + self.seconds


def fleet_capacity(shapes: Sequence[tuple[int, int]], kv_cache_tokens: int) -> float:
    """GPU req/s at which ENGINES engines are full for these (prompt, max_tokens) shapes, every prompt token prefilled (no reuse).

    The engine model's seats are SEATS or as many average contexts as
    ``kv_cache_tokens`` holds, whichever is fewer (``engine_capacity``).
    """
    params = engine_params(kv_cache_tokens)
    share = 1.0 / len(shapes)
    return pooled_capacity(ENGINES, params, [(share, prompt, out) for prompt, out in shapes])


def zipf_weights(count: int, exponent: float) -> list[float]:
    """Popularity of ranks 1..count: 1 / rank**exponent, normalised."""
    raw = [1.0 / (rank**exponent) for rank in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def block_tokens(rng: random.Random, low: int, high: int) -> int:
    """A length in [low, high], a multiple of 16 (a whole number of KV-cache blocks)."""
    return 16 * rng.randint(low // 16, high // 16)


def system_prompts(spec: Spec) -> list[str]:
    """Each tenant's system prompt: 1,024 to 2,048 tokens of text only that tenant has."""
    rng = random.Random(f"tenants:{spec.seed}")
    return [piece(f"tenant:{spec.seed}:{k}", block_tokens(rng, 1024, 2048)) for k in range(spec.tenants)]


def question(number: int, rng: random.Random, seed: int) -> str:
    """A short question of 16 to 80 tokens, unique to request ``number``."""
    return unique(number, rng.randint(16, 80), seed=seed)


def _poisson(
    name: str, description: str, spec: Spec, draw: Callable[[int, random.Random], tuple[str, tuple[tuple[str, str], ...], int, str]]
) -> Workload:
    """Requests ``draw(number, rng)`` -> (kind, messages, max_tokens, key), Poisson at ``spec.load`` of their capacity.

    The capacity is the first CAPACITY_SAMPLE draws' (the schedule's first requests); later ones are drawn as the schedule needs them.
    """
    rng = random.Random(f"{name}:{spec.seed}")
    drawn = [draw(number, rng) for number in range(CAPACITY_SAMPLE)]
    capacity = fleet_capacity([(count_chat_tokens([c for _, c in m]), out) for _, m, out, _ in drawn], spec.kv_cache_tokens)
    rate = spec.load * capacity
    times = random.Random(f"{name}:{spec.seed}:arrivals")
    requests: list[Request] = []
    at = times.expovariate(rate)
    while at < spec.length_s and len(requests) < MAX_REQUESTS:
        number = len(requests)
        kind, messages, max_tokens, key = drawn[number] if number < len(drawn) else draw(number, rng)
        requests.append(Request(at, kind, messages, max_tokens, key))
        at += times.expovariate(rate)
    return Workload(name, description, rate, capacity, spec.warmup_s, spec.length_s, requests=tuple(requests))


def tenants(spec: Spec) -> Workload:
    """(a) K tenants by Zipf popularity, each question after its tenant's system prompt; a share of unique long documents beside."""
    prompts = system_prompts(spec)
    weights = zipf_weights(spec.tenants, spec.zipf)

    def draw(number: int, rng: random.Random) -> tuple[str, tuple[tuple[str, str], ...], int, str]:
        if rng.random() < spec.unique_share:
            document = unique(number, rng.randint(1500, 3000), seed=spec.seed)
            return "long", (("user", document),), LONG_MAX_TOKENS, f"doc-{number}"
        tenant = rng.choices(range(spec.tenants), weights)[0]
        return "short", (("system", prompts[tenant]), ("user", question(number, rng, spec.seed))), SHORT_MAX_TOKENS, f"tenant-{tenant}"

    share = f"{spec.unique_share:.0%} unique 1.5-3k-token documents (max_tokens {LONG_MAX_TOKENS}) beside"
    what = f"{spec.tenants} tenants, Zipf {spec.zipf:g}, a 1-2k-token system prompt each + a unique 16-80-token question; {share}"
    return _poisson("tenants", what, spec, draw)


def unique_prompts(spec: Spec) -> Workload:
    """(e) tenants' shapes with nothing shared: every system prompt is the request's own."""
    rng_sizes = random.Random(f"tenants:{spec.seed}")
    sizes = [block_tokens(rng_sizes, 1024, 2048) for _ in range(spec.tenants)]
    weights = zipf_weights(spec.tenants, spec.zipf)

    def draw(number: int, rng: random.Random) -> tuple[str, tuple[tuple[str, str], ...], int, str]:
        if rng.random() < spec.unique_share:
            return "long", (("user", unique(number, rng.randint(1500, 3000), seed=spec.seed)),), LONG_MAX_TOKENS, f"doc-{number}"
        tenant = rng.choices(range(spec.tenants), weights)[0]
        system = unique(number, sizes[tenant], seed=spec.seed + 1)  # another seed: never the question's nonce
        return "short", (("system", system), ("user", question(number, rng, spec.seed))), SHORT_MAX_TOKENS, f"req-{number}"

    return _poisson("unique", "the tenants workload's shapes, every prompt unique from its first block: nothing to share", spec, draw)


def rag(spec: Spec, documents: int = 12) -> Workload:
    """(c) a set of documents (1-3k tokens each), many different questions about each, a short system prompt common to all."""
    rng_docs = random.Random(f"documents:{spec.seed}")
    texts = [piece(f"document:{spec.seed}:{d}", block_tokens(rng_docs, 1024, 3072)) for d in range(documents)]
    system = piece("rag-system", 32)

    def draw(number: int, rng: random.Random) -> tuple[str, tuple[tuple[str, str], ...], int, str]:
        d = rng.randrange(documents)
        return "short", (("system", system), ("user", texts[d] + question(number, rng, spec.seed))), SHORT_MAX_TOKENS, f"doc-{d}"

    what = f"{documents} documents of 1-3k tokens, uniform popularity, a unique question after the document; one 32-token system prompt for all"
    return _poisson("rag", what, spec, draw)


def conversations(spec: Spec, think_s: float = 1.0) -> Workload:
    """(b) multi-turn chats: a unique 256-768-token opening, 3-8 turns of 16-80 tokens, think time between turns.

    Each turn resends the history with the answers as received, so a
    conversation's prompt grows past the raw-length short threshold (500
    tokens) within a few turns. Conversations start as a Poisson process
    whose turns add up to ``load`` of the capacity for the turns' shapes
    (answers counted as ``ANSWER_TOKENS_PER_TOKEN`` tokens a token).
    """
    rng = random.Random(f"conversations:{spec.seed}")
    system = piece("chat-system", 64)
    drawn: list[tuple[str, tuple[Turn, ...]]] = []
    shapes: list[tuple[int, int]] = []
    number = 0
    for c in range(MAX_REQUESTS // 8):
        turns: list[Turn] = []
        history = 64 + 4
        for t in range(rng.randint(3, 8)):
            text = unique(number, block_tokens(rng, 256, 768) if t == 0 else rng.randint(16, 80), seed=spec.seed)
            number += 1
            turns.append(Turn(text, SHORT_MAX_TOKENS, rng.expovariate(1 / think_s) if t else 0.0))
            history += len(text) // 4 + 4
            shapes.append((history + 3, SHORT_MAX_TOKENS))
            history += math.ceil(SHORT_MAX_TOKENS * ANSWER_TOKENS_PER_TOKEN) + 4
        drawn.append((f"chat-{c}", tuple(turns)))
    capacity = fleet_capacity(shapes, spec.kv_cache_tokens)
    rate = spec.load * capacity / (len(shapes) / len(drawn))  # conversations a second
    chats: list[Conversation] = []
    at = rng.expovariate(rate)
    for key, turns_of in drawn:
        if at >= spec.length_s:
            break
        chats.append(Conversation(at, key, system, turns_of))
        at += rng.expovariate(rate)
    what = (
        f"chats of 3-8 turns: a unique 256-768-token opening, then 16-80-token turns, each resending the history and the answers "
        f"received; think time exponential, mean {think_s:g} GPU s"
    )
    return Workload("multi-turn", what, rate * len(shapes) / len(drawn), capacity, spec.warmup_s, spec.length_s, conversations=tuple(chats))
