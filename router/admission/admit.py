"""Admission: one decision per request, caps -> class -> model -> context -> the ticket it queues with.

Nothing here waits or touches a pool's seats: the verdict is a class, its pool
and a :class:`~router.pool.Ticket`, or a RequestRejected error. Each decision is
written into the request's record as it is made, so a refusal's access log
shows how far it got.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import NamedTuple

from ..config import ClassConfig, Config, EstimateConfig
from ..errors import Forbidden, InvalidRequest, ModelNotFound
from ..fleet import Pool, ResponseHomes, Ticket, rendezvous_order
from ..observe import RequestRecord
from ..queueing import Share
from ..quotas import Caller
from .estimate import PromptSize, estimate_text_tokens, size_prompt
from .limits import check_context, check_prompt, check_sequences, effective_max_tokens
from .prefix_keys import prefix_group, prefix_key_of
from .prefix_memory import ConversationMemory, HistoryDigests, Warm, history_digests, uncached_tokens
from .prompt_ratios import PromptRatios
from .request import POOLING, RouterRequest


class Admitted(NamedTuple):
    """Admission's verdict: the class, its pool, the ticket it queues with, and what to learn or remember once answered."""

    klass: ClassConfig
    pool: Pool
    ticket: Ticket
    history: HistoryDigests | None  # a chat's digests where some class bounds uncached tokens, else None
    size: PromptSize  # the raw estimate by kind of text, for the engine's usage to correct (router/admission/prompt_ratios.py)


def decide(
    request: RouterRequest,
    caller: Caller,
    config: Config,
    pools: Mapping[str, Pool],
    record: RequestRecord,
    arrival: float,
    memory: ConversationMemory | None = None,
    ratios: PromptRatios | None = None,
    homes: ResponseHomes | None = None,
) -> Admitted:
    """The request's class, its pool and its ticket, or the RequestRejected error that refuses it.

    The prompt's size is the raw estimate corrected by ``ratios`` (what the
    engines' usage taught of its model), and that one number is what the
    input cap, the class, the context check, the ticket and the token budget
    use. With ``memory`` and a class whose ``prompt_bound`` is "uncached", a
    chat's history is looked up: that class then bounds the tokens expected
    to need prefill on the conversation's warm home (``expected_uncached``).
    """
    size = size_prompt(request, config.estimate)
    prompt_tokens = size.tokens if ratios is None else ratios.corrected(size, models_for(request, pools), config.estimate)
    record.prompt_tokens = prompt_tokens
    pooling = request.kind in POOLING
    if pooling:
        # Each input is a prompt of its own to the engine: the cap bounds the largest (the body cap, the batch).
        check_prompt(largest_input(request, config.estimate), config.limits)
        max_tokens, clamped = 1, False  # no decode: one output position a request
    else:
        check_prompt(prompt_tokens, config.limits)
        max_tokens, clamped = effective_max_tokens(request.max_tokens, config.limits)
    record.max_tokens, record.clamped = max_tokens, clamped
    sequences = check_sequences(request.sequences, config.limits)
    output_tokens = max_tokens * sequences  # each of the n choices may generate max_tokens
    history = uncached = None
    if memory is not None and any(k.prompt_bound == "uncached" for k in config.classes):
        history = history_digests(request.conversation())
        warm = memory.warm(history) if history is not None else None
        if warm is not None:
            uncached = partial(expected_uncached, request, prompt_tokens, warm, pools)
    if request.forced_class is not None:
        if request.forced_class not in caller.may_force_classes:
            raise Forbidden(f"the caller {caller.name!r} may not force the class {request.forced_class!r}", param="class")
        klass = forced(request.forced_class, config.classes)
        if request.kind not in klass.kinds:
            raise InvalidRequest(f"the class {klass.name!r} does not take {request.kind} requests", param="class")
    else:
        classes = [k for k in config.classes if request.kind in k.kinds]
        if not classes:
            raise ModelNotFound(
                f"no class here takes {request.kind} requests: a class with kinds = [\"{request.kind}\"] whose pool serves "
                "the model would (docs/pools.md, \"Embeddings and rerank\")",
                param="model",
            )
        klass = classify(prompt_tokens, output_tokens, classes, uncached)
    pool = pools[klass.pool]
    home = response_home(request, pools, homes)
    pinned = None
    if home is not None:  # its class's queue timeout and priority, in the pool of the engine keeping its response
        pool, pinned = home
    record.request_class, record.pool = klass.name, pool.name
    model = request.model or pool.config.models[0]
    if model not in pool.config.models:
        raise ModelNotFound(
            f"the model {model!r} is not served here (class {klass.name!r} routes to pool "
            f"{pool.name!r}, which serves {', '.join(pool.config.models)})",
            param="model",
        )
    if not pooling:  # a pooling request's inputs are each checked against the context by the engine
        check_context(prompt_tokens, max_tokens, pool.config.max_model_len, pool.name)
    check_seatable(sequences, pool, klass)
    record.model = model
    if uncached is not None and klass.prompt_bound == "uncached":
        record.uncached_tokens = uncached(klass)
    key = prefix_key_of(request, pool.config.placement.blocks)
    record.prefix_group = prefix_group(key)
    share = Share(caller.name, caller.weight, prompt_tokens + output_tokens)  # what it may cost: settled at its end
    ticket = Ticket(klass.name, model, prompt_tokens, max_tokens, klass.priority, arrival, key, share, sequences, pinned)
    return Admitted(klass, pool, ticket, history, size)


def response_home(request: RouterRequest, pools: Mapping[str, Pool], homes: ResponseHomes | None) -> tuple[Pool, str] | None:
    """The pool and endpoint a Responses API turn must run on: those keeping its ``previous_response_id``
    (router/fleet/response_homes.py), whatever pool its class names: a turn classed long after a short first
    one, or a first turn a lender served, still continues where its response is, seated as that pool's own
    (no lending rule stands between it and the only engine that can answer it). None where this process does
    not know the id or its engine is in no pool now (it is placed as any request; the engine answers for the id)."""
    previous = request.params.get("previous_response_id") if request.kind == "responses" else None
    if homes is None or not isinstance(previous, str):
        return None
    url = homes.home(previous)
    if url is None:
        return None
    pool = next((pool for pool in pools.values() if any(endpoint.url == url for endpoint in pool.endpoints)), None)
    return None if pool is None else (pool, url)


def largest_input(request: RouterRequest, estimate: EstimateConfig) -> int:
    """The estimated tokens of a pooling request's largest input (a rerank's query beside its longest document)."""
    texts = max((sum(estimate_text_tokens(text, estimate) for text in texts) for texts in request.pooled_inputs()), default=0)
    return max(texts, request.largest_input_ids())


def models_for(request: RouterRequest, pools: Mapping[str, Pool]) -> tuple[str, ...]:
    """The models the request may run on: the one it names, else each pool's first (its class, not yet known, picks the pool)."""
    if request.model is not None:
        return (request.model,)
    return tuple(dict.fromkeys(pool.config.models[0] for pool in pools.values() if pool.config.models))


def expected_uncached(request: RouterRequest, prompt_tokens: int, warm: Warm, pools: Mapping[str, Pool], klass: ClassConfig) -> int:
    """The prompt tokens ``klass``'s pool is expected to prefill: fewer only where the warm endpoint is the request's home there.

    The home is the first endpoint of the request's prefix key in rendezvous
    order among the pool's usable ones (where prefix affinity would send it
    load allowing); a pool placing by load alone, a key-less request, or a
    warm endpoint that is not the home (gone, ejected, moved, another pool's)
    counts every token.
    """
    pool = pools[klass.pool]
    placement = pool.config.placement
    if placement.mode != "prefix_affinity":
        return prompt_tokens
    key = prefix_key_of(request, placement.blocks)
    usable = [e for e in pool.endpoints if e.usable and pool.holds(e)]
    if key is None or not usable or rendezvous_order(key, usable)[0].url != warm.endpoint_url:
        return prompt_tokens
    return uncached_tokens(prompt_tokens, warm)


def check_seatable(sequences: int, pool: Pool, klass: ClassConfig) -> None:
    """Raise InvalidRequest (param ``n``) for a request of more sequences than its pool could ever run at once.

    Its seats are taken together on one engine (vLLM batches a request's
    choices on the engine it was sent to), so the largest engine's cap and
    the class's seat limit and the pool's configured cap bound it; a pool
    with no endpoint yet is left to answer for itself.
    """
    if sequences == 1:
        return
    largest = max((e.max_concurrency for e in pool.endpoints), default=None)
    limit = pool.config.class_limit(klass.name)
    most = min(x for x in (largest, limit, pool.config.max_concurrency) if x is not None)
    if sequences > most:
        raise InvalidRequest(
            f"n = {sequences} asks for more sequences at once than pool {pool.name!r} runs for one request ({most}): "
            "each choice is a sequence of its own on the engine; ask for fewer choices, or send several requests",
            param="n",
        )


def classify(
    prompt_tokens: int, max_tokens: int, classes: Sequence[ClassConfig], uncached: Callable[[ClassConfig], int] | None = None
) -> ClassConfig:
    """The first class whose thresholds admit both sizes (config validation
    guarantees the last class is a catch-all). ``max_tokens`` is the whole
    request's output: n choices of max_tokens each.

    ``uncached`` gives, for a class with ``prompt_bound = "uncached"``, the
    prompt tokens it is expected to prefill; without it every token counts.
    """
    for klass in classes:
        counted = uncached(klass) if uncached is not None and klass.prompt_bound == "uncached" else prompt_tokens
        if klass.max_prompt_tokens is not None and counted > klass.max_prompt_tokens:
            continue
        if klass.max_output_tokens is not None and max_tokens > klass.max_output_tokens:
            continue
        return klass
    raise AssertionError("config validation guarantees a catch-all class")


def forced(name: str, classes: Sequence[ClassConfig]) -> ClassConfig:
    """The class a caller asked for by name (authorization is checked elsewhere)."""
    for klass in classes:
        if klass.name == name:
            return klass
    known = ", ".join(k.name for k in classes)
    raise InvalidRequest(f"unknown class {name!r}; classes are: {known}", param="class")
