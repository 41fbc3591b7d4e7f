"""Admission: one decision per request, caps -> class -> model -> context -> the ticket it queues with.

Nothing here waits or touches a pool's seats: the verdict is a class, its pool
and a :class:`~router.pool.Ticket`, or a RequestRejected error. Each decision is
written into the request's record as it is made, so a refusal's access log
shows how far it got.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .auth import Caller
from .config_types import ClassConfig, Config
from .errors import Forbidden, InvalidRequest, ModelNotFound
from .limits import check_context, check_prompt, effective_max_tokens, estimate_prompt_tokens
from .pool import Pool, Ticket
from .prefix_key import prefix_key_of
from .request import RouterRequest
from .telemetry import RequestRecord


def decide(
    request: RouterRequest, caller: Caller, config: Config, pools: Mapping[str, Pool], record: RequestRecord, arrival: float
) -> tuple[ClassConfig, Pool, Ticket]:
    """The request's class, its pool and its ticket, or the RequestRejected error that refuses it."""
    prompt_tokens = estimate_prompt_tokens(request, config.estimate)
    record.prompt_tokens = prompt_tokens
    check_prompt(prompt_tokens, config.limits)
    max_tokens, clamped = effective_max_tokens(request.max_tokens, config.limits)
    record.max_tokens, record.clamped = max_tokens, clamped
    if request.forced_class is not None:
        if request.forced_class not in caller.may_force_classes:
            raise Forbidden(f"the caller {caller.name!r} may not force the class {request.forced_class!r}", param="class")
        klass = forced(request.forced_class, config.classes)
    else:
        klass = classify(prompt_tokens, max_tokens, config.classes)
    pool = pools[klass.pool]
    record.request_class, record.pool = klass.name, pool.name
    model = request.model or pool.config.models[0]
    if model not in pool.config.models:
        raise ModelNotFound(
            f"the model {model!r} is not served here (class {klass.name!r} routes to pool "
            f"{pool.name!r}, which serves {', '.join(pool.config.models)})",
            param="model",
        )
    check_context(prompt_tokens, max_tokens, pool.config.max_model_len, pool.name)
    record.model = model
    return klass, pool, Ticket(
        klass.name, model, prompt_tokens, max_tokens, klass.priority, arrival, prefix_key_of(request, pool.config.placement.blocks)
    )


def classify(prompt_tokens: int, max_tokens: int, classes: Sequence[ClassConfig]) -> ClassConfig:
    """The first class whose thresholds admit both sizes (config validation
    guarantees the last class is a catch-all)."""
    for klass in classes:
        if klass.max_prompt_tokens is not None and prompt_tokens > klass.max_prompt_tokens:
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
